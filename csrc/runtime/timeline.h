// The timeline's recording (collectives/api/timeline.py is its Python face): while it is on,
// every call that runs adds one event (its submission, start, agreement, data phase and end
// on the steady clock, and the bytes it sent). Calls run on the engine's thread while Python
// switches the recording and takes the events from another, so both sides lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace collectives {

// The steady clock every time here is read on, in seconds.
double steady_seconds();

// What the timeline shows of a described call.
struct CallTexts {
  std::string collective, detail, algorithm;
};

class Timeline {
 public:
  // One call: which described call (an index into Taken::texts), seconds of its submission
  // (-1: run at once, never queued), start, agreement done, data moved, end; bytes sent;
  // the algorithm that ran when it is not the described one (empty: the described one);
  // the rank of its communicator that arrived last and the others' wait for it, together.
  struct Event {
    size_t call;
    double queued, start, agreed, moved, end;
    int64_t bytes;
    std::string algorithm;
    int last;
    double waited;
  };
  struct Taken {
    std::vector<Event> events;  // oldest first
    std::vector<CallTexts> texts;
  };

  void set_on(bool on) { on_.store(on, std::memory_order_relaxed); }
  bool on() const { return on_.load(std::memory_order_relaxed); }
  // Record one call of the described call `call_id` (unique in the process); event.call is
  // filled in here.
  void add(int64_t call_id, const CallTexts& texts, Event event);
  // The events since the last take, and the texts they refer to.
  Taken take();

 private:
  std::atomic<bool> on_{false};
  std::mutex mu_;
  Taken taken_;
  // each described call's texts are copied once per recording, not once per call
  std::unordered_map<int64_t, size_t> index_;  // call_id -> index in taken_.texts
};

}  // namespace collectives
