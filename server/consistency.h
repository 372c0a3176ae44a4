// Consistency policies: when a shard applies pushed gradients and when a pull may proceed.
//
// A policy is chosen per job by its mode string (JobSpec.mode / InitJobRequest.consistency)
// through a ConsistencyRegistry: "name" or "name:param". Unknown names or bad parameters are
// InvalidArgument listing the known modes.
//
//   "async"   Every push is applied on arrival; pulls never wait.
//   "ssp:<s>" Pushes are applied on arrival. A worker that has pushed c steps may pull only
//             when the slowest unfinished worker has pushed at least c - s steps (its pull
//             waits), so no worker runs more than s clocks ahead. s = 0 is lock-step.
//   "sync"    Bulk-synchronous: for each step the shard waits for the pushes of every worker
//             of the barrier group (all N workers unless SetGroup changed it), averages their
//             gradients in rank order (so the result does not depend on arrival order),
//             applies the optimizer once with the group's learning-rate factor, and only then
//             acknowledges the pushes. A worker that pulls after its push therefore sees step
//             t applied.
//
// Sync barrier groups (elastic sync, SetGroup): the coordinator shrinks a sync job's group
// when it loses a worker for good, and grows it back when a replacement arrives.
//   - Each step takes its group (and lr factor) from the policy when it is created, by its
//     first push; a push of a worker outside its step's group fails with FAILED_PRECONDITION
//     "worker w is not in the sync group of job J (active: [...])" and changes nothing.
//   - Shrinking also applies to the steps in progress: the removed ranks leave their groups,
//     a removed worker's contribution already buffered for such a step is dropped (its push
//     fails with FAILED_PRECONDITION, nothing of it is applied), the step takes the new lr
//     factor, and a step whose remaining workers have all pushed completes at once (its
//     waiters re-evaluate their condition when the group changes).
//   - Growing applies from the next step that has no pushes yet: a step in progress keeps the
//     group it was created with (a newly added worker's push to it is refused as above, with
//     a message saying so), since waiting for a worker that may start later would stall it.
//   - The average is over the contributions of the step's group, in rank order; staleness is
//     measured from the base versions of the lowest-ranked contribution.
//   async and ssp have no barrier group: SetGroup is FAILED_PRECONDITION there.
//
// Waits are bounded by the job's barrier timeout: then the waiting push (sync) or pull (ssp)
// fails with FAILED_PRECONDITION naming the workers that did not arrive, and nothing of it is
// applied (sync).
//
// Waiting without a thread: StartPush and StartPull return at once; a call that must wait is
// parked with its completion (WaitDone), which runs later on the thread that releases it (the
// push that completes the step or advances the clock, SetGroup's hand-off, the timer at the
// deadline, or a canceller). A caller that gives up (its RPC was cancelled) uses WaitCancel: a
// waiting push is then withdrawn as on a timeout (nothing of it is applied) and completes with
// CANCELLED. OnPush and BeforePull are the blocking forms (they wait on the calling thread).
//
// Locks and disk: a sync step is decided under the policy's lock (the push that finds its
// group complete seals it: no timeout, cancellation or group change touches it any more), then
// averaged and applied (for durable jobs this writes the log record) with no policy lock
// held, then published (its waiters released) under the lock again. So pushes of other steps
// and workers, SetGroup, stats() and pulls proceed while a step is written.
//
// Thread safety: a policy instance belongs to one job of one shard; its methods are called
// concurrently from many threads and are internally synchronised. Completions never run under
// a policy lock. Only the blocking forms block.
#ifndef GRADMESH_SERVER_CONSISTENCY_H_
#define GRADMESH_SERVER_CONSISTENCY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/registry.h"
#include "server/shard_limits.h"
#include "server/wait_timer.h"

namespace gradmesh {

// A push that an update completes.
struct RequestRef {
  int32_t worker = 0;
  int64_t step = 0;
  uint64_t request_id = 0;
};

// Gradients for some chunks of one shard: one validated push, or (sync) the average of all
// workers' pushes of a step. Pointers stay valid for the duration of the call they are
// passed to.
struct ChunkUpdate {
  std::vector<int64_t> chunks;         // Partition indices of the chunks.
  std::vector<int64_t> numels;         // Elements of each chunk.
  std::vector<const float*> grads;     // numels[i] floats per chunk.
  std::vector<int64_t> base_versions;  // Version each gradient was computed from.
  std::vector<RequestRef> requests;    // Pushes this update completes.
  // Factor on the optimizer's learning rate (sync: the barrier group's lr_scale); in (0, 1].
  float lr_scale = 1.0f;
  // commit_steps jobs (PushRequest.nonfinite): a worker's gradient was not finite, so its
  // values here are placeholders; the sync average carries it if any contribution did.
  bool nonfinite = false;
};

// Applies an update to the shard's chunks (and logs it, for durable jobs).
using ApplyFn = std::function<absl::Status(const ChunkUpdate&)>;

struct ConsistencyConfig {
  std::string job;          // Job name, for messages.
  std::string mode;         // "async", "ssp:3", "sync".
  int32_t num_workers = 1;  // > 0.
  absl::Duration barrier_timeout = absl::Seconds(120);
  const Logger* logger = nullptr;  // Not owned; may be null.
};

struct ConsistencyStats {
  int64_t max_clock_lead = 0;  // ssp: largest lead at which a pull was served.
  double barrier_wait_s = 0;   // Total time pushes/pulls waited for other workers.
};

// The completion of a call that may wait: called exactly once with its outcome, on the
// calling thread if the call did not wait, otherwise on the thread that released it. Never
// called under a policy lock.
using WaitDone = std::function<void(absl::Status)>;

// Lets the caller of a call that may wait give up (e.g. its RPC was cancelled).
// Thread safety: all methods may be called concurrently. The caller owns it and keeps it alive
// until the call's completion has run and no Cancel is in progress.
class WaitCancel {
 public:
  // Gives up: runs the handler a policy registered (once), or makes a later Watch refuse.
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);
  bool cancelled() const ABSL_LOCKS_EXCLUDED(mu_);

