// Bindings of the call path's runtime (runtime/engine.h, agree.h, call.h, fast_allreduce.h,
// call_watch.h): the engine, one communicator's stats and agreement channel, a call's
// native description, execute() and join_step(), FastAllreduce, CallWatch and tree's
// allreduce. Only conversion lives here: arguments are checked (check.h) with the GIL held,
// each call then runs in runtime/ with the GIL released, and Python callables become
// callbacks that take the GIL back. collectives/runtime/engine.py is the Python face.
#include <mpi4py/mpi4py.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings/check.h"
#include "bindings/module.h"
#include "runtime/agree.h"
#include "runtime/call.h"
#include "runtime/call_watch.h"
#include "runtime/engine.h"
#include "runtime/fast_allreduce.h"
#include "runtime/shm.h"

namespace py = pybind11;
using namespace collectives;

namespace {

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

// A payload's buffers, checked: count elements of the dtype from send into out.
Payload payload(py::handle send, py::handle out, const char* out_name, int64_t count,
                int dtype_code, int op_code) {
  const DType dtype = check::dtype(dtype_code);
  const ReduceOp op = check::op(op_code);
  check::count(count);
  const void* src = check::ptr(send, "send", dtype, false, count);
  void* dst = check::ptr(out, out_name, dtype, true, count);
  return {src, dst, count, dtype, op};
}

// A described call (call.h's CallInfo) whose callbacks are the Python functions that raise
// MismatchError on every rank and hand the call to joined ranks (collectives/api/join.py).
struct Call {
  CallInfo info;
  py::object stats;  // keeps *info.counter alive
};

Call make_call(int64_t digest, std::string collective, std::string detail, py::object stats,
               const std::string& algorithm, py::function mismatch, py::function on_joined) {
  static int64_t next_id = 0;
  Stats& on = stats.cast<Stats&>();
  Counter* counter = on.counter(collective, algorithm);
  CallInfo info{next_id++, digest, {std::move(collective), std::move(detail), algorithm},
                counter, &on, nullptr, nullptr};
  info.mismatch = [mismatch = std::move(mismatch)] {
    py::gil_scoped_acquire gil;
    mismatch();
  };
  info.on_joined = [on_joined = std::move(on_joined)](int joined, int first_active) {
    py::gil_scoped_acquire gil;
    on_joined(joined, first_active);
  };
  return Call{std::move(info), std::move(stats)};
}

// One communicator's agreement channel (agree.h), owning the Python objects it points into.
struct PyChannel {
  PyChannel(py::object comm, int tag, int64_t capacity, double first_wait,
            py::function on_wait, py::object window)
      : comm_obj(std::move(comm)), window_obj(std::move(window)) {
    const MPI_Comm c = comm_of(comm_obj);
    ShmWindow* w = window_obj.is_none() ? nullptr : window_obj.cast<ShmWindow*>();
    if (capacity < 0) throw py::value_error("capacity: must be >= 0");
    OnWait wait = [on_wait = std::move(on_wait)](double waited) {
      py::gil_scoped_acquire gil;
      return on_wait(waited).cast<double>();
    };
    channel = AgreeChannel{c, tag, capacity, first_wait, std::move(wait), w};
  }

  py::object comm_obj, window_obj;
  AgreeChannel channel;
};

// The engine (engine.h) holding Python objects in its queue: a pushed item is referenced
// until next() hands it back.
struct PyEngine {
  void push(py::object item) { engine.push(item.release().ptr()); }

  py::object next() {
    void* item;
    {
      py::gil_scoped_release release;
      item = engine.next();
    }
    return py::reinterpret_steal<py::object>(static_cast<PyObject*>(item));
  }

  py::object execute(PyChannel& channel, Call& call, py::handle send, py::handle out,
                     int64_t count, int dtype_code, int op_code, int64_t divisor,
                     py::handle move, double queued) {
    const Payload p = payload(send, out, "out", count, dtype_code, op_code);
    check::divisor(divisor);
    py::object result = py::none();
    std::function<void()> data_phase;
    if (!move.is_none())
      data_phase = [&] {
        py::gil_scoped_acquire gil;
        result = move();
      };
    {
      py::gil_scoped_release release;
      collectives::execute(engine, channel.channel, call.info, p, divisor, queued, data_phase);
    }
    return result;
  }

  py::tuple join_step(PyChannel& channel, Call& call, bool first) {
    AgreeResult r;
    {
      py::gil_scoped_release release;
      r = collectives::join_step(engine, channel.channel, call.info, first);
    }
    return py::make_tuple(r.ok, r.joined, r.first_active, r.last_joiner);
  }

