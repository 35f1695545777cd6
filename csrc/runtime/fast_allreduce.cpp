// See fast_allreduce.h.
#include "runtime/fast_allreduce.h"

#include <chrono>
#include <stdexcept>
#include <utility>

namespace collectives {

FastAllreduce::FastAllreduce(Engine& engine, const AgreeChannel& channel, const CallInfo& call,
                             int64_t count, DType dtype, ReduceOp op, int64_t divisor,
                             std::optional<Pipeline> pipeline)
    : engine_(engine), channel_(channel), call_(call), count_(count), dtype_(dtype), op_(op),
      divisor_(divisor), nbytes_(count * dtype_size(dtype)), pipeline_(std::move(pipeline)) {
  if (!pipeline_) {
    if (nbytes_ > channel.capacity)
      throw std::invalid_argument("count: the payload exceeds the channel's capacity");
    return;
  }
  const Pipeline& p = *pipeline_;
  if (p.bounds.size() < 2 || p.bounds.front() != 0 || p.bounds.back() != count || p.e <= 0 ||
      p.nchunks <= 0)
    throw std::invalid_argument("pipeline: bounds must run from 0 to count, e and nchunks > 0");
}

bool FastAllreduce::run(const void* src, void* dst) {
  if (!engine_.try_claim()) return false;
  struct Release {
    Engine& engine;
    ~Release() { engine.release(); }
  } release{engine_};
  if (watch_ != nullptr && !watch_->take()) return false;  // due: Python reviews
  if (!pipeline_) {
    execute(engine_, channel_, call_, {src, dst, count_, dtype_, op_}, divisor_, -1, nullptr);
    return true;
  }
  execute(engine_, channel_, call_, {nullptr, nullptr, 0, dtype_, op_}, 1, -1,
          [&] { pipelined(src, dst); });
  return true;
}

// shm.py's allreduce of src into dst, counted and averaged as shm.py and algorithms.reduce
// do it, and timed for the watch as online.run times a call.
void FastAllreduce::pipelined(const void* src, void* dst) {
  const Pipeline& p = *pipeline_;
  if (window_ == nullptr || window_->closed) {
    window_ = p.window();
    const int64_t size = static_cast<int64_t>(window_->segments.size());
    if (static_cast<int64_t>(p.bounds.size()) != size + 1 ||
        size * p.e * dtype_size(dtype_) > window_->slot_bytes)
      throw std::logic_error("FastAllreduce: the window does not fit the pipeline");
  }
  const auto start = std::chrono::steady_clock::now();
  // an Average divides by the ranks that contributed (divide_average's rule), folded into
  // the pipeline's reduce stage
  const int joined = engine_.running().joined;
  const int64_t contributed = divisor_ == 1 ? 1 : divisor_ - joined;
  shm_reduce(*window_, src, dst, p.bounds, p.e, p.nchunks, dtype_, op_, true,
             contributed > 1 ? contributed : 1);
  engine_.add_bytes(nbytes_, nbytes_);
  if (watch_ != nullptr && joined == 0 && nbytes_ > 0) {
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    watch_->record(took.count() / static_cast<double>(nbytes_));
  }
}

}  // namespace collectives
