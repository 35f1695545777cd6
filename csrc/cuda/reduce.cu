// Elementwise reduce and divide on the GPU, same semantics as csrc/kernels/reduce.cpp: a left
// fold dst = a op b op c op d of one to four sources (dst may be a; longer lists are folded
// on into dst by the caller, which is the same fold), integers wrapping (two's complement),
// half types computed in float32 and rounded to nearest even after every op, Min/Max
// propagating NaN (as numpy.minimum); divide is correctly rounded for floats and floor
// division for integers. Every float op is explicitly rounded to nearest even (float32:
// ieee.cuh, which also keeps subnormals under -ftz=true; float64: _rn intrinsics), so no
// compiler option (contraction, approximate division, flushing) can change a result bit.
#include "convert.cuh"

// How an element type is loaded into arithmetic form (M), rounded to the element type,
// and stored back (S).
template <typename T>
struct Plain {
  typedef T S;
  typedef T M;
  __device__ static M load(S s) { return s; }
  __device__ static S store(M m) { return m; }
};
struct Half {
  typedef unsigned short S;
  typedef float M;
  __device__ static M load(S s) { return half_to_float_bits(s); }
  __device__ static S store(M m) { return float_to_half_bits(m); }
};
struct BFloat {
  typedef unsigned short S;
  typedef float M;
  __device__ static M load(S s) { return bf16_to_float_bits(s); }
  __device__ static S store(M m) { return float_to_bf16_bits(m); }
};

// Integer arithmetic goes through an unsigned type at least as wide as unsigned int, so
// overflow wraps instead of being undefined (8-bit operands would otherwise become int).
template <typename I> struct Wide { typedef unsigned int T; };
template <> struct Wide<long long> { typedef unsigned long long T; };

__device__ __forceinline__ bool is_nan(float x) { return nan_f32(x); }
__device__ __forceinline__ bool is_nan(double x) { return x != x; }
template <typename I> __device__ __forceinline__ bool is_nan(I) { return false; }

struct Sum {
  __device__ static float apply(float a, float b) { return add_f32(a, b); }
  __device__ static double apply(double a, double b) { return __dadd_rn(a, b); }
  template <typename I> __device__ static I apply(I a, I b) {
    typedef typename Wide<I>::T W;
    return (I)((W)a + (W)b);
  }
};
struct Product {
  __device__ static float apply(float a, float b) { return mul_f32(a, b); }
  __device__ static double apply(double a, double b) { return __dmul_rn(a, b); }
  template <typename I> __device__ static I apply(I a, I b) {
    typedef typename Wide<I>::T W;
    return (I)((W)a * (W)b);
  }
};
struct Min {  // NaN in either operand wins
  __device__ static float apply(float a, float b) { return (lt_f32(a, b) || is_nan(a)) ? a : b; }
  template <typename M> __device__ static M apply(M a, M b) {
    return (a < b || is_nan(a)) ? a : b;
  }
};
struct Max {
  __device__ static float apply(float a, float b) { return (gt_f32(a, b) || is_nan(a)) ? a : b; }
  template <typename M> __device__ static M apply(M a, M b) {
    return (a > b || is_nan(a)) ? a : b;
  }
};

// One step of the fold, rounded to the element type (a no-op for Plain types).
template <typename Traits, typename Op>
__device__ __forceinline__ typename Traits::M step(typename Traits::M acc,
                                                   typename Traits::S x) {
  return Traits::load(Traits::store(Op::apply(acc, Traits::load(x))));
}

// nsrc in 1..4; b, c, d are read only when nsrc says so. dst may be a: each element is
// read from every source before it is written.
template <typename Traits, typename Op>
__device__ void fold(typename Traits::S* dst, const typename Traits::S* a,
                     const typename Traits::S* b, const typename Traits::S* c,
                     const typename Traits::S* d, int nsrc, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    typename Traits::M acc = Traits::load(a[i]);
    if (nsrc > 1) acc = step<Traits, Op>(acc, b[i]);
    if (nsrc > 2) acc = step<Traits, Op>(acc, c[i]);
    if (nsrc > 3) acc = step<Traits, Op>(acc, d[i]);
    dst[i] = Traits::store(acc);
  }
}

__device__ __forceinline__ float quotient(float a, float d) { return div_f32(a, d); }
__device__ __forceinline__ double quotient(double a, double d) { return __ddiv_rn(a, d); }
template <typename I> __device__ __forceinline__ bool negative(I x) { return x < (I)0; }
__device__ __forceinline__ bool negative(unsigned char) { return false; }
template <typename I> __device__ __forceinline__ I quotient(I a, I d) {  // floor division
  const I q = (I)(a / d);
  return (a % d != 0 && negative(a) != negative(d)) ? (I)(q - 1) : q;
}

template <typename Traits>
__device__ void divide_as(typename Traits::S* buf, long long n, long long divisor) {
  const typename Traits::M d = (typename Traits::M)divisor;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    buf[i] = Traits::store(quotient(Traits::load(buf[i]), d));
}

#define REDUCE_KERNEL(NAME, TRAITS, OP, OPNAME)                                            \
  extern "C" __global__ void reduce_##NAME##_##OPNAME(                                    \
      TRAITS::S* dst, const TRAITS::S* a, const TRAITS::S* b, const TRAITS::S* c,          \
      const TRAITS::S* d, int nsrc, long long n) {                                         \
    fold<TRAITS, OP>(dst, a, b, c, d, nsrc, n);                                            \
  }
// reduce_<dtype>_<op> for every op, and divide_<dtype>
#define DTYPE_KERNELS(NAME, TRAITS)                                                        \
  REDUCE_KERNEL(NAME, TRAITS, Sum, sum)                                                    \
  REDUCE_KERNEL(NAME, TRAITS, Min, min)                                                    \
  REDUCE_KERNEL(NAME, TRAITS, Max, max)                                                    \
  REDUCE_KERNEL(NAME, TRAITS, Product, product)                                            \
  extern "C" __global__ void divide_##NAME(TRAITS::S* buf, long long n, long long divisor) { \
    divide_as<TRAITS>(buf, n, divisor);                                                    \
  }
DTYPE_KERNELS(float16, Half)
DTYPE_KERNELS(bfloat16, BFloat)
DTYPE_KERNELS(float32, Plain<float>)
DTYPE_KERNELS(float64, Plain<double>)
DTYPE_KERNELS(int8, Plain<signed char>)
DTYPE_KERNELS(uint8, Plain<unsigned char>)
DTYPE_KERNELS(int32, Plain<int>)
DTYPE_KERNELS(int64, Plain<long long>)
DTYPE_KERNELS(int16, Plain<short>)
