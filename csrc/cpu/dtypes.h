// Element types shared by every kernel, and bit-exact float16 / bfloat16 conversions.
//
// Half types are reduced in float32 and rounded back to nearest-even after every
// operation, which is what NumPy (float16) and PyTorch (bfloat16) do element by element,
// and what the CUDA kernels do with __half / __nv_bfloat16, so all three agree bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace collectives {

// Codes are part of the Python interface (collectives/kernels.py keeps the same table).
enum class DType : int { f16 = 0, bf16 = 1, f32 = 2, f64 = 3, i8 = 4, u8 = 5, i32 = 6, i64 = 7 };

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf, nan
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24 is exact in float32
  return bits_float(float_bits(static_cast<float>(man) * 5.9604644775390625e-8f) | sign);
}

inline uint16_t float_to_half(float f) {
  const uint32_t x = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u | ((ax >> 13) & 0x3ffu);  // quiet nan
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // |f| >= 65520 rounds to inf
  if (ax < 0x38800000u) {                         // below 2^-14: subnormal half
    const float scaled = bits_float(ax) * 16777216.0f;  // exact: units of 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  // rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even
  const uint32_t odd = (ax >> 13) & 1u;
  return sign | static_cast<uint16_t>((ax + 0xc8000fffu + odd) >> 13);
}

inline float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline int64_t dtype_size(DType t) {
  switch (t) {
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::i8:
    case DType::u8:
      return 1;
  }
  return 0;
}

}  // namespace collectives
