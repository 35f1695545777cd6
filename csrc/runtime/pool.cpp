#include "runtime/pool.h"

#include <sys/mman.h>

#include <cstdlib>
#include <new>

namespace collectives {

Pool::~Pool() {
  for (auto& [size, block] : free_) std::free(block);
}

void* Pool::take(size_t bytes) {
  const size_t size = round(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = free_.find(size);
    if (it != free_.end()) {
      void* block = it->second;
      free_.erase(it);
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cached_ + size <= capacity_) {
      free_.emplace(size, block);
      cached_ += size;
      return;
    }
  }
  std::free(block);
}

size_t Pool::cached() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_;
}

}  // namespace collectives
