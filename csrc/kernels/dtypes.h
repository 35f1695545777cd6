// Element types shared by every kernel, and bit-exact float16 / bfloat16 conversions.
//
// Half types are reduced in float32 and rounded back to nearest-even after every
// operation, which is what NumPy (float16) and PyTorch (bfloat16) do element by element;
// csrc/cuda/convert.cuh has the same arithmetic, so CPU and GPU agree bit for bit. The
// conversions are integer selects rather than branches so the loops calling them vectorize.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace collectives {

// Codes are part of the Python interface (collectives/dtypes.py keeps the same table).
enum class DType : int {
  f16 = 0, bf16 = 1, f32 = 2, f64 = 3, i8 = 4, u8 = 5, i32 = 6, i64 = 7, i16 = 8
};

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

// c ? a : b with masks rather than a branch: GCC would otherwise sink the float math of an
// unused arm into a branch and then refuse to if-convert it (float ops "may trap").
inline uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return (a & m) | (b & ~m);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent and mantissa
  const uint32_t exp = em & 0x0f800000u;
  // normal: rebias 15 -> 127; inf / nan: exponent 31 -> 255
  const uint32_t wide = em + (exp == 0x0f800000u ? 0x70000000u : 0x38000000u);
  // zero / subnormal: 2^-14 * (1 + man/1024) - 2^-14 = man * 2^-24, exact
  const float sub = bits_float(em + 0x38800000u) - 6.103515625e-05f;
  return bits_float(select_bits(exp == 0, float_bits(sub), wide) | sign);
}

inline uint16_t float_to_half(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int32_t ax = static_cast<int32_t>(x & 0x7fffffffu);  // < 2^31: signed compares are safe
  const uint32_t nan = 0x7e00u | ((static_cast<uint32_t>(ax) >> 13) & 0x3ffu);
  // below 2^-14: adding 0.5 rounds to a multiple of 2^-24 (nearest even) in the low bits
  const uint32_t sub = float_bits(bits_float(static_cast<uint32_t>(ax)) + 0.5f) - 0x3f000000u;
  // rebias 127 -> 15 and round the 13 dropped bits to nearest even
  const uint32_t odd = (static_cast<uint32_t>(ax) >> 13) & 1u;
  const uint32_t norm = (static_cast<uint32_t>(ax) + 0xc8000fffu + odd) >> 13;
  uint32_t h = select_bits(ax < 0x38800000, sub, norm);
  h = select_bits(ax >= 0x477ff000, 0x7c00u, h);  // |f| >= 65520 rounds to inf
  h = select_bits(ax > 0x7f800000, nan, h);
  return static_cast<uint16_t>(h | sign);
}

inline float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const uint32_t nan = (x >> 16) | 0x40u;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// Bytes per element, indexed by the DType's code.
inline int64_t dtype_size(DType t) {
  constexpr int64_t sizes[] = {2, 2, 4, 8, 1, 1, 4, 8, 2};  // f16 bf16 f32 f64 i8 u8 i32 i64 i16
  static_assert(sizeof sizes / sizeof *sizes == static_cast<size_t>(DType::i16) + 1,
                "one size per DType");
  return sizes[static_cast<int>(t)];
}

}  // namespace collectives
