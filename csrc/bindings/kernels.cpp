// Bindings of the pure kernels (kernels/): reductions, fusion packing, quantization, 1-bit
// compression. Arguments are checked by check.h with the GIL held; every kernel then runs
// with the GIL released. These also check element types: each buffer must be C-contiguous
// and of the named type.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bindings/check.h"
#include "bindings/module.h"
#include "kernels/adam.h"
#include "kernels/onebit.h"
#include "kernels/pack.h"
#include "kernels/quantize.h"
#include "kernels/reduce.h"
#include "kernels/topk.h"

namespace py = pybind11;
using namespace collectives;

namespace {

void py_reduce(const py::buffer& dst, const std::vector<py::buffer>& srcs, int64_t count,
               int dtype_code, int op_code) {
  const DType dtype = check::dtype(dtype_code);
  const ReduceOp op = check::op(op_code);
  if (srcs.empty()) throw py::value_error("srcs: need at least one source buffer");
  if (count < 0) throw py::value_error("count: must be >= 0");
  void* out = check::ptr(dst, "dst", dtype, true, count);
  std::vector<const void*> in;
  in.reserve(srcs.size());
  for (const auto& s : srcs) in.push_back(check::ptr(s, "srcs", dtype, false, count));
  py::gil_scoped_release release;
  reduce_many(out, in.data(), static_cast<int>(in.size()), count, dtype, op);
}

void py_divide(const py::buffer& buf, int64_t count, int dtype_code, int64_t divisor) {
  const DType dtype = check::dtype(dtype_code);
  if (divisor == 0) throw py::value_error("divisor: must be non-zero");
  if (count < 0) throw py::value_error("count: must be >= 0");
  void* ptr = check::ptr(buf, "buf", dtype, true, count);
  py::gil_scoped_release release;
  divide(ptr, count, dtype, divisor);
}

void check_scale(DType dtype, double scale) {
  const bool floating = dtype == DType::f16 || dtype == DType::bf16 || dtype == DType::f32 ||
                        dtype == DType::f64;
  if (!floating && scale != 1.0)
    throw py::value_error(std::string("scale: must be 1 for ") + check::dtype_name(dtype) +
                          " tensors, got " + std::to_string(scale));
}

// A tensor list's element type, and every tensor's address and element count: NumPy
// arrays (any buffer) when torch_dtype is None, else torch CPU tensors of that dtype.
struct TensorList {
  DType dtype;
  std::vector<void*> ptrs;
  std::vector<int64_t> counts;
  int64_t total;  // elements in all
  int size() const { return static_cast<int>(ptrs.size()); }
};

TensorList tensor_list(const py::sequence& tensors, int dtype_code,
                       const py::object& torch_dtype, double scale, bool writable) {
  TensorList list{check::dtype(dtype_code), {}, {}, 0};
  check_scale(list.dtype, scale);
  const size_t n = py::len(tensors);
  list.ptrs.reserve(n);
  list.counts.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    const py::handle t = tensors[k];
    const auto index = static_cast<int64_t>(k);
    const check::View v = torch_dtype.is_none()
                              ? check::view(t, "tensors", list.dtype, writable, index)
                              : check::torch_tensor(t, torch_dtype, index);
    list.ptrs.push_back(v.ptr);
    list.counts.push_back(v.size);
    list.total += v.size;
  }
  return list;
}

int64_t py_pack(const py::buffer& out, const py::sequence& tensors, int dtype_code,
                const py::object& torch_dtype, double scale) {
  const TensorList list = tensor_list(tensors, dtype_code, torch_dtype, scale, false);
  void* dst = check::ptr(out, "out", list.dtype, true, list.total);
  py::gil_scoped_release release;
  pack(dst, list.ptrs.data(), list.counts.data(), list.size(), list.dtype, scale);
  return list.total;
}

