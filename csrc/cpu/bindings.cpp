// The only Python binding module (collectives._C). Arguments are checked here, with the
// GIL held; every kernel then runs with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "onebit.h"
#include "pack.h"
#include "quantize.h"
#include "reduce.h"
#include "shm.h"

namespace py = pybind11;
using namespace collectives;
using collectives::bindings::to_dtype;
using collectives::bindings::to_op;

namespace {

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


// ---- Fusion packing, quantization, 1-bit compression (pack.h, quantize.h, onebit.h) ----
// These check the element type too: each buffer must be C-contiguous and of the named type.

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
  }
  return "";
}

const char* dtype_name(DType t) {
  static const char* const names[] = {"float16", "bfloat16", "float32", "float64",
                                      "int8",    "uint8",    "int32",   "int64"};
  return names[static_cast<int>(t)];
}

bool has_dtype(const Py_buffer& b, DType t) {
  std::string fmt = b.format == nullptr ? "B" : b.format;
  if (fmt.size() == 2 && (fmt[0] == '@' || fmt[0] == '=' || fmt[0] == '<')) fmt.erase(0, 1);
  return fmt.size() == 1 && b.itemsize == dtype_size(t) &&
         std::string(format_letters(t)).find(fmt[0]) != std::string::npos;
}

struct View {
  void* ptr;
  int64_t size;  // elements
};

// "name" or "name[index]", built only when an error needs it.
std::string arg_name(const char* name, int64_t index) {
  return index < 0 ? name : std::string(name) + "[" + std::to_string(index) + "]";
}

// obj as a C-contiguous buffer of `dtype` elements; errors name the argument. (The raw
// buffer protocol: py::buffer_info's heap-allocated shape vectors cost more per tensor.)
View typed_view(py::handle obj, const char* name, DType dtype, bool writable,
                int64_t index = -1) {
  if (!PyObject_CheckBuffer(obj.ptr()))
    throw py::type_error(arg_name(name, index) + ": expected an array, got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  Py_buffer b;
  const int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &b, flags) != 0) {  // e.g. a read-only output array
    const py::error_already_set e;
    throw py::value_error(arg_name(name, index) + ": " + e.what());
  }
  const View v{b.buf, b.itemsize > 0 ? static_cast<int64_t>(b.len / b.itemsize) : 0};
  const bool typed = has_dtype(b, dtype);
  const std::string format = b.format == nullptr ? "B" : b.format;
  const auto itemsize = b.itemsize;
  const bool contiguous = PyBuffer_IsContiguous(&b, 'C') != 0;
  PyBuffer_Release(&b);  // the caller keeps obj, and so the memory, alive
  if (!typed)
    throw py::type_error(arg_name(name, index) + ": expected " + dtype_name(dtype) +
                         " elements, got format '" + format + "' of " +
                         std::to_string(itemsize) + " bytes");
  if (!contiguous) throw py::value_error(arg_name(name, index) + ": buffer must be C-contiguous");
  return v;
}

// As above, holding at least `need` elements.
void* typed_ptr(py::handle obj, const char* name, DType dtype, bool writable, int64_t need,
                int64_t index = -1) {
  const View v = typed_view(obj, name, dtype, writable, index);
  if (v.size < need)
    throw py::value_error(arg_name(name, index) + ": holds " + std::to_string(v.size) +
                          " elements, need " + std::to_string(need));
  return v.ptr;
}

void check_count(int64_t count) {
  if (count < 0) throw py::value_error("count: must be >= 0, got " + std::to_string(count));
}

void check_scale(DType dtype, double scale) {
  const bool floating = dtype == DType::f16 || dtype == DType::bf16 || dtype == DType::f32 ||
                        dtype == DType::f64;
  if (!floating && scale != 1.0)
    throw py::value_error(std::string("scale: must be 1 for ") + dtype_name(dtype) +
                          " tensors, got " + std::to_string(scale));
}

// Attribute names of a torch tensor, interned once (and never freed: they outlive the module).
struct TorchNames {
  PyObject* data_ptr = PyUnicode_InternFromString("data_ptr");
  PyObject* numel = PyUnicode_InternFromString("numel");
  PyObject* is_contiguous = PyUnicode_InternFromString("is_contiguous");
  PyObject* is_cpu = PyUnicode_InternFromString("is_cpu");
  PyObject* dtype = PyUnicode_InternFromString("dtype");
};

