#include "kernels/topk.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace collectives {

namespace {

// |v|, with NaN above every number: a total order that std::nth_element may rely on.
inline float magnitude(float v) {
  return std::isnan(v) ? std::numeric_limits<float>::infinity() : std::fabs(v);
}

}  // namespace

void topk_feedback(const float* x, float* residual, int64_t count, int64_t k,
                   int32_t* indices, float* values) {
  for (int64_t i = 0; i < count; ++i) residual[i] += x[i];
  if (k <= 0) return;
  if (k >= count) {
    for (int64_t i = 0; i < count; ++i) {
      indices[i] = static_cast<int32_t>(i);
      values[i] = residual[i];
      residual[i] = 0.0f;
    }
    return;
  }
  // the k-th largest magnitude: entries above it are all taken, entries equal to it in
  // index order until k are. nth_element leaves every magnitude above the threshold
  // before it, so they are counted among the first k - 1 alone.
  std::vector<float> mags(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) mags[i] = magnitude(residual[i]);
  std::nth_element(mags.begin(), mags.begin() + (k - 1), mags.end(), std::greater<float>());
  const float threshold = mags[k - 1];
  const int64_t above = std::count_if(mags.begin(), mags.begin() + (k - 1),
                                      [threshold](float m) { return m > threshold; });
  int64_t ties = k - above, taken = 0;
  for (int64_t i = 0; i < count && taken < k; ++i) {
    const float m = magnitude(residual[i]);
    if (m > threshold || (m == threshold && ties > 0)) {
      if (m == threshold) --ties;
      indices[taken] = static_cast<int32_t>(i);
      values[taken] = residual[i];
      residual[i] = 0.0f;
      ++taken;
    }
  }
}

void scatter_add(const int32_t* indices, const float* values, int64_t k, float* out) {
  for (int64_t j = 0; j < k; ++j) out[indices[j]] += values[j];
}

}  // namespace collectives
