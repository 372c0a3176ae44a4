// Shard: the core of one parameter-server shard, independent of any transport.
//
// A shard holds, for each job it serves, the chunks of the job's tensors that the partitioner
// assigns to it (common/partitioner.h), with per-element optimizer slots and a version per
// chunk. Pushes are validated completely (ownership, length, dtype, finiteness, worker range)
// before anything changes, so a bad request never alters state; then the job's consistency
// policy decides when the optimizer runs. Each chunk has its own lock, so pushes from many
// workers to different chunks proceed in parallel. Retried pushes (same job, worker and
// request id, within the last `dedupe_window` requests of that worker) are acknowledged and
// not applied again.
//
// Durability (per job, DurabilitySpec; needs ShardOptions.store):
//   none          memory only.
//   periodic      snapshots (values, slots, versions, worker progress, recent request ids)
//                 every N updates or T seconds; a crash loses the updates since the last one.
//   every_update  each update is appended to the store's log (RocksDB WAL) before it is
//                 applied and acknowledged, under a per-job lock that also fixes the order of
//                 updates, so replaying the log over the last snapshot reproduces the state
//                 exactly; snapshots bound the replay.
// Create() restores every job found in the store (snapshot, then log replay), so a shard
// restarted on the same --data_dir carries on, and replayed request ids are still recognised
// as duplicates.
//
// Elastic sync (SetSyncGroup): a sync job's barrier group and learning-rate factor can be
// changed while it runs (see server/consistency.h for steps in progress). Each update carries
// the factor it was applied with, and every_update logs it, so log replay is exact. The group
// itself is not persisted: a restored job starts with all ranks and factor 1 until the
// coordinator re-sends the group (every heartbeat, 500 ms). Meanwhile the group is a superset
// of the right one, so survivors' steps only wait at the barrier; none completes wrongly
// unless a removed worker is still alive and pushing.
//
// The gRPC adapter (server/parameter_service.h) only converts between wire and these calls;
// the request/response types are the proto messages of proto/gradmesh.proto.
//
// Shard is a facade over one set of parts per job: JobState (server/job_state.h: layout,
// chunks, optimizer, policy, sync group), RequestLedger (server/request_ledger.h: dedupe
// window, per-worker progress, counters), ShardDurability (server/shard_durability.h: log,
// snapshots, restore) and PullEncoder (server/pull_encoder.h: dense, fp16/bf16 and "changes"
// pulls); push decoding is server/push_decoding.h.
//
// Thread safety: all methods may be called concurrently. Calls block on chunk and job locks,
// on the store (durable jobs) and on the consistency policy (sync pushes, ssp pulls, bounded
// by the job's barrier timeout).
#ifndef GRADMESH_SERVER_SHARD_H_
#define GRADMESH_SERVER_SHARD_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/optimizer.h"
#include "compression/compressor.h"
#include "proto/gradmesh.pb.h"
#include "server/consistency.h"
#include "server/push_decoding.h"
#include "server/shard_store.h"

namespace gradmesh {

struct Chunk;  // server/job_state.h

struct ShardOptions {
  // Retried-push detection: request ids remembered per (job, worker). Default 4096.
  int64_t dedupe_window = 4096;
  // Buckets of the staleness histogram (the last one counts >= buckets-1). Default 16.
  int32_t staleness_buckets = 16;
  // Optimizers and consistency policies known to this shard. Default: the built-ins.
  OptimizerRegistry optimizers = OptimizerRegistry::WithBuiltins();
  ConsistencyRegistry consistency = ConsistencyRegistry::WithBuiltins();
  // Codecs of compressed pushes and pulls. Default: the built-ins.
  CompressorRegistry compressors = CompressorRegistry::WithBuiltins();
  // Durable state; null means no durability is available (jobs asking for it are refused).
  // Owned by the shard.
  std::shared_ptr<ShardStore> store;
  // Not owned; may be null.
  const Logger* logger = nullptr;
};

// Thread safety: every method may be called concurrently (see the file comment; lock order
// below). One parameter-server shard.
class Shard {
 public:
  // InvalidArgument for nonsensical options; the store's error if its state cannot be
  // restored.
  static absl::StatusOr<std::unique_ptr<Shard>> Create(ShardOptions options);
  ~Shard();

  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  absl::StatusOr<InitJobResponse> InitJob(const InitJobRequest& request);
  absl::StatusOr<PushResponse> Push(const PushRequest& request);
  // Fills `response` (passed in so large payloads are written once, in place).
  absl::Status Pull(const PullRequest& request, PullResponse* response);
  absl::Status Finish(const FinishRequest& request);
  absl::StatusOr<JobInfoResponse> GetJobInfo(const JobInfoRequest& request);
  // Names of the jobs this shard holds, sorted.
  std::vector<std::string> JobNames() const;

  // Sets the barrier group of sync job `job`: the ranks whose pushes complete a step (empty:
  // all ranks) and the factor on the learning rate of its updates (in (0, 1]). NOT_FOUND for
  // an unknown job, FAILED_PRECONDITION if the job is not sync, INVALID_ARGUMENT for a rank
  // out of range, a repeated rank or a bad lr_scale; nothing changes on error. Idempotent.
  // Does not block on barriers; a step waiting for a removed worker completes in the calls
  // of the workers still in the group.
  absl::Status SetSyncGroup(const std::string& job, const std::vector<int32_t>& active,
                            double lr_scale);

 private:
  // Lock order: init_mu_ (job creation), then mu_ (the job map, held only to look up or insert
  // a job), then a job's own locks, whose order the job's parts document (ShardDurability:
  // apply lock, chunk, snapshot bookkeeping, ledger; PullEncoder: chunk, then what was sent;
  // JobState: sync group, then the policy). codecs_ has its own leaf lock.
  struct Job;
  explicit Shard(ShardOptions options);
  absl::StatusOr<std::shared_ptr<Job>> FindJob(const std::string& name);
  // True if the job exists with this layout; FAILED_PRECONDITION if it exists with another.
  absl::StatusOr<bool> JobExists(const InitJobRequest& layout) ABSL_LOCKS_EXCLUDED(mu_);
  // Builds an empty job (partition, optimizer, policy, chunks) from a validated layout.
  absl::StatusOr<std::shared_ptr<Job>> BuildJob(const InitJobRequest& layout) const;
  // Makes `job` durable (if it asks to be) and visible, unless one of its name exists by now.
  absl::StatusOr<bool> AddJob(const std::string& name, std::shared_ptr<Job> job)
      ABSL_LOCKS_EXCLUDED(init_mu_, mu_);
  // Logs (durable jobs, unless replaying) and applies an update; records its requests.
  absl::Status ApplyUpdate(Job* job, const ChunkUpdate& update, bool replay);
  absl::Status Restore();
  absl::Status RestoreJob(const ShardStore::StoredJob& stored);
  // Validates a push completely and turns it into an update of `targets`; gradients that
  // need decoding or realignment live in `scratch`.
  absl::Status PushUpdate(const Job& job, const PushRequest& request, ChunkUpdate* update,
                          std::vector<Chunk*>* targets, std::vector<std::vector<float>>* scratch);
  // After a worker's first Finish: logs the job's statistics if every worker has finished.
  void MaybeLogJobStats(const Job& job);

  const ShardOptions options_;
  CodecCache codecs_{&options_.compressors};  // Codecs of pushes and fp16/bf16 pulls.
  absl::Mutex init_mu_;                       // Serialises job creation (taken before mu_).
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_SHARD_H_
