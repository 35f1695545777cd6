// See call.h.
#include "runtime/call.h"

#include <stdexcept>

namespace collectives {
namespace {

// Enters the stall record for the call and leaves it (and the running call) however the
// call ends: finished with what done() gave, else failed.
class InCall {
 public:
  InCall(Engine& engine, const CallInfo& call, double queued) : engine_(engine) {
    engine.check_usable();
    engine.record().enter(call.texts.collective, call.texts.detail, call.texts.algorithm,
                          queued, call.stats->label(), call.stats->next_seq());
  }
  ~InCall() {
    engine_.record().leave(finished_ ? &outcome_ : nullptr);
    engine_.running().joined = 0;
  }
  InCall(const InCall&) = delete;
  InCall& operator=(const InCall&) = delete;
  void done(const Record::Outcome& outcome) {
    outcome_ = outcome;
    finished_ = true;
  }

 private:
  Engine& engine_;
  Record::Outcome outcome_{};
  bool finished_ = false;
};

}  // namespace

void divide_average(void* buf, int64_t count, DType dtype, int64_t divisor, int joined) {
  if (divisor == 1) return;
  const int64_t contributed = divisor - joined;
  if (contributed > 1 && count) divide(buf, count, dtype, contributed);
}

void execute(Engine& engine, const AgreeChannel& channel, const CallInfo& call,
             const Payload& payload, int64_t divisor, double queued,
             const std::function<void()>& move) {
  const bool tracing = engine.timeline().on();
  const double start = tracing ? steady_seconds() : 0;
  InCall in_call(engine, call, queued);
  Engine::Running& running = engine.running();
  running.credit = call.counter;
  running.algorithm = nullptr;
  const auto before = engine.bytes();
  const AgreeResult r = channel.run(call.digest, payload.send, payload.out, payload.count,
                                    payload.dtype, payload.op, Role::active, engine.clock());
  if (!r.ok) {
    call.mismatch();
    throw std::logic_error("the mismatch callback returned");
  }
  engine.add_bytes(r.payload_sent, r.payload_sent);
  if (r.waited > 0) call.stats->add_wait(r.last_arrival, r.waited);
  const double agreed = tracing ? steady_seconds() : 0;
  if (r.joined) {
    running.joined = r.joined;
    call.on_joined(r.joined, r.first_active);
  }
  divide_average(payload.out, payload.count, payload.dtype, divisor, r.joined);
  engine.record().run();
  if (move) move();
  const auto after = engine.bytes();
  const int64_t sent = after.first - before.first;
  running.credit->add(1, sent, after.second - before.second);
  in_call.done({sent, r.last_arrival, r.waited, running.algorithm});
  if (tracing && engine.timeline().on()) {  // (not the call whose move stopped it)
    const double end = steady_seconds();
    engine.timeline().add(call.id, call.texts,
                          {0, queued, start, agreed, move ? end : agreed, end, sent,
                           running.algorithm ? *running.algorithm : std::string(),
                           r.last_arrival, r.waited});
  }
}

AgreeResult join_step(Engine& engine, const AgreeChannel& channel, const CallInfo& call,
                      bool first) {
  InCall in_call(engine, call, -1);
  const AgreeResult r = channel.run(call.digest, nullptr, nullptr, 0, DType::u8,
                                    ReduceOp::sum, first ? Role::joining : Role::joined);
  engine.add_bytes(r.payload_sent, r.payload_sent);
  if (first) call.counter->add(1, 0, 0);
  in_call.done({r.payload_sent, r.last_arrival, r.waited, nullptr});
  return r;
}

void contribute(Engine& engine, int joined, const std::function<void()>& move) {
  if (joined < 1) throw std::invalid_argument("joined: must be >= 1");
  struct Reset {
    Engine::Running& running;
    ~Reset() { running.joined = 0; }
  } reset{engine.running()};
  reset.running.joined = joined;
  move();
}

}  // namespace collectives
