// Bindings of the agreement exchange (agree.h): AgreeChannel, one communicator's exchange,
// and SmallAllreduce, the whole of a small allreduce's fast entry in one call.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <time.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "agree.h"
#include "bindings.h"

namespace py = pybind11;
using namespace collectives;
using collectives::bindings::to_dtype;
using collectives::bindings::to_op;

namespace {

// A C-contiguous NumPy array holding at least `count` elements of `dtype`.
void* array_ptr(const py::array& a, const char* name, int64_t count, DType dtype,
                bool writable) {
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(std::string(name) + ": array must be C-contiguous");
  if (writable && !a.writeable()) throw py::value_error(std::string(name) + ": read-only");
  if (a.nbytes() < count * dtype_size(dtype))
    throw py::value_error(std::string(name) + ": holds " + std::to_string(a.nbytes()) +
                          " bytes, need " + std::to_string(count * dtype_size(dtype)));
  return const_cast<void*>(a.data());
}

// One communicator's agreement exchange, with what stays fixed across calls bound once.
class AgreeChannel {
 public:
  AgreeChannel(uintptr_t comm_handle, int tag, int64_t capacity, double first_wait,
               py::function on_wait)
      : tag_(tag), capacity_(capacity), first_wait_(first_wait), on_wait_(std::move(on_wait)) {
    static_assert(sizeof(MPI_Comm) <= sizeof(uintptr_t), "MPI_Comm wider than a pointer");
    std::memcpy(&comm_, &comm_handle, sizeof(comm_));  // mpi4py's MPI._handleof(comm)
    if (capacity < 0) throw py::value_error("capacity: must be >= 0");
  }

  // NumPy arrays only (read without a buffer request: this is on every call's path).
  // Returns -1 if the ranks disagree, else the payload bytes sent (= received: when every
  // rank agrees, every message carries the same payload size).
  int64_t exchange(int64_t digest, const py::array& send, py::array& out, int64_t count,
                   int dtype_code, int op_code, int64_t divisor) {
    const DType dtype = to_dtype(dtype_code);
    const ReduceOp op = to_op(op_code);
    if (count < 0) throw py::value_error("count: must be >= 0");
    if (divisor == 0) throw py::value_error("divisor: must be non-zero");
    return run(digest, array_ptr(send, "send", count, dtype, false),
               array_ptr(out, "out", count, dtype, true), count, dtype, op, divisor);
  }

  // exchange() on checked pointers; called with the GIL held, releases it.
  int64_t run(int64_t digest, const void* src, void* dst, int64_t count, DType dtype,
              ReduceOp op, int64_t divisor) {
    const OnWait on_wait = [this](double waited) {
      py::gil_scoped_acquire gil;
      return on_wait_(waited).cast<double>();
    };
    AgreeResult r;
    {
      py::gil_scoped_release release;
      r = agree_exchange(comm_, tag_, digest, src, dst, count, dtype, op, divisor, capacity_,
                         first_wait_, on_wait);
    }
    return r.ok ? r.payload_sent : -1;
  }

  int64_t capacity() const { return capacity_; }

 private:
  MPI_Comm comm_;
  int tag_;
  int64_t capacity_;
  double first_wait_;
  py::function on_wait_;
};

// time.monotonic()
double monotonic() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// list[i] += v for a list of Python ints, dict[key] += v for a dict of them.
void add_item(PyObject* list, Py_ssize_t i, int64_t v) {
  PyObject* now = PyLong_FromLongLong(PyLong_AsLongLong(PyList_GET_ITEM(list, i)) + v);
  if (!now || PyList_SetItem(list, i, now) != 0) throw py::error_already_set();  // steals now
}

void add_key(PyObject* dict, PyObject* key, int64_t v) {
  PyObject* old = PyDict_GetItemWithError(dict, key);  // borrowed
  if (!old) throw py::error_already_set();
  py::object now = py::reinterpret_steal<py::object>(PyLong_FromLongLong(PyLong_AsLongLong(old) + v));
  if (!now || PyDict_SetItem(dict, key, now.ptr()) != 0) throw py::error_already_set();
}

// What this rank is doing, for the stall watchdog (collectives/watchdog.py reports it to
// stalled ranks). In C++ so that SmallAllreduce keeps it without Python calls; every access
// holds the GIL.
class Record {
 public:
  enum State { idle, waiting, running };

