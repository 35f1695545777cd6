// Lossy gradient compression for allreduce: float32 -> float16 (half the bytes) and
// float32 -> int8 with one float32 scale per block of kInt8Block elements (~quarter).
#pragma once

#include <cstdint>

namespace collectives {

// Elements per int8 scale. Small enough that one outlier spoils few neighbours, large
// enough that the scales cost 1.6% of the int8 payload. collectives/kernels/args.py
// (INT8_BLOCK_SIZE) and csrc/cuda/quantize.cu keep the same value.
constexpr int64_t kInt8Block = 256;

// h[i] = x[i] rounded to float16 (nearest even, overflow to inf, NaN stays NaN).
void quantize_fp16(const float* x, uint16_t* h, int64_t count);
void dequantize_fp16(const uint16_t* h, float* x, int64_t count);

// Per block b of kInt8Block elements (the last may be shorter):
//   scales[b] = max|x| / 127;  q[i] = clamp(rint(x[i] / scales[b]), -127, 127)
// so |x - q * scale| <= max|x| / 254 (+ rounding). An all-zero block (or one whose scale
// underflows: max|x| < ~1e-43) has scale 0 and q = 0; a block holding NaN or +-inf has
// scale NaN and q = 0, so it decodes to NaN: a non-finite gradient is reported, not hidden.
void quantize_int8(const float* x, int8_t* q, float* scales, int64_t count);
// x[i] = q[i] * scales[i / kInt8Block]
void dequantize_int8(const int8_t* q, const float* scales, float* x, int64_t count);

}  // namespace collectives
