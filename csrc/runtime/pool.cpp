#include "runtime/pool.h"

#include <sys/mman.h>

#include <cstdlib>
#include <new>
#include <vector>

namespace collectives {

Pool::~Pool() {
  for (auto& w : waiting_) std::free(w.block);
}

void* Pool::take(size_t bytes) {
  const size_t size = round(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = by_size_.find(size);
    if (it != by_size_.end()) {
      void* block = it->second->block;
      waiting_.erase(it->second);
      by_size_.erase(it);
      cached_ -= size;
      return block;
    }
  }
  // Large blocks start on a 2 MiB boundary and ask for huge pages, as NumPy's do: the
  // peer's single-copy transfers (and our copies) then walk 512x fewer pages.
  const bool huge = size >= kHugeFrom;
  void* block = std::aligned_alloc(huge ? kHugePage : 4096, size);
  if (block == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (huge) madvise(block, size, MADV_HUGEPAGE);
#endif
  return block;
}

void Pool::give(void* block, size_t bytes) {
  const size_t size = round(bytes);
  std::vector<void*> evicted;  // freed after the lock: returning memory takes a while
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (size <= capacity_) {
      while (cached_ + size > capacity_) {
        const Waiting oldest = waiting_.front();
        auto lo = by_size_.lower_bound(oldest.size);
        while (lo->second != waiting_.begin()) ++lo;
        by_size_.erase(lo);
        waiting_.pop_front();
        cached_ -= oldest.size;
        evicted.push_back(oldest.block);
      }
      by_size_.emplace(size, waiting_.insert(waiting_.end(), {size, block}));
      cached_ += size;
      block = nullptr;
    }
  }
  for (void* b : evicted) std::free(b);
  std::free(block);
}

size_t Pool::cached() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_;
}

}  // namespace collectives