  // For policies: `on_cancel` runs (outside this object's lock) when Cancel is called. False
  // if Cancel was already called (nothing is registered). A leaf lock: may be called under a
  // policy's lock.
  bool Watch(std::function<void()> on_cancel) ABSL_LOCKS_EXCLUDED(mu_);
  // For policies: the wait ended; Cancel no longer runs the handler.
  void Unwatch() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> on_cancel_ ABSL_GUARDED_BY(mu_);
};

class ConsistencyPolicy {
 public:
  virtual ~ConsistencyPolicy() = default;
  virtual std::string mode() const = 0;

  // Before the policy is shared: run deadlines and hand-offs on `timer` (not owned; it must
  // outlive the policy) rather than on a timer thread of the policy's own (the default, which
  // starts when first needed).
  void UseTimer(WaitTimer* timer) { shared_timer_ = timer; }

  // Before the policy is shared: count the calls parked here in `counter` (not owned; it must
  // outlive the policy, and is shared by a shard's jobs). A call that would park beyond the
  // counter's limit completes at once with its RESOURCE_EXHAUSTED and changes nothing (a sync
  // push that completes its step never parks). Default: no limit.
  void UseWaitCounter(WaitCounter* counter) { wait_counter_ = counter; }

  // A validated push (exactly one request). The policy calls `apply` (now, or once all
  // workers' pushes of the step have arrived, perhaps on another thread) and then `done` with
  // the push's outcome. The push's buffers need only stay valid until StartPush returns.
  // `cancel` may be null.
  virtual void StartPush(const ChunkUpdate& push, ApplyFn apply, WaitDone done,
                         WaitCancel* cancel) = 0;

  // Before serving a pull of `worker`: `done` runs when it may proceed (OK), or with the
  // error that fails the pull. `cancel` may be null.
  virtual void StartPull(int32_t worker, WaitDone done, WaitCancel* cancel) = 0;

  // Blocking forms of StartPush and StartPull: wait on the calling thread for the outcome.
  absl::Status OnPush(const ChunkUpdate& push, const ApplyFn& apply);
  absl::Status BeforePull(int32_t worker);

  // `worker` will push no more.
  virtual void OnFinish(int32_t worker) = 0;

  // Restores clocks after a shard restart: steps pushed so far per worker, and who finished.
  virtual void Restore(const std::vector<int64_t>& pushed_steps,
                       const std::vector<bool>& finished) = 0;

  // Sets the barrier group: the ranks whose pushes complete a step (non-empty, each in
  // [0, num_workers), no repeats, any order) and the factor on the learning rate of the
  // updates of its steps, in (0, 1]. INVALID_ARGUMENT for bad arguments (nothing changes).
  // Idempotent. See "Sync barrier groups" above for steps in progress; a step it completes is
  // applied on the timer's thread. Never blocks on a barrier, applies nothing itself.
  // Default (async, ssp): FAILED_PRECONDITION, as they have no barrier group.
  virtual absl::Status SetGroup(const std::vector<int32_t>& active, float lr_scale);

  // Completes every call still waiting with `why` (shutdown); a sync step already sealed is
  // left to complete. Default: nothing waits.
  virtual void AbortWaits(const absl::Status& why);

  // Calls parked now (waiting for other workers).
  virtual int64_t waiting() const { return 0; }

  virtual ConsistencyStats stats() const = 0;

 protected:
  // The timer for deadlines and hand-offs: the shared one, or the policy's own.
  WaitTimer* timer();
  // Derived destructors call it first: runs what the policy's own timer still holds (see
  // ~WaitTimer) while the derived object is whole, and stops it. No-op with a shared timer.
  void StopOwnTimer();
  // One more parked call: OK, or the counter's RESOURCE_EXHAUSTED naming `what`. Pair an OK
  // one with ExitWait.
  absl::Status EnterWait(const std::string& what) {
    return wait_counter_ == nullptr ? absl::OkStatus() : wait_counter_->Enter(what);
  }
  void ExitWait() {
    if (wait_counter_ != nullptr) wait_counter_->Exit();
  }

 private:
  WaitTimer* shared_timer_ = nullptr;
  WaitCounter* wait_counter_ = nullptr;
  absl::Mutex own_timer_mu_;
  std::unique_ptr<WaitTimer> own_timer_ ABSL_GUARDED_BY(own_timer_mu_);
};

class ConsistencyRegistry {
 public:
  // `param` is the text after ':' in the mode ("" if none).
  using Factory = std::function<absl::StatusOr<std::unique_ptr<ConsistencyPolicy>>(
      const ConsistencyConfig& config, const std::string& param)>;

  // A registry holding "async", "ssp" and "sync".
  static ConsistencyRegistry WithBuiltins();

  void Register(const std::string& name, Factory factory);
  absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> Create(const ConsistencyConfig& config) const;
  std::vector<std::string> names() const;

 private:
  NamedRegistry<Factory> factories_{"consistency mode"};
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_CONSISTENCY_H_
