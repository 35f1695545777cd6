// float16 / bfloat16 bit conversions for the CUDA kernels: the same integer arithmetic as
// csrc/kernels/dtypes.h (round to nearest even, NaN stays NaN), so CPU and GPU agree bit for
// bit without relying on cuda_fp16.h, which run-time compilation may not find.
#pragma once
#include "ieee.cuh"

__device__ __forceinline__ float half_to_float_bits(unsigned short h) {
  const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
  const unsigned int em = (unsigned int)(h & 0x7fffu) << 13;
  const unsigned int exp = em & 0x0f800000u;
  if (exp == 0)  // zero / subnormal: 2^-14 * (1 + man/1024) - 2^-14 = man * 2^-24, exact
    return __uint_as_float(__float_as_uint(sub_f32(__uint_as_float(em + 0x38800000u),
                                                   6.103515625e-05f)) | sign);
  return __uint_as_float((em + (exp == 0x0f800000u ? 0x70000000u : 0x38000000u)) | sign);
}

__device__ __forceinline__ unsigned short float_to_half_bits(float f) {
  const unsigned int x = __float_as_uint(f);
  const unsigned int sign = (x >> 16) & 0x8000u;
  const unsigned int ax = x & 0x7fffffffu;
  unsigned int h;
  if (ax > 0x7f800000u) {
    h = 0x7e00u | ((ax >> 13) & 0x3ffu);  // quiet NaN
  } else if (ax >= 0x477ff000u) {
    h = 0x7c00u;  // |f| >= 65520 rounds to inf
  } else if (ax < 0x38800000u) {  // adding 0.5 rounds to a multiple of 2^-24, nearest even
    h = __float_as_uint(add_f32(__uint_as_float(ax), 0.5f)) - 0x3f000000u;
  } else {  // rebias 127 -> 15, round the 13 dropped bits to nearest even
    h = (ax + 0xc8000fffu + ((ax >> 13) & 1u)) >> 13;
  }
  return (unsigned short)(h | sign);
}

__device__ __forceinline__ float bf16_to_float_bits(unsigned short b) {
  return __uint_as_float((unsigned int)b << 16);
}

__device__ __forceinline__ unsigned short float_to_bf16_bits(float f) {
  const unsigned int x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
  return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