  void enter(py::object collective, py::object fields) {
    ++calls;
    collective_ = std::move(collective);
    fields_ = std::move(fields);
    state_ = waiting;
    since_ = monotonic();
  }

  void leave() {
    state_ = idle;
    since_ = monotonic();
  }

  std::string state() const { return kNames[state_]; }

  void set_state(const std::string& name) {
    for (int s = idle; s <= running; ++s)
      if (name == kNames[s]) {
        state_ = static_cast<State>(s);
        return;
      }
    throw py::value_error("state: expected idle, waiting or running, got " + name);
  }

  py::tuple snapshot() const {
    return py::make_tuple(state(), calls, collective_, fields_, monotonic() - since_);
  }

  int64_t calls = 0;
  py::object collective_ = py::str(""), fields_ = py::tuple();

 private:
  static constexpr const char* kNames[] = {"idle", "waiting", "running"};
  State state_ = idle;
  double since_ = monotonic();
};

// An allreduce small enough to ride in its own agreement exchange, with everything derived
// from its arguments bound (collectives/fastpath.py). One call does what the Python path
// does around that exchange: claim the engine as Engine.enter_inline does, keep the stall
// record (watchdog.Record), allocate the result, count stats. Per-call Python overhead was
// the larger part of a 4 KiB allreduce's latency.
class SmallAllreduce {
 public:
  SmallAllreduce(py::object channel, int64_t digest, int64_t count, int dtype_code,
                 int op_code, int64_t divisor, py::str collective, py::tuple fields,
                 py::object watchdog, py::list counter, py::dict totals, py::object queue,
                 py::object lock, py::function mismatch)
      : channel_obj_(std::move(channel)), channel_(channel_obj_.cast<AgreeChannel*>()),
        digest_(digest), count_(count), dtype_(to_dtype(dtype_code)), op_(to_op(op_code)),
        divisor_(divisor), nbytes_(count * dtype_size(dtype_)),
        collective_(std::move(collective)), fields_(std::move(fields)),
        watchdog_(std::move(watchdog)), record_obj_(watchdog_.attr("record")),
        record_(record_obj_.cast<Record*>()), counter_(std::move(counter)),
        totals_(std::move(totals)), queue_(std::move(queue)), acquire_(lock.attr("acquire")),
        release_(lock.attr("release")), mismatch_(std::move(mismatch)) {
    if (count < 0) throw py::value_error("count: must be >= 0");
    if (divisor == 0) throw py::value_error("divisor: must be non-zero");
    if (py::len(counter_) != 3) throw py::value_error("counter: expected [calls, sent, received]");
    for (const py::str& key : {s_sent_, s_received_, s_calls_})
      if (!totals_.contains(key)) throw py::value_error("totals: no count of " + std::string(key));
    if (nbytes_ > channel_->capacity())
      throw py::value_error("count: " + std::to_string(nbytes_) +
                            " bytes exceed the channel's capacity");
  }

  // The reduced array (x itself when inplace), or None when the fast entry does not apply
  // (layout, engine busy, watchdog failed): the caller then takes the general path.
  // x must have the dtype and element count this object was made for.
  py::object run(const py::array& x, bool inplace) {
    if (!(x.flags() & py::array::c_style) || (inplace && !x.writeable())) return py::none();
    if (x.nbytes() != nbytes_) throw py::value_error("x: size differs from the planned call");
    if (!watchdog_.attr(failed_).is_none() || !claim()) return py::none();
    py::object out;
    try {
      record_->enter(collective_, fields_);
      py::array result = inplace ? x : py::array(x.dtype(), shape_of(x));
      const int64_t moved = channel_->run(digest_, x.data(), result.mutable_data(), count_,
                                          dtype_, op_, divisor_);
      if (moved < 0) {
        mismatch_();  // raises MismatchError
        throw std::logic_error("mismatch callback returned");
      }
      count_stats(moved);
      out = std::move(result);
    } catch (...) {
      leave();
      throw;
    }
    leave();
    return out;
  }

 private:
  static std::vector<py::ssize_t> shape_of(const py::array& x) {
    return std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim());
  }

