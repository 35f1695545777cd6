// Bindings of the result pool (runtime/pool.h): `_C.pooled(nbytes)` is a writable buffer
// whose memory goes back to the pool when its last user (the NumPy array made over it)
// is gone.
#include <pybind11/pybind11.h>

#include <sys/mman.h>

#include <cstdint>
#include <memory>

#include "bindings/module.h"
#include "runtime/pool.h"

namespace py = pybind11;
using namespace collectives;

namespace {

// Made by set_pool_capacity (collectives/runtime/buffers.py) and never destroyed: blocks may come
// back while the interpreter exits.
Pool* pool = nullptr;

struct Block {
  void* data;
  size_t bytes;
  Block(size_t n) : data(pool->take(n)), bytes(n) {}
  ~Block() { pool->give(data, bytes); }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
};

}  // namespace

Pool* result_pool() { return pool; }

void bind_pool(py::module_& m) {
  m.def("set_pool_capacity", [](int64_t capacity) {
        if (capacity < 0) throw py::value_error("capacity: must be >= 0");
        if (!pool) pool = new Pool(static_cast<size_t>(capacity));
      }, py::arg("capacity"), "Create the result pool (once) holding at most capacity bytes");
  m.def("pool_cached", []() { return pool ? pool->cached() : 0; },
        "Bytes of blocks waiting in the result pool");
  py::class_<Block>(m, "PooledBlock", py::buffer_protocol(),
                    "A block of the result pool, returned to it when dropped")
      .def_buffer([](Block& b) {
        return py::buffer_info(b.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.bytes)}, {1});
      });
  m.def("advise_huge_pages", [](uintptr_t address, int64_t nbytes) {
        if (nbytes < 0) throw py::value_error("nbytes: must be >= 0");
        // only whole huge pages inside the range: madvise needs aligned bounds
        const uintptr_t lo = (address + Pool::kHugePage - 1) / Pool::kHugePage * Pool::kHugePage;
        const uintptr_t hi = (address + static_cast<uintptr_t>(nbytes)) / Pool::kHugePage *
                             Pool::kHugePage;
#ifdef MADV_HUGEPAGE
        if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#endif
      }, py::arg("address"), py::arg("nbytes"),
      "Ask for huge pages over the whole 2 MiB pages of [address, address + nbytes)");
  m.def("pooled", [](int64_t nbytes) {
        if (!pool) throw std::logic_error("the result pool is not created");
        if (nbytes < 0) throw py::value_error("nbytes: must be >= 0");
        return std::make_unique<Block>(static_cast<size_t>(nbytes));
      }, py::arg("nbytes"), "A writable block of nbytes from the result pool");
}
