// See check.h.
#include "bindings/check.h"

#include <pybind11/numpy.h>

#include <string>

namespace py = pybind11;

namespace collectives::check {
namespace {

std::string arg(const char* name, int64_t index) {
  return index < 0 ? name : std::string(name) + "[" + std::to_string(index) + "]";
}

// The buffer-protocol format letters that may carry each element type (itemsize decides
// between 'l' and 'q'); bfloat16 travels as uint16 bits.
const char* format_letters(DType t) {
  switch (t) {
    case DType::f16: return "e";
    case DType::bf16: return "H";
    case DType::f32: return "f";
    case DType::f64: return "d";
    case DType::i8: return "b";
    case DType::u8: return "B";
    case DType::i32: return "il";
    case DType::i64: return "lq";
    case DType::i16: return "h";
  }
  return "";
}

// NumPy's dtype kind of each element type's storage.
char numpy_kind(DType t) {
  switch (t) {
    case DType::f16: case DType::f32: case DType::f64: return 'f';
    case DType::bf16: case DType::u8: return 'u';
    default: return 'i';
  }
}

[[noreturn]] void wrong_type(const std::string& what, DType type, const std::string& got,
                             int64_t itemsize) {
  throw py::type_error(what + ": expected " + dtype_name(type) + " elements, got format '" +
                       got + "' of " + std::to_string(itemsize) + " bytes");
}

View numpy_view(const py::array& a, const char* name, std::optional<DType> type,
                bool writable, int64_t index) {
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(arg(name, index) + ": buffer must be C-contiguous");
  if (writable && !a.writeable()) throw py::value_error(arg(name, index) + ": read-only");
  const py::dtype dt = a.dtype();
  if (type && (dt.kind() != numpy_kind(*type) || dt.itemsize() != dtype_size(*type)))
    wrong_type(arg(name, index), *type, std::string(1, dt.char_()), dt.itemsize());
  const auto n = type ? static_cast<int64_t>(a.size()) : static_cast<int64_t>(a.nbytes());
  return {const_cast<void*>(a.data()), n};
}

bool has_format(const Py_buffer& b, DType t) {
  std::string fmt = b.format == nullptr ? "B" : b.format;
  if (fmt.size() == 2 && (fmt[0] == '@' || fmt[0] == '=' || fmt[0] == '<')) fmt.erase(0, 1);
  return fmt.size() == 1 && b.itemsize == dtype_size(t) &&
         std::string(format_letters(t)).find(fmt[0]) != std::string::npos;
}

}  // namespace

DType dtype(int code) {
  if (code < 0 || code > static_cast<int>(DType::i16))
    throw py::value_error("dtype: unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

ReduceOp op(int code) {
  if (code < 0 || code > static_cast<int>(ReduceOp::prod))
    throw py::value_error("op: unknown reduce-op code " + std::to_string(code));
  return static_cast<ReduceOp>(code);
}

const char* dtype_name(DType t) {
  static const char* const names[] = {"float16", "bfloat16", "float32", "float64", "int8",
                                      "uint8",   "int32",    "int64",   "int16"};
  return names[static_cast<int>(t)];
}

void count(int64_t count) {
  if (count < 0) throw py::value_error("count: must be >= 0, got " + std::to_string(count));
}

void divisor(int64_t divisor) {
  if (divisor < 1) throw py::value_error("divisor: must be >= 1");
}

View view(py::handle obj, const char* name, std::optional<DType> type, bool writable,
          int64_t index) {
  if (py::isinstance<py::array>(obj))  // the common case, without a buffer request
    return numpy_view(py::reinterpret_borrow<py::array>(obj), name, type, writable, index);
  if (!PyObject_CheckBuffer(obj.ptr()))
    throw py::type_error(arg(name, index) + ": expected an array, got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  Py_buffer b;
  const int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &b, flags) != 0) {  // e.g. a read-only output
    const py::error_already_set e;
    throw py::value_error(arg(name, index) + ": " + e.what());
  }
  const bool typed = !type || has_format(b, *type);
  const std::string format = b.format == nullptr ? "B" : b.format;
  const auto itemsize = b.itemsize;
  const bool contiguous = PyBuffer_IsContiguous(&b, 'C') != 0;
  const View v{b.buf, type ? (itemsize > 0 ? static_cast<int64_t>(b.len / itemsize) : 0)
                           : static_cast<int64_t>(b.len)};
  PyBuffer_Release(&b);  // the caller keeps obj, and so the memory, alive
  if (!typed) wrong_type(arg(name, index), *type, format, itemsize);
  if (!contiguous) throw py::value_error(arg(name, index) + ": buffer must be C-contiguous");
  return v;
}

void* ptr(py::handle obj, const char* name, std::optional<DType> type, bool writable,
          int64_t need, int64_t index) {
  const View v = view(obj, name, type, writable, index);
  if (v.size < need)
    throw py::value_error(arg(name, index) + ": holds " + std::to_string(v.size) +
                          (type ? " elements" : " bytes") + ", need " + std::to_string(need));
  return v.ptr;
}

namespace {

// Attribute names of a torch tensor, interned once (and never freed: they outlive the module).
struct TorchNames {
  PyObject* data_ptr = PyUnicode_InternFromString("data_ptr");
  PyObject* numel = PyUnicode_InternFromString("numel");
  PyObject* is_contiguous = PyUnicode_InternFromString("is_contiguous");
  PyObject* is_cpu = PyUnicode_InternFromString("is_cpu");
  PyObject* dtype = PyUnicode_InternFromString("dtype");
};

// obj.name or obj.name() through the C API with the interned names above: pybind11's
// attr("name")() makes a name string and accessor objects on every call.
py::object get(py::handle obj, PyObject* name, bool call) {
  PyObject* r =
      call ? PyObject_CallMethodNoArgs(obj.ptr(), name) : PyObject_GetAttr(obj.ptr(), name);
  if (r == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

}  // namespace

View torch_tensor(py::handle t, const py::object& torch_dtype, int64_t index) {
  static const TorchNames* const names = new TorchNames;
  const auto what = [&] { return arg("tensors", index); };
  PyObject* is_cpu = PyObject_GetAttr(t.ptr(), names->is_cpu);
  if (is_cpu == nullptr) {
    PyErr_Clear();
    throw py::type_error(what() + ": expected a torch.Tensor, got " +
                         std::string(py::str(py::type::of(t).attr("__name__"))));
  }
  if (!py::reinterpret_steal<py::object>(is_cpu).cast<bool>())
    throw py::type_error(what() + ": expected a CPU tensor, got one on " +
                         std::string(py::str(t.attr("device"))));
  const py::object dtype = get(t, names->dtype, false);
  if (!dtype.is(torch_dtype))
    throw py::type_error(what() + ": dtype " + std::string(py::str(dtype)) +
                         " differs from tensors[0]'s " + std::string(py::str(torch_dtype)));
  if (!get(t, names->is_contiguous, true).cast<bool>())
    throw py::value_error(what() + ": tensor must be contiguous");
  return {reinterpret_cast<void*>(get(t, names->data_ptr, true).cast<uintptr_t>()),
          get(t, names->numel, true).cast<int64_t>()};
}

}  // namespace collectives::check
