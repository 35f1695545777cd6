// Branch-free float16 / bfloat16 conversions for hot loops.
//
// Bit-identical to half_to_float / float_to_half / float_to_bf16 in dtypes.h (checked over
// every input), but written as integer selects instead of branches so that loops calling
// them vectorize (dtypes.h's versions keep the readable, branchy form). The same
// arithmetic is in csrc/cuda/convert.cuh, so CPU and GPU round identically.
#pragma once

#include <cstdint>

#include "dtypes.h"

namespace collectives {

// c ? a : b with masks rather than a branch: GCC would otherwise sink the float math of an
// unused arm into a branch and then refuse to if-convert it (float ops "may trap").
inline uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return (a & m) | (b & ~m);
}

inline float half_to_float_vec(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent and mantissa
  const uint32_t exp = em & 0x0f800000u;
  // normal: rebias 15 -> 127; inf / nan: exponent 31 -> 255
  const uint32_t wide = em + (exp == 0x0f800000u ? 0x70000000u : 0x38000000u);
  // zero / subnormal: 2^-14 * (1 + man/1024) - 2^-14 = man * 2^-24, exact
  const float sub = bits_float(em + 0x38800000u) - 6.103515625e-05f;
  return bits_float(select_bits(exp == 0, float_bits(sub), wide) | sign);
}

inline uint16_t float_to_half_vec(float f) {
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

inline uint16_t float_to_bf16_vec(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const uint32_t nan = (x >> 16) | 0x40u;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

}  // namespace collectives
