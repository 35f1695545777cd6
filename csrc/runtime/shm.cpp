// Stages of the shared-memory collectives (see shm.h and collectives/algorithms/shm.py);
// counters are posted and waited for by Sync (shm_sync.h).
#include "runtime/shm.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "runtime/shm_sync.h"

namespace collectives {
namespace {

// Stage s of chunk k runs at step k + s, earlier stages first within a step: each wait is
// on work the other ranks did a step earlier.
void pipeline(int64_t nchunks, std::initializer_list<std::function<void(int64_t)>> stages) {
  const int64_t n = static_cast<int64_t>(stages.size());
  for (int64_t step = 0; step < nchunks + n - 1; ++step) {
    int64_t s = 0;
    for (const auto& stage : stages) {
      if (step - s >= 0 && step - s < nchunks) stage(step - s);
      ++s;
    }
  }
}

// memcpy whose stores stream to memory instead of filling this core's cache (x86-64; a
// plain memcpy elsewhere). Ends with a store fence, so a counter posted after it is seen
// after the bytes.
void copy_streaming(unsigned char* dst, const unsigned char* src, int64_t n) {
#if defined(__x86_64__)
  const int64_t head = std::min<int64_t>(n, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  int64_t i = head;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

// An out-of-place allreduce from this size up writes its result with streaming stores. Its
// lines are not in any cache (the input is read from send, the result goes to recv), so a
// plain store first reads each line from memory: a third pass over the buffer. Streaming
// skips that read. In place, the result's lines were just read as the input, and plain
// stores are cheaper, except while the staging buffers stream (StoreChoice): then the
// ranks' cores share no cache, and streaming the result too saves about a tenth. Below
// this size streaming gains little or loses (benchmarks/README.md, "Average and in
// place"), and the result stays in cache for the caller to read.
constexpr int64_t kStreamResultBytes = 8 << 20;

// Blocks of elements (bounds) cut into pieces of e; piece k of block j, clipped to it.
struct Pieces {
  const std::vector<int64_t>& bounds;
  int64_t e;

  std::pair<int64_t, int64_t> operator()(int j, int64_t k) const {
    const int64_t end = bounds[j + 1];
    const int64_t lo = std::min(bounds[j] + k * e, end);
    return {lo, std::min(lo + e, end)};
  }
};

class ReduceStages {
 public:
  ReduceStages(const ShmWindow& w, int64_t seq, const unsigned char* send, unsigned char* recv,
               const std::vector<int64_t>& bounds, int64_t e, DType dtype, ReduceOp op,
               bool allreduce, int64_t divisor, bool stream, bool stream_result)
      : sync_(w), seq_(seq), send_(send), recv_(recv), piece_{bounds, e}, e_(e),
        dtype_(dtype), op_(op), allreduce_(allreduce), divisor_(divisor),
        item_(dtype_size(dtype)), stream_(stream), stream_result_(stream_result) {
    if (stream_ && allreduce_) scratch_.resize(e * item_);
  }

  // Copy this rank's pieces of the other ranks' blocks into its buffer.
  void copy_in(int64_t k) {
    const int64_t g = seq_ + k;
    sync_.wait(kDone, g - sync_.depth());
    for (int j = 0; j < sync_.size(); ++j) {
      if (j == sync_.rank()) continue;
      const auto [lo, hi] = piece_(j, k);
      store(at(sync_.rank(), g, j), send_ + lo * item_, (hi - lo) * item_, stream_);
    }
    sync_.post(kReady, g);
  }

  // Fold piece `rank` of every rank's buffer (own straight from send), in rank order, and
  // divide it by divisor (an Average) while it is in cache.
  void reduce(int64_t k) {
    const int64_t g = seq_ + k;
    sync_.wait(kReady, g);
    const int r = sync_.rank();
    const auto [lo, hi] = piece_(r, k);
    srcs_.resize(sync_.size());
    for (int j = 0; j < sync_.size(); ++j) srcs_[j] = j == r ? send_ + lo * item_ : at(j, g, r);
    // streaming, an allreduce folds in a scratch piece (hot in cache), streamed to the buffer
    unsigned char* dst = !allreduce_ ? recv_ + (lo - piece_.bounds[r]) * item_
                         : stream_   ? scratch_.data()
                                     : at(r, g, r);
    reduce_many(dst, srcs_.data(), sync_.size(), hi - lo, dtype_, op_);
    if (divisor_ > 1) divide(dst, hi - lo, dtype_, divisor_);
    if (allreduce_ && stream_) copy_streaming(at(r, g, r), dst, (hi - lo) * item_);
    if (allreduce_) store(recv_ + lo * item_, dst, (hi - lo) * item_, stream_result_);
    sync_.post(allreduce_ ? kReduced : kDone, g);
  }

  // Copy every other rank's reduced piece (left in its own buffer) into recv.
  void copy_out(int64_t k) {
    const int64_t g = seq_ + k;
    sync_.wait(kReduced, g);
    for (int j = 0; j < sync_.size(); ++j) {
      if (j == sync_.rank()) continue;
      const auto [lo, hi] = piece_(j, k);
      store(recv_ + lo * item_, at(j, g, j), (hi - lo) * item_, stream_result_);
    }
    sync_.post(kDone, g);
  }

 private:
  // streaming: copy_streaming, else memcpy
  static void store(unsigned char* dst, const unsigned char* src, int64_t n, bool streaming) {
    if (streaming)
      copy_streaming(dst, src, n);
    else
      std::memcpy(dst, src, n);
  }

  // Piece j's place in rank owner's buffer for chunk g.
  unsigned char* at(int owner, int64_t g, int j) const {
    return sync_.slot(owner, g) + j * e_ * item_;
  }

  Sync sync_;
  int64_t seq_;
  const unsigned char* send_;
  unsigned char* recv_;
  Pieces piece_;
  int64_t e_;
  DType dtype_;
  ReduceOp op_;
  bool allreduce_;
  int64_t divisor_;
  int64_t item_;
  bool stream_;
  bool stream_result_;  // the result's stores stream (kStreamResultBytes)
  std::vector<unsigned char> scratch_;  // streaming allreduce: the piece being reduced
  std::vector<const void*> srcs_;
};

}  // namespace

void shm_single(ShmWindow& w, const void* head, int64_t head_bytes, const void* data,
                int64_t data_bytes,
                const std::function<void(const unsigned char* const* buffers)>& read,
                const OnWait* on_wait, double first_wait) {
  const int64_t seq = w.begin(1);
  Sync sync(w, on_wait, first_wait);
  sync.wait(kDone, seq - sync.depth());
  unsigned char* mine = sync.slot(sync.rank(), seq);
  if (head_bytes) std::memcpy(mine, head, head_bytes);
  if (data_bytes) std::memcpy(mine + shm_single_data_offset(head_bytes), data, data_bytes);
  sync.post(kReady, seq);
  sync.wait(kReady, seq);
  std::vector<const unsigned char*> buffers(sync.size());
  for (int j = 0; j < sync.size(); ++j) buffers[j] = sync.slot(j, seq);
  read(buffers.data());
  sync.post(kDone, seq);
}

void shm_reduce_single(ShmWindow& w, const void* send, void* recv,
                       int64_t count, int64_t lo, int64_t hi, DType dtype, ReduceOp op) {
  const int64_t item = dtype_size(dtype);
  const int n = static_cast<int>(w.segments.size());
  shm_single(w, nullptr, 0, send, count * item, [&](const unsigned char* const* buffers) {
    std::vector<const void*> srcs(n);
    for (int j = 0; j < n; ++j) srcs[j] = buffers[j] + lo * item;
    reduce_many(recv, srcs.data(), n, hi - lo, dtype, op);
  });
}

void shm_allgather_single(ShmWindow& w, const void* send, void* recv,
                          const std::vector<int64_t>& bounds, int64_t item) {
  const int n = static_cast<int>(w.segments.size());
  auto* out = static_cast<unsigned char*>(recv);
  const int64_t mine = (bounds[w.rank + 1] - bounds[w.rank]) * item;
  shm_single(w, nullptr, 0, send, mine, [&](const unsigned char* const* buffers) {
    for (int j = 0; j < n; ++j)
      std::memcpy(out + bounds[j] * item, buffers[j], (bounds[j + 1] - bounds[j]) * item);
  });
}

void shm_reduce(ShmWindow& w, const void* send, void* recv, const std::vector<int64_t>& bounds,
                int64_t e, int64_t nchunks, DType dtype, ReduceOp op, bool allreduce,
                int64_t divisor) {
  const int64_t seq = w.begin(nchunks);
  const int64_t bytes = (bounds.back() - bounds.front()) * dtype_size(dtype);
  const int64_t kind = StoreChoice::key(bytes, allreduce, send == recv, divisor > 1);
  const bool stream = w.stores.pick(kind, nchunks);
  const bool stream_result =
      allreduce && (send != recv || stream) && bytes >= kStreamResultBytes;
  const auto start = std::chrono::steady_clock::now();
  ReduceStages st(w, seq, static_cast<const unsigned char*>(send),
                  static_cast<unsigned char*>(recv), bounds, e, dtype, op, allreduce, divisor,
                  stream, stream_result);
  if (allreduce)
    pipeline(nchunks, {[&](int64_t k) { st.copy_in(k); }, [&](int64_t k) { st.reduce(k); },
                       [&](int64_t k) { st.copy_out(k); }});
  else
    pipeline(nchunks, {[&](int64_t k) { st.copy_in(k); }, [&](int64_t k) { st.reduce(k); }});
  if (nchunks >= StoreChoice::kMinChunks)
    w.stores.record(
        kind, stream,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), bytes);
}

void shm_allgather(ShmWindow& w, const void* send, void* recv,
                   const std::vector<int64_t>& bounds, int64_t e, int64_t nchunks,
                   int64_t item) {
  const int64_t seq = w.begin(nchunks);
  Sync sync(w);
  const Pieces piece{bounds, e};
  const int r = sync.rank();
  const auto* in = static_cast<const unsigned char*>(send);  // block r: elements from bounds[r]
  auto* out = static_cast<unsigned char*>(recv);
  // 1. own piece into the own buffer and the own output block
  auto copy_in = [&](int64_t k) {
    const int64_t g = seq + k;
    sync.wait(kDone, g - sync.depth());
    const auto [lo, hi] = piece(r, k);
    const unsigned char* mine = in + (lo - bounds[r]) * item;
    std::memcpy(sync.slot(r, g), mine, (hi - lo) * item);
    if (out + lo * item != mine) std::memcpy(out + lo * item, mine, (hi - lo) * item);
    sync.post(kReady, g);
  };
  // 2. every other rank's piece out of its buffer
  auto copy_out = [&](int64_t k) {
    const int64_t g = seq + k;
    sync.wait(kReady, g);
    for (int j = 0; j < sync.size(); ++j) {
      if (j == r) continue;
      const auto [lo, hi] = piece(j, k);
      std::memcpy(out + lo * item, sync.slot(j, g), (hi - lo) * item);
    }
    sync.post(kDone, g);
  };
  pipeline(nchunks, {copy_in, copy_out});
}

void shm_broadcast(ShmWindow& w, void* buf, int64_t nbytes, int64_t e, int64_t nchunks,
                   int root) {
  const int64_t seq = w.begin(nchunks);
  Sync sync(w);
  auto* data = static_cast<unsigned char*>(buf);
  const bool is_root = sync.rank() == root;
  auto bytes = [&](int64_t k) { return std::min(e, nbytes - k * e); };
  auto copy_in = [&](int64_t k) {  // the root fills its buffer
    if (!is_root) return;
    const int64_t g = seq + k;
    sync.wait(kDone, g - sync.depth());
    std::memcpy(sync.slot(root, g), data + k * e, bytes(k));
    sync.post(kReady, g);
  };
  auto copy_out = [&](int64_t k) {  // the others read it
    const int64_t g = seq + k;
    if (!is_root) {
      sync.wait_for(root, kReady, g);
      std::memcpy(data + k * e, sync.slot(root, g), bytes(k));
    }
    sync.post(kDone, g);
  };
  pipeline(nchunks, {copy_in, copy_out});
}

}  // namespace collectives
