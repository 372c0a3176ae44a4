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
// Thread safety: a policy instance belongs to one job of one shard; its methods are called
// concurrently from many RPC threads and are internally synchronised. OnPush and BeforePull
// may block up to the barrier timeout.
#ifndef GRADMESH_SERVER_CONSISTENCY_H_
#define GRADMESH_SERVER_CONSISTENCY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/registry.h"

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
};

// Applies an update to the shard's chunks (and logs it, for durable jobs).
using ApplyFn = std::function<absl::Status(const ChunkUpdate&)>;

struct ConsistencyConfig {
  std::string job;          // Job name, for messages.
  std::string mode;         // "async", "ssp:3", "sync".
  int32_t num_workers = 1;  // > 0.
  absl::Duration barrier_timeout = absl::Seconds(120);
};

struct ConsistencyStats {
  int64_t max_clock_lead = 0;  // ssp: largest lead at which a pull was served.
  double barrier_wait_s = 0;   // Total time pushes/pulls waited for other workers.
};

class ConsistencyPolicy {
 public:
  virtual ~ConsistencyPolicy() = default;
  virtual std::string mode() const = 0;

  // A validated push (exactly one request). The policy calls `apply` (now, or once all
  // workers' pushes of the step have arrived) and returns the push's outcome.
  virtual absl::Status OnPush(const ChunkUpdate& push, const ApplyFn& apply) = 0;

  // Before serving a pull of `worker`. May block; an error fails the pull.
  virtual absl::Status BeforePull(int32_t worker) = 0;

  // `worker` will push no more.
  virtual void OnFinish(int32_t worker) = 0;

  // Restores clocks after a shard restart: steps pushed so far per worker, and who finished.
  virtual void Restore(const std::vector<int64_t>& pushed_steps,
                       const std::vector<bool>& finished) = 0;

  // Sets the barrier group: the ranks whose pushes complete a step (non-empty, each in
  // [0, num_workers), no repeats, any order) and the factor on the learning rate of the
  // updates of its steps, in (0, 1]. INVALID_ARGUMENT for bad arguments (nothing changes).
  // Idempotent. See "Sync barrier groups" above for steps in progress. Never blocks on a
  // barrier. Default (async, ssp): FAILED_PRECONDITION, as they have no barrier group.
  virtual absl::Status SetGroup(const std::vector<int32_t>& active, float lr_scale);

  virtual ConsistencyStats stats() const = 0;
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
