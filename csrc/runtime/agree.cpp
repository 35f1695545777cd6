// Recursive doubling of {header, payload}: see agree.h. Every received header is compared
// with this rank's own; a difference, or a partner's report of one, sets `bad`, which then
// travels in every later header. The comparisons form a hypercube over the ranks, so after
// the last step every rank knows whether any two ranks differed.
//
// A partial result that holds no active rank's data (only joined ranks so far) is the
// reduction's identity: meeting one folds nothing, and a joined partial meeting an active
// one takes its digest, size, type and data. Both sides of a swap thus hold the same bits,
// and the active ranks' data is folded in the same order as without joined ranks.
#include "runtime/agree.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace collectives {
namespace {

constexpr int32_t kNone = std::numeric_limits<int32_t>::max();

struct Header {
  int64_t digest;
  int64_t nbytes;
  int32_t bad;
  int32_t joined;        // joined ranks folded into this partial result
  int32_t dtype, op;     // the payload's, so that a joined rank can fold it later
  int32_t first_active;  // lowest active rank folded in; kNone: none yet
  int32_t last_joiner;   // highest rank folded in whose role is `joining`; -1: none
  int32_t last;          // the active rank folded in that arrived latest; -1: none yet
  int32_t unused = 0;
  double latest;         // its arrival (the job's clock)
  double arrivals;       // the sum of the active ranks' arrivals folded in
};
constexpr int64_t kHeader = sizeof(Header);

using Bytes = std::vector<unsigned char>;

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw std::runtime_error(std::string(what) + " failed: " + std::string(text, len));
}

