// Top-K sparsification with error feedback: of x plus what earlier calls did not send (the
// residual), keep the k entries of largest magnitude as (index, value) pairs and carry the
// rest to the next call.
#pragma once

#include <cstdint>

namespace collectives {

// c = x + residual (float32, element by element). Selects the k entries of largest |c|,
// ties broken by the lower index, a NaN counted larger than any number (so a non-finite
// gradient is sent, not held back); writes their indices in ascending order and their
// values c[i]; leaves residual = c with the selected entries zeroed. So, exactly,
// residual_after + (the selected values at their indices) == c.
// Cost: three passes over the vector and one selection (std::nth_element: O(count) on
// average) over a scratch copy of the magnitudes; 0 <= k <= count.
void topk_feedback(const float* x, float* residual, int64_t count, int64_t k,
                   int32_t* indices, float* values);

// out[indices[j]] += values[j] for j < k, in that order (indices distinct, each < count).
void scatter_add(const int32_t* indices, const float* values, int64_t k, float* out);

}  // namespace collectives
