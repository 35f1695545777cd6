// Fusion-buffer packing on the GPU: one launch for the whole tensor list. blockIdx.y walks
// the tensors and blockIdx.x / threadIdx.x the elements of each (grid-stride both ways).
// srcs / dsts are device arrays of pointers; offsets[k] is where tensor k starts in the
// packed buffer and offsets[n] the total. Same semantics as csrc/kernels/pack.cpp.
#include "convert.cuh"

template <typename T, typename F>
__device__ void pack_tensors(const T* const* srcs, const long long* offsets, int n, T* dst,
                             F f) {
  for (int t = blockIdx.y; t < n; t += gridDim.y) {
    const long long lo = offsets[t], len = offsets[t + 1] - lo;
    const T* src = srcs[t];
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x)
      dst[lo + i] = f(src[i]);
  }
}

template <typename T, typename F>
__device__ void unpack_tensors(const T* src, T* const* dsts, const long long* offsets, int n,
                               F f) {
  for (int t = blockIdx.y; t < n; t += gridDim.y) {
    const long long lo = offsets[t], len = offsets[t + 1] - lo;
    T* dst = dsts[t];
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x)
      dst[i] = f(src[lo + i]);
  }
}

template <typename T>
struct Copy {
  __device__ T operator()(T x) const { return x; }
};
__device__ __forceinline__ float times(float x, float s) { return mul_f32(x, s); }
__device__ __forceinline__ double times(double x, double s) { return __dmul_rn(x, s); }
template <typename T>
struct Scale {
  T s;
  __device__ T operator()(T x) const { return times(x, s); }
};
struct ScaleHalf {  // multiply in float32, round once
  float s;
  __device__ unsigned short operator()(unsigned short x) const {
    return float_to_half_bits(mul_f32(half_to_float_bits(x), s));
  }
};
struct ScaleBf16 {
  float s;
  __device__ unsigned short operator()(unsigned short x) const {
    return float_to_bf16_bits(mul_f32(bf16_to_float_bits(x), s));
  }
};

// scale == 1: a copy by element size, for every dtype.
#define COPY_KERNELS(SUFFIX, T)                                                           \
  extern "C" __global__ void pack_copy##SUFFIX(const T* const* srcs,                     \
                                               const long long* offsets, int n, T* dst) { \
    pack_tensors(srcs, offsets, n, dst, Copy<T>());                                      \
  }                                                                                       \
  extern "C" __global__ void unpack_copy##SUFFIX(const T* src, T* const* dsts,           \
                                                 const long long* offsets, int n) {       \
    unpack_tensors(src, dsts, offsets, n, Copy<T>());                                    \
  }
COPY_KERNELS(1, unsigned char)
COPY_KERNELS(2, unsigned short)
COPY_KERNELS(4, unsigned int)
COPY_KERNELS(8, unsigned long long)

// scale != 1: floating dtypes only.
#define SCALE_KERNELS(SUFFIX, T, S, FUNCTOR)                                              \
  extern "C" __global__ void pack_##SUFFIX(const T* const* srcs, const long long* offsets, \
                                           int n, T* dst, S scale) {                      \
    pack_tensors(srcs, offsets, n, dst, FUNCTOR{scale});                                  \
  }                                                                                        \
  extern "C" __global__ void unpack_##SUFFIX(const T* src, T* const* dsts,                \
                                             const long long* offsets, int n, S scale) {   \
    unpack_tensors(src, dsts, offsets, n, FUNCTOR{scale});                                \
  }
SCALE_KERNELS(float32, float, float, Scale<float>)
SCALE_KERNELS(float64, double, double, Scale<double>)
SCALE_KERNELS(float16, unsigned short, float, ScaleHalf)
SCALE_KERNELS(bfloat16, unsigned short, float, ScaleBf16)
