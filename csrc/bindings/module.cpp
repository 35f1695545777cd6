// The only Python binding module, collectives._C (Python face: collectives/kernels/ and
// collectives/runtime/engine.py). Arguments are checked in the binding files with the GIL held
// (check.h); kernels and MPI waits then run with the GIL released.
#include "bindings/module.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "collectives C++ kernels and runtime (CPU)";
  bind_kernels(m);
  bind_runtime(m);
  bind_shm(m);
  bind_pool(m);
}
