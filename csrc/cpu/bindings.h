// What the binding files (bindings.cpp, bind_agreement.cpp) share: code checks.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "dtypes.h"
#include "reduce.h"

namespace collectives::bindings {

inline DType to_dtype(int code) {
  if (code < 0 || code > static_cast<int>(DType::i64))
    throw pybind11::value_error("dtype: unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

inline ReduceOp to_op(int code) {
  if (code < 0 || code > static_cast<int>(ReduceOp::prod))
    throw pybind11::value_error("op: unknown reduce-op code " + std::to_string(code));
  return static_cast<ReduceOp>(code);
}

}  // namespace collectives::bindings

// Registers AgreeChannel and SmallAllreduce (bind_agreement.cpp).
void bind_agreement(pybind11::module_& m);
