// The binding module collectives._C is assembled from one binding file per area.
#pragma once

#include <pybind11/pybind11.h>

void bind_kernels(pybind11::module_& m);  // kernels.cpp: the pure kernels
void bind_runtime(pybind11::module_& m);  // runtime.cpp: engine, calls, fast allreduce
void bind_shm(pybind11::module_& m);      // shm.cpp: the shared-memory stages
void bind_pool(pybind11::module_& m);     // pool.cpp: memory for results, reused

namespace collectives {
class Pool;
}
// The result pool (pool.cpp), or nullptr before collectives/runtime/buffers.py creates it.
collectives::Pool* result_pool();
