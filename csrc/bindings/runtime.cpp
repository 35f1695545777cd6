// Bindings of the call path's runtime (runtime/engine.h, runtime/agree.h): the engine with
// its stall record, one communicator's stats, the agreement channel, a call's native
// description, execute() (one collective after the claim: record, agreement, the Python
// move, stats) and FastAllreduce, an allreduce's whole call path (claim + execute) in one
// C++ call. collectives/engine.py is the Python face.
#include <mpi4py/mpi4py.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bindings/check.h"
#include "bindings/module.h"
#include "runtime/agree.h"
#include "runtime/engine.h"
#include "runtime/shm.h"

namespace py = pybind11;
using namespace collectives;

namespace {

// collectives.StallError: a stall timeout, and every call after one.
struct Unusable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The MPI_Comm of an mpi4py communicator, through mpi4py's C API.
MPI_Comm comm_of(py::handle comm) {
  static bool imported = false;
  if (!imported) {
    if (import_mpi4py() < 0) throw py::error_already_set();
    imported = true;
  }
  MPI_Comm* c = PyMPIComm_Get(comm.ptr());
  if (c == nullptr) throw py::error_already_set();
  return *c;
}

// One communicator's counters (engine.h's Stats), shared by the calls that count on it.
struct PyStats {
  Stats stats;
};

// What execute() needs of one described call (collectives/calls.py builds it once per
// distinct call): the digest of its agreed fields, the stall record's text, its counter,
// the Python function that raises MismatchError on every rank, and the one that hands the
// call to joined ranks (collectives/join.py), called with (joined, first_active).
struct Call {
  int64_t id;  // unique in the process (the timeline's key)
  int64_t digest;
  std::string collective, detail, algorithm;
  Counter* counter;
  py::object stats;  // keeps *counter alive
  py::function mismatch;
  py::function on_joined;
};

// One communicator's agreement exchange (agree.h), with what stays fixed bound once: over
// MPI messages, or over a shared window (ShmWindow; None: messages) when every rank of the
// communicator shares memory.
class AgreeChannel {
 public:
  AgreeChannel(py::object comm, int tag, int64_t capacity, double first_wait,
               py::function on_wait, py::object window)
      : comm_obj_(std::move(comm)), comm_(comm_of(comm_obj_)), tag_(tag), capacity_(capacity),
        first_wait_(first_wait), on_wait_(std::move(on_wait)), window_obj_(std::move(window)),
        window_(window_obj_.is_none() ? nullptr : window_obj_.cast<ShmWindow*>()) {
    if (capacity < 0) throw py::value_error("capacity: must be >= 0");
  }

  // The exchange (agree.h). GIL held on entry; released while it waits.
  AgreeResult run(int64_t digest, const void* src, void* dst, int64_t count, DType dtype,
                  ReduceOp op, Role role = Role::active) {
    if (count * dtype_size(dtype) > capacity_)
      throw py::value_error("count: the payload exceeds the channel's capacity");
    const OnWait on_wait = [this](double waited) {
      py::gil_scoped_acquire gil;
      return on_wait_(waited).cast<double>();
    };
    AgreeResult r;
    {
      py::gil_scoped_release release;
      if (window_ != nullptr)
        r = agree_shared(*window_, digest, src, dst, count, dtype, op, capacity_, first_wait_,
                         on_wait, role);
      else
        r = agree_exchange(comm_, tag_, digest, src, dst, count, dtype, op, capacity_,
                           first_wait_, on_wait, role);
    }
    return r;
  }

  int64_t capacity() const { return capacity_; }
  bool shared() const { return window_ != nullptr; }

 private:
  py::object comm_obj_;  // owns comm_
  MPI_Comm comm_;
  int tag_;
  int64_t capacity_;
  double first_wait_;
  py::function on_wait_;
  py::object window_obj_;  // owns window_
  ShmWindow* window_;
};

// One call as the timeline shows it (collectives/timeline.py): which described call
// (an index into the recorded calls' texts), steady-clock seconds of its submission (-1:
// run at once, never queued), start, agreement done, data moved, end, and bytes sent.
struct TraceEvent {
  size_t call;
  double queued, start, agreed, moved, end;
  int64_t bytes;
};

double clock_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The engine (engine.h) holding Python objects in its queue: a pushed item is referenced
// until next() hands it back.
class PyEngine {
 public:
  void push(py::object item) { engine_.push(item.release().ptr()); }

