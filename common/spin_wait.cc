#include "common/spin_wait.h"

#include <sched.h>

#include <algorithm>

namespace gradmesh {

AdaptiveSpin::AdaptiveSpin(absl::Duration budget)
    : budget_ns_(std::clamp<int64_t>(absl::ToInt64Nanoseconds(budget), 0, 1'000'000'000)) {}

absl::Duration AdaptiveSpin::SpinFor() const {
  if (budget_ns_ == 0 || 2 * mean_ns_.load(std::memory_order_relaxed) >= budget_ns_) {
    return absl::ZeroDuration();
  }
  return absl::Nanoseconds(budget_ns_);
}

void AdaptiveSpin::Record(absl::Duration waited) {
  const int64_t w = std::max<int64_t>(0, absl::ToInt64Nanoseconds(waited));
  const int64_t old = mean_ns_.load(std::memory_order_relaxed);
  // Weight 1/4 for the newest; a wait longer than 4 budgets counts as 4 budgets, so one
  // outlier (a stall, a retry) stops spinning for a few waits, not for hundreds.
  const int64_t capped = budget_ns_ > 0 ? std::min(w, 4 * budget_ns_) : w;
  mean_ns_.store(old + (capped - old) / 4, std::memory_order_relaxed);
}

absl::Duration AdaptiveSpin::mean() const {
  return absl::Nanoseconds(mean_ns_.load(std::memory_order_relaxed));
}

void SpinYield() { sched_yield(); }

}  // namespace gradmesh