// obj.name or obj.name() through the C API: pybind11's attr("name")() costs 5x more.
py::object get(py::handle obj, PyObject* name, bool call) {
  PyObject* r =
      call ? PyObject_CallMethodNoArgs(obj.ptr(), name) : PyObject_GetAttr(obj.ptr(), name);
  if (r == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

// A torch CPU tensor of torch_dtype, read through its Python API: torch tensors have no
// buffer protocol, and this costs a fraction of a microsecond where .numpy() costs two.
View torch_view(py::handle t, const py::object& torch_dtype, int64_t index) {
  static const TorchNames* const names = new TorchNames;
  const auto what = [&] { return arg_name("tensors", index); };
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

// Pointers and element counts of every tensor: NumPy arrays (any buffer) when torch_dtype
// is None, else torch CPU tensors of that dtype.
void tensor_views(const py::sequence& tensors, DType dtype, const py::object& torch_dtype,
                  bool writable, std::vector<void*>& ptrs, std::vector<int64_t>& counts) {
  const size_t n = py::len(tensors);
  ptrs.reserve(n);
  counts.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    const py::handle t = tensors[k];
    const auto index = static_cast<int64_t>(k);
    const View v = torch_dtype.is_none() ? typed_view(t, "tensors", dtype, writable, index)
                                         : torch_view(t, torch_dtype, index);
    ptrs.push_back(v.ptr);
    counts.push_back(v.size);
  }
}

int64_t total_count(const std::vector<int64_t>& counts) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

int64_t py_pack(const py::buffer& out, const py::sequence& tensors, int dtype_code,
                const py::object& torch_dtype, double scale) {
  const DType dtype = to_dtype(dtype_code);
  check_scale(dtype, scale);
  std::vector<void*> srcs;
  std::vector<int64_t> counts;
  tensor_views(tensors, dtype, torch_dtype, false, srcs, counts);
  const int64_t total = total_count(counts);
  void* dst = typed_ptr(out, "out", dtype, true, total);
  py::gil_scoped_release release;
  pack(dst, srcs.data(), counts.data(), static_cast<int>(srcs.size()), dtype, scale);
  return total;
}

void py_unpack(const py::buffer& buffer, const py::sequence& tensors, int dtype_code,
               const py::object& torch_dtype, double scale) {
  const DType dtype = to_dtype(dtype_code);
  check_scale(dtype, scale);
  std::vector<void*> dsts;
  std::vector<int64_t> counts;
  tensor_views(tensors, dtype, torch_dtype, true, dsts, counts);
  const void* src = typed_ptr(buffer, "buffer", dtype, false, total_count(counts));
  py::gil_scoped_release release;
  unpack(src, dsts.data(), counts.data(), static_cast<int>(dsts.size()), dtype, scale);
}

void py_quantize_fp16(const py::buffer& x, const py::buffer& out, int64_t count) {
  check_count(count);
  const auto* src = static_cast<const float*>(typed_ptr(x, "x", DType::f32, false, count));
  auto* dst = static_cast<uint16_t*>(typed_ptr(out, "out", DType::f16, true, count));
  py::gil_scoped_release release;
  quantize_fp16(src, dst, count);
}

void py_dequantize_fp16(const py::buffer& h, const py::buffer& out, int64_t count) {
  check_count(count);
  const auto* src = static_cast<const uint16_t*>(typed_ptr(h, "h", DType::f16, false, count));
  auto* dst = static_cast<float*>(typed_ptr(out, "out", DType::f32, true, count));
  py::gil_scoped_release release;
  dequantize_fp16(src, dst, count);
}

int64_t int8_blocks(int64_t count) { return (count + kInt8Block - 1) / kInt8Block; }

void py_quantize_int8(const py::buffer& x, const py::buffer& q, const py::buffer& scales,
                      int64_t count) {
  check_count(count);
  const auto* src = static_cast<const float*>(typed_ptr(x, "x", DType::f32, false, count));
  auto* qp = static_cast<int8_t*>(typed_ptr(q, "q", DType::i8, true, count));
  auto* sp = static_cast<float*>(typed_ptr(scales, "scales", DType::f32, true, int8_blocks(count)));
  py::gil_scoped_release release;
  quantize_int8(src, qp, sp, count);
}

void py_dequantize_int8(const py::buffer& q, const py::buffer& scales, const py::buffer& out,
                        int64_t count) {
  check_count(count);
  const auto* qp = static_cast<const int8_t*>(typed_ptr(q, "q", DType::i8, false, count));
  const auto* sp =
      static_cast<const float*>(typed_ptr(scales, "scales", DType::f32, false, int8_blocks(count)));
  auto* dst = static_cast<float*>(typed_ptr(out, "out", DType::f32, true, count));
  py::gil_scoped_release release;
  dequantize_int8(qp, sp, dst, count);
}

// Scales needed by count elements in blocks of `block` (block >= 1).
int64_t onebit_blocks(int64_t count, int64_t block) {
  if (block < 1) throw py::value_error("block_size: must be >= 1, got " + std::to_string(block));
  return count / block + (count % block != 0);
}

void py_onebit_compress(const py::buffer& x, const py::buffer& error, const py::buffer& bits,
                        const py::buffer& scales, int64_t count, int64_t block) {
  check_count(count);
  const int64_t nscales = onebit_blocks(count, block);
  const auto* xp = static_cast<const float*>(typed_ptr(x, "x", DType::f32, false, count));
  auto* ep = static_cast<float*>(typed_ptr(error, "error", DType::f32, true, count));
  auto* bp = static_cast<uint8_t*>(typed_ptr(bits, "bits", DType::u8, true, (count + 7) / 8));
  auto* sp = static_cast<float*>(typed_ptr(scales, "scales", DType::f32, true, nscales));
  py::gil_scoped_release release;
  onebit_compress(xp, ep, bp, sp, count, block);
}

void py_onebit_decompress(const py::buffer& bits, const py::buffer& scales,
                          const py::buffer& out, int64_t count, int64_t block) {
  check_count(count);
  const int64_t nscales = onebit_blocks(count, block);
  const auto* bp =
      static_cast<const uint8_t*>(typed_ptr(bits, "bits", DType::u8, false, (count + 7) / 8));
  const auto* sp =
      static_cast<const float*>(typed_ptr(scales, "scales", DType::f32, false, nscales));
  auto* dst = static_cast<float*>(typed_ptr(out, "out", DType::f32, true, count));
  py::gil_scoped_release release;
  onebit_decompress(bp, sp, dst, count, block);
}

// The (bits, scales) arrays of n compressed sources of count elements, checked.
std::pair<std::vector<const uint8_t*>, std::vector<const float*>> onebit_sources(
    const py::sequence& bits, const py::sequence& scales, int64_t count, int64_t nscales) {
  const size_t n = py::len(bits);
  if (py::len(scales) != n)
    throw py::value_error("scales: got " + std::to_string(py::len(scales)) + " arrays for " +
                          std::to_string(n) + " bits arrays");
  std::vector<const uint8_t*> bp;
  std::vector<const float*> sp;
  for (size_t k = 0; k < n; ++k) {
    const auto i = static_cast<int64_t>(k);
    bp.push_back(static_cast<const uint8_t*>(
        typed_ptr(bits[k], "bits", DType::u8, false, (count + 7) / 8, i)));
    sp.push_back(
        static_cast<const float*>(typed_ptr(scales[k], "scales", DType::f32, false, nscales, i)));
  }
  return {bp, sp};
}

void py_onebit_accumulate(const py::buffer& acc, const py::sequence& bits,
                          const py::sequence& scales, int64_t count, int64_t block) {
  check_count(count);
  const int64_t nscales = onebit_blocks(count, block);
  auto* dst = static_cast<float*>(typed_ptr(acc, "acc", DType::f32, true, count));
  const auto [bp, sp] = onebit_sources(bits, scales, count, nscales);
  py::gil_scoped_release release;
  onebit_accumulate(dst, bp.data(), sp.data(), static_cast<int>(bp.size()), count, block);
}

void py_onebit_serve(const py::sequence& bits, const py::sequence& scales,
                     const py::buffer& error, const py::buffer& out_bits,
                     const py::buffer& out_scales, int64_t count, int64_t block) {
  check_count(count);
  const int64_t nscales = onebit_blocks(count, block);
  const auto [bp, sp] = onebit_sources(bits, scales, count, nscales);
  auto* ep = static_cast<float*>(typed_ptr(error, "error", DType::f32, true, count));
  auto* ob = static_cast<uint8_t*>(typed_ptr(out_bits, "out_bits", DType::u8, true, (count + 7) / 8));
  auto* os = static_cast<float*>(typed_ptr(out_scales, "out_scales", DType::f32, true, nscales));
  py::gil_scoped_release release;
  onebit_serve(bp.data(), sp.data(), static_cast<int>(bp.size()), ep, ob, os, count, block);
}

// ---- Shared-memory reduction pipeline (shm.h) ---------------------------------------------

ShmWindow make_shm_window(const std::vector<uintptr_t>& segments, int rank,
                          int64_t header_bytes, int64_t stride, int64_t slot_bytes,
                          int64_t depth, double spin_seconds, double stall_seconds) {
  if (rank < 0 || rank >= static_cast<int>(segments.size()))
    throw py::value_error("rank: out of range");
  if (depth <= 0 || slot_bytes <= 0 || header_bytes < 3 * stride * 8 || stride <= 0)
    throw py::value_error("depth, slot_bytes, header_bytes, stride: bad window layout");
  ShmWindow w;
  for (uintptr_t a : segments) w.segments.push_back(reinterpret_cast<unsigned char*>(a));
  w.rank = rank;
  w.header_bytes = header_bytes;
  w.stride = stride;
  w.slot_bytes = slot_bytes;
  w.depth = depth;
  w.spin_seconds = spin_seconds;
  w.stall_seconds = stall_seconds;
  return w;
}

void check_pieces(const ShmWindow& w, const std::vector<int64_t>& bounds, int64_t e,
                  int64_t nchunks, int64_t piece_bytes) {
  if (bounds.size() != w.segments.size() + 1) throw py::value_error("bounds: need size + 1");
  if (e <= 0 || nchunks < 0) throw py::value_error("e, nchunks: bad");
  if (piece_bytes > w.slot_bytes) throw py::value_error("e: pieces do not fit a slot");
  int64_t longest = 0;
  for (size_t j = 0; j + 1 < bounds.size(); ++j) longest = std::max(longest, bounds[j + 1] - bounds[j]);
  if (nchunks * e < longest) throw py::value_error("nchunks: too few for the longest block");
}

void py_shm_reduce(const ShmWindow& w, int64_t seq, const py::buffer& send,
                   const py::buffer& recv, const std::vector<int64_t>& bounds, int64_t e,
                   int64_t nchunks, int dtype_code, int op_code, bool allreduce) {
  const DType dtype = to_dtype(dtype_code);
  const ReduceOp op = to_op(op_code);
  const int64_t size = static_cast<int64_t>(w.segments.size());
  check_pieces(w, bounds, e, nchunks, size * e * dtype_size(dtype));
  const void* in = buffer_ptr(send, "send", bounds.back(), dtype, false);
  void* out = buffer_ptr(recv, "recv",
                         allreduce ? bounds.back() : bounds[w.rank + 1] - bounds[w.rank], dtype,
                         true);
  py::gil_scoped_release release;
  shm_reduce(w, seq, in, out, bounds, e, nchunks, dtype, op, allreduce);
}

void py_shm_allgather(const ShmWindow& w, int64_t seq, const py::buffer& send,
                      const py::buffer& recv, const std::vector<int64_t>& bounds, int64_t e,
                      int64_t nchunks, int64_t item) {
  if (item <= 0) throw py::value_error("item: must be > 0");
  check_pieces(w, bounds, e, nchunks, e * item);
  const void* in = buffer_ptr(send, "send", (bounds[w.rank + 1] - bounds[w.rank]) * item,
                              DType::u8, false);
  void* out = buffer_ptr(recv, "recv", bounds.back() * item, DType::u8, true);
  py::gil_scoped_release release;
  shm_allgather(w, seq, in, out, bounds, e, nchunks, item);
}

void py_shm_broadcast(const ShmWindow& w, int64_t seq, const py::buffer& buf, int64_t nbytes,
                      int64_t e, int64_t nchunks, int root) {
  if (root < 0 || root >= static_cast<int>(w.segments.size()))
    throw py::value_error("root: out of range");
  if (e <= 0 || e > w.slot_bytes || nbytes < 0) throw py::value_error("e, nbytes: bad");
  if (nchunks < 0 || nchunks * e < nbytes) throw py::value_error("nchunks: too few for nbytes");
  void* data = buffer_ptr(buf, "buf", nbytes, DType::u8, w.rank != root);
  py::gil_scoped_release release;
  shm_broadcast(w, seq, data, nbytes, e, nchunks, root);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "collectives C++ kernels (CPU); see collectives/kernels.py for the Python face";
  m.def("reduce", &py_reduce, py::arg("dst"), py::arg("srcs"), py::arg("count"),
        py::arg("dtype"), py::arg("op"),
        "dst = srcs[0] op srcs[1] op ... elementwise over count elements");
  m.def("divide", &py_divide, py::arg("buf"), py::arg("count"), py::arg("dtype"),
        py::arg("divisor"), "buf /= divisor in place (floor division for integers)");

  py::class_<ShmWindow>(m, "ShmWindow", "A shared window's layout, seen from one rank (shm.h)")
      .def(py::init(&make_shm_window), py::arg("segments"), py::arg("rank"),
           py::arg("header_bytes"), py::arg("stride"), py::arg("slot_bytes"), py::arg("depth"),
           py::arg("spin_seconds"), py::arg("stall_seconds"))
      .def(
          "set_jitter",
          [](ShmWindow& w, double seconds) {
            if (!(seconds >= 0)) throw py::value_error("seconds: must be >= 0");
            w.jitter_seconds = seconds;
          },
          py::arg("seconds"),
          "Tests only: sleep up to seconds before a fifth of this window's counter posts");
  m.def("shm_reduce", &py_shm_reduce, py::arg("window"), py::arg("seq"), py::arg("send"),
        py::arg("recv"), py::arg("bounds"), py::arg("e"), py::arg("nchunks"), py::arg("dtype"),
        py::arg("op"), py::arg("allreduce"),
        "shm.py's pipelined allreduce / reducescatter stages (GIL released)");
  m.def("shm_allgather", &py_shm_allgather, py::arg("window"), py::arg("seq"), py::arg("send"),
        py::arg("recv"), py::arg("bounds"), py::arg("e"), py::arg("nchunks"), py::arg("item"),
        "shm.py's pipelined allgather stages (GIL released)");
  m.def("shm_broadcast", &py_shm_broadcast, py::arg("window"), py::arg("seq"), py::arg("buf"),
        py::arg("nbytes"), py::arg("e"), py::arg("nchunks"), py::arg("root"),
        "shm.py's pipelined broadcast stages (GIL released)");
  bind_agreement(m);

  // fusion packing, quantization, 1-bit compression
  m.attr("INT8_BLOCK_SIZE") = kInt8Block;
  m.def("pack", &py_pack, py::arg("out"), py::arg("tensors"), py::arg("dtype"),
        py::arg("torch_dtype"), py::arg("scale"),
        "out[:total] = concat(tensors) * scale in one call; returns total. tensors are NumPy "
        "arrays, or torch CPU tensors of torch_dtype when it is not None");
  m.def("unpack", &py_unpack, py::arg("buffer"), py::arg("tensors"), py::arg("dtype"),
        py::arg("torch_dtype"), py::arg("scale"),
        "tensors[k] = (its slice of buffer) * scale, the inverse of pack");
  m.def("quantize_fp16", &py_quantize_fp16, py::arg("x"), py::arg("out"), py::arg("count"),
        "out = float16(x), nearest even");
  m.def("dequantize_fp16", &py_dequantize_fp16, py::arg("h"), py::arg("out"),
        py::arg("count"), "out = float32(h)");
  m.def("quantize_int8", &py_quantize_int8, py::arg("x"), py::arg("q"), py::arg("scales"),
        py::arg("count"), "q, scales = int8 quantization of x, one scale per INT8_BLOCK_SIZE");
  m.def("dequantize_int8", &py_dequantize_int8, py::arg("q"), py::arg("scales"),
        py::arg("out"), py::arg("count"), "out = q * scales[i / INT8_BLOCK_SIZE]");
  m.def("onebit_compress", &py_onebit_compress, py::arg("x"), py::arg("error"),
        py::arg("bits"), py::arg("scales"), py::arg("count"), py::arg("block"),
        "bits, scales = 1-bit compression of x + error; error updated in place");
  m.def("onebit_decompress", &py_onebit_decompress, py::arg("bits"), py::arg("scales"),
        py::arg("out"), py::arg("count"), py::arg("block"), "out = +-scales from bits");
  m.def("onebit_serve", &py_onebit_serve, py::arg("bits"), py::arg("scales"),
        py::arg("error"), py::arg("out_bits"), py::arg("out_scales"), py::arg("count"),
        py::arg("block"),
        "onebit_accumulate from zeros then onebit_compress, fused (compressed allreduce's "
        "server step)");
  m.def("onebit_accumulate", &py_onebit_accumulate, py::arg("acc"), py::arg("bits"),
        py::arg("scales"), py::arg("count"), py::arg("block"),
        "acc += decompress(bits[k], scales[k]) for each k, in order");
}