  void contribute(int joined, py::handle move) {
    collectives::contribute(engine, joined, [&] { move(); });
  }

  py::list take_trace() {
    engine.timeline().set_on(false);
    const Timeline::Taken taken = engine.timeline().take();
    py::list out;
    for (const Timeline::Event& e : taken.events) {
      const CallTexts& t = taken.texts[e.call];
      out.append(py::make_tuple(t.collective, t.detail,
                                e.algorithm.empty() ? t.algorithm : e.algorithm, e.queued, e.start,
                                e.agreed, e.moved, e.end, e.bytes, e.last, e.waited));
    }
    return out;
  }

  py::list history() const {
    py::list out;
    for (const Record::Flight& f : engine.record().history())
      out.append(py::make_tuple(f.seq, f.comm, f.comm_seq, f.collective, f.detail, f.algorithm, f.queued, f.start,
                                f.agreed_at, f.end, f.bytes, f.last, f.waited,
                                Record::name(f.phase)));
    return out;
  }

  py::object failed() const {
    return engine.has_failed() ? py::object(py::str(engine.failed())) : py::none();
  }

  py::tuple snapshot() const {
    const Record::Snapshot s = engine.record().snapshot();
    return py::make_tuple(Record::name(s.state), s.calls, s.collective, s.detail, s.age);
  }

  Engine engine;
};

// FastAllreduce (fast_allreduce.h) over NumPy arrays or raw addresses, owning the Python
// objects it points into: the engine, channel and call, the pipeline's window function and
// the window it last returned, and the watch.
class PyFastAllreduce {
 public:
  PyFastAllreduce(py::object engine, py::object channel, py::object call, int64_t count,
                  int dtype_code, int op_code, int64_t divisor, py::object pipeline)
      : engine_obj_(std::move(engine)), channel_obj_(std::move(channel)),
        call_obj_(std::move(call)) {
    Engine& e = engine_obj_.cast<PyEngine*>()->engine;
    const AgreeChannel& ch = channel_obj_.cast<PyChannel*>()->channel;
    const CallInfo& c = call_obj_.cast<Call*>()->info;
    const DType dtype = check::dtype(dtype_code);
    const ReduceOp op = check::op(op_code);
    check::count(count);
    check::divisor(divisor);
    std::optional<FastAllreduce::Pipeline> p;
    if (!pipeline.is_none()) {
      p.emplace();
      std::tie(p->bounds, p->e, p->nchunks, window_fn_) =
          pipeline.cast<std::tuple<std::vector<int64_t>, int64_t, int64_t, py::function>>();
      p->window = [this] {
        py::gil_scoped_acquire gil;
        window_obj_ = window_fn_();
        return window_obj_.cast<ShmWindow*>();
      };
    }
    fast_.emplace(e, ch, c, count, dtype, op, divisor, std::move(p));
  }
  PyFastAllreduce(const PyFastAllreduce&) = delete;  // fast_'s window function holds this
  PyFastAllreduce& operator=(const PyFastAllreduce&) = delete;

  // The reduced array, or None when the fast entry does not apply. out is x (in place), an
  // array of x's dtype and shape to write (a pooled one), or None for a new array.
  py::object run(const py::array& x, py::object out_obj) {
    const bool inplace = out_obj.is(x);
    if (!(x.flags() & py::array::c_style) || (inplace && !x.writeable())) return py::none();
    if (x.nbytes() != fast_->nbytes())
      throw py::value_error("x: size differs from the planned call");
    py::array out = out_obj.is_none()
                        ? py::array(x.dtype(), std::vector<py::ssize_t>(x.shape(),
                                                                        x.shape() + x.ndim()))
                        : out_obj.cast<py::array>();
    if (!(out.flags() & py::array::c_style) || !out.writeable() ||
        out.nbytes() != fast_->nbytes())
      throw py::value_error("out: expected a writable C-contiguous array of x's size");
    const void* src = x.data();
    void* dst = out.mutable_data();
    bool ran;
    {
      py::gil_scoped_release release;
      ran = fast_->run(src, dst);
    }
    if (!ran) return py::none();
    return std::move(out);
  }

  // Between raw host addresses (a CPU torch tensor's data_ptr()), skipping the NumPy view a
  // tensor would need (an object per call, a visible share of a small call's time).
  bool run_at(uintptr_t src, uintptr_t dst) {
    if (fast_->nbytes() && (src == 0 || dst == 0))
      throw py::value_error("src, dst: null address");
    py::gil_scoped_release release;
    return fast_->run(reinterpret_cast<const void*>(src), reinterpret_cast<void*>(dst));
  }

  void watch(py::object w) {
    fast_->watch(w.is_none() ? nullptr : w.cast<CallWatch*>());
    watch_obj_ = std::move(w);
  }