  py::object next() {
    void* item;
    {
      py::gil_scoped_release release;
      item = engine_.next();
    }
    return py::reinterpret_steal<py::object>(static_cast<PyObject*>(item));
  }

  bool try_claim() { return engine_.try_claim(); }
  void release() { engine_.release(); }

  // One collective, after the claim: the stall record, the agreement exchange (reducing a
  // payload of count elements from send into out, divided by divisor: the world size for
  // Average, less the ranks that have joined), the hand-over to joined ranks if any,
  // move() (None: no data phase), and the call's stats. Returns move()'s result.
  py::object execute(AgreeChannel& channel, Call& call, const void* send, void* out,
                     int64_t count, DType dtype, ReduceOp op, int64_t divisor,
                     py::handle move, double queued = -1) {
    return execute_with(channel, call, send, out, count, dtype, op, divisor, queued,
                        !move.is_none(), [&] { return move.is_none() ? py::none() : move(); });
  }

  // execute() with its data phase a C++ callable returning the result (moves: whether there
  // is a data phase, for the timeline).
  template <class Move>
  py::object execute_with(AgreeChannel& channel, Call& call, const void* send, void* out,
                          int64_t count, DType dtype, ReduceOp op, int64_t divisor,
                          double queued, bool moves, Move&& move) {
    check_usable();
    const double start = tracing_ ? clock_s() : 0;
    Record& record = engine_.record();
    record.enter(call.collective, call.detail);
    credit_ = call.counter;
    struct Leave {
      PyEngine* self;
      ~Leave() {
        self->engine_.record().leave();
        self->joined_ = 0;
      }
    } leave{this};
    const auto before = engine_.bytes();
    const AgreeResult r = channel.run(call.digest, send, out, count, dtype, op);
    if (!r.ok) {
      call.mismatch();  // raises MismatchError
      throw std::logic_error("the mismatch callback returned");
    }
    engine_.add_bytes(r.payload_sent, r.payload_sent);
    const double agreed = tracing_ ? clock_s() : 0;
    if (r.joined) {
      joined_ = r.joined;
      call.on_joined(r.joined, r.first_active);  // raises if the call cannot run with them
      if (divisor != 1) divisor -= r.joined;
    }
    if (divisor != 1 && count) {
      py::gil_scoped_release release;
      divide(out, count, dtype, divisor);
    }
    record.run();
    py::object result = move();
    const auto after = engine_.bytes();
    credit_->calls += 1;
    credit_->sent += after.first - before.first;
    credit_->received += after.second - before.second;
    if (tracing_) {
      const double end = clock_s();
      // each described call's texts are copied once per recording, not once per call
      const auto found = traced_calls_.try_emplace(call.id, traced_texts_.size());
      if (found.second) traced_texts_.push_back({call.collective, call.detail, call.algorithm});
      trace_.push_back({found.first->second, queued, start, agreed, moves ? end : agreed, end,
                        after.first - before.first});
    }
    return result;
  }

  // The timeline's recording (collectives/timeline.py): on/off, and the events so far.
  void trace(bool on) { tracing_ = on; }
  bool tracing() const { return tracing_; }
  py::list take_trace() {
    py::list out;
    for (const TraceEvent& e : trace_) {
      const auto& [collective, detail, algorithm] = traced_texts_[e.call];
      out.append(py::make_tuple(collective, detail, algorithm, e.queued, e.start, e.agreed,
                                e.moved, e.end, e.bytes));
    }
    trace_.clear();
    traced_calls_.clear();
    traced_texts_.clear();
    return out;
  }

  // One agreement exchange of a rank inside join() (first: its first one), under the stall
  // record; counted as one `join` call. Returns (ok, joined, first_active, last_joiner).
  py::tuple join_step(AgreeChannel& channel, Call& call, bool first) {
    check_usable();
    Record& record = engine_.record();
    record.enter(call.collective, call.detail);
    struct Leave {
      Record& record;
      ~Leave() { record.leave(); }
    } leave{record};
    const AgreeResult r = channel.run(call.digest, nullptr, nullptr, 0, DType::u8,
                                      ReduceOp::sum, first ? Role::joining : Role::joined);
    engine_.add_bytes(r.payload_sent, r.payload_sent);
    if (first) call.counter->calls += 1;
    return py::make_tuple(r.ok, r.joined, r.first_active, r.last_joiner);
  }

