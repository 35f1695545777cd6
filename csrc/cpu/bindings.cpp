// The only Python binding module (collectives._C). Arguments are checked here, with the
// GIL held; every kernel then runs with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "reduce.h"

namespace py = pybind11;
using namespace collectives;

namespace {

DType to_dtype(int code) {
  if (code < 0 || code > static_cast<int>(DType::i64))
    throw py::value_error("dtype: unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

ReduceOp to_op(int code) {
  if (code < 0 || code > static_cast<int>(ReduceOp::prod))
    throw py::value_error("op: unknown reduce-op code " + std::to_string(code));
  return static_cast<ReduceOp>(code);
}

// A C-contiguous buffer holding at least `count` elements of `dtype`.
void* buffer_ptr(const py::buffer& obj, const char* name, int64_t count, DType dtype,
                 bool writable) {
  py::buffer_info info = obj.request(writable);
  const int64_t need = count * dtype_size(dtype);
  const int64_t have = info.size * info.itemsize;
  if (have < need)
    throw py::value_error(std::string(name) + ": buffer holds " + std::to_string(have) +
                          " bytes, need " + std::to_string(need));
  int64_t stride = info.itemsize;
  for (int d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] != 1 && info.strides[d] != stride)
      throw py::value_error(std::string(name) + ": buffer must be C-contiguous");
    stride *= info.shape[d];
  }
  return info.ptr;
}

void py_reduce(const py::buffer& dst, const std::vector<py::buffer>& srcs, int64_t count,
               int dtype_code, int op_code) {
  const DType dtype = to_dtype(dtype_code);
  const ReduceOp op = to_op(op_code);
  if (srcs.empty()) throw py::value_error("srcs: need at least one source buffer");
  if (count < 0) throw py::value_error("count: must be >= 0");
  void* out = buffer_ptr(dst, "dst", count, dtype, true);
  std::vector<const void*> in;
  in.reserve(srcs.size());
  for (const auto& s : srcs) in.push_back(buffer_ptr(s, "srcs", count, dtype, false));
  py::gil_scoped_release release;
  reduce_many(out, in.data(), static_cast<int>(in.size()), count, dtype, op);
}

void py_divide(const py::buffer& buf, int64_t count, int dtype_code, int64_t divisor) {
  const DType dtype = to_dtype(dtype_code);
  if (divisor == 0) throw py::value_error("divisor: must be non-zero");
  if (count < 0) throw py::value_error("count: must be >= 0");
  void* ptr = buffer_ptr(buf, "buf", count, dtype, true);
  py::gil_scoped_release release;
  divide(ptr, count, dtype, divisor);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "collectives C++ kernels (CPU); see collectives/kernels.py for the Python face";
  m.def("reduce", &py_reduce, py::arg("dst"), py::arg("srcs"), py::arg("count"),
        py::arg("dtype"), py::arg("op"),
        "dst = srcs[0] op srcs[1] op ... elementwise over count elements");
  m.def("divide", &py_divide, py::arg("buf"), py::arg("count"), py::arg("dtype"),
        py::arg("divisor"), "buf /= divisor in place (floor division for integers)");
}
