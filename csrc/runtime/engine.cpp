// See engine.h.
#include "runtime/engine.h"

namespace collectives {

double Record::now() { return steady_seconds(); }

const char* Record::name(State s) {
  static const char* const names[] = {"idle", "waiting", "running"};
  return names[s];
}

void Record::enter(const std::string& collective, const std::string& detail) {
  std::lock_guard<std::mutex> lock(mu_);
  ++calls_;
  collective_ = collective;
  detail_ = detail;
  state_ = waiting;
  since_ = now();
}

void Record::run() {
  std::lock_guard<std::mutex> lock(mu_);
  state_ = running;
}

void Record::leave() {
  std::lock_guard<std::mutex> lock(mu_);
  state_ = idle;
  since_ = now();
}

Record::Snapshot Record::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {state_, calls_, collective_, detail_, now() - since_};
}

Counter* Stats::counter(const std::string& collective, const std::string& algorithm,
                        const std::string** name) {
  auto& entry = *per_.try_emplace({collective, algorithm}).first;
  if (name != nullptr) *name = &entry.first.second;
  return &entry.second;
}

std::vector<std::tuple<std::string, std::string, Counts>> Stats::snapshot() const {
  std::vector<std::tuple<std::string, std::string, Counts>> out;
  for (const auto& [key, c] : per_) {
    const Counts counts{c.calls.load(std::memory_order_relaxed),
                        c.sent.load(std::memory_order_relaxed),
                        c.received.load(std::memory_order_relaxed)};
    if (counts.calls) out.emplace_back(key.first, key.second, counts);
  }
  return out;
}


void Engine::push(void* item) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(item);
  }
  cv_.notify_all();
}

void* Engine::next() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !queue_.empty() && !running_; });
  running_ = true;
  void* item = queue_.front();
  queue_.pop_front();
  return item;
}

bool Engine::try_claim() {
  std::lock_guard<std::mutex> lock(mu_);
  if (running_ || !queue_.empty()) return false;
  running_ = true;
  return true;
}

void Engine::release() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
  }
  cv_.notify_all();
}

void Engine::fail(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.empty()) failed_ = why;
  has_failed_.store(true, std::memory_order_release);
}

std::string Engine::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

void Engine::check_usable() const {
  if (has_failed())
    throw Unusable("collectives is unusable after a stall timeout (" + failed() +
                   "); an MPI collective cannot be cancelled: restart the job");
}

}  // namespace collectives