void py_unpack(const py::buffer& buffer, const py::sequence& tensors, int dtype_code,
               const py::object& torch_dtype, double scale) {
  const TensorList list = tensor_list(tensors, dtype_code, torch_dtype, scale, true);
  const void* src = check::ptr(buffer, "buffer", list.dtype, false, list.total);
  py::gil_scoped_release release;
  unpack(src, list.ptrs.data(), list.counts.data(), list.size(), list.dtype, scale);
}

// count elements of `in` converted into out by kernel (float32 <-> float16).
template <class From, class To>
void convert(void (*kernel)(const From*, To*, int64_t), const py::buffer& in,
             const char* in_name, DType in_type, const py::buffer& out, DType out_type,
             int64_t count) {
  check::count(count);
  const auto* src = static_cast<const From*>(check::ptr(in, in_name, in_type, false, count));
  auto* dst = static_cast<To*>(check::ptr(out, "out", out_type, true, count));
  py::gil_scoped_release release;
  kernel(src, dst, count);
}

void py_quantize_fp16(const py::buffer& x, const py::buffer& out, int64_t count) {
  convert(quantize_fp16, x, "x", DType::f32, out, DType::f16, count);
}

void py_dequantize_fp16(const py::buffer& h, const py::buffer& out, int64_t count) {
  convert(dequantize_fp16, h, "h", DType::f16, out, DType::f32, count);
}

int64_t int8_blocks(int64_t count) { return (count + kInt8Block - 1) / kInt8Block; }

void py_quantize_int8(const py::buffer& x, const py::buffer& q, const py::buffer& scales,
                      int64_t count) {
  check::count(count);
  const auto* src = static_cast<const float*>(check::ptr(x, "x", DType::f32, false, count));
  auto* qp = static_cast<int8_t*>(check::ptr(q, "q", DType::i8, true, count));
  auto* sp = static_cast<float*>(check::ptr(scales, "scales", DType::f32, true, int8_blocks(count)));
  py::gil_scoped_release release;
  quantize_int8(src, qp, sp, count);
}

void py_dequantize_int8(const py::buffer& q, const py::buffer& scales, const py::buffer& out,
                        int64_t count) {
  check::count(count);
  const auto* qp = static_cast<const int8_t*>(check::ptr(q, "q", DType::i8, false, count));
  const auto* sp =
      static_cast<const float*>(check::ptr(scales, "scales", DType::f32, false, int8_blocks(count)));
  auto* dst = static_cast<float*>(check::ptr(out, "out", DType::f32, true, count));
  py::gil_scoped_release release;
  dequantize_int8(qp, sp, dst, count);
}

int64_t int4_blocks(int64_t count) { return (count + kInt4Block - 1) / kInt4Block; }

void py_quantize_int4(const py::buffer& x, const py::buffer& q, const py::buffer& scales,
                      int64_t count) {
  check::count(count);
  const auto* src = static_cast<const float*>(check::ptr(x, "x", DType::f32, false, count));
  auto* qp = static_cast<uint8_t*>(check::ptr(q, "q", DType::u8, true, (count + 1) / 2));
  auto* sp = static_cast<float*>(check::ptr(scales, "scales", DType::f32, true, int4_blocks(count)));
  py::gil_scoped_release release;
  quantize_int4(src, qp, sp, count);
}

void py_dequantize_int4(const py::buffer& q, const py::buffer& scales, const py::buffer& out,
                        int64_t count) {
  check::count(count);
  const auto* qp = static_cast<const uint8_t*>(check::ptr(q, "q", DType::u8, false, (count + 1) / 2));
  const auto* sp =
      static_cast<const float*>(check::ptr(scales, "scales", DType::f32, false, int4_blocks(count)));
  auto* dst = static_cast<float*>(check::ptr(out, "out", DType::f32, true, count));
  py::gil_scoped_release release;
  dequantize_int4(qp, sp, dst, count);
}

