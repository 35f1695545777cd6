// float16 and block-int8 quantization on the GPU, same semantics as csrc/kernels/quantize.cpp.
// Launch quantize_int8 with INT8_BLOCK threads per CTA: a CTA quantizes one block at a time.
#include "convert.cuh"

#define INT8_BLOCK 256  // kInt8Block in csrc/kernels/quantize.h

extern "C" __global__ void quantize_fp16(const float* x, unsigned short* h, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    h[i] = float_to_half_bits(x[i]);
}

extern "C" __global__ void dequantize_fp16(const unsigned short* h, float* x, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    x[i] = half_to_float_bits(h[i]);
}

extern "C" __global__ void quantize_int8(const float* x, signed char* q, float* scales,
                                         long long n) {
  __shared__ unsigned int amax;
  const long long nblocks = (n + INT8_BLOCK - 1) / INT8_BLOCK;
  for (long long b = blockIdx.x; b < nblocks; b += gridDim.x) {
    const long long i = b * INT8_BLOCK + threadIdx.x;
    // max |x| as float bits: integer order is float order here, and NaN beats everything
    const unsigned int bits = i < n ? (__float_as_uint(x[i]) & 0x7fffffffu) : 0u;
    if (threadIdx.x == 0) amax = 0;
    __syncthreads();
    atomicMax(&amax, bits);
    __syncthreads();
    const float scale = amax >= 0x7f800000u ? __uint_as_float(0x7fc00000u)  // NaN
                                            : div_f32(__uint_as_float(amax), 127.0f);
    if (threadIdx.x == 0) scales[b] = scale;
    if (i < n) {
      const int v = gt_f32(scale, 0.0f) ? rint_to_int(div_f32(x[i], scale)) : 0;
      q[i] = (signed char)min(127, max(-127, v));
    }
    __syncthreads();  // amax is reused by the next block
  }
}

extern "C" __global__ void dequantize_int8(const signed char* q, const float* scales,
                                           float* x, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    x[i] = mul_f32((float)q[i], scales[i / INT8_BLOCK]);
}
