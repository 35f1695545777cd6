// float32 arithmetic and comparisons that keep subnormals whatever the compiler is told.
// CuPy compiles every module with -ftz=true (flush subnormals to zero), which turns each f32
// add, multiply, divide, comparison and conversion into its .ftz form: results would then
// differ from the C++ kernels' (IEEE) wherever a value is subnormal. These are the PTX
// instructions without .ftz, round to nearest even, so no option can change a result bit.
// ci/compile_cuda.sh compiles with -ftz=true and fails if any .ftz instruction is left.
#pragma once

// a op b, one PTX instruction (e.g. "add.rn.f32") rounding to nearest even.
#define COLLECTIVES_F32_BINARY(name, instruction)                  \
  __device__ __forceinline__ float name(float a, float b) {        \
    float r;                                                       \
    asm(instruction " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));    \
    return r;                                                      \
  }

COLLECTIVES_F32_BINARY(add_f32, "add.rn.f32")
COLLECTIVES_F32_BINARY(sub_f32, "sub.rn.f32")
COLLECTIVES_F32_BINARY(mul_f32, "mul.rn.f32")
COLLECTIVES_F32_BINARY(div_f32, "div.rn.f32")
#undef COLLECTIVES_F32_BINARY

// a < b, a > b, a >= b: false when either is NaN, as in C++.
__device__ __forceinline__ bool lt_f32(float a, float b) {
  unsigned int r;
  asm("{ .reg .pred p; setp.lt.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(r) : "f"(a), "f"(b));
  return r != 0;
}

__device__ __forceinline__ bool gt_f32(float a, float b) { return lt_f32(b, a); }

__device__ __forceinline__ bool ge_f32(float a, float b) {
  unsigned int r;
  asm("{ .reg .pred p; setp.ge.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(r) : "f"(a), "f"(b));
  return r != 0;
}

__device__ __forceinline__ float neg_f32(float a) {  // the sign bit flipped, as in C++
  return __uint_as_float(__float_as_uint(a) ^ 0x80000000u);
}

__device__ __forceinline__ bool nan_f32(float a) {
  return (__float_as_uint(a) & 0x7fffffffu) > 0x7f800000u;
}

__device__ __forceinline__ double f32_to_f64(float a) {  // exact
  double r;
  asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(a));
  return r;
}

__device__ __forceinline__ float f64_to_f32(double a) {  // round to nearest even
  float r;
  asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(a));
  return r;
}

__device__ __forceinline__ int rint_to_int(float a) {  // nearest, ties to even; saturating
  int r;
  asm("cvt.rni.s32.f32 %0, %1;" : "=r"(r) : "f"(a));
  return r;
}
