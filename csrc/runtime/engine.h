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

// What this rank is doing and has done: the stall watchdog's record (read by its responder
// thread while the engine's thread writes it, so every access takes the lock) and the flight
// recorder, a ring of the last calls (collectives/runtime/flight.py dumps it). The current
// call is the ring's newest entry, so the ring costs no copy the stall record did not make.
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
  // One call as the flight recorder keeps it; times on the steady clock (s), 0: not reached.
  enum Phase { entered, agreed, done, failed };
  struct Flight {
    int64_t seq = 0;  // this rank's call number (Snapshot::calls when it was entered)
    std::string comm;       // its communicator's label (Stats::label)
    int64_t comm_seq = 0;   // its number there
    std::string collective, detail, algorithm;
    double queued = -1, start = 0, agreed_at = 0, end = 0;  // queued -1: never queued
    int64_t bytes = 0;   // sent by our own messages
    int32_t last = -1;   // rank of its communicator that arrived last (-1: not known)
    double waited = 0;   // seconds the other ranks waited for it, together
    Phase phase = entered;
  };
  // What a finished call adds to its entry.
  struct Outcome {
    int64_t bytes;
    int32_t last;
    double waited;
    const std::string* algorithm;  // the one that ran, when not the described one
  };

  Record() : ring_(1) {}
  // Keep the last `calls` calls (at least the current one); forgets those kept.
  void set_capacity(int64_t calls);
  int64_t capacity() const;
  void enter(const std::string& collective, const std::string& detail,
             const std::string& algorithm, double queued, const std::string& comm,
             int64_t comm_seq);  // waits for peers
  void run();  // the peers arrived: data moves
  // The call is over: finished with outcome, or (null) left by an error.
  void leave(const Outcome* outcome);
  Snapshot snapshot() const;
  std::vector<Flight> history() const;  // the kept calls, oldest first
  static const char* name(State s);
  static const char* name(Phase p);

 private:
  mutable std::mutex mu_;
  State state_ = idle;
  int64_t calls_ = 0;
  std::vector<Flight> ring_;  // entry (calls_ - 1) % size is the current or last call
  double since_ = now();
  Flight& newest() { return ring_[static_cast<size_t>((calls_ + ring_.size() - 1) % ring_.size())]; }
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
  explicit Stats(std::string label = "") : label_(std::move(label)) {}
  // The same on every member, telling communicators apart (the flight recorder's name).
  const std::string& label() const { return label_; }
  // The next call's number on this communicator (the claim serializes calls).
  int64_t next_seq() { return ++seq_; }

  // The counter of (collective, algorithm); its name's algorithm into *name when given
  // (stable, as the counter is).
  Counter* counter(const std::string& collective, const std::string& algorithm,
                   const std::string** name = nullptr);
  std::vector<std::tuple<std::string, std::string, Counts>> snapshot() const;

  // Seconds the other ranks spent waiting for `rank` (of this communicator): each call's
  // agreement credits the rank that arrived last with every other rank's wait. Any thread.
  void add_wait(int rank, double seconds);
  std::vector<double> waits() const;  // by rank; ranks never credited may be missing

 private:
  const std::string label_;
  int64_t seq_ = 0;
  std::map<std::pair<std::string, std::string>, Counter> per_;
  mutable std::mutex waits_mu_;
  std::vector<double> waits_;
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

  // The job's clock (s): the steady clock less this rank's reading at a moment every rank
  // marked together (set_origin at init, after a barrier), so that ranks' arrivals compare.
  double clock() const { return steady_seconds() - origin_.load(std::memory_order_relaxed); }
  void set_origin(double steady) { origin_.store(steady, std::memory_order_relaxed); }

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
  std::atomic<double> origin_{0};
  std::atomic<int64_t> sent_{0}, received_{0};
  Running current_;  // the running call's (running_ is the claim)
  Timeline timeline_;
};

}  // namespace collectives
