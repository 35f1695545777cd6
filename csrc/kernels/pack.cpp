// One copy loop per element type; a scale of 1 is a plain copy for every dtype (bit exact,
// NaN payloads included). Tensors are copied one after another with no threads: the copy
// is memory bound, and a second thread adds no memory bandwidth to share.
//
// Big packs (a model's gradients into the fusion buffer) stream: non-temporal stores, so
// destination lines are not first read into the cache (2 bytes of memory traffic per byte
// packed, not 3), and a software prefetch 4 KiB ahead, because the tensors are separate
// allocations and the hardware prefetcher stops at every 4 KiB page. Together this packs
// faster than plain loops or memcpy per tensor (benchmarks/README.md, Kernels).
#include "pack.h"

#include <cstring>

#include "clones.h"
#include "dtypes.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace collectives {
namespace {

// Packs of at least this many bytes stream: well past L2, and written once to be sent.
constexpr int64_t kStreamBytes = 4 << 20;
constexpr int kPrefetchBytes = 4096;

template <typename T>
void scale_copy(T* __restrict__ dst, const T* __restrict__ src, int64_t count, T scale) {
  for (int64_t i = 0; i < count; ++i) dst[i] = src[i] * scale;
}

COLLECTIVES_CLONES void scale_copy_f16(uint16_t* __restrict__ dst,
                                      const uint16_t* __restrict__ src, int64_t count,
                                      float scale) {
  for (int64_t i = 0; i < count; ++i)
    dst[i] = float_to_half(half_to_float(src[i]) * scale);
}

COLLECTIVES_CLONES void scale_copy_bf16(uint16_t* __restrict__ dst,
                                       const uint16_t* __restrict__ src, int64_t count,
                                       float scale) {
  for (int64_t i = 0; i < count; ++i)
    dst[i] = float_to_bf16(bf16_to_float(src[i]) * scale);
}

#if defined(__SSE2__)
// memcpy with streaming stores once dst is 16-byte aligned; the caller fences.
void stream_copy(char* __restrict__ dst, const char* __restrict__ src, int64_t bytes) {
  int64_t i = 0;
  for (; i < bytes && reinterpret_cast<uintptr_t>(dst + i) % 16 != 0; ++i) dst[i] = src[i];
  for (; i + 64 <= bytes; i += 64) {
    __builtin_prefetch(src + i + kPrefetchBytes);
    for (int j = 0; j < 64; j += 16) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + j));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + j), v);
    }
  }
  std::memcpy(dst + i, src + i, static_cast<size_t>(bytes - i));
}

// scale_copy for float32 with streaming stores; the caller fences.
void stream_scale(float* __restrict__ dst, const float* __restrict__ src, int64_t count,
                  float scale) {
  int64_t i = 0;
  for (; i < count && reinterpret_cast<uintptr_t>(dst + i) % 16 != 0; ++i) dst[i] = src[i] * scale;
  const __m128 s = _mm_set1_ps(scale);
  for (; i + 16 <= count; i += 16) {
    __builtin_prefetch(src + i + kPrefetchBytes / 4);
    for (int j = 0; j < 16; j += 4)
      _mm_stream_ps(dst + i + j, _mm_mul_ps(_mm_loadu_ps(src + i + j), s));
  }
  for (; i < count; ++i) dst[i] = src[i] * scale;
}
#endif

// dst[:count] = src[:count] * scale for one tensor.
void copy_one(void* dst, const void* src, int64_t count, DType dtype, double scale,
              bool stream) {
  const int64_t bytes = count * dtype_size(dtype);
#if defined(__SSE2__)
  if (stream && scale == 1.0)
    return stream_copy(static_cast<char*>(dst), static_cast<const char*>(src), bytes);
  if (stream && dtype == DType::f32)
    return stream_scale(static_cast<float*>(dst), static_cast<const float*>(src), count,
                        static_cast<float>(scale));
#endif
  if (scale == 1.0) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return;
  }
  switch (dtype) {
    case DType::f32:
      return scale_copy(static_cast<float*>(dst), static_cast<const float*>(src), count,
                        static_cast<float>(scale));
    case DType::f64:
      return scale_copy(static_cast<double*>(dst), static_cast<const double*>(src), count,
                        scale);
    case DType::f16:
      return scale_copy_f16(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src),
                            count, static_cast<float>(scale));
    case DType::bf16:
      return scale_copy_bf16(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src),
                             count, static_cast<float>(scale));
    default:  // integers: the binding rejects scale != 1
      return;
  }
}

bool use_streaming(const int64_t* counts, int n, DType dtype) {
  int64_t bytes = 0;
  for (int k = 0; k < n; ++k) bytes += counts[k] * dtype_size(dtype);
  return bytes >= kStreamBytes;
}

// Non-temporal stores are weakly ordered: fence them before another thread or process
// (MPI, the progress thread) may read the buffer.
void end_streaming() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace

void pack(void* dst, const void* const* srcs, const int64_t* counts, int n, DType dtype,
          double scale) {
  const bool stream = use_streaming(counts, n, dtype);
  char* out = static_cast<char*>(dst);
  for (int k = 0; k < n; ++k) {
    copy_one(out, srcs[k], counts[k], dtype, scale, stream);
    out += counts[k] * dtype_size(dtype);
  }
  if (stream) end_streaming();
}

void unpack(const void* src, void* const* dsts, const int64_t* counts, int n, DType dtype,
            double scale) {
  const bool stream = use_streaming(counts, n, dtype);
  const char* in = static_cast<const char*>(src);
  for (int k = 0; k < n; ++k) {
    copy_one(dsts[k], in, counts[k], dtype, scale, stream);
    in += counts[k] * dtype_size(dtype);
  }
  if (stream) end_streaming();
}

}  // namespace collectives
