// AdaptiveSpin: whether a thread about to block for an answer should first spin, and for how
// long. Blocking costs a futex wake-up, and on a VM whose idle vCPU has halted, an
// inter-processor interrupt and a VM exit (tens of µs each) when the answer comes: more than
// a small operation's whole round trip on loopback (see README, "lone operation"). Spinning
// while yielding the CPU (sched_yield) keeps the vCPU awake and the waiter on it, but wastes a
// core when the answer is far off, so it is only worth it while answers come quickly.
//
// The rule: spin for up to `budget` while the recent waits (an exponentially weighted mean,
// weight 1/4 for the newest; a wait counts as at most 4 budgets) were shorter than half of
// it, so that a spin usually ends with the answer; otherwise block at once. One slow
// operation (a large message, a real model's step, a retry) stops the spinning, and a run of
// fast ones starts it again. The first wait spins.
//
// Thread safety: all methods may be called concurrently (relaxed atomics; a lost update only
// shifts the mean).
#ifndef GRADMESH_COMMON_SPIN_WAIT_H_
#define GRADMESH_COMMON_SPIN_WAIT_H_

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"

namespace gradmesh {

class AdaptiveSpin {
 public:
  // `budget` <= 0: never spin; more than 1 s counts as 1 s.
  explicit AdaptiveSpin(absl::Duration budget);

  // How long the next wait should spin before blocking (zero: block at once).
  absl::Duration SpinFor() const;
  // Records how long a wait took in all (spinning and blocked).
  void Record(absl::Duration waited);
  // The current mean (for tests and logs).
  absl::Duration mean() const;

 private:
  const int64_t budget_ns_;
  std::atomic<int64_t> mean_ns_{0};
};

// One turn of a spin: gives the CPU to another runnable thread, if any (sched_yield).
void SpinYield();

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_SPIN_WAIT_H_
