// An allreduce whose whole call runs in C++, claim to result, with everything derived from
// its arguments bound once (collectives/api/calls.py makes one per distinct call): the small
// allreduce of a Python call costs microseconds, and the interpreter would be most of them.
// Either its data rides in the agreement exchange (a small one), or it is shm's pipelined
// allreduce (collectives/algorithms/shm.py) after a header-only exchange on one node.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "kernels/dtypes.h"
#include "kernels/reduce.h"
#include "runtime/agree.h"
#include "runtime/call.h"
#include "runtime/call_watch.h"
#include "runtime/engine.h"
#include "runtime/shm.h"

namespace collectives {

class FastAllreduce {
 public:
  // The pipelined case: the layout shm.py cuts the call into (bounds: one block per rank,
  // pieces of e elements, nchunks chunks), and a function returning the shared window it
  // runs on (made or grown collectively, so called after the agreement, where shm.py's own
  // path makes it, and again only once that window is closed).
  struct Pipeline {
    std::vector<int64_t> bounds;
    int64_t e, nchunks;
    std::function<ShmWindow*()> window;
  };

  // The references must outlive this object. divisor: as execute()'s (call.h).
  // std::invalid_argument if the payload exceeds the channel or the pipeline is malformed.
  FastAllreduce(Engine& engine, const AgreeChannel& channel, const CallInfo& call,
                int64_t count, DType dtype, ReduceOp op, int64_t divisor,
                std::optional<Pipeline> pipeline);

  // The call from src into dst (count elements; dst may be src). False, with nothing done,
  // when the engine is busy or the watched class is due for review: the caller then takes
  // the general path.
  bool run(const void* src, void* dst);

  // Count and time this entry's calls under w (null: unwatched); w must outlive its use.
  void watch(CallWatch* w) { watch_ = w; }
  int64_t nbytes() const { return nbytes_; }

 private:
  void pipelined(const void* src, void* dst);

  Engine& engine_;
  const AgreeChannel& channel_;
  const CallInfo& call_;
  int64_t count_;
  DType dtype_;
  ReduceOp op_;
  int64_t divisor_, nbytes_;
  std::optional<Pipeline> pipeline_;
  ShmWindow* window_ = nullptr;  // the pipeline's, once fetched
  CallWatch* watch_ = nullptr;
};

}  // namespace collectives