 private:
  py::object engine_obj_, channel_obj_, call_obj_;
  py::function window_fn_;
  py::object window_obj_;  // the window fast_ runs on
  py::object watch_obj_;
  std::optional<FastAllreduce> fast_;
};

void py_tree_allreduce(PyEngine& engine, py::handle comm, int tag, py::handle send,
                       py::handle recv, int64_t count, int dtype_code, int op_code) {
  const Payload p = payload(send, recv, "recv", count, dtype_code, op_code);
  const MPI_Comm c = comm_of(comm);
  py::gil_scoped_release release;
  tree_allreduce(engine.engine, c, tag, p.send, p.out, p.count, p.dtype, p.op, result_pool());
}

void bind_engine(py::module_& m) {
  // Never destroyed: the engine's thread may still wait on it while the interpreter exits.
  py::class_<PyEngine, std::unique_ptr<PyEngine, py::nodelete>>(
      m, "Engine", "Ordering, claim, stall record and byte counts (engine.h)")
      .def(py::init<>())
      .def("push", &PyEngine::push, py::arg("item"), "Queue item behind everything before")
      .def("next", &PyEngine::next,
           "Block (GIL released) until the head item may run; claim, pop and return it")
      .def("try_claim", [](PyEngine& s) { return s.engine.try_claim(); },
           "Claim for a sync call: False if busy")
      .def("release", [](PyEngine& s) { s.engine.release(); }, "End the claim")
      .def("execute", &PyEngine::execute, py::arg("channel"), py::arg("call"),
           py::arg("send"), py::arg("out"), py::arg("count"), py::arg("dtype"), py::arg("op"),
           py::arg("divisor"), py::arg("move"), py::arg("queued") = -1.0,
           "One claimed call: record, agreement (with payload), move(), stats; queued: "
           "when it was submitted (steady clock, s), for the timeline")
      .def_property_readonly("tracing", [](PyEngine& s) { return s.engine.timeline().on(); },
                             "Whether calls are recorded for the timeline")
      .def(
          "start_trace",
          [](PyEngine& s) {
            s.engine.timeline().set_on(true);
            return steady_seconds();
          },
          "Record every call from now on for the timeline; returns the steady clock's reading "
          "(s) at the start, the trace's origin")
      .def("take_trace", &PyEngine::take_trace,
           "Stop recording; [(collective, detail, algorithm, queued, start, agreed, moved, end, "
           "bytes, last, waited)] recorded since the start, oldest first")
      .def_static("clock", &steady_seconds, "The steady clock the timeline uses, in seconds")
      .def("set_origin", [](PyEngine& s, double steady) { s.engine.set_origin(steady); },
           py::arg("steady"),
           "Make the steady clock's reading `steady` the job clock's zero on this rank "
           "(every rank's at one moment: the agreement compares arrivals on it)")
      .def_property(
          "flight_capacity", [](const PyEngine& s) { return s.engine.record().capacity(); },
          [](PyEngine& s, int64_t calls) { s.engine.record().set_capacity(calls); },
          "Calls the flight recorder keeps (setting it forgets those kept)")
      .def("history", &PyEngine::history,
           "The flight recorder: [(seq, comm, comm_seq, collective, detail, algorithm, queued, start, agreed, "
           "end, bytes, last, waited, phase)], oldest first; times on the steady clock (s), "
           "0 where not reached, queued -1 where never queued")
      .def("join_step", &PyEngine::join_step, py::arg("channel"), py::arg("call"),
           py::arg("first"), "One agreement exchange of a joined rank: (ok, joined, "
           "first_active, last_joiner)")
      .def_property_readonly(
          "joined", [](PyEngine& s) { return s.engine.running().joined; },
          "Ranks inside join() that took part in the running call (0 outside a call): set by "
          "its agreement, or by contribute() on a joined rank")
      .def("contribute", &PyEngine::contribute, py::arg("joined"), py::arg("move"),
           "A joined rank's part of the others' call (collectives/api/join.py): move() with "
           "the running call's joined count set to joined, so that the part it reduces of an "
           "Average is divided by the ranks that contributed")
      .def(
          "divide_average",
          [](PyEngine& s, py::handle buf, int dtype_code, int64_t divisor) {
            const DType dtype = check::dtype(dtype_code);
            check::divisor(divisor);
            const check::View v = check::view(buf, "buf", dtype, true);
            const int joined = s.engine.running().joined;
            py::gil_scoped_release release;
            divide_average(v.ptr, v.size, dtype, divisor, joined);
          },
          py::arg("buf"), py::arg("dtype"), py::arg("divisor"),
          "Finish an Average that moved as a Sum, in place: buf divided by divisor (the "
          "world size) less the running call's joined ranks, the one rule every Average "
          "uses; nothing when that leaves 1")
      .def("credit",
           [](PyEngine& s, Stats& stats, const std::string& collective,
              const std::string& algorithm) {
             Engine::Running& running = s.engine.running();
             running.credit = stats.counter(collective, algorithm, &running.algorithm);
           },
           py::arg("stats"), py::arg("collective"), py::arg("algorithm"),
           "Count the running call as (collective, algorithm); the timeline shows algorithm")
      .def("add_bytes",
           [](PyEngine& s, int64_t sent, int64_t received) {
             s.engine.add_bytes(sent, received);
           },
           py::arg("sent"), py::arg("received"))
      .def("fail", [](PyEngine& s, const std::string& why) { s.engine.fail(why); },
           py::arg("why"), "Refuse every later call")
      .def_property_readonly("failed", &PyEngine::failed)
      .def("snapshot", &PyEngine::snapshot,
           "The stall record: (state, calls, collective, detail, age in s)");
}

void bind_fast_allreduce(py::module_& m) {
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
  py::class_<PyFastAllreduce>(m, "FastAllreduce",
                              "An allreduce's C++ call path with its arguments bound")
      .def(py::init<py::object, py::object, py::object, int64_t, int, int, int64_t, py::object>(),
           py::arg("engine"), py::arg("channel"), py::arg("call"), py::arg("count"),
           py::arg("dtype"), py::arg("op"), py::arg("divisor"), py::arg("pipeline") = py::none())
      .def("__call__", &PyFastAllreduce::run, py::arg("x"), py::arg("out"),
           "The reduced array in out (x: in place; None: a new one), or None if the fast "
           "entry does not apply")
      .def("at", &PyFastAllreduce::run_at, py::arg("src"), py::arg("dst"),
           "The call between raw host addresses of the planned dtype and size (dst may be "
           "src); False if the engine is busy")
      .def("watch", &PyFastAllreduce::watch, py::arg("watch"),
           "Count and time the calls under a CallWatch (None: unwatched); a call coming "
           "due is not taken");
}

}  // namespace

