// A shared window's slots and counters seen from one rank: posting a counter, waiting for
// every rank's (runtime/shm.cpp's stages and the shared-memory agreement, agree.cpp).
// A counter is published with a full fence then a release store, and read with an acquire
// load then a full fence, so a rank that sees chunk g counted also sees its data. The window
// is allocated in Python (collectives/runtime/window.py); every stage runs here.
#pragma once

#include <sched.h>
#include <signal.h>

#include <cerrno>
#include <fstream>

#include <chrono>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

#include "runtime/shm.h"

namespace collectives {

// Whether process pid runs (not gone, not a zombie awaiting its parent): how a wait in
// fault-tolerant mode tells a dead peer, and how collectives/runtime/faults.py names the
// ranks that died on this host.
inline bool process_alive(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return true;  // no procfs: kill's answer stands
  const auto paren = text.rfind(')');
  const char state = paren + 2 < text.size() ? text[paren + 2] : 'R';
  return state != 'Z' && state != 'X';
}

class Sync {
 public:
  // on_wait (may be null): called past each of its deadlines (the first at first_wait s)
  // while a wait lasts, in place of the window's stall limit.
  explicit Sync(const ShmWindow& w, const OnWait* on_wait = nullptr, double first_wait = 0)
      : w_(w), size_(static_cast<int>(w.segments.size())), on_wait_(on_wait),
        first_wait_(first_wait) {}

  // Tell the window's ranks that this one met a failure: their waits for it end.
  static void mark_failed(const ShmWindow& w) {
    __atomic_store_n(reinterpret_cast<int64_t*>(w.segments[w.rank]) + kFailed * w.stride, 1,
                     __ATOMIC_RELEASE);
  }

  int rank() const { return w_.rank; }
  int size() const { return size_; }
  int64_t depth() const { return w_.depth; }

  // Start of rank owner's buffer for chunk g.
  unsigned char* slot(int owner, int64_t g) const {
    return w_.segments[owner] + w_.header_bytes + (g % w_.depth) * w_.slot_bytes;
  }

  void post(int64_t c, int64_t g) {
    if (w_.jitter_seconds > 0) jitter();
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(counter(w_.rank, c), g + 1, __ATOMIC_RELEASE);
  }

  // Return once every rank has counted chunk g on counter c (at once for g < 0).
  void wait(int64_t c, int64_t g) {
    if (g < 0) return;
    Clock clock(on_wait_ ? first_wait_ : w_.stall());
    for (int j = 0; j < size_; ++j) spin(j, c, g, clock);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
  }

  // Return once rank j has counted chunk g on counter c.
  void wait_for(int j, int64_t c, int64_t g) {
    Clock clock(on_wait_ ? first_wait_ : w_.stall());
    spin(j, c, g, clock);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
  }

 private:
  // One wait's start (a wait on several ranks is one wait), read from the clock only once
  // a counter is found short (most waits find theirs counted), and its next deadline.
  struct Clock {
    explicit Clock(double deadline) : deadline(deadline) {}
    void begin() {
      if (started) return;
      start = std::chrono::steady_clock::now();
      started = true;
    }
    std::chrono::steady_clock::time_point start;
    bool started = false;
    double deadline;
    double next_check = kCheckSeconds;  // fault-tolerant mode: when peers are next checked
  };

  // Seconds of waiting between two checks that the peers are alive (fault-tolerant mode).
  static constexpr double kCheckSeconds = 0.005;

  int64_t* counter(int owner, int64_t c) const {
    return reinterpret_cast<int64_t*>(w_.segments[owner]) + c * w_.stride;
  }

  void spin(int j, int64_t c, int64_t g, Clock& clock) const {
    const int64_t* flag = counter(j, c);
    if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) > g) return;
    clock.begin();
    for (unsigned polls = 1; __atomic_load_n(flag, __ATOMIC_ACQUIRE) <= g; ++polls) {
      if (polls % 32) continue;
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - clock.start)
              .count();
      if (waited > w_.spin_seconds) sched_yield();
      if (!w_.pids.empty() && waited >= clock.next_check) {
        clock.next_check = waited + kCheckSeconds;
        check_peers(j);
      }
      if (waited <= clock.deadline) continue;
      if (on_wait_ != nullptr) {
        clock.deadline = (*on_wait_)(waited);
        continue;
      }
      static const char* const names[] = {"READY", "REDUCED", "DONE"};
      throw std::runtime_error("shm: rank " + std::to_string(j) + " has not counted chunk " +
                               std::to_string(g) + " as " + names[c] + " after " +
                               std::to_string(clock.deadline) +
                               " s; did it leave the collective?");
    }
  }

  // Fault-tolerant mode: throw PeerFailure (after telling the others) if rank j, waited
  // for, is dead, or any rank said it met a failure.
  void check_peers(int j) const {
    for (int k = 0; k < size_; ++k) {
      if (__atomic_load_n(counter(k, kFailed), __ATOMIC_ACQUIRE) != 0) {
        mark_failed(w_);
        throw PeerFailure("shm: rank " + std::to_string(k) +
                          " of the node stopped on a failure");
      }
    }
    if (!process_alive(w_.pids[j])) {
      mark_failed(w_);
      throw PeerFailure("shm: rank " + std::to_string(j) + " of the node (pid " +
                        std::to_string(w_.pids[j]) + ") has died");
    }
  }

  // Ranks drift apart mid-call (tests of the counters' ordering).
  void jitter() const {
    thread_local std::minstd_rand rng(static_cast<unsigned>(w_.rank) + 1);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    if (u(rng) < 0.2)
      std::this_thread::sleep_for(std::chrono::duration<double>(u(rng) * w_.jitter_seconds));
  }

  const ShmWindow& w_;
  int size_;
  const OnWait* on_wait_;
  double first_wait_;
};

}  // namespace collectives
