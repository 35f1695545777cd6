// See engine.h.
#include "runtime/engine.h"

#include <algorithm>

namespace collectives {

double Record::now() { return steady_seconds(); }

const char* Record::name(State s) {
  static const char* const names[] = {"idle", "waiting", "running"};
  return names[s];
}

const char* Record::name(Phase p) {
  static const char* const names[] = {"entered", "agreed", "done", "failed"};
  return names[p];
}

void Record::set_capacity(int64_t calls) {
  if (calls < 0) throw std::invalid_argument("calls: must be >= 0");
  std::lock_guard<std::mutex> lock(mu_);
  const Flight current = newest();
  ring_.assign(static_cast<size_t>(std::max<int64_t>(calls, 1)), Flight{});
  newest() = current;
}

int64_t Record::capacity() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(ring_.size());
}

void Record::enter(const std::string& collective, const std::string& detail,
                   const std::string& algorithm, double queued, const std::string& comm,
                   int64_t comm_seq) {
  std::lock_guard<std::mutex> lock(mu_);
  ++calls_;
  since_ = now();
  Flight& f = newest();  // assignments reuse the slot's strings' storage
  f.seq = calls_;
  f.comm = comm;
  f.comm_seq = comm_seq;
  f.collective = collective;
  f.detail = detail;
  f.algorithm = algorithm;
  f.queued = queued;
  f.start = since_;
  f.agreed_at = f.end = 0;
  f.bytes = 0;
  f.last = -1;
  f.waited = 0;
  f.phase = entered;
  state_ = waiting;
}

void Record::run() {
  std::lock_guard<std::mutex> lock(mu_);
  newest().agreed_at = now();
  newest().phase = agreed;
  state_ = running;
}

void Record::leave(const Outcome* outcome) {
  std::lock_guard<std::mutex> lock(mu_);
  state_ = idle;
  since_ = now();
  Flight& f = newest();
  f.end = since_;
  if (outcome == nullptr) {
    f.phase = failed;
    return;
  }
  f.phase = done;
  f.bytes = outcome->bytes;
  f.last = outcome->last;
  f.waited = outcome->waited;
  if (outcome->algorithm != nullptr) f.algorithm = *outcome->algorithm;
}

Record::Snapshot Record::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  const Flight& f = ring_[static_cast<size_t>((calls_ + ring_.size() - 1) % ring_.size())];
  return {state_, calls_, f.collective, f.detail, now() - since_};
}

std::vector<Record::Flight> Record::history() const {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t size = static_cast<int64_t>(ring_.size());
  std::vector<Flight> out;
  for (int64_t seq = std::max<int64_t>(1, calls_ - size + 1); seq <= calls_; ++seq)
    out.push_back(ring_[static_cast<size_t>((seq - 1) % size)]);
  return out;
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

void Stats::add_wait(int rank, double seconds) {
  if (rank < 0) return;
  std::lock_guard<std::mutex> lock(waits_mu_);
  if (waits_.size() <= static_cast<size_t>(rank)) waits_.resize(static_cast<size_t>(rank) + 1);
  waits_[static_cast<size_t>(rank)] += seconds;
}

std::vector<double> Stats::waits() const {
  std::lock_guard<std::mutex> lock(waits_mu_);
  return waits_;
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
