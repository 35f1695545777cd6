// Agreement carried inside the data (with shm.h, the runtime pieces that talk to MPI).
//
// Before any collective moves data, ranks check that they called the same collective with
// the same arguments (a 64-bit digest of them). The check is a recursive-doubling exchange
// of a 64-byte header (MPICH's fold for non-powers of two), and a small allreduce rides in
// the same messages: its payload follows the header and is folded at every step, so a
// small allreduce with checks on costs no extra round trip. The header also carries when
// each rank arrived (on the job's clock, Engine::clock), folded to the latest arrival, its
// rank and the sum of arrivals: every rank learns who the others waited for, and how long.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>

#include "kernels/dtypes.h"
#include "kernels/reduce.h"
#include "runtime/engine.h"
#include "runtime/pool.h"
#include "runtime/shm.h"  // ShmWindow, OnWait

namespace collectives {

// How this rank takes part: making a call, or standing in for a rank that has run out of
// work (join): a joined rank contributes no data (the identity of the reduction), adopts
// the digest, size and type of the active ranks' payload as it meets them, and learns how
// many ranks have joined and which is the lowest active one.
enum class Role { active, joined, joining };  // joining: this rank's first join exchange

struct AgreeResult {
  bool ok;               // every active rank passed the same digest and payload size
  int64_t payload_sent;  // payload bytes this rank sent (headers not counted); when ok,
                         // also the bytes it received
  int joined;            // ranks that took part as joined
  int first_active;      // lowest active rank (the size of comm if none)
  int last_joiner;       // highest rank whose role was `joining` (-1 if none)
  int last_arrival = -1;  // the active rank that arrived last (the highest of a tie; -1: none)
  double waited = 0;      // seconds the active ranks waited for it, together
};

// Recursive doubling over `comm` of {digest, payload}, this rank arriving at `arrival` (the
// job's clock; 0 where no one reads last_arrival and waited). When ok, out holds the reduction of
// every active rank's payload (count elements of dtype; lower ranks' data folded first, so
// every rank gets the same bits); otherwise out is untouched. Every rank returns the same
// result. Payloads of any rank are at most `capacity` bytes (the receive size). Not
// thread-safe per communicator: callers serialize, as with any MPI collective. Buffers
// over 1 MiB (a tree allreduce's) come from `large` when given, and go back to it.
AgreeResult agree_exchange(MPI_Comm comm, int tag, int64_t digest, const void* send, void* out,
                           int64_t count, DType dtype, ReduceOp op, int64_t capacity,
                           double first_wait, const OnWait& on_wait,
                           Role role = Role::active, Pool* large = nullptr,
                           double arrival = 0);

// The same exchange, with the same result, for ranks that share memory (agree_shared.cpp):
// one single-step round on a shared window (shm.h's shm_single, its next chunk) in which every
// rank writes its header and payload into its own buffer and reads every rank's. No
// messages: one copy of the payload and one wait on every rank's counter. Active payloads
// are folded in rank order (other bits than the exchange above's recursive doubling, the
// same on every rank). The window's buffers hold at least a header and `capacity` bytes.
AgreeResult agree_shared(ShmWindow& w, int64_t digest, const void* send,
                         void* out, int64_t count, DType dtype, ReduceOp op, int64_t capacity,
                         double first_wait, const OnWait& on_wait, Role role = Role::active,
                         double arrival = 0);

// One communicator's exchange with what stays fixed bound once: over MPI messages, or over
// a shared window (window not null) when every rank of the communicator shares memory.
struct AgreeChannel {
  MPI_Comm comm;
  int tag;
  int64_t capacity;  // payload bytes at most
  double first_wait;
  OnWait on_wait;
  ShmWindow* window;  // null: messages

  // agree_exchange or agree_shared; a payload over capacity is std::invalid_argument.
  AgreeResult run(int64_t digest, const void* send, void* out, int64_t count, DType dtype,
                  ReduceOp op, Role role = Role::active, double arrival = 0) const;
};

// tree.py's allreduce of count elements from send into recv: agree_exchange's recursive
// doubling without the check (the call was agreed already), its buffers over 1 MiB from
// `large`; bytes counted on the engine.
void tree_allreduce(Engine& engine, MPI_Comm comm, int tag, const void* send, void* recv,
                    int64_t count, DType dtype, ReduceOp op, Pool* large);

}  // namespace collectives