  // Ranks that joined in the running call's agreement (0 outside execute()).
  int joined() const { return joined_; }

  py::object py_execute(AgreeChannel& channel, Call& call, py::handle send, py::handle out,
                        int64_t count, int dtype_code, int op_code, int64_t divisor,
                        py::handle move, double queued) {
    const DType dtype = check::dtype(dtype_code);
    const ReduceOp op = check::op(op_code);
    check::count(count);
    if (divisor < 1) throw py::value_error("divisor: must be >= 1");
    const void* src = check::ptr(send, "send", dtype, false, count);
    void* dst = check::ptr(out, "out", dtype, true, count);
    return execute(channel, call, src, dst, count, dtype, op, divisor, move, queued);
  }

  // The running call's bytes count for (collective, algorithm) on stats instead of the
  // described call's counter: for calls whose algorithm depends on agreed values.
  void credit(PyStats& stats, const std::string& collective, const std::string& algorithm) {
    credit_ = stats.stats.counter(collective, algorithm);
  }

  void add_bytes(int64_t sent, int64_t received) { engine_.add_bytes(sent, received); }
  void fail(const std::string& why) { engine_.fail(why); }
  py::object failed() const {
    return engine_.has_failed() ? py::object(py::str(engine_.failed())) : py::none();
  }

  py::tuple snapshot() const {
    const Record::Snapshot s = engine_.record().snapshot();
    return py::make_tuple(Record::name(s.state), s.calls, s.collective, s.detail, s.age);
  }

 private:
  void check_usable() const {
    if (engine_.has_failed())
      throw Unusable("collectives is unusable after a stall timeout (" + engine_.failed() +
                     "); an MPI collective cannot be cancelled: restart the job");
  }

  Engine engine_;
  Counter* credit_ = nullptr;  // the running call's counter
  int joined_ = 0;             // the running call's joined ranks
  bool tracing_ = false;       // the timeline records calls
  std::vector<TraceEvent> trace_;
  std::unordered_map<int64_t, size_t> traced_calls_;  // Call::id -> index in traced_texts_
  std::vector<std::tuple<std::string, std::string, std::string>> traced_texts_;
};

// An allreduce whose whole call runs in C++, claim to result, with everything derived
// from its arguments bound (collectives/calls.py). Either its data rides in the agreement
// exchange (a small one), or it is shm's pipelined allreduce (collectives/algorithms/
// shm.py) after a header-only exchange on one node: `pipeline` is then (bounds, e,
// nchunks, window), the layout shm.py cuts it into and a function returning the shared
// window it runs on (made or grown collectively, so called after the agreement, where
// shm.py's own path makes it, and again only once that window is freed).
// A settled `auto` allreduce class's watch (collectives/online.py): the calls left before
// the ranks compare notes, and this rank's best seconds per byte since then. Taken and
// recorded in the calls' submission order (on the engine's thread, or by a fast entry that
// claimed the engine), so every rank counts the same calls and comes due in the same one.
class CallWatch {
 public:
  // Count one call; false (nothing counted) once none is left: the call goes to Python.
  bool take() {
    if (left_ == 0) return false;
    --left_;
    return true;
  }
  void record(double seconds_per_byte) { best_ = std::min(best_, seconds_per_byte); }
  void renew(int64_t calls) {
    if (calls < 0) throw py::value_error("calls: must be >= 0");
    left_ = calls;
    best_ = std::numeric_limits<double>::infinity();
  }
  int64_t left() const { return left_; }
  double best() const { return best_; }

