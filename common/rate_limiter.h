// RateLimiter: a token bucket that paces bytes to a given rate, used to model a slow network
// link in the transport (e.g. a worker's 100 Mbit/s NIC) on a machine whose loopback is far
// faster.
//
// Acquire(n) returns once n bytes may pass: the bucket refills at `bytes_per_second` and holds
// at most `burst_bytes`; a request larger than the burst waits for the deficit, so the long-run
// rate is exact. A rate of 0 means unlimited.
//
// Thread safety: Acquire may be called concurrently; callers are paced together (one link).
#ifndef GRADMESH_COMMON_RATE_LIMITER_H_
#define GRADMESH_COMMON_RATE_LIMITER_H_

#include <algorithm>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace gradmesh {

class RateLimiter {
 public:
  explicit RateLimiter(double bytes_per_second, double burst_bytes = 64 * 1024)
      : rate_(bytes_per_second), burst_(burst_bytes), tokens_(burst_bytes), last_(absl::Now()) {}

  // Returns the time spent waiting.
  absl::Duration Acquire(int64_t bytes) {
    if (rate_ <= 0 || bytes <= 0) return absl::ZeroDuration();
    absl::Duration wait;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      tokens_ = std::min(burst_, tokens_ + absl::ToDoubleSeconds(now - last_) * rate_);
      last_ = now;
      tokens_ -= static_cast<double>(bytes);  // May go negative: later callers wait longer.
      if (tokens_ >= 0) return absl::ZeroDuration();
      wait = absl::Seconds(-tokens_ / rate_);
    }
    absl::SleepFor(wait);
    return wait;
  }

 private:
  const double rate_;
  const double burst_;
  absl::Mutex mu_;
  double tokens_ ABSL_GUARDED_BY(mu_);
  absl::Time last_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_RATE_LIMITER_H_
