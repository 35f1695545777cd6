// The pipelined shared-memory collectives of collectives/algorithms/shm.py, run in C++ so
// that no stage waits or copies under the Python interpreter (GIL released throughout).
// The window layout, the counters' meaning and the stage order are shm.py's; read its
// module docstring first.
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/dtypes.h"
#include "kernels/reduce.h"

namespace collectives {

// Called while a wait has lasted `seconds` (the agreement's watchdog, agree.h); returns the
// waited time at which to be called next, or throws to give up.
using OnWait = std::function<double(double seconds)>;

// A rank of the window's group died, or reported that it met a failure (fault-tolerant
// mode only): the call cannot finish. collectives.runtime.faults turns it into the job's
// RanksFailedError.
struct PeerFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// How this rank writes a pipelined reduction's chunks into its staging buffers, chosen by
// measurement. Plain stores leave a chunk in this core's cache, where the other ranks read
// it: cheap when their cores share that cache. Streaming stores send it to memory first:
// cheaper when they do not, since reading a line another core has modified can cost
// several times a read from memory (a VM's vCPUs can move between the two: shm.py's
// docstring). Calls of at least kMinChunks run the way that was faster among calls of their
// own kind (key(): size within a power of two, allreduce or reducescatter, in or out of
// place, Average or not): kinds differ in cost per byte more than the two ways may.
// Each way's cost is the best of its last kRecent calls of the kind: interference and a
// cold call (caches full of another algorithm's buffers, fresh result pages) only add
// time, so one slow call neither decides nor hides a way, and a machine that changed
// shows within kRecent calls. A trial runs the other way kRecent calls in a row, from the
// kind's kFirstTrial-th call, and again after a gap: kExplore calls, doubled after each
// trial the other way lost (up to kMaxGap), since a losing trial costs what the two ways
// differ by (2-3x on a VM whose cores stop sharing a cache). A shift in the running way's
// cost by more than kShift against the last trial's (the machine changed) brings the next
// trial forward and the gap back to kExplore. Which way is faster follows the machine, not
// the kind, so a kind's first calls run the way the latest trial of any kind chose. The
// ranks' calls take the same time, so they try a way together; each decides for itself,
// which only changes speed, never the result. Cost: one map lookup per large call; trials,
// kRecent calls in kExplore of a kind at most, and in kMaxGap once the other way keeps
// losing.
struct StoreChoice {
  static constexpr int64_t kMinChunks = 8;  // smaller calls: plain stores
  static constexpr int64_t kRecent = 2;
  static constexpr int64_t kFirstTrial = 4;
  static constexpr int64_t kExplore = 16;
  static constexpr int64_t kMaxGap = 256;
  static constexpr double kShift = 1.5;
  struct Kind {
    double recent[2][kRecent] = {};  // seconds per byte of each way's last calls; 0: none
    int64_t calls = 0;
    int64_t next_trial = kFirstTrial;
    int64_t gap = kExplore;  // calls from one trial's start to the next's
    int64_t trial_left = 0;  // calls left in the trial under way
    double at_trial = 0;     // the running way's cost after the last trial
    bool stream = false;     // the running way (outside trials)
    int64_t ran[2] = {0, 0};  // calls made with plain and with streaming stores
    int64_t trials = 0;       // trials begun

    // A way's seconds per byte: the best of its recent calls (0: none).
    double cost(bool way) const {
      double best = 0;
      for (double t : recent[way])
        if (t > 0 && (best == 0 || t < best)) best = t;
      return best;
    }
  };
  std::map<int64_t, Kind> kinds;  // by key()
  bool latest = false;            // the way the latest trial of any kind chose
  int forced = -1;  // set_stores (tests, a frozen run): 0 plain, 1 streaming, -1 chosen

  static int64_t key(int64_t bytes, bool allreduce, bool inplace, bool average) {
    int64_t log2 = 0;
    while ((bytes >> log2) > 1) ++log2;
    return log2 * 8 + (allreduce ? 4 : 0) + (inplace ? 2 : 0) + (average ? 1 : 0);
  }

