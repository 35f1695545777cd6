// Stages of the shared-memory reduction (see shm.h and collectives/algorithms/shm.py).
// A counter is published with a full fence then a release store, and read with an acquire
// load then a full fence: the same ordering MPI_Win_sync gives the Python stages, so both
// may run on one window in any mix.
#include "shm.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>


namespace collectives {
namespace {

const char* const kCounterNames[] = {"READY", "REDUCED", "DONE"};

class Stages {
 public:
  Stages(const ShmWindow& w, int64_t seq, const unsigned char* send, unsigned char* recv,
         const std::vector<int64_t>& bounds, int64_t e, DType dtype, ReduceOp op,
         bool allreduce)
      : w_(w), seq_(seq), send_(send), recv_(recv), bounds_(bounds), e_(e), dtype_(dtype),
        op_(op), allreduce_(allreduce), item_(dtype_size(dtype)),
        size_(static_cast<int>(w.segments.size())) {}

  // Copy this rank's pieces of the other ranks' blocks into its buffer.
  void copy_in(int64_t k) {
    const int64_t g = seq_ + k;
    wait(kDone, g - w_.depth);
    for (int j = 0; j < size_; ++j) {
      if (j == w_.rank) continue;
      const auto [lo, hi] = piece(j, k);
      std::memcpy(slot(w_.rank, g, j), send_ + lo * item_, (hi - lo) * item_);
    }
    post(kReady, g);
  }

  // Fold piece `rank` of every rank's buffer (own straight from send), in rank order.
  void reduce(int64_t k) {
    const int64_t g = seq_ + k;
    wait(kReady, g);
    const int r = w_.rank;
    const auto [lo, hi] = piece(r, k);
    srcs_.resize(size_);
    for (int j = 0; j < size_; ++j) srcs_[j] = j == r ? send_ + lo * item_ : slot(j, g, r);
    unsigned char* dst = allreduce_ ? slot(r, g, r) : recv_ + (lo - bounds_[r]) * item_;
    reduce_many(dst, srcs_.data(), size_, hi - lo, dtype_, op_);
    if (allreduce_) std::memcpy(recv_ + lo * item_, dst, (hi - lo) * item_);  // hot in cache now
    post(allreduce_ ? kReduced : kDone, g);
  }

  // Copy every other rank's reduced piece (left in its own buffer) into recv.
  void copy_out(int64_t k) {
    const int64_t g = seq_ + k;
    wait(kReduced, g);
    for (int j = 0; j < size_; ++j) {
      if (j == w_.rank) continue;
      const auto [lo, hi] = piece(j, k);
      std::memcpy(recv_ + lo * item_, slot(j, g, j), (hi - lo) * item_);
    }
    post(kDone, g);
  }

 private:
  std::pair<int64_t, int64_t> piece(int j, int64_t k) const {
    const int64_t end = bounds_[j + 1];
    const int64_t lo = std::min(bounds_[j] + k * e_, end);
    return {lo, std::min(lo + e_, end)};
  }

  // Piece j's place in rank owner's buffer for chunk g.
  unsigned char* slot(int owner, int64_t g, int j) const {
    return w_.segments[owner] + w_.header_bytes + (g % w_.depth) * w_.slot_bytes + j * e_ * item_;
  }

  int64_t* counter(int owner, int64_t c) const {
    return reinterpret_cast<int64_t*>(w_.segments[owner]) + c * w_.stride;
  }

  void post(int64_t c, int64_t g) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(counter(w_.rank, c), g + 1, __ATOMIC_RELEASE);
  }

  // Return once every rank has counted chunk g on counter c (at once for g < 0).
  void wait(int64_t c, int64_t g) {
    if (g < 0) return;
    for (int j = 0; j < size_; ++j) {
      const int64_t* flag = counter(j, c);
      if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) > g) continue;
      const auto start = std::chrono::steady_clock::now();
      for (unsigned polls = 1; __atomic_load_n(flag, __ATOMIC_ACQUIRE) <= g; ++polls) {
        if (polls % 32) continue;
        const double waited =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (waited > w_.spin_seconds) sched_yield();
        if (waited > w_.stall_seconds)
          throw std::runtime_error(
              "shm: rank " + std::to_string(j) + " has not counted chunk " + std::to_string(g) +
              " as " + kCounterNames[c] + " after " + std::to_string(w_.stall_seconds) +
              " s; did it leave the collective?");
      }
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
  }

  const ShmWindow& w_;
  int64_t seq_;
  const unsigned char* send_;
  unsigned char* recv_;
  const std::vector<int64_t>& bounds_;
  int64_t e_;
  DType dtype_;
  ReduceOp op_;
  bool allreduce_;
  int64_t item_;
  int size_;
  std::vector<const void*> srcs_;
};

}  // namespace

void shm_reduce(const ShmWindow& w, int64_t seq, const void* send, void* recv,
                const std::vector<int64_t>& bounds, int64_t e, int64_t nchunks, DType dtype,
                ReduceOp op, bool allreduce) {
  Stages st(w, seq, static_cast<const unsigned char*>(send), static_cast<unsigned char*>(recv),
            bounds, e, dtype, op, allreduce);
  // stage s of chunk k runs at step k + s, earlier stages first within a step
  const int stages = allreduce ? 3 : 2;
  for (int64_t step = 0; step < nchunks + stages - 1; ++step) {
    if (step < nchunks) st.copy_in(step);
    if (step >= 1 && step - 1 < nchunks) st.reduce(step - 1);
    if (allreduce && step >= 2 && step - 2 < nchunks) st.copy_out(step - 2);
  }
}

}  // namespace collectives