  bool claim() {
    if (queued()) return false;  // queued work goes first
    call(acquire_.ptr(), Py_False);
    if (!last_) return false;
    if (queued()) {
      release();
      return false;
    }
    return true;
  }

  bool queued() {
    const Py_ssize_t n = PyObject_Length(queue_.ptr());
    if (n < 0) throw py::error_already_set();
    return n > 0;
  }

  void call(PyObject* fn, PyObject* arg) {
    PyObject* r = arg ? PyObject_CallOneArg(fn, arg) : PyObject_CallNoArgs(fn);
    if (!r) throw py::error_already_set();
    last_ = r == Py_True;
    Py_DECREF(r);
  }

  void release() { call(release_.ptr(), nullptr); }

  void leave() {
    record_->leave();
    release();
  }

  void count_stats(int64_t moved) {  // as stats.count() does
    add_key(totals_.ptr(), s_sent_.ptr(), moved);
    add_key(totals_.ptr(), s_received_.ptr(), moved);
    add_key(totals_.ptr(), s_calls_.ptr(), 1);
    add_item(counter_.ptr(), 0, 1);
    add_item(counter_.ptr(), 1, moved);
    add_item(counter_.ptr(), 2, moved);
  }

  py::object channel_obj_;
  AgreeChannel* channel_;
  int64_t digest_, count_;
  DType dtype_;
  ReduceOp op_;
  int64_t divisor_, nbytes_;
  py::str collective_;
  py::tuple fields_;
  py::object watchdog_, record_obj_;
  Record* record_;
  py::list counter_;
  py::dict totals_;
  py::object queue_, acquire_, release_;
  py::function mismatch_;
  py::str failed_{"failed"}, s_sent_{"bytes_sent"}, s_received_{"bytes_received"},
      s_calls_{"calls"};
  bool last_ = false;  // the last call() returned True
};

}  // namespace

void bind_agreement(py::module_& m) {
  py::class_<AgreeChannel>(m, "AgreeChannel",
                           "The agreement exchange of one communicator (agree.h): "
                           "AgreeChannel(comm handle, tag, capacity, first_wait, on_wait)")
      .def(py::init<uintptr_t, int, int64_t, double, py::function>(), py::arg("comm"),
           py::arg("tag"), py::arg("capacity"), py::arg("first_wait"), py::arg("on_wait"))
      .def("exchange", &AgreeChannel::exchange, py::arg("digest"), py::arg("send"),
           py::arg("out"), py::arg("count"), py::arg("dtype"), py::arg("op"),
           py::arg("divisor"),
           "Check every rank passed the same digest while allreducing a small payload into "
           "out (then dividing it by divisor); returns -1 if they differ, else the payload "
           "bytes sent (= received). MPI, GIL released.");
  py::class_<Record>(m, "Record", "What this rank is doing, for the stall watchdog")
      .def(py::init<>())
      .def("enter", &Record::enter, py::arg("collective"), py::arg("fields"),
           "A collective call starts waiting for the other ranks")
      .def("leave", &Record::leave, "The call is over")
      .def("snapshot", &Record::snapshot, "(state, calls, collective, fields, age in s)")
      .def_readonly("calls", &Record::calls)
      .def_readonly("collective", &Record::collective_)
      .def_readonly("fields", &Record::fields_)
      .def_property("state", &Record::state, &Record::set_state);
  py::class_<SmallAllreduce>(m, "SmallAllreduce",
                             "A small allreduce's fast entry with its arguments bound "
                             "(collectives/fastpath.py)")
      .def(py::init<py::object, int64_t, int64_t, int, int, int64_t, py::str, py::tuple,
                    py::object, py::list, py::dict, py::object, py::object, py::function>(),
           py::arg("channel"), py::arg("digest"), py::arg("count"), py::arg("dtype"),
           py::arg("op"), py::arg("divisor"), py::arg("collective"), py::arg("fields"),
           py::arg("watchdog"), py::arg("counter"), py::arg("totals"), py::arg("queue"),
           py::arg("lock"), py::arg("mismatch"))
      .def("__call__", &SmallAllreduce::run, py::arg("x"), py::arg("inplace"),
           "The reduced array (x when inplace), or None if the fast entry does not apply");
}