  // key()'s kind: its smallest size, allreduce, in place, Average.
  static std::tuple<int64_t, bool, bool, bool> fields(int64_t key) {
    return {int64_t{1} << (key / 8), (key & 4) != 0, (key & 2) != 0, (key & 1) != 0};
  }

  // Whether a call of nchunks chunks of kind `key` streams (counts the call if it is large).
  bool pick(int64_t key, int64_t nchunks) {
    if (nchunks < kMinChunks) return forced == 1;
    auto [it, fresh] = kinds.try_emplace(key);
    Kind& k = it->second;
    if (fresh) k.stream = latest;
    ++k.calls;
    if (forced >= 0) {  // counted, never tried
      ++k.ran[forced];
      return forced == 1;
    }
    if (k.trial_left == 0 && k.calls >= k.next_trial) {
      k.trial_left = kRecent;
      ++k.trials;
      std::fill(std::begin(k.recent[!k.stream]), std::end(k.recent[!k.stream]), 0.0);
    }
    const bool way = k.trial_left > 0 ? !k.stream : k.stream;
    ++k.ran[way];
    return way;
  }

  // A large call's time: bytes moved in seconds, the stores it used.
  void record(int64_t key, bool stream, double seconds, int64_t bytes) {
    if (bytes <= 0 || seconds <= 0) return;
    Kind& k = kinds[key];
    double* recent = k.recent[stream];
    std::rotate(recent, recent + 1, recent + kRecent);
    recent[kRecent - 1] = seconds / bytes;
    if (k.trial_left > 0) {
      if (--k.trial_left > 0) return;
      const double running = k.cost(k.stream);
      const bool won = running == 0 || k.cost(!k.stream) < running;
      k.stream = won ? !k.stream : k.stream;
      k.gap = won ? kExplore : std::min(2 * k.gap, kMaxGap);
      k.next_trial = k.calls + k.gap - kRecent + 1;
      k.at_trial = k.cost(k.stream);
      latest = k.stream;
      return;
    }
    const double v = k.cost(k.stream);
    if (k.at_trial > 0 && (v > kShift * k.at_trial || kShift * v < k.at_trial)) {
      k.gap = kExplore;
      k.next_trial = std::min(k.next_trial, k.calls + 1);
      k.at_trial = 0;  // one trial per shift
    }
  }
};

// A communicator's stall limit in seconds (inf: never), shared by its Topology
// (collectives/runtime/watchdog.py: Limit, which Topology.set_timeout and torch's timeout=
// write) and the windows made on its communicator, which read it as each wait starts.
struct StallLimit {
  std::atomic<double> seconds{0};
};

struct ShmWindow {
  std::vector<unsigned char*> segments;  // each rank's segment: counters page, then slots
  int rank = 0;
  int64_t header_bytes = 0;   // counters page
  int64_t stride = 0;         // int64s between two counters of one rank
  int64_t slot_bytes = 0;     // one staging buffer
  int64_t depth = 0;          // staging buffers per rank
  double spin_seconds = 0;    // poll this long before yielding the core between polls
  double stall_seconds = 0;   // then give up: a rank has left the collective (inf: never)
  std::shared_ptr<const StallLimit> limit;  // where set, the live stall_seconds (stall())
  double jitter_seconds = 0;  // tests only (set_jitter): sleep up to this long before a
                              // fifth of the posts, so ranks drift apart mid-call
  int64_t seq = 0;            // chunks begun on the window: the same count on every rank
  bool closed = false;        // the window's memory was freed (close()): no stage may run
  std::vector<pid_t> pids;    // fault-tolerant mode: each rank's process, checked alive by
                              // a long wait (empty: not checked; shm_sync.h)
  StoreChoice stores;         // plain or streaming stores into the buffers (shm_reduce)

  // Seconds a wait may last before it gives up: the communicator's limit where the window
  // has one, else the one it was made with.
  double stall() const {
    return limit ? limit->seconds.load(std::memory_order_relaxed) : stall_seconds;
  }

