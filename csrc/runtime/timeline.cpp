// See timeline.h.
#include "runtime/timeline.h"

#include <chrono>
#include <utility>

namespace collectives {

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Timeline::add(int64_t call_id, const CallTexts& texts, Event event) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto found = index_.try_emplace(call_id, taken_.texts.size());
  if (found.second) taken_.texts.push_back(texts);
  event.call = found.first->second;
  taken_.events.push_back(std::move(event));
}

Timeline::Taken Timeline::take() {
  std::lock_guard<std::mutex> lock(mu_);
  Taken out = std::move(taken_);
  taken_ = Taken{};
  index_.clear();
  return out;
}

}  // namespace collectives
