// JobState: what one job is on this shard: its layout (the normalized InitJob request without
// initial values), the partition, the chunks this shard owns (values, optimizer slots,
// version), the optimizer, the consistency policy and, for sync jobs, the barrier group. Also
// the layout checks InitJob runs before a job exists (ValidateLayout, NormalizedLayout).
//
// Thread safety: the layout, partition, optimizer, policy pointer, durability mode and the set
// of chunks are immutable after Create and are read without locks. Each Chunk's values, slots
// and version are guarded by its own `mu`; no method here holds more than one chunk lock at a
// time. The sync group copy is guarded by `group_mu_`, which SetSyncGroup holds while calling
// the policy (lock order: group_mu_ before the policy's internal lock). The policy itself is
// internally synchronised (server/consistency.h).
#ifndef GRADMESH_SERVER_JOB_STATE_H_
#define GRADMESH_SERVER_JOB_STATE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/optimizer.h"
#include "common/partitioner.h"
#include "proto/gradmesh.pb.h"
#include "server/consistency.h"

namespace gradmesh {

// Thread safety: `info` is immutable; values, slots and version only under `mu`.
// One stored chunk: values, optimizer slots and version, under its own lock.
struct Chunk {
  explicit Chunk(const ChunkInfo& i) : info(i) {}
  const ChunkInfo info;
  absl::Mutex mu;
  std::vector<float> values ABSL_GUARDED_BY(mu);  // Empty until initial values are loaded.
  std::vector<float> slots ABSL_GUARDED_BY(mu);   // num_slots * numel, slot-major.
  int64_t version ABSL_GUARDED_BY(mu) = 0;        // Number of updates applied.
};

enum class Durability { kNone, kPeriodic, kEveryUpdate };

// DurabilitySpec.mode: "" and "none", "periodic", "every_update"; InvalidArgument otherwise.
absl::StatusOr<Durability> ParseDurability(const DurabilitySpec& d);

// Checks an InitJob request's layout (job name, tensors, shards, workers, timeouts,
// durability); InvalidArgument naming the job and tensor.
absl::Status ValidateLayout(const InitJobRequest& r);

// The request without initial values and with the defaults the shard relies on filled in, so
// that equal layouts compare equal (TensorSpec.dtype FLOAT32 becomes unset, its equal).
InitJobRequest NormalizedLayout(const InitJobRequest& request);

// Thread safety: accessors of the immutable parts need no lock; chunk contents need their
// Chunk::mu; the sync-group methods lock group_mu_ (see the file comment).
// One job of this shard (see the file comment).
class JobState {
 public:
  using ChunkMap = absl::flat_hash_map<int64_t, std::unique_ptr<Chunk>>;

  // Builds the job of a validated, normalized layout: partition, optimizer, policy, and the
  // owned chunks with zeroed slots and no values yet. Errors are prefixed "InitJob: job <J>";
  // FAILED_PRECONDITION if the layout asks for durability and `have_store` is false.
  static absl::StatusOr<std::unique_ptr<JobState>> Create(const InitJobRequest& layout,
                                                          const OptimizerRegistry& optimizers,
                                                          const ConsistencyRegistry& consistency,
                                                          bool have_store,
                                                          const Logger* logger = nullptr);

  JobState(const JobState&) = delete;
  JobState& operator=(const JobState&) = delete;

  const InitJobRequest& layout() const { return layout_; }
  const std::string& name() const { return layout_.job(); }
  int32_t num_workers() const { return layout_.num_workers(); }
  int32_t shard_index() const { return layout_.shard_index(); }
  const Partition& partition() const { return *partition_; }
  const Optimizer& optimizer() const { return *optimizer_; }
  ConsistencyPolicy& policy() const { return *policy_; }
  Durability durability() const { return durability_; }
  bool sync_mode() const { return sync_mode_; }
  int64_t owned_elements() const { return owned_elements_; }
  // Optimizer slot elements of the owned chunks (buffers have none).
  int64_t owned_slot_elements() const { return owned_slot_elements_; }
  // Owned chunks, keyed by index in partition().chunks().
  const ChunkMap& chunks() const { return chunks_; }
  // Partition indices of the owned chunks, in partition order.
  const std::vector<int64_t>& owned_indices() const {
    return partition_->shard_chunks(layout_.shard_index());
  }
  // The owned chunk with partition index `idx` (which must be owned).
  Chunk* chunk(int64_t idx) const { return chunks_.at(idx).get(); }

  // "job J tensor T (name) chunk C", for messages.
  std::string ChunkName(int32_t tensor, int32_t chunk) const;
  // InvalidArgument "<rpc>: job J worker W not in [0, N)" unless 0 <= worker < N.
  absl::Status CheckWorker(const char* rpc, int32_t worker) const;
  // The chunk (tensor, chunk) of a request: NOT_FOUND if it does not exist,
  // FAILED_PRECONDITION if another shard owns it. Returns its partition index and the chunk.
  absl::StatusOr<std::pair<int64_t, Chunk*>> OwnedChunk(const char* rpc, int32_t tensor,
                                                        int32_t chunk) const;

  // Whether tensor `t` of the layout is a model buffer (TensorSpec.buffer).
  bool is_buffer(int32_t t) const { return buffer_tensors_[t]; }

  // Runs the optimizer on each chunk of `u` (locking one chunk at a time), bumping its version;
  // returns each chunk's staleness (its version before the update minus the base version,
  // at least 0). Chunks of buffer tensors get their gradient added as a plain delta instead
  // (values += grad; no optimizer, schedule, damping or lr_scale) and have no slots.
  std::vector<int64_t> ApplyToChunks(const ChunkUpdate& u) const;

  // See Shard::SetSyncGroup; errors are prefixed "SetSyncGroup: job J".
  absl::Status SetSyncGroup(const std::vector<int32_t>& active, double lr_scale,
                            const Logger* logger) ABSL_LOCKS_EXCLUDED(group_mu_);
  // The barrier group (ascending; empty unless sync) and its lr factor.
  std::pair<std::vector<int32_t>, float> SyncGroup() const ABSL_LOCKS_EXCLUDED(group_mu_);
  // Per worker, whether its Finish counts towards "every worker finished": all workers, or
  // for sync jobs the barrier group's (removed workers push no more).
  std::vector<bool> CountedWorkers() const ABSL_LOCKS_EXCLUDED(group_mu_);

 private:
  explicit JobState(const InitJobRequest& layout) : layout_(layout) {}
  absl::Status BuildStrategies(const OptimizerRegistry& optimizers,
                               const ConsistencyRegistry& consistency, const Logger* logger);
  void BuildChunks();

  const InitJobRequest layout_;
  std::unique_ptr<Partition> partition_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<ConsistencyPolicy> policy_;
  ChunkMap chunks_;
  std::vector<bool> buffer_tensors_;  // Per layout tensor: TensorSpec.buffer.
  int64_t owned_elements_ = 0;
  int64_t owned_slot_elements_ = 0;
  Durability durability_ = Durability::kNone;
  bool sync_mode_ = false;

  // sync: a copy of the policy's barrier group, for GetJobInfo; group_mu_ also serialises
  // SetSyncGroup calls, so the copy and the policy agree.
  mutable absl::Mutex group_mu_;
  std::vector<int32_t> active_workers_ ABSL_GUARDED_BY(group_mu_);  // Ascending; sync only.
  float lr_scale_ ABSL_GUARDED_BY(group_mu_) = 1.0f;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_JOB_STATE_H_
