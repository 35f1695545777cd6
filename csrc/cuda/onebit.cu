// 1-bit compression with error feedback on the GPU; format and semantics as
// csrc/kernels/onebit.h. compress is three launches:
//   onebit_partial_sumsq  one CTA per piece (a block, or a segment of a long block):
//                         a sum of (x + error)^2 in double, reduced in a fixed order
//   onebit_scales         one thread per block: sqrt(sum of its pieces / length)
//   onebit_pack           one thread per byte of bits: 8 signs, and the 8 new errors
// Launch onebit_partial_sumsq with SUMSQ_THREADS threads per CTA.
#define SUMSQ_THREADS 256
#include "ieee.cuh"

extern "C" __global__ void onebit_partial_sumsq(const float* x, const float* error,
                                                long long n, long long block, long long seg,
                                                long long pieces_per_block,
                                                long long pieces, double* partial) {
  __shared__ double lane[SUMSQ_THREADS];
  for (long long p = blockIdx.x; p < pieces; p += gridDim.x) {
    const long long b = p / pieces_per_block;
    const long long lo = b * block + (p % pieces_per_block) * seg;
    const long long hi = min(lo + seg, min((b + 1) * block, n));
    double acc = 0.0;
    for (long long i = lo + threadIdx.x; i < hi; i += SUMSQ_THREADS) {
      const double c = f32_to_f64(add_f32(x[i], error[i]));
      acc += c * c;
    }
    lane[threadIdx.x] = acc;
    __syncthreads();
    for (int half = SUMSQ_THREADS / 2; half > 0; half /= 2) {
      if (threadIdx.x < half) lane[threadIdx.x] += lane[threadIdx.x + half];
      __syncthreads();
    }
    if (threadIdx.x == 0) partial[p] = lane[0];
    __syncthreads();  // lane is reused by the next piece
  }
}

extern "C" __global__ void onebit_scales(const double* partial, long long pieces_per_block,
                                         long long n, long long block, long long nblocks,
                                         float* scales) {
  for (long long b = blockIdx.x * (long long)blockDim.x + threadIdx.x; b < nblocks;
       b += (long long)gridDim.x * blockDim.x) {
    double sum = 0.0;
    for (long long p = 0; p < pieces_per_block; ++p) sum += partial[b * pieces_per_block + p];
    const long long len = min(block, n - b * block);
    scales[b] = f64_to_f32(sqrt(sum / (double)len));
  }
}

extern "C" __global__ void onebit_pack(const float* x, float* error, unsigned char* bits,
                                       const float* scales, long long n, long long block) {
  const long long nbytes = (n + 7) / 8;
  for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < nbytes;
       k += (long long)gridDim.x * blockDim.x) {
    unsigned int byte = 0;
    for (int j = 0; j < 8; ++j) {
      const long long i = 8 * k + j;
      if (i < n) {
        const float c = add_f32(x[i], error[i]);
        const bool positive = ge_f32(c, 0.0f);  // false for NaN
        const float s = scales[i / block];
        byte |= (unsigned int)positive << (7 - j);
        error[i] = sub_f32(c, positive ? s : neg_f32(s));
      }
    }
    bits[k] = (unsigned char)byte;
  }
}

extern "C" __global__ void onebit_decompress(const unsigned char* bits, const float* scales,
                                             float* out, long long n, long long block) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const float s = scales[i / block];
    out[i] = (bits[i >> 3] >> (7 - (i & 7))) & 1 ? s : neg_f32(s);
  }
}

// acc[i] += decompress(bits[k], scales[k])[i] for k = 0 .. nchunks - 1, in order.
extern "C" __global__ void onebit_accumulate(float* acc, const unsigned char* const* bits,
                                             const float* const* scales, int nchunks,
                                             long long n, long long block) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    float a = acc[i];
    for (int k = 0; k < nchunks; ++k) {
      const float s = scales[k][i / block];
      a = add_f32(a, (bits[k][i >> 3] >> (7 - (i & 7))) & 1 ? s : neg_f32(s));
    }
    acc[i] = a;
  }
}