 private:
  int64_t left_ = 0;
  double best_ = std::numeric_limits<double>::infinity();
};

class FastAllreduce {
 public:
  FastAllreduce(py::object engine, py::object channel, py::object call, int64_t count,
                int dtype_code, int op_code, int64_t divisor, py::object pipeline)
      : engine_obj_(std::move(engine)), channel_obj_(std::move(channel)),
        call_obj_(std::move(call)), engine_(engine_obj_.cast<PyEngine*>()),
        channel_(channel_obj_.cast<AgreeChannel*>()), call_(call_obj_.cast<Call*>()),
        count_(count), dtype_(check::dtype(dtype_code)), op_(check::op(op_code)),
        divisor_(divisor), nbytes_(count * dtype_size(dtype_)) {
    check::count(count);
    if (divisor < 1) throw py::value_error("divisor: must be >= 1");
    if (pipeline.is_none()) {
      if (nbytes_ > channel_->capacity())
        throw py::value_error("count: the payload exceeds the channel's capacity");
      return;
    }
    std::tie(bounds_, e_, nchunks_, window_fn_) =
        pipeline.cast<std::tuple<std::vector<int64_t>, int64_t, int64_t, py::function>>();
    if (bounds_.size() < 2 || bounds_.front() != 0 || bounds_.back() != count || e_ <= 0 ||
        nchunks_ <= 0)
      throw py::value_error("pipeline: bounds must run from 0 to count, e and nchunks > 0");
  }

  // The reduced array, or None when the engine is busy or x's layout does not fit (the
  // caller then takes the general path). x must have the dtype and element count this
  // object was made for; out is x (in place), an array of x's dtype and shape to write
  // (a pooled one), or None for a new array made here.
  py::object run(const py::array& x, py::object out_obj) {
    const bool inplace = out_obj.is(x);
    if (!(x.flags() & py::array::c_style) || (inplace && !x.writeable())) return py::none();
    if (x.nbytes() != nbytes_) throw py::value_error("x: size differs from the planned call");
    py::array out = out_obj.is_none()
                        ? py::array(x.dtype(), std::vector<py::ssize_t>(x.shape(),
                                                                        x.shape() + x.ndim()))
                        : out_obj.cast<py::array>();
    if (!(out.flags() & py::array::c_style) || !out.writeable() || out.nbytes() != nbytes_)
      throw py::value_error("out: expected a writable C-contiguous array of x's size");
    if (!engine_->try_claim()) return py::none();
    struct Release {
      PyEngine* engine;
      ~Release() { engine->release(); }
    } release{engine_};
    if (watch_ != nullptr && !watch_->take()) return py::none();  // due: Python reviews
    execute(x.data(), out.mutable_data());
    return std::move(out);
  }

  // The same call between raw host addresses (a contiguous CPU torch tensor's data_ptr(),
  // of the dtype and size this object was made for; dst may be src), skipping the NumPy
  // view a tensor would need (~1 us of a 4 KiB call). False when the engine is busy.
  bool run_at(uintptr_t src, uintptr_t dst) {
    if (nbytes_ && (src == 0 || dst == 0)) throw py::value_error("src, dst: null address");
    if (!engine_->try_claim()) return false;
    struct Release {
      PyEngine* engine;
      ~Release() { engine->release(); }
    } release{engine_};
    if (watch_ != nullptr && !watch_->take()) return false;  // due: Python reviews
    execute(reinterpret_cast<const void*>(src), reinterpret_cast<void*>(dst));
    return true;
  }

  // Count and time this entry's calls under w (None: unwatched): its class's watch.
  void watch(py::object w) {
    watch_ = w.is_none() ? nullptr : w.cast<CallWatch*>();
    watch_obj_ = std::move(w);
  }

 private:
  void execute(const void* src, void* dst) {
    if (window_fn_.is_none()) {
      engine_->execute(*channel_, *call_, src, dst, count_, dtype_, op_, divisor_, py::none());
      return;
    }
    engine_->execute_with(*channel_, *call_, nullptr, nullptr, 0, dtype_, op_, 1, -1, true,
                          [&] { return pipelined(src, dst); });
  }

  // shm.py's allreduce of src into dst, counted and averaged as shm.py and
  // algorithms.reduce do it.
  py::object pipelined(const void* src, void* dst) {
    if (window_ == nullptr || window_->closed) {
      window_obj_ = window_fn_();
      window_ = window_obj_.cast<ShmWindow*>();
      const int64_t size = static_cast<int64_t>(window_->segments.size());
      if (static_cast<int64_t>(bounds_.size()) != size + 1 ||
          size * e_ * dtype_size(dtype_) > window_->slot_bytes)
        throw std::logic_error("FastAllreduce: the window does not fit the pipeline");
    }
    const auto start = std::chrono::steady_clock::now();
    {
      py::gil_scoped_release release;
      shm_reduce(*window_, src, dst, bounds_, e_, nchunks_, dtype_, op_, true);
    }
    engine_->add_bytes(nbytes_, nbytes_);
    const int64_t divisor = divisor_ == 1 ? 1 : divisor_ - engine_->joined();
    if (divisor > 1) {
      py::gil_scoped_release release;
      divide(dst, count_, dtype_, divisor);
    }
    if (watch_ != nullptr && engine_->joined() == 0 && nbytes_ > 0) {  // as online.run times
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      watch_->record(took.count() / static_cast<double>(nbytes_));
    }
    return py::none();
  }

