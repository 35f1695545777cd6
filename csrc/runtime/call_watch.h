// A settled `auto` allreduce class's watch (collectives/auto/online.py): the calls left before
// the ranks compare notes, and this rank's best seconds per byte since then. Taken and
// recorded in the calls' submission order (on the engine's thread, or by a fast entry that
// claimed the engine), so every rank counts the same calls and comes due in the same one;
// the claim serializes them, and the atomics let Python read the watch from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <limits>
#include <stdexcept>

namespace collectives {

class CallWatch {
 public:
  // Count one call; false (nothing counted) once none is left: the call goes to Python.
  bool take() {
    const int64_t left = left_.load(std::memory_order_relaxed);
    if (left == 0) return false;
    left_.store(left - 1, std::memory_order_relaxed);
    return true;
  }
  void record(double seconds_per_byte) {
    if (seconds_per_byte < best_.load(std::memory_order_relaxed))
      best_.store(seconds_per_byte, std::memory_order_relaxed);
  }
  // calls more calls before the next review; the best time forgotten.
  void renew(int64_t calls) {
    if (calls < 0) throw std::invalid_argument("calls: must be >= 0");
    left_.store(calls, std::memory_order_relaxed);
    best_.store(kNone, std::memory_order_relaxed);
  }
  int64_t left() const { return left_.load(std::memory_order_relaxed); }
  double best() const { return best_.load(std::memory_order_relaxed); }  // inf: none

 private:
  static constexpr double kNone = std::numeric_limits<double>::infinity();
  std::atomic<int64_t> left_{0};
  std::atomic<double> best_{kNone};
};

}  // namespace collectives