void py_topk_feedback(const py::buffer& x, const py::buffer& residual, const py::buffer& indices,
                      const py::buffer& values, int64_t count, int64_t k) {
  check::count(count);
  if (k < 0 || k > count)
    throw py::value_error("k: expected 0 <= k <= count (" + std::to_string(count) + "), got " +
                          std::to_string(k));
  if (count > INT32_MAX)
    throw py::value_error("count: Top-K indexes with int32, at most 2**31 - 1 elements, got " +
                          std::to_string(count));
  const auto* src = static_cast<const float*>(check::ptr(x, "x", DType::f32, false, count));
  auto* res = static_cast<float*>(check::ptr(residual, "residual", DType::f32, true, count));
  auto* idx = static_cast<int32_t*>(check::ptr(indices, "indices", DType::i32, true, k));
  auto* val = static_cast<float*>(check::ptr(values, "values", DType::f32, true, k));
  py::gil_scoped_release release;
  topk_feedback(src, res, count, k, idx, val);
}

void py_scatter_add(const py::buffer& indices, const py::buffer& values, const py::buffer& out,
                    int64_t k, int64_t count) {
  check::count(k);
  check::count(count);
  const auto* idx = static_cast<const int32_t*>(check::ptr(indices, "indices", DType::i32, false, k));
  const auto* val = static_cast<const float*>(check::ptr(values, "values", DType::f32, false, k));
  auto* dst = static_cast<float*>(check::ptr(out, "out", DType::f32, true, count));
  for (int64_t j = 0; j < k; ++j)
    if (idx[j] < 0 || idx[j] >= count)
      throw py::value_error("indices: expected each in [0, " + std::to_string(count) +
                            "), got " + std::to_string(idx[j]) + " at " + std::to_string(j));
  py::gil_scoped_release release;
  scatter_add(idx, val, k, dst);
}

// Scales needed by count elements in blocks of `block` (block >= 1).
int64_t onebit_blocks(int64_t count, int64_t block) {
  if (block < 1) throw py::value_error("block_size: must be >= 1, got " + std::to_string(block));
  return count / block + (count % block != 0);
}

void py_onebit_compress(const py::buffer& x, const py::buffer& error, const py::buffer& bits,
                        const py::buffer& scales, int64_t count, int64_t block) {
  check::count(count);
  const int64_t nscales = onebit_blocks(count, block);
  const auto* xp = static_cast<const float*>(check::ptr(x, "x", DType::f32, false, count));
  auto* ep = static_cast<float*>(check::ptr(error, "error", DType::f32, true, count));
  auto* bp = static_cast<uint8_t*>(check::ptr(bits, "bits", DType::u8, true, (count + 7) / 8));
  auto* sp = static_cast<float*>(check::ptr(scales, "scales", DType::f32, true, nscales));
  py::gil_scoped_release release;
  onebit_compress(xp, ep, bp, sp, count, block);
}

void py_onebit_decompress(const py::buffer& bits, const py::buffer& scales,
                          const py::buffer& out, int64_t count, int64_t block) {
  check::count(count);
  const int64_t nscales = onebit_blocks(count, block);
  const auto* bp =
      static_cast<const uint8_t*>(check::ptr(bits, "bits", DType::u8, false, (count + 7) / 8));
  const auto* sp =
      static_cast<const float*>(check::ptr(scales, "scales", DType::f32, false, nscales));
  auto* dst = static_cast<float*>(check::ptr(out, "out", DType::f32, true, count));
  py::gil_scoped_release release;
  onebit_decompress(bp, sp, dst, count, block);
}

void py_adam_update(const py::buffer& p, const py::buffer& m, const py::buffer& v,
                    int64_t count, float lr, float c1, float sqrt_c2, float eps, float decay,
                    float bound) {
  check::count(count);
  auto* pp = static_cast<float*>(check::ptr(p, "p", DType::f32, true, count));
  const auto* mp = static_cast<const float*>(check::ptr(m, "m", DType::f32, false, count));
  const auto* vp = static_cast<const float*>(check::ptr(v, "v", DType::f32, false, count));
  if (!(c1 > 0) || !(sqrt_c2 > 0)) throw py::value_error("c1, sqrt_c2: must be > 0");
  if (!(bound >= 0)) throw py::value_error("bound: must be >= 0 (inf: none)");
  py::gil_scoped_release release;
  adam_update(pp, mp, vp, count, lr, c1, sqrt_c2, eps, decay, bound);
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
        check::ptr(bits[k], "bits", DType::u8, false, (count + 7) / 8, i)));
    sp.push_back(
        static_cast<const float*>(check::ptr(scales[k], "scales", DType::f32, false, nscales, i)));
  }
  return {bp, sp};
}