// need bytes for one call: kept's (grown if short), else a block of pool given back when
// the call ends, else memory of this call's own.
class Scratch {
 public:
  Scratch(size_t need, Bytes* kept, Pool* pool) : pool_(kept ? nullptr : pool), bytes_(need) {
    if (kept) {
      if (kept->size() < need) kept->resize(need);
      data_ = kept->data();
    } else if (pool_) {
      data_ = static_cast<unsigned char*>(pool_->take(need));
    } else {
      own_.reset(new unsigned char[need]);
      data_ = own_.get();
    }
  }
  ~Scratch() {
    if (pool_) pool_->give(data_, bytes_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  unsigned char* data() { return data_; }

 private:
  Pool* pool_;
  size_t bytes_;
  std::unique_ptr<unsigned char[]> own_;
  unsigned char* data_ = nullptr;
};

class Exchange {
 public:
  Exchange(MPI_Comm comm, int tag, int64_t digest, int64_t count, DType dtype, ReduceOp op,
           int64_t capacity, double first_wait, const OnWait& on_wait, unsigned char* mine,
           unsigned char* theirs, int rank, Role role, double arrival)
      : comm_(comm), tag_(tag), digest_(digest), count_(count),
        nbytes_(count * dtype_size(dtype)), capacity_(capacity), dtype_(dtype), op_(op),
        first_wait_(first_wait), on_wait_(on_wait), mine_(mine), theirs_(theirs),
        joined_(role == Role::active ? 0 : 1),
        first_active_(role == Role::active ? rank : kNone),
        last_joiner_(role == Role::joining ? rank : -1),
        last_(role == Role::active ? rank : -1),
        latest_(role == Role::active ? arrival : -std::numeric_limits<double>::infinity()),
        arrivals_(role == Role::active ? arrival : 0) {
    if (role != Role::active) nbytes_ = count_ = 0;
  }

  unsigned char* payload() { return mine_ + kHeader; }
  bool bad() const { return bad_; }
  int64_t sent() const { return sent_; }
  int joined() const { return joined_; }
  int first_active() const { return first_active_; }
  int last_joiner() const { return last_joiner_; }
  int last() const { return last_; }
  // the active ranks' waits for the last one, together
  double waited(int active) const { return last_ < 0 ? 0 : active * latest_ - arrivals_; }

  // Swap partial results with peer and fold (the lower rank's data first).
  void swap_with(int peer, bool peer_lower) {
    MPI_Request reqs[2];
    MPI_Status st[2];
    post_recv(peer, &reqs[0]);
    post_send(peer, &reqs[1]);
    wait(reqs, 2, st);
    absorb(st[0], peer_lower ? Absorb::fold_lower : Absorb::fold_higher);
  }

  // Hand this rank's payload to peer and receive the finished result from it later.
  void hand_over(int peer) {
    MPI_Request reqs[2];
    MPI_Status st[2];
    post_recv(peer, &reqs[0]);
    post_send(peer, &reqs[1]);
    wait(reqs, 2, st);
    absorb(st[0], Absorb::take);
  }

  void receive_from_lower(int peer) {
    MPI_Request req;
    MPI_Status st;
    post_recv(peer, &req);
    wait(&req, 1, &st);
    absorb(st, Absorb::fold_lower);
  }

  void send_result(int peer) {
    MPI_Request req;
    MPI_Status st;
    post_send(peer, &req);
    wait(&req, 1, &st);
  }

 private:
  enum class Absorb { fold_lower, fold_higher, take };

  void post_recv(int peer, MPI_Request* req) {
    check(MPI_Irecv(theirs_, static_cast<int>(kHeader + capacity_), MPI_BYTE, peer,
                    tag_, comm_, req),
          "MPI_Irecv");
  }

  void post_send(int peer, MPI_Request* req) {
    Header head{digest_, nbytes_, bad_ ? 1 : 0, joined_, static_cast<int32_t>(dtype_),
                static_cast<int32_t>(op_), first_active_, last_joiner_, last_, 0, latest_,
                arrivals_};
    std::memcpy(mine_, &head, kHeader);
    check(MPI_Isend(mine_, static_cast<int>(kHeader + nbytes_), MPI_BYTE, peer, tag_,
                    comm_, req),
          "MPI_Isend");
    sent_ += nbytes_;
  }

  void absorb(const MPI_Status& st, Absorb how) {
    int got = 0;
    MPI_Get_count(&st, MPI_BYTE, &got);
    Header head{};
    if (got >= kHeader) std::memcpy(&head, theirs_, kHeader);
    if (got < kHeader || head.bad || got != kHeader + head.nbytes) bad_ = true;
    if (bad_) return;
    const bool i_active = first_active_ != kNone, they_active = head.first_active != kNone;
    if (how == Absorb::take) {  // the finished result: every count is in it already
      joined_ = head.joined;
      first_active_ = head.first_active;
      last_joiner_ = head.last_joiner;
      last_ = head.last;
      latest_ = head.latest;
      arrivals_ = head.arrivals;
    } else {
      joined_ += head.joined;
      first_active_ = std::min(first_active_, head.first_active);
      last_joiner_ = std::max(last_joiner_, head.last_joiner);
      arrivals_ += head.arrivals;  // commutative: both sides of a swap get the same bits
      if (head.latest > latest_ || (head.latest == latest_ && head.last > last_)) {
        latest_ = head.latest;
        last_ = head.last;
      }
    }
    if (!they_active) return;  // the identity: nothing to fold
    if (!i_active) {           // take the active ranks' call and data
      digest_ = head.digest;
      nbytes_ = head.nbytes;
      dtype_ = static_cast<DType>(head.dtype);
      op_ = static_cast<ReduceOp>(head.op);
      count_ = nbytes_ / dtype_size(dtype_);
      std::swap(mine_, theirs_);
      return;
    }
    if (head.digest != digest_ || head.nbytes != nbytes_) {
      bad_ = true;
      return;
    }
    unsigned char* their_payload = theirs_ + kHeader;
    if (how == Absorb::fold_higher) {
      const void* srcs[2] = {payload(), their_payload};
      reduce_many(payload(), srcs, 2, count_, dtype_, op_);
    } else {
      if (how == Absorb::fold_lower) {
        const void* srcs[2] = {their_payload, payload()};
        reduce_many(their_payload, srcs, 2, count_, dtype_, op_);
      }
      std::swap(mine_, theirs_);
    }
  }

  // Spin on the requests; past each deadline ask on_wait (which may log, or throw to give up).
  void wait(MPI_Request* reqs, int n, MPI_Status* st) {
    int done = 0;
    check(MPI_Testall(n, reqs, &done, st), "MPI_Testall");
    if (done) return;
    const auto start = std::chrono::steady_clock::now();
    double next = first_wait_;
    for (unsigned spins = 1;; ++spins) {
      check(MPI_Testall(n, reqs, &done, st), "MPI_Testall");
      if (done) return;
      if (spins % 1024) continue;
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited < next) continue;
      try {
        next = on_wait_(waited);
      } catch (...) {
        for (int i = 0; i < n; ++i) {
          if (reqs[i] == MPI_REQUEST_NULL) continue;
          MPI_Cancel(&reqs[i]);  // receives are withdrawn; sends finish or die with the job
          MPI_Request_free(&reqs[i]);
        }
        throw;
      }
    }
  }

  MPI_Comm comm_;
  int tag_;
  int64_t digest_, count_, nbytes_, capacity_;
  DType dtype_;
  ReduceOp op_;
  double first_wait_;
  const OnWait& on_wait_;
  unsigned char* mine_;    // header + this rank's partial result
  unsigned char* theirs_;  // receive space: header + capacity
  int32_t joined_, first_active_, last_joiner_, last_;
  double latest_, arrivals_;
  bool bad_ = false;
  int64_t sent_ = 0;
};

}  // namespace

