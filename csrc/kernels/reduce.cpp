// Reductions are folded block by block: a block of the accumulator stays in L1 while each
// source is folded into it, so every source byte is read once and dst written once.
#include "reduce.h"

#include "clones.h"

#include <algorithm>
#include <type_traits>

namespace collectives {
namespace {

constexpr int64_t kBlock = 2048;

// How an element type is loaded into arithmetic form and stored back.
template <typename T>
struct Plain {
  using Storage = T;
  using Math = T;
  static Math load(Storage s) { return s; }
  static Storage store(Math m) { return m; }
};
struct Half {
  using Storage = uint16_t;
  using Math = float;
  static Math load(Storage s) { return half_to_float(s); }
  static Storage store(Math m) { return float_to_half(m); }
};
struct BFloat {
  using Storage = uint16_t;
  using Math = float;
  static Math load(Storage s) { return bf16_to_float(s); }
  static Storage store(Math m) { return float_to_bf16(m); }
};

// Integer arithmetic goes through the unsigned type so overflow wraps instead of being UB.
template <typename M>
M wrap_add(M a, M b) {
  if constexpr (std::is_integral_v<M>) {
    using U = std::make_unsigned_t<M>;
    return static_cast<M>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}
template <typename M>
M wrap_mul(M a, M b) {
  if constexpr (std::is_integral_v<M>) {
    using U = std::make_unsigned_t<M>;
    using W = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;
    return static_cast<M>(static_cast<U>(static_cast<W>(static_cast<U>(a)) *
                                         static_cast<W>(static_cast<U>(b))));
  } else {
    return a * b;
  }
}

struct Sum {
  template <typename M> static M apply(M a, M b) { return wrap_add(a, b); }
};
struct Prod {
  template <typename M> static M apply(M a, M b) { return wrap_mul(a, b); }
};
struct Min {  // NaN in either operand wins, as numpy.minimum
  template <typename M> static M apply(M a, M b) { return (a < b || a != a) ? a : b; }
};
struct Max {
  template <typename M> static M apply(M a, M b) { return (a > b || a != a) ? a : b; }
};

// Two to four sources of a type that needs no conversion (the common case: tree and ring
// fold two, shm one per rank) go in one pass, without the accumulator's round trip.
// dst may be a (the contract of reduce_many), so no __restrict__ on them.
template <typename T, typename Op>
COLLECTIVES_CLONES void fold_direct(T* dst, const T* a, const T* __restrict__ b,
                                    const T* __restrict__ c, const T* __restrict__ d, int nsrc,
                                    int64_t count) {
  if (nsrc == 2) {
    for (int64_t i = 0; i < count; ++i) dst[i] = Op::apply(a[i], b[i]);
  } else if (nsrc == 3) {
    for (int64_t i = 0; i < count; ++i) dst[i] = Op::apply(Op::apply(a[i], b[i]), c[i]);
  } else {
    for (int64_t i = 0; i < count; ++i)
      dst[i] = Op::apply(Op::apply(Op::apply(a[i], b[i]), c[i]), d[i]);
  }
}

template <typename Traits, typename Op>
void fold(void* dst_v, const void* const* srcs_v, int nsrc, int64_t count) {
  using S = typename Traits::Storage;
  using M = typename Traits::Math;
  if constexpr (std::is_same_v<S, M>) {
    if (nsrc >= 2 && nsrc <= 4) {
      const S* const* s = reinterpret_cast<const S* const*>(srcs_v);
      return fold_direct<S, Op>(static_cast<S*>(dst_v), s[0], s[1], nsrc > 2 ? s[2] : nullptr,
                                nsrc > 3 ? s[3] : nullptr, nsrc, count);
    }
  }
  S* __restrict__ dst = static_cast<S*>(dst_v);
  M acc[kBlock];
  for (int64_t base = 0; base < count; base += kBlock) {
    const int64_t len = std::min(kBlock, count - base);
    const S* __restrict__ s0 = static_cast<const S*>(srcs_v[0]) + base;
    for (int64_t i = 0; i < len; ++i) acc[i] = Traits::load(s0[i]);
    for (int k = 1; k < nsrc; ++k) {
      const S* __restrict__ sk = static_cast<const S*>(srcs_v[k]) + base;
      if constexpr (std::is_same_v<S, M>) {
        for (int64_t i = 0; i < len; ++i) acc[i] = Op::apply(acc[i], sk[i]);
      } else {  // round after every op, so k-way folds equal k-1 pairwise reductions
        for (int64_t i = 0; i < len; ++i)
          acc[i] = Traits::load(Traits::store(Op::apply(acc[i], Traits::load(sk[i]))));
      }
    }
    for (int64_t i = 0; i < len; ++i) dst[base + i] = Traits::store(acc[i]);
  }
}

template <typename Traits>
void fold_op(void* dst, const void* const* srcs, int nsrc, int64_t count, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return fold<Traits, Sum>(dst, srcs, nsrc, count);
    case ReduceOp::min: return fold<Traits, Min>(dst, srcs, nsrc, count);
    case ReduceOp::max: return fold<Traits, Max>(dst, srcs, nsrc, count);
    case ReduceOp::prod: return fold<Traits, Prod>(dst, srcs, nsrc, count);
  }
}

template <typename Traits>
void divide_as(void* buf_v, int64_t count, int64_t divisor) {
  using S = typename Traits::Storage;
  using M = typename Traits::Math;
  S* __restrict__ buf = static_cast<S*>(buf_v);
  // A power of two (2, 4, 8 ranks) divides as cheaply as it can with the same bits: a float
  // multiplied by 2^-k rounds the very real number x / 2^k rounds to, and an integer's floor
  // division by 2^k is an arithmetic shift. A hardware divide costs several times a multiply
  // (it is what an Average of cached data pays).
  const bool power_of_two = divisor > 0 && divisor < (int64_t{1} << 31) && (divisor & (divisor - 1)) == 0;
  if constexpr (std::is_integral_v<M>) {
    const M d = static_cast<M>(divisor);
    if (power_of_two) {
      int shift = 0;
      while ((int64_t{1} << shift) < divisor) ++shift;
      for (int64_t i = 0; i < count; ++i) buf[i] = static_cast<S>(buf[i] >> shift);
      return;
    }
    for (int64_t i = 0; i < count; ++i) {
      const M q = buf[i] / d;
      buf[i] = (buf[i] % d != 0 && ((buf[i] < 0) != (d < 0))) ? q - 1 : q;  // floor
    }
  } else {
    const M d = static_cast<M>(divisor);
    if (power_of_two) {
      const M inverse = M(1) / d;
      for (int64_t i = 0; i < count; ++i) buf[i] = Traits::store(Traits::load(buf[i]) * inverse);
      return;
    }
    for (int64_t i = 0; i < count; ++i) buf[i] = Traits::store(Traits::load(buf[i]) / d);
  }
}

}  // namespace

void reduce_many(void* dst, const void* const* srcs, int nsrc, int64_t count, DType dtype,
                 ReduceOp op) {
  switch (dtype) {
    case DType::f16: return fold_op<Half>(dst, srcs, nsrc, count, op);
    case DType::bf16: return fold_op<BFloat>(dst, srcs, nsrc, count, op);
    case DType::f32: return fold_op<Plain<float>>(dst, srcs, nsrc, count, op);
    case DType::f64: return fold_op<Plain<double>>(dst, srcs, nsrc, count, op);
    case DType::i8: return fold_op<Plain<int8_t>>(dst, srcs, nsrc, count, op);
    case DType::u8: return fold_op<Plain<uint8_t>>(dst, srcs, nsrc, count, op);
    case DType::i32: return fold_op<Plain<int32_t>>(dst, srcs, nsrc, count, op);
    case DType::i64: return fold_op<Plain<int64_t>>(dst, srcs, nsrc, count, op);
    case DType::i16: return fold_op<Plain<int16_t>>(dst, srcs, nsrc, count, op);
  }
}

void divide(void* buf, int64_t count, DType dtype, int64_t divisor) {
  switch (dtype) {
    case DType::f16: return divide_as<Half>(buf, count, divisor);
    case DType::bf16: return divide_as<BFloat>(buf, count, divisor);
    case DType::f32: return divide_as<Plain<float>>(buf, count, divisor);
    case DType::f64: return divide_as<Plain<double>>(buf, count, divisor);
    case DType::i8: return divide_as<Plain<int8_t>>(buf, count, divisor);
    case DType::u8: return divide_as<Plain<uint8_t>>(buf, count, divisor);
    case DType::i32: return divide_as<Plain<int32_t>>(buf, count, divisor);
    case DType::i64: return divide_as<Plain<int64_t>>(buf, count, divisor);
    case DType::i16: return divide_as<Plain<int16_t>>(buf, count, divisor);
  }
}

}  // namespace collectives
