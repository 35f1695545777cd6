// float16, block-int8 and block-int4 quantization. Every loop is branch-free so GCC/Clang vectorize
// it at -O3 (csrc/README.md shows the -fopt-info-vec evidence).
#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "clones.h"
#include "dtypes.h"

namespace collectives {
namespace {

// max |x| over the block, as float bits: for non-negative floats integer order is float
// order, and NaN (> 0x7f800000) beats everything, so one integer max finds NaN too.
COLLECTIVES_CLONES int32_t abs_max_bits(const float* __restrict__ x, int64_t n) {
  int32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    int32_t u;
    std::memcpy(&u, x + i, sizeof u);
    u &= 0x7fffffff;
    m = u > m ? u : m;
  }
  return m;
}

// The scale of a block for `levels` steps each side of zero: max|x| / levels, NaN where the
// block holds NaN or +-inf (int8's and int4's rule).
float block_scale(const float* x, int64_t n, float levels) {
  const int32_t amax = abs_max_bits(x, n);
  return amax >= 0x7f800000 ? NAN : bits_float(static_cast<uint32_t>(amax)) / levels;
}

COLLECTIVES_CLONES void quantize_block(const float* __restrict__ x, int8_t* __restrict__ q,
                                      int64_t n, float scale) {
  // x / scale lies in [-127, 127] (up to rounding), where adding and removing 1.5 * 2^23
  // rounds to nearest even; the integer clamp only guards that last rounding.
  for (int64_t i = 0; i < n; ++i) {
    const float v = (x[i] / scale + 12582912.0f) - 12582912.0f;
    q[i] = static_cast<int8_t>(std::clamp(static_cast<int32_t>(v), -127, 127));
  }
}

// Two int4 values (each in [-7, 7]) in one byte: element 2k in the low nibble, 2k + 1 in
// the high one. The values are rounded into a block-sized int8 buffer first (the same
// branch-free loop as int8's, which vectorizes), then packed pairwise.
COLLECTIVES_CLONES void quantize_block4(const float* __restrict__ x, uint8_t* __restrict__ q,
                                       int64_t n, float scale) {
  int8_t v[kInt4Block];
  for (int64_t i = 0; i < n; ++i) {
    const float r = (x[i] / scale + 12582912.0f) - 12582912.0f;
    v[i] = static_cast<int8_t>(std::clamp(static_cast<int32_t>(r), -7, 7));
  }
  if (n % 2) v[n] = 0;
  for (int64_t k = 0; k < (n + 1) / 2; ++k) {
    q[k] = static_cast<uint8_t>((v[2 * k] & 0xf) | ((v[2 * k + 1] & 0xf) << 4));
  }
}

}  // namespace

COLLECTIVES_CLONES void quantize_fp16(const float* __restrict__ x, uint16_t* __restrict__ h,
                                     int64_t count) {
  for (int64_t i = 0; i < count; ++i) h[i] = float_to_half(x[i]);
}

COLLECTIVES_CLONES void dequantize_fp16(const uint16_t* __restrict__ h, float* __restrict__ x,
                                       int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] = half_to_float(h[i]);
}

void quantize_int8(const float* x, int8_t* q, float* scales, int64_t count) {
  for (int64_t lo = 0, b = 0; lo < count; lo += kInt8Block, ++b) {
    const int64_t n = std::min(kInt8Block, count - lo);
    const float scale = block_scale(x + lo, n, 127.0f);
    scales[b] = scale;
    if (scale > 0.0f) {
      quantize_block(x + lo, q + lo, n, scale);
    } else {  // all zero (or below ~1e-43, where the scale underflows), or not finite
      std::memset(q + lo, 0, static_cast<size_t>(n));
    }
  }
}

void dequantize_int8(const int8_t* __restrict__ q, const float* __restrict__ scales,
                     float* __restrict__ x, int64_t count) {
  for (int64_t lo = 0, b = 0; lo < count; lo += kInt8Block, ++b) {
    const int64_t n = std::min(kInt8Block, count - lo);
    const float s = scales[b];
    for (int64_t i = 0; i < n; ++i) x[lo + i] = static_cast<float>(q[lo + i]) * s;
  }
}

void quantize_int4(const float* x, uint8_t* q, float* scales, int64_t count) {
  // blocks hold an even number of elements, so each starts on a byte
  for (int64_t lo = 0, b = 0; lo < count; lo += kInt4Block, ++b) {
    const int64_t n = std::min(kInt4Block, count - lo);
    const float scale = block_scale(x + lo, n, 7.0f);
    scales[b] = scale;
    if (scale > 0.0f) {
      quantize_block4(x + lo, q + lo / 2, n, scale);
    } else {
      std::memset(q + lo / 2, 0, static_cast<size_t>((n + 1) / 2));
    }
  }
}

COLLECTIVES_CLONES void dequantize_int4(const uint8_t* __restrict__ q,
                                        const float* __restrict__ scales,
                                        float* __restrict__ x, int64_t count) {
  for (int64_t lo = 0, b = 0; lo < count; lo += kInt4Block, ++b) {
    const int64_t n = std::min(kInt4Block, count - lo);
    const float s = scales[b];
    const uint8_t* in = q + lo / 2;
    float* out = x + lo;
    for (int64_t k = 0; k < n / 2; ++k) {  // sign-extend each nibble by shifts
      const int8_t byte = static_cast<int8_t>(in[k]);
      out[2 * k] = static_cast<float>(static_cast<int8_t>(byte << 4) >> 4) * s;
      out[2 * k + 1] = static_cast<float>(byte >> 4) * s;
    }
    if (n % 2) {
      const int8_t byte = static_cast<int8_t>(in[n / 2]);
      out[n - 1] = static_cast<float>(static_cast<int8_t>(byte << 4) >> 4) * s;
    }
  }
}

}  // namespace collectives