  py::object engine_obj_, channel_obj_, call_obj_;  // keep the pointers below alive
  PyEngine* engine_;
  AgreeChannel* channel_;
  Call* call_;
  int64_t count_;
  DType dtype_;
  ReduceOp op_;
  int64_t divisor_, nbytes_;
  // the pipelined case only
  std::vector<int64_t> bounds_;
  int64_t e_ = 0, nchunks_ = 0;
  py::object window_fn_ = py::none();
  py::object window_obj_;  // owns window_
  ShmWindow* window_ = nullptr;
  py::object watch_obj_;  // owns watch_
  CallWatch* watch_ = nullptr;
};

// tree.py's allreduce: the agreement's recursive doubling without the check (the call was
// agreed already), GIL released, its buffers from the result pool; bytes counted on the
// engine.
void tree_allreduce(PyEngine& engine, py::handle comm, int tag, py::handle send,
                    py::handle recv, int64_t count, int dtype_code, int op_code) {
  const DType dtype = check::dtype(dtype_code);
  const ReduceOp op = check::op(op_code);
  check::count(count);
  const void* src = check::ptr(send, "send", dtype, false, count);
  void* dst = check::ptr(recv, "recv", dtype, true, count);
  const MPI_Comm c = comm_of(comm);
  AgreeResult r;
  {
    py::gil_scoped_release release;
    r = agree_exchange(c, tag, 0, src, dst, count, dtype, op, count * dtype_size(dtype),
                       std::numeric_limits<double>::infinity(), [](double) { return 0.0; },
                       Role::active, result_pool());
  }
  engine.add_bytes(r.payload_sent, r.payload_sent);
}

}  // namespace