void bind_runtime(py::module_& m) {
  py::register_exception<Unusable>(m, "StallError", PyExc_RuntimeError);
  py::class_<Stats>(m, "Stats", "One communicator's calls and bytes per (collective, algorithm)")
      .def(py::init<std::string>(), py::arg("label") = "")
      .def("snapshot", [](const Stats& s) {
            py::list out;
            for (const auto& [collective, algorithm, c] : s.snapshot())
              out.append(py::make_tuple(collective, algorithm, c.calls, c.sent, c.received));
            return out;
          }, "[(collective, algorithm, calls, bytes_sent, bytes_received)] of counters in use")
      .def_property_readonly("label", &Stats::label, "The same on every member, telling "
                             "communicators apart (the flight recorder's name of it)")
      .def("waits", &Stats::waits,
           "Seconds the other ranks waited for each rank (by rank of the communicator)");
  py::class_<Call>(m, "Call", "A described call's native part (collectives/calls.py)")
      .def(py::init(&make_call), py::arg("digest"), py::arg("collective"), py::arg("detail"),
           py::arg("stats"), py::arg("algorithm"), py::arg("mismatch"), py::arg("on_joined"))
      .def_property_readonly("digest", [](const Call& c) { return c.info.digest; });
  py::class_<PyChannel>(m, "AgreeChannel",
                        "The agreement exchange of one communicator (agree.h)")
      .def(py::init<py::object, int, int64_t, double, py::function, py::object>(),
           py::arg("comm"), py::arg("tag"), py::arg("capacity"), py::arg("first_wait"),
           py::arg("on_wait"), py::arg("window") = py::none())
      .def_property_readonly("capacity", [](const PyChannel& c) { return c.channel.capacity; })
      .def_property(
          "first_wait", [](const PyChannel& c) { return c.channel.first_wait; },
          [](PyChannel& c, double seconds) { c.channel.first_wait = seconds; },
          "Seconds of waiting before on_wait is first called (a call in progress keeps its "
          "own)")
      .def_property_readonly("shared",
                             [](const PyChannel& c) { return c.channel.window != nullptr; },
                             "Whether the exchange runs over a shared window");
  bind_engine(m);
  bind_fast_allreduce(m);
  m.def("tree_allreduce", &py_tree_allreduce, py::arg("engine"), py::arg("comm"),
        py::arg("tag"), py::arg("send"), py::arg("recv"), py::arg("count"), py::arg("dtype"),
        py::arg("op"), "Recursive-doubling allreduce of send into recv (GIL released)");
}