void py_onebit_accumulate(const py::buffer& acc, const py::sequence& bits,
                          const py::sequence& scales, int64_t count, int64_t block) {
  check::count(count);
  const int64_t nscales = onebit_blocks(count, block);
  auto* dst = static_cast<float*>(check::ptr(acc, "acc", DType::f32, true, count));
  const auto [bp, sp] = onebit_sources(bits, scales, count, nscales);
  py::gil_scoped_release release;
  onebit_accumulate(dst, bp.data(), sp.data(), static_cast<int>(bp.size()), count, block);
}

void py_onebit_serve(const py::sequence& bits, const py::sequence& scales,
                     const py::buffer& error, const py::buffer& out_bits,
                     const py::buffer& out_scales, int64_t count, int64_t block) {
  check::count(count);
  const int64_t nscales = onebit_blocks(count, block);
  const auto [bp, sp] = onebit_sources(bits, scales, count, nscales);
  auto* ep = static_cast<float*>(check::ptr(error, "error", DType::f32, true, count));
  auto* ob = static_cast<uint8_t*>(check::ptr(out_bits, "out_bits", DType::u8, true, (count + 7) / 8));
  auto* os = static_cast<float*>(check::ptr(out_scales, "out_scales", DType::f32, true, nscales));
  py::gil_scoped_release release;
  onebit_serve(bp.data(), sp.data(), static_cast<int>(bp.size()), ep, ob, os, count, block);
}

}  // namespace

void bind_kernels(py::module_& m) {
  m.def("reduce", &py_reduce, py::arg("dst"), py::arg("srcs"), py::arg("count"),
        py::arg("dtype"), py::arg("op"),
        "dst = srcs[0] op srcs[1] op ... elementwise over count elements");
  m.def("divide", &py_divide, py::arg("buf"), py::arg("count"), py::arg("dtype"),
        py::arg("divisor"), "buf /= divisor in place (floor division for integers)");

  // fusion packing, quantization, 1-bit compression
  m.attr("INT8_BLOCK_SIZE") = kInt8Block;
  m.attr("INT4_BLOCK_SIZE") = kInt4Block;
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
  m.def("quantize_int4", &py_quantize_int4, py::arg("x"), py::arg("q"), py::arg("scales"),
        py::arg("count"), "q (two values a byte), scales = int4 quantization of x");
  m.def("dequantize_int4", &py_dequantize_int4, py::arg("q"), py::arg("scales"),
        py::arg("out"), py::arg("count"), "out = the values of q * scales[i / INT4_BLOCK_SIZE]");
  m.def("topk_feedback", &py_topk_feedback, py::arg("x"), py::arg("residual"),
        py::arg("indices"), py::arg("values"), py::arg("count"), py::arg("k"),
        "indices, values = the k largest |x + residual|; residual = the rest, in place");
  m.def("scatter_add", &py_scatter_add, py::arg("indices"), py::arg("values"), py::arg("out"),
        py::arg("k"), py::arg("count"), "out[indices[j]] += values[j], in order");
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
  m.def("adam_update", &py_adam_update, py::arg("p"), py::arg("m"), py::arg("v"),
        py::arg("count"), py::arg("lr"), py::arg("c1"), py::arg("sqrt_c2"), py::arg("eps"),
        py::arg("decay"), py::arg("bound"),
        "p = p * decay - lr * clamp((m / c1) / (sqrt(v) / sqrt_c2 + eps), +-bound), in place");
  m.def("onebit_accumulate", &py_onebit_accumulate, py::arg("acc"), py::arg("bits"),
        py::arg("scales"), py::arg("count"), py::arg("block"),
        "acc += decompress(bits[k], scales[k]) for each k, in order");
}
