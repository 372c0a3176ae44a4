// Clock: the coordinator's time source, injected so that tests drive failure detection and
// progress timing with a FakeClock instead of sleeping.
//
// Thread safety: NowMs() may be called concurrently; FakeClock's setters are thread-safe.
#ifndef GRADMESH_COORDINATOR_CLOCK_H_
#define GRADMESH_COORDINATOR_CLOCK_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace gradmesh {

class Clock {
 public:
  virtual ~Clock() = default;
  // Unix time in milliseconds.
  virtual int64_t NowMs() const = 0;
};

// The system's real-time clock (created in main, handed down; not a singleton).
class SystemClock : public Clock {
 public:
  int64_t NowMs() const override { return absl::ToUnixMillis(absl::Now()); }
};

// A clock that moves only when told to.
class FakeClock : public Clock {
 public:
  explicit FakeClock(int64_t start_ms = 1'700'000'000'000) : now_ms_(start_ms) {}

  int64_t NowMs() const override {
    absl::MutexLock lock(&mu_);
    return now_ms_;
  }
  void AdvanceMs(int64_t ms) {
    absl::MutexLock lock(&mu_);
    now_ms_ += ms;
  }

 private:
  mutable absl::Mutex mu_;
  int64_t now_ms_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gradmesh

#endif  // GRADMESH_COORDINATOR_CLOCK_H_