void bind_runtime(py::module_& m) {
  py::register_exception<Unusable>(m, "StallError", PyExc_RuntimeError);
  py::class_<PyStats>(m, "Stats", "One communicator's calls and bytes per (collective, algorithm)")
      .def(py::init<>())
      .def("snapshot", [](const PyStats& s) {
            py::list out;
            for (const auto& [collective, algorithm, c] : s.stats.snapshot())
              out.append(py::make_tuple(collective, algorithm, c.calls, c.sent, c.received));
            return out;
          }, "[(collective, algorithm, calls, bytes_sent, bytes_received)] of counters in use")
      .def("reset", [](PyStats& s) { s.stats.reset(); }, "Zero every counter");
  py::class_<Call>(m, "Call", "A described call's native part (collectives/calls.py)")
      .def(py::init([](int64_t digest, std::string collective, std::string detail,
                       py::object stats, const std::string& algorithm, py::function mismatch,
                       py::function on_joined) {
             Counter* c = stats.cast<PyStats&>().stats.counter(collective, algorithm);
             static int64_t next_id = 0;
             return Call{next_id++,        digest,           std::move(collective),
                         std::move(detail), algorithm,       c,
                         std::move(stats), std::move(mismatch), std::move(on_joined)};
           }),
           py::arg("digest"), py::arg("collective"), py::arg("detail"), py::arg("stats"),
           py::arg("algorithm"), py::arg("mismatch"), py::arg("on_joined"))
      .def_readonly("digest", &Call::digest);
  py::class_<AgreeChannel>(m, "AgreeChannel",
                           "The agreement exchange of one communicator (agree.h)")
      .def(py::init<py::object, int, int64_t, double, py::function, py::object>(),
           py::arg("comm"), py::arg("tag"), py::arg("capacity"), py::arg("first_wait"),
           py::arg("on_wait"), py::arg("window") = py::none())
      .def_property_readonly("capacity", &AgreeChannel::capacity)
      .def_property_readonly("shared", &AgreeChannel::shared,
                             "Whether the exchange runs over a shared window");
  // Never destroyed: the engine's thread may still wait on it while the interpreter exits.
  py::class_<PyEngine, std::unique_ptr<PyEngine, py::nodelete>>(
      m, "Engine", "Ordering, claim, stall record and byte counts (engine.h)")
      .def(py::init<>())
      .def("push", &PyEngine::push, py::arg("item"), "Queue item behind everything before")
      .def("next", &PyEngine::next,
           "Block (GIL released) until the head item may run; claim, pop and return it")
      .def("try_claim", &PyEngine::try_claim, "Claim for a sync call: False if busy")
      .def("release", &PyEngine::release, "End the claim")
      .def("execute", &PyEngine::py_execute, py::arg("channel"), py::arg("call"),
           py::arg("send"), py::arg("out"), py::arg("count"), py::arg("dtype"), py::arg("op"),
           py::arg("divisor"), py::arg("move"), py::arg("queued") = -1.0,
           "One claimed call: record, agreement (with payload), move(), stats; queued: "
           "when it was submitted (steady clock, s), for the timeline")
      .def_property("tracing", &PyEngine::tracing, &PyEngine::trace,
                    "Whether calls are recorded for the timeline")
      .def("take_trace", &PyEngine::take_trace,
           "[(collective, detail, algorithm, queued, start, agreed, moved, end, bytes)] "
           "recorded since the last take, oldest first")
      .def_static("clock", &clock_s, "The steady clock the timeline uses, in seconds")
      .def("join_step", &PyEngine::join_step, py::arg("channel"), py::arg("call"),
           py::arg("first"), "One agreement exchange of a joined rank: (ok, joined, "
           "first_active, last_joiner)")
      .def_property_readonly("joined", &PyEngine::joined,
                             "Ranks that joined in the running call's agreement")
      .def("credit", &PyEngine::credit, py::arg("stats"), py::arg("collective"),
           py::arg("algorithm"), "Count the running call as (collective, algorithm)")
      .def("add_bytes", &PyEngine::add_bytes, py::arg("sent"), py::arg("received"))
      .def("fail", &PyEngine::fail, py::arg("why"), "Refuse every later call")
      .def_property_readonly("failed", &PyEngine::failed)
      .def("snapshot", &PyEngine::snapshot,
           "The stall record: (state, calls, collective, detail, age in s)");
  py::class_<CallWatch>(m, "CallWatch",
                        "A settled `auto` allreduce class's watch (collectives/online.py)")
      .def(py::init<>())
      .def("take", &CallWatch::take, "Count a call; False (none counted) when none is left")
      .def("record", &CallWatch::record, py::arg("seconds_per_byte"),
           "Keep the best time of a call")
      .def("renew", &CallWatch::renew, py::arg("calls"),
           "calls more calls before the next review; forget the best time")
      .def_property_readonly("left", &CallWatch::left)
      .def_property_readonly("best", &CallWatch::best,
                             "Best seconds per byte since renewed (inf: none)");
  py::class_<FastAllreduce>(m, "FastAllreduce",
                            "An allreduce's C++ call path with its arguments bound")
      .def(py::init<py::object, py::object, py::object, int64_t, int, int, int64_t, py::object>(),
           py::arg("engine"), py::arg("channel"), py::arg("call"), py::arg("count"),
           py::arg("dtype"), py::arg("op"), py::arg("divisor"), py::arg("pipeline") = py::none())
      .def("__call__", &FastAllreduce::run, py::arg("x"), py::arg("out"),
           "The reduced array in out (x: in place; None: a new one), or None if the fast "
           "entry does not apply")
      .def("at", &FastAllreduce::run_at, py::arg("src"), py::arg("dst"),
           "The call between raw host addresses of the planned dtype and size (dst may be "
           "src); False if the engine is busy")
      .def("watch", &FastAllreduce::watch, py::arg("watch"),
           "Count and time the calls under a CallWatch (None: unwatched); a call coming "
           "due is not taken");
  m.def("tree_allreduce", &tree_allreduce, py::arg("engine"), py::arg("comm"), py::arg("tag"),
        py::arg("send"), py::arg("recv"), py::arg("count"), py::arg("dtype"), py::arg("op"),
        "Recursive-doubling allreduce of send into recv (GIL released)");
}
