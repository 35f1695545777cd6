// The engine's state, owned here and nowhere else (collectives/runtime/engine.py is its Python
// face): the queue of submitted collectives and the claim that lets one collective run at a
// time in submission order, what this rank is doing (the stall record), whether a stall
// made the library unusable, the bytes our own messages moved, the running call's counter
// and joined ranks, the timeline's recording, and one communicator's call counters. Pure
// C++: queue items are opaque pointers whose lifetime the binding manages. call.h runs a
// call against this state.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "runtime/timeline.h"

namespace collectives {

// A call on an engine after a stall timeout (collectives.StallError).
struct Unusable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// What this rank is doing, for the stall watchdog: read by its responder thread while the
// engine's thread writes it, so every access takes the lock.
class Record {
 public:
  enum State { idle, waiting, running };
  struct Snapshot {
    State state;
    int64_t calls;           // collective calls entered so far
    std::string collective;  // the current or last one
    std::string detail;      // its agreed arguments, readable
    double age;              // seconds in this state
  };

  void enter(const std::string& collective, const std::string& detail);  // waits for peers
  void run();    // the peers arrived: data moves
  void leave();  // the call is over
  Snapshot snapshot() const;
  static const char* name(State s);

 private:
  mutable std::mutex mu_;
  State state_ = idle;
  int64_t calls_ = 0;
  std::string collective_, detail_;
  double since_ = now();
  static double now();
};

// Calls and bytes of one (collective, algorithm) on one communicator. Only the running call
// writes them (the claim serializes calls: one writer, so a relaxed load and store, no
// read-modify-write) while another thread may take a snapshot, hence atomics.
struct Counts {
  int64_t calls, sent, received;
};
struct Counter {
  std::atomic<int64_t> calls{0}, sent{0}, received{0};
  void add(int64_t more_calls, int64_t more_sent, int64_t more_received) {
    bump(calls, more_calls);
    bump(sent, more_sent);
    bump(received, more_received);
  }

 private:
  static void bump(std::atomic<int64_t>& v, int64_t by) {
    v.store(v.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  }
};

// One communicator's counters. Entries are never erased, so a Counter* stays valid as long
// as its Stats. Callers of counter() and snapshot() serialize (the binding holds the GIL).
class Stats {
 public:
  // The counter of (collective, algorithm); its name's algorithm into *name when given
  // (stable, as the counter is).
  Counter* counter(const std::string& collective, const std::string& algorithm,
                   const std::string** name = nullptr);
  std::vector<std::tuple<std::string, std::string, Counts>> snapshot() const;

 private:
  std::map<std::pair<std::string, std::string>, Counter> per_;
};

// Ordering and the claim. Every rank submits collectives in the same program order and they
// run in that order: an async call queues (push) and the engine's thread runs the head
// (next); a sync call runs on the caller's thread when nothing is queued or running
// (try_claim), else it queues behind the rest.
class Engine {
 public:
  void push(void* item);  // queue behind everything submitted before
  void* next();           // block until the head may run; claim, pop and return it
  bool try_claim();       // claim for a sync call: false if anything is queued or running
  void release();         // end the claim of next() or try_claim()

  Record& record() { return record_; }
  const Record& record() const { return record_; }
  Timeline& timeline() { return timeline_; }

  // The running call, touched only by the thread holding the claim: the counter its stats
  // go to (a call whose algorithm depends on agreed values moves it), and the ranks that
  // joined in its agreement (0 outside a call).
  struct Running {
    Counter* credit = nullptr;
    // the algorithm credit counts, when a move credited another counter than its call's
    // (`auto`'s online check): the timeline shows it instead of the described one
    const std::string* algorithm = nullptr;
    int joined = 0;
  };
  Running& running() { return current_; }

  // After a stall timeout MPI cannot cancel the collective: every later call must fail.
  void fail(const std::string& why);
  bool has_failed() const { return has_failed_.load(std::memory_order_acquire); }
  std::string failed() const;  // why
  void check_usable() const;   // throws Unusable after fail()

  // Bytes our point-to-point messages and agreement payloads moved (any thread).
  void add_bytes(int64_t sent, int64_t received) {
    sent_.fetch_add(sent, std::memory_order_relaxed);
    received_.fetch_add(received, std::memory_order_relaxed);
  }
  std::pair<int64_t, int64_t> bytes() const {
    return {sent_.load(std::memory_order_relaxed), received_.load(std::memory_order_relaxed)};
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<void*> queue_;
  bool running_ = false;
  std::string failed_;
  std::atomic<bool> has_failed_{false};
  Record record_;
  std::atomic<int64_t> sent_{0}, received_{0};
  Running current_;  // the running call's (running_ is the claim)
  Timeline timeline_;
};

}  // namespace collectives
