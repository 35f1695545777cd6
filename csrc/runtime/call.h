// One collective call after the claim, the same sequence for every entry (collectives/
// engine.py's calls, join.py's exchanges, fast_allreduce.h): the stall record, the
// agreement exchange (a small payload reduced in it), the hand-over to joined ranks, Average's
// divide, the data phase, the call's stats and its timeline event. Pure C++: what only
// Python can do (raise MismatchError, hand the call to joined ranks, move the data) comes in
// as callbacks, which the binding makes take the GIL; everything here runs without it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "kernels/dtypes.h"
#include "kernels/reduce.h"
#include "runtime/agree.h"
#include "runtime/engine.h"
#include "runtime/timeline.h"

namespace collectives {

// A described call (collectives/api/calls.py builds it once per distinct call): the digest of
// its agreed fields, its texts (the stall record's and the timeline's), its counter, and the
// callbacks for the two ways its agreement can end other than plainly.
struct CallInfo {
  int64_t id;  // unique in the process (the timeline's key)
  int64_t digest;
  CallTexts texts;
  Counter* counter;
  Stats* stats;  // its communicator's: who the others waited for
  std::function<void()> mismatch;  // raises MismatchError on every rank; never returns
  // hands the call to the ranks that joined (collectives/api/join.py), called with (joined,
  // first_active); throws if the call cannot run with them
  std::function<void(int joined, int first_active)> on_joined;
};

// The payload reduced inside the agreement: count elements from send into out.
struct Payload {
  const void* send;
  void* out;
  int64_t count;
  DType dtype;
  ReduceOp op;
};

// Average's divide of a reduced sum, in place: by divisor (the world size; 1: not an
// Average, nothing to do) less the ranks that joined, which contributed nothing.
void divide_average(void* buf, int64_t count, DType dtype, int64_t divisor, int joined);

// The call: its payload agreed and reduced (divided for Average, when divisor is not 1),
// then move() if given (the data phase), under the stall record (which keeps it in the
// flight recorder); its bytes counted on the engine's running counter (call.counter unless
// the move credits another), the others' wait for the last rank to arrive on call.stats. queued: the
// steady-clock seconds of its submission (-1: never queued), for the timeline.
void execute(Engine& engine, const AgreeChannel& channel, const CallInfo& call,
             const Payload& payload, int64_t divisor, double queued,
             const std::function<void()>& move);

// One agreement exchange of a rank inside join() (first: its first one, which counts one
// call), under the stall record.
AgreeResult join_step(Engine& engine, const AgreeChannel& channel, const CallInfo& call,
                      bool first);

// A joined rank's part of the others' call, after the join_step that handed it over: move()
// with the running call's joined count set to joined (what an Average divides by, on this
// rank as on the active ones), and 0 again however move() ends.
void contribute(Engine& engine, int joined, const std::function<void()>& move);

}  // namespace collectives
