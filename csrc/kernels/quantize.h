// Lossy gradient compression for allreduce: float32 -> float16 (half the bytes),
// float32 -> int8 with one float32 scale per block of kInt8Block elements (~quarter), and
// float32 -> int4, two values a byte, one float32 scale per block of kInt4Block (~eighth).
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

// Elements per int4 scale: an int4 value has 15 levels, so a block is shorter than int8's
// (an outlier spoils fewer neighbours); the scales cost 6.25% of the packed payload.
// collectives/kernels/args.py (INT4_BLOCK_SIZE) keeps the same value.
constexpr int64_t kInt4Block = 128;

// Per block b of kInt4Block elements (the last may be shorter):
//   scales[b] = max|x| / 7;  v[i] = clamp(rint(x[i] / scales[b]), -7, 7)
// packed two a byte, element 2k in the low nibble of q[k] and 2k + 1 in the high one (two's
// complement nibbles; an odd count leaves the last high nibble 0): (count + 1) / 2 bytes,
// |x - v * scale| <= max|x| / 14 (+ rounding). Zero and non-finite blocks as for int8.
void quantize_int4(const float* x, uint8_t* q, float* scales, int64_t count);
// x[i] = v[i] * scales[i / kInt4Block]
void dequantize_int4(const uint8_t* q, const float* scales, float* x, int64_t count);

}  // namespace collectives
