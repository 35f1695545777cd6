// The agreement exchange on ranks that share memory (agree.h): every rank writes
// {header, payload} into its buffer of a shared window and, once every rank has, reads all
// headers and folds the active ranks' payloads in rank order. Every rank reads the same
// headers and buffers, so every rank reaches the same result, a mismatch included, with no
// message sent. A joined rank's header says so and carries no payload: it is left out of
// the fold (the identity) and of the comparison.
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/agree.h"

namespace collectives {
namespace {

struct SharedHeader {
  int64_t digest;
  int64_t nbytes;
  int32_t role;  // Role
  int32_t dtype, op;
  double arrival;  // the job's clock
};

}  // namespace

AgreeResult agree_shared(ShmWindow& w, int64_t digest, const void* send,
                         void* out, int64_t count, DType dtype, ReduceOp op, int64_t capacity,
                         double first_wait, const OnWait& on_wait, Role role,
                         double arrival) {
  const int64_t nbytes = role == Role::active ? count * dtype_size(dtype) : 0;
  if (nbytes > capacity)
    throw std::invalid_argument("payload of " + std::to_string(nbytes) +
                                " bytes exceeds the capacity of " + std::to_string(capacity));
  const int64_t data_at = shm_single_data_offset(sizeof(SharedHeader));
  if (data_at + capacity > w.slot_bytes)
    throw std::invalid_argument("capacity: exceeds the window's buffers");
  const SharedHeader mine{digest, nbytes, static_cast<int32_t>(role),
                          static_cast<int32_t>(dtype), static_cast<int32_t>(op), arrival};
  const int n = static_cast<int>(w.segments.size());
  AgreeResult r{true, 0, 0, n, -1};
  double latest = 0, arrivals = 0;
  shm_single(
      w, &mine, sizeof mine, send, nbytes,
      [&](const unsigned char* const* buffers) {
        std::vector<const void*> active;
        const SharedHeader* first = nullptr;
        for (int j = 0; j < n; ++j) {
          SharedHeader head;
          std::memcpy(&head, buffers[j], sizeof head);
          if (static_cast<Role>(head.role) != Role::active) {
            ++r.joined;
            if (static_cast<Role>(head.role) == Role::joining) r.last_joiner = j;
            continue;
          }
          arrivals += head.arrival;  // in rank order: the same bits on every rank
          if (r.last_arrival < 0 || head.arrival >= latest) {
            latest = head.arrival;
            r.last_arrival = j;
          }
          if (first == nullptr) {
            first = reinterpret_cast<const SharedHeader*>(buffers[j]);
            r.first_active = j;
          } else if (head.digest != first->digest || head.nbytes != first->nbytes) {
            r.ok = false;
          }
          active.push_back(buffers[j] + data_at);
        }
        if (!r.ok || first == nullptr || first->nbytes == 0 || role != Role::active) return;
        reduce_many(out, active.data(), static_cast<int>(active.size()), count, dtype, op);
      },
      &on_wait, first_wait);
  if (r.ok && nbytes) r.payload_sent = nbytes;
  if (r.last_arrival >= 0) r.waited = (n - r.joined) * latest - arrivals;
  return r;
}

}  // namespace collectives