  // The number of a call's first chunk; its nchunks chunks are counted as begun.
  int64_t begin(int64_t nchunks) {
    if (closed) throw std::logic_error("shm: the window was freed");
    const int64_t first = seq;
    seq += nchunks;
    return first;
  }
};

// Counter indices (shm.py: READY, REDUCED, DONE).
// kFailed is not a count: nonzero once its rank met a failure (fault-tolerant mode), so that
// ranks waiting for it stop.
enum ShmCounter : int64_t { kReady = 0, kReduced = 1, kDone = 2, kFailed = 3 };

// Every call below runs the window's next chunks (ShmWindow::begin): their numbers are
// counted on the window, so that calls made through any entry stay in step.

// nchunks chunks of a reduction of every rank's send, cut into one block
// per rank (bounds, size + 1 element offsets) and each block into pieces of e elements.
// allreduce: recv (all of bounds) gets the whole result; otherwise (reducescatter) recv is
// this rank's block only. divisor > 1 folds an Average in: each rank divides the pieces it
// reduces, while they are in cache, before any rank copies them (the same bits as a Sum
// divided afterwards: one division of the same sum). The stores into the staging buffers
// are the window's StoreChoice; those into a large allreduce's recv stream where it is out
// of place or the staging stores stream (kStreamResultBytes, shm.cpp).
// Throws std::runtime_error if a peer stalls past stall_seconds.
void shm_reduce(ShmWindow& w, const void* send, void* recv, const std::vector<int64_t>& bounds,
                int64_t e, int64_t nchunks, DType dtype, ReduceOp op, bool allreduce,
                int64_t divisor = 1);

// nchunks chunks of an allgather: recv (all of bounds, elements of item
// bytes) gets every rank's block; send is this rank's block.
void shm_allgather(ShmWindow& w, const void* send, void* recv,
                   const std::vector<int64_t>& bounds, int64_t e, int64_t nchunks,
                   int64_t item);

// nchunks chunks of a broadcast of root's buf (nbytes) into every other
// rank's buf, e bytes per chunk (nchunks = ceil(nbytes / e)).
void shm_broadcast(ShmWindow& w, void* buf, int64_t nbytes, int64_t e, int64_t nchunks,
                   int root);

// The single-step path: one chunk (the window's next, g) carries a whole call. This rank copies head
// (head_bytes) and then, at the next 64-byte boundary, data (data_bytes) into its buffer,
// counts READY, waits until every rank has, and hands read every rank's buffer in rank
// order; then counts DONE. Before writing, it waits until every rank has counted chunk
// g - depth DONE (no one still reads the buffer). Waits report to on_wait when given,
// else end at the window's stall limit. Cost: one copy of the input, one wait, read's work.
void shm_single(ShmWindow& w, const void* head, int64_t head_bytes, const void* data,
                int64_t data_bytes,
                const std::function<void(const unsigned char* const* buffers)>& read,
                const OnWait* on_wait = nullptr, double first_wait = 0);

// Offset of the data behind a head of head_bytes in a single-step buffer.
inline int64_t shm_single_data_offset(int64_t head_bytes) { return (head_bytes + 63) / 64 * 64; }

// Elements [lo, hi) of the reduction of every rank's send (count elements each) into recv
// (hi - lo elements; may be send when lo = 0), in one step (shm_single): every rank folds
// the slice from every rank's buffer itself, in rank order. recv is the same on every rank.
void shm_reduce_single(ShmWindow& w, const void* send, void* recv,
                       int64_t count, int64_t lo, int64_t hi, DType dtype, ReduceOp op);

// Every rank's send (bounds[j+1] - bounds[j] elements of item bytes from rank j) into recv
// in rank order, in one step (shm_single): every rank copies every block out.
void shm_allgather_single(ShmWindow& w, const void* send, void* recv,
                          const std::vector<int64_t>& bounds, int64_t item);

}  // namespace collectives
