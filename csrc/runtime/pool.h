// Memory for collectives' results, kept for reuse.
//
// A new result array (an allgather's, an alltoall's, an out-of-place allreduce's) of
// fresh memory costs a page fault and the kernel's zeroing per page on first touch, a
// sizeable share of a large collective's own time. Training loops ask for the same
// sizes every step, so blocks come back here when Python drops the array and the next call
// of that size reuses one, already faulted in. Blocks are matched by exact size (rounded up
// to 4 KiB, or to 2 MiB huge pages from 4 MiB); at most `capacity` bytes wait here. A block
// handed back to a full pool makes room by freeing the blocks that have waited longest:
// the sizes a job asks for now are those it dropped last, while blocks of sizes it has
// moved on from would otherwise fill the pool for good and turn every large result into
// fresh memory. Cost: a lookup per take and give, a free per evicted block.
#pragma once

#include <cstddef>
#include <list>
#include <map>
#include <mutex>
#include <vector>

namespace collectives {

class Pool {
 public:
  explicit Pool(size_t capacity) : capacity_(capacity) {}
  ~Pool();

  // A page-aligned block of round(bytes) bytes: a cached one if any, else new.
  void* take(size_t bytes);
  // Hand back a block from take(bytes) (any thread).
  void give(void* block, size_t bytes);
  size_t cached() const;
  // Sizes are whole pages; from kHugeFrom up, whole huge pages.
  static size_t round(size_t bytes) {
    const size_t unit = bytes >= kHugeFrom ? kHugePage : 4096;
    return (bytes + unit - 1) / unit * unit;
  }
  static constexpr size_t kHugePage = size_t{2} << 20;
  static constexpr size_t kHugeFrom = size_t{4} << 20;

 private:
  struct Waiting {
    size_t size;
    void* block;
  };
  using Queue = std::list<Waiting>;
  mutable std::mutex mu_;
  Queue waiting_;                                  // longest waiting first
  std::multimap<size_t, Queue::iterator> by_size_;  // the same blocks by size
  size_t cached_ = 0;
  const size_t capacity_;
};

}  // namespace collectives
