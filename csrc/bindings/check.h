// The one argument checker of the binding files: every buffer a binding receives is checked
// here, with the GIL held, and errors name the argument ("tensors[3]: buffer must be
// C-contiguous", "bits: holds 2 elements, need 3").
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>

#include "kernels/dtypes.h"
#include "kernels/reduce.h"

namespace collectives::check {

DType dtype(int code);       // a dtype code from collectives/dtypes.py
ReduceOp op(int code);       // a kernel op code (collectives/ops.py; Average is not one)
const char* dtype_name(DType t);
void count(int64_t count);   // >= 0
void divisor(int64_t divisor);  // Average's: >= 1

// A C-contiguous buffer: its address and element count.
struct View {
  void* ptr;
  int64_t size;
};

// obj (a NumPy array, read without a buffer request, or any buffer) as a C-contiguous
// buffer of `type` elements; `type` empty: any element type, size in bytes. index >= 0
// names the argument "name[index]".
View view(pybind11::handle obj, const char* name, std::optional<DType> type, bool writable,
          int64_t index = -1);

// As view(), holding at least `need` elements (bytes when type is empty).
void* ptr(pybind11::handle obj, const char* name, std::optional<DType> type, bool writable,
          int64_t need, int64_t index = -1);

// A torch CPU tensor of torch_dtype (torch tensors have no buffer protocol), read through
// its Python API; errors name "tensors[index]".
View torch_tensor(pybind11::handle t, const pybind11::object& torch_dtype, int64_t index);

}  // namespace collectives::check