AgreeResult agree_exchange(MPI_Comm comm, int tag, int64_t digest, const void* send, void* out,
                           int64_t count, DType dtype, ReduceOp op, int64_t capacity,
                           double first_wait, const OnWait& on_wait, Role role, Pool* large,
                           double arrival) {
  const int64_t nbytes = role == Role::active ? count * dtype_size(dtype) : 0;
  if (nbytes > capacity)
    throw std::invalid_argument("payload of " + std::to_string(nbytes) +
                                " bytes exceeds the capacity of " + std::to_string(capacity));
  int rank = 0, n = 1;
  check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check(MPI_Comm_size(comm, &n), "MPI_Comm_size");
  // Buffers up to kKeep bytes are kept per thread across calls (every small call needs
  // them); larger ones (tree allreduces of big buffers) come from `large`, already faulted
  // in when a call of that size ran before (fresh memory costs a page fault and the
  // kernel's zeroing per page, which for large buffers costs more than the exchange).
  constexpr size_t kKeep = size_t{1} << 20;
  thread_local Bytes kept_a, kept_b;
  const size_t need = static_cast<size_t>(kHeader + capacity);
  Scratch a(need, need <= kKeep ? &kept_a : nullptr, large);
  Scratch b(need, need <= kKeep ? &kept_b : nullptr, large);

  Exchange ex(comm, tag, digest, count, dtype, op, capacity, first_wait, on_wait, a.data(),
              b.data(), rank, role, arrival);
  if (nbytes) std::memcpy(ex.payload(), send, nbytes);
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int e = n - p;  // ranks below 2e pair up: the even one hands its data to the odd one
  if (rank < 2 * e && rank % 2 == 0) {
    ex.hand_over(rank + 1);
  } else {
    if (rank < 2 * e) ex.receive_from_lower(rank - 1);
    const int v = rank < 2 * e ? rank / 2 : rank - e;
    for (int d = 1; d < p; d <<= 1) {
      const int pv = v ^ d;
      ex.swap_with(pv < e ? 2 * pv + 1 : pv + e, pv < v);
    }
    if (rank < 2 * e) ex.send_result(rank - 1);
  }
  if (!ex.bad() && nbytes) std::memcpy(out, ex.payload(), nbytes);
  const int first = ex.first_active() == kNone ? n : ex.first_active();
  return {!ex.bad(), ex.sent(), ex.joined(), first, ex.last_joiner(), ex.last(),
          ex.waited(n - ex.joined())};
}

AgreeResult AgreeChannel::run(int64_t digest, const void* send, void* out, int64_t count,
                              DType dtype, ReduceOp op, Role role, double arrival) const {
  if (count * dtype_size(dtype) > capacity)
    throw std::invalid_argument("count: the payload exceeds the channel's capacity");
  if (window != nullptr)
    return agree_shared(*window, digest, send, out, count, dtype, op, capacity, first_wait,
                        on_wait, role, arrival);
  return agree_exchange(comm, tag, digest, send, out, count, dtype, op, capacity, first_wait,
                        on_wait, role, nullptr, arrival);
}

void tree_allreduce(Engine& engine, MPI_Comm comm, int tag, const void* send, void* recv,
                    int64_t count, DType dtype, ReduceOp op, Pool* large) {
  const AgreeResult r = agree_exchange(comm, tag, 0, send, recv, count, dtype, op,
                                       count * dtype_size(dtype),
                                       std::numeric_limits<double>::infinity(),
                                       [](double) { return 0.0; }, Role::active, large);
  engine.add_bytes(r.payload_sent, r.payload_sent);
}

}  // namespace collectives
