// Bindings of the shared-memory stages (runtime/shm.h) of collectives/algorithms/shm.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <vector>

#include "bindings/check.h"
#include "bindings/module.h"
#include "runtime/shm.h"
#include "runtime/shm_sync.h"

namespace py = pybind11;
using namespace collectives;

namespace {

// Each kind of call's calls with plain and with streaming stores, and its trials, by the
// kind's fields (StoreChoice::fields).
py::dict store_counts(const StoreChoice& s) {
  py::dict out;
  for (const auto& [key, k] : s.kinds)
    out[py::cast(StoreChoice::fields(key))] = py::make_tuple(k.ran[0], k.ran[1], k.trials);
  return out;
}


ShmWindow make_shm_window(const std::vector<uintptr_t>& segments, int rank,
                          int64_t header_bytes, int64_t stride, int64_t slot_bytes,
                          int64_t depth, double spin_seconds, double stall_seconds,
                          const std::vector<int64_t>& pids,
                          std::shared_ptr<const StallLimit> limit) {
  if (rank < 0 || rank >= static_cast<int>(segments.size()))
    throw py::value_error("rank: out of range");
  if (!pids.empty() && pids.size() != segments.size())
    throw py::value_error("pids: one per segment, or none");
  if (depth <= 0 || slot_bytes <= 0 || header_bytes < 4 * stride * 8 || stride <= 0)
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
  w.limit = std::move(limit);
  for (int64_t pid : pids) w.pids.push_back(static_cast<pid_t>(pid));
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

void py_shm_reduce(ShmWindow& w, const py::buffer& send,
                   const py::buffer& recv, const std::vector<int64_t>& bounds, int64_t e,
                   int64_t nchunks, int dtype_code, int op_code, bool allreduce,
                   int64_t divisor) {
  const DType dtype = check::dtype(dtype_code);
  const ReduceOp op = check::op(op_code);
  if (divisor < 1) throw py::value_error("divisor: must be >= 1");
  const int64_t size = static_cast<int64_t>(w.segments.size());
  check_pieces(w, bounds, e, nchunks, size * e * dtype_size(dtype));
  const void* in = check::ptr(send, "send", dtype, false, bounds.back());
  void* out = check::ptr(recv, "recv", dtype, true,
                         allreduce ? bounds.back() : bounds[w.rank + 1] - bounds[w.rank]);
  py::gil_scoped_release release;
  shm_reduce(w, in, out, bounds, e, nchunks, dtype, op, allreduce, divisor);
}

void py_shm_reduce_single(ShmWindow& w, const py::buffer& send,
                          const py::buffer& recv, int64_t count, int64_t lo, int64_t hi,
                          int dtype_code, int op_code) {
  const DType dtype = check::dtype(dtype_code);
  const ReduceOp op = check::op(op_code);
  check::count(count);
  if (lo < 0 || hi < lo || hi > count) throw py::value_error("lo, hi: not a slice of count");
  if (count * dtype_size(dtype) > w.slot_bytes)
    throw py::value_error("count: the input does not fit a slot");
  const void* in = check::ptr(send, "send", dtype, false, count);
  void* out = check::ptr(recv, "recv", dtype, true, hi - lo);
  py::gil_scoped_release release;
  shm_reduce_single(w, in, out, count, lo, hi, dtype, op);
}

void py_shm_allgather_single(ShmWindow& w, const py::buffer& send,
                             const py::buffer& recv, const std::vector<int64_t>& bounds,
                             int64_t item) {
  if (item <= 0) throw py::value_error("item: must be > 0");
  if (bounds.size() != w.segments.size() + 1) throw py::value_error("bounds: need size + 1");
  for (size_t j = 0; j + 1 < bounds.size(); ++j) {
    if (bounds[j] < 0 || bounds[j + 1] < bounds[j])
      throw py::value_error("bounds: must start at 0 or more and not decrease");
    if ((bounds[j + 1] - bounds[j]) * item > w.slot_bytes)
      throw py::value_error("bounds: a block does not fit a slot");
  }
  const void* in =
      check::ptr(send, "send", std::nullopt, false, (bounds[w.rank + 1] - bounds[w.rank]) * item);
  void* out = check::ptr(recv, "recv", std::nullopt, true, bounds.back() * item);
  py::gil_scoped_release release;
  shm_allgather_single(w, in, out, bounds, item);
}

void py_shm_allgather(ShmWindow& w, const py::buffer& send,
                      const py::buffer& recv, const std::vector<int64_t>& bounds, int64_t e,
                      int64_t nchunks, int64_t item) {
  if (item <= 0) throw py::value_error("item: must be > 0");
  check_pieces(w, bounds, e, nchunks, e * item);
  const void* in =
      check::ptr(send, "send", std::nullopt, false, (bounds[w.rank + 1] - bounds[w.rank]) * item);
  void* out = check::ptr(recv, "recv", std::nullopt, true, bounds.back() * item);
  py::gil_scoped_release release;
  shm_allgather(w, in, out, bounds, e, nchunks, item);
}

void py_shm_broadcast(ShmWindow& w, const py::buffer& buf, int64_t nbytes,
                      int64_t e, int64_t nchunks, int root) {
  if (root < 0 || root >= static_cast<int>(w.segments.size()))
    throw py::value_error("root: out of range");
  if (e <= 0 || e > w.slot_bytes || nbytes < 0) throw py::value_error("e, nbytes: bad");
  if (nchunks < 0 || nchunks * e < nbytes) throw py::value_error("nchunks: too few for nbytes");
  void* data = check::ptr(buf, "buf", std::nullopt, w.rank != root, nbytes);
  py::gil_scoped_release release;
  shm_broadcast(w, data, nbytes, e, nchunks, root);
}

}  // namespace

void bind_shm(py::module_& m) {
  py::register_exception<PeerFailure>(m, "PeerFailure", PyExc_RuntimeError);
  m.def("process_alive", [](int64_t pid) { return process_alive(static_cast<pid_t>(pid)); },
        py::arg("pid"), "Whether process pid runs (not gone, not a zombie)");
  py::class_<StoreChoice>(m, "StoreChoice",
                          "Tests only: a window's choice of stores into its staging buffers, "
                          "on its own (shm.h)")
      .def(py::init<>())
      .def_static("key", &StoreChoice::key, py::arg("bytes"), py::arg("allreduce"),
                  py::arg("inplace"), py::arg("average"), "The kind of a call")
      .def("pick", &StoreChoice::pick, py::arg("key"), py::arg("nchunks"),
           "Whether the next call of this kind and nchunks chunks streams (counts it)")
      .def(
          "record",
          [](StoreChoice& s, int64_t key, bool stream, double seconds, int64_t bytes) {
            if (s.kinds.find(key) == s.kinds.end())
              throw py::value_error("key: no call of this kind was picked");
            s.record(key, stream, seconds, bytes);
          },
          py::arg("key"), py::arg("stream"), py::arg("seconds"), py::arg("bytes"),
          "The picked call's time")
      .def("counts", &store_counts,
           "{(smallest bytes, allreduce, in place, Average): (plain calls, streaming calls, "
           "trials)} of the calls picked so far");
  py::class_<StallLimit, std::shared_ptr<StallLimit>>(
      m, "StallLimit",
      "A communicator's stall limit, read by its windows' waits as each starts (shm.h)")
      .def(py::init<>())
      .def_property(
          "seconds", [](const StallLimit& l) { return l.seconds.load(); },
          [](StallLimit& l, double seconds) {
            if (!(seconds >= 0)) throw py::value_error("seconds: expected >= 0 (inf: never)");
            l.seconds.store(seconds);
          },
          "Seconds a wait may last (inf: forever)");
  py::class_<ShmWindow>(m, "ShmWindow", "A shared window's layout, seen from one rank (shm.h)")
      .def(py::init(&make_shm_window), py::arg("segments"), py::arg("rank"),
           py::arg("header_bytes"), py::arg("stride"), py::arg("slot_bytes"), py::arg("depth"),
           py::arg("spin_seconds"), py::arg("stall_seconds"), py::arg("pids"),
           py::arg("limit") = nullptr)
      .def(
          "mark_failed", [](const ShmWindow& w) { Sync::mark_failed(w); },
          "Tell the window's ranks that this one met a failure: their waits for it raise "
          "PeerFailure")
      .def(
          "set_jitter",
          [](ShmWindow& w, double seconds) {
            if (!(seconds >= 0)) throw py::value_error("seconds: must be >= 0");
            w.jitter_seconds = seconds;
          },
          py::arg("seconds"),
          "Tests only: sleep up to seconds before a fifth of this window's counter posts")
      .def(
          "set_stores",
          [](ShmWindow& w, int mode) {
            if (mode < -1 || mode > 1) throw py::value_error("mode: expected -1, 0 or 1");
            w.stores.forced = mode;
          },
          py::arg("mode"),
          "Tests, and a frozen run (Config.frozen): the stores of this window's pipelined "
          "reductions, 0 plain, 1 streaming, -1 chosen by measurement (StoreChoice, shm.h)")
      .def(
          "stores", [](const ShmWindow& w) { return store_counts(w.stores); },
          "{(smallest bytes, allreduce, in place, Average): (plain calls, streaming calls, "
          "trials)} of this window's large reductions (StoreChoice, shm.h)")
      .def_readwrite("seq", &ShmWindow::seq,
                     "Chunks begun on the window (the same on every rank); tests move it to "
                     "provoke a stall")
      .def(
          "close", [](ShmWindow& w) { w.closed = true; },
          "Mark the window's memory freed: every later stage on it raises");
  m.def("shm_reduce", &py_shm_reduce, py::arg("window"), py::arg("send"),
        py::arg("recv"), py::arg("bounds"), py::arg("e"), py::arg("nchunks"), py::arg("dtype"),
        py::arg("op"), py::arg("allreduce"), py::arg("divisor") = 1,
        "shm.py's pipelined allreduce / reducescatter stages, an Average's division folded "
        "into the reduce stage where divisor > 1 (GIL released)");
  m.def("shm_reduce_single", &py_shm_reduce_single, py::arg("window"),
        py::arg("send"), py::arg("recv"), py::arg("count"), py::arg("lo"), py::arg("hi"),
        py::arg("dtype"), py::arg("op"),
        "shm.py's single-step reduction: elements [lo, hi) of the reduction (GIL released)");
  m.def("shm_allgather_single", &py_shm_allgather_single, py::arg("window"),
        py::arg("send"), py::arg("recv"), py::arg("bounds"), py::arg("item"),
        "shm.py's single-step allgather (GIL released)");
  m.def("shm_allgather", &py_shm_allgather, py::arg("window"), py::arg("send"),
        py::arg("recv"), py::arg("bounds"), py::arg("e"), py::arg("nchunks"), py::arg("item"),
        "shm.py's pipelined allgather stages (GIL released)");
  m.def("shm_broadcast", &py_shm_broadcast, py::arg("window"), py::arg("buf"),
        py::arg("nbytes"), py::arg("e"), py::arg("nchunks"), py::arg("root"),
        "shm.py's pipelined broadcast stages (GIL released)");
}
