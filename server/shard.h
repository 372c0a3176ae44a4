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
//   every_update  each update is appended to the store's log (append-only files beside the
//                 RocksDB, concurrent updates written together) before it is applied and
//                 acknowledged, and updates are applied in log order, so replaying the log
//                 over the last snapshot reproduces the state exactly; snapshots bound the
//                 replay.
// Create() restores every job found in the store (snapshot, then log replay), so a shard
// restarted on the same --data_dir carries on, and replayed request ids are still recognised
// as duplicates.
//
// Two-phase sync (InitJobRequest.commit_steps; server/sync_commits.h): a sync step whose
// barrier completes is held, not applied; its pushes are answered with this shard's part of
// the averaged gradient's squared norm, and the first pull that commits the step
// (PullRequest.commit: the workers' clip coefficient, or skip) applies it through the same
// log-and-apply path as any update. That is how sync clips by the global norm and skips a
// non-finite step on every shard alike.
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
// Waiting (sync pushes, ssp pulls) takes no thread in PushAsync/PullAsync: the call is parked
// in the job's consistency policy with its completion and released by another worker's push,
// the shard's WaitTimer (barrier timeout) or the caller's WaitCancel; at most
// limits.max_waiting_pushes calls wait at once. No policy lock is held while a sync step is
// applied and logged (server/consistency.h).
//
// Thread safety: all methods may be called concurrently. Calls block on chunk and job locks
// and on the store (durable jobs); Push and Pull (the blocking forms) also wait for the
// consistency policy, bounded by the job's barrier timeout.
#ifndef GRADMESH_SERVER_SHARD_H_
#define GRADMESH_SERVER_SHARD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/optimizer.h"
#include "common/partitioner.h"
#include "compression/compressor.h"
#include "proto/gradmesh.pb.h"
#include "server/consistency.h"
#include "server/push_decoding.h"
#include "server/shard_limits.h"
#include "server/shard_store.h"
#include "server/wait_timer.h"

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
  // What one InitJob may ask for, jobs held, waiting pushes and the memory budget
  // (server/shard_limits.h). Default: ShardLimits's defaults (no memory budget).
  ShardLimits limits;
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

  const ShardLimits& limits() const { return options_.limits; }

  // Validates every field before anything is allocated (server/init_job_validation.h):
  // INVALID_ARGUMENT naming the field; RESOURCE_EXHAUSTED when the shard holds
  // options.limits.max_jobs jobs or the job's memory does not fit the budget (naming what it
  // needs and what is left). Nothing changes on error. The job's memory stays reserved while
  // the shard holds it.
  // `incarnation` (InitJobRequest.incarnation; the service passes the hash of the caller's
  // job token, "" without tokens) replaces a held job of the same name whose incarnation
  // differs, both being non-empty: its state, memory and durable records are dropped first
  // (event=job_replaced). Otherwise an existing job with the same layout answers created=false
  // and one with another layout FAILED_PRECONDITION.
  absl::StatusOr<InitJobResponse> InitJob(const InitJobRequest& request,
                                          const std::string& incarnation = "");
  // Completions of PushAsync and PullAsync: called exactly once, on the calling thread if the
  // call did not wait, otherwise on the thread that released it (another worker's push, the
  // shard's timer at the barrier timeout, a canceller); never under a shard lock.
  using PushDone = std::function<void(absl::StatusOr<PushResponse>)>;
  using PullDone = std::function<void(absl::Status)>;

  // A push, without taking a thread while it waits: a sync push that must wait for the other
  // workers of its step is parked in the job's policy, with `done`, and PushAsync returns.
  // `request` need only stay valid until PushAsync returns. RESOURCE_EXHAUSTED (nothing
  // changes) when options.limits.max_waiting_pushes calls already wait on this shard. With
  // `cancel` (may be null; see WaitCancel), a waiting push can be withdrawn: nothing of it is
  // applied, its request id is forgotten, and `done` gets CANCELLED.
  // With PushRequest.pull, the pull runs once the push completed OK and its values land in
  // PushResponse.pulled; the request is refused whole (nothing applied) if the pull is bad.
  // `dense` (may be null): the raw data of request.chunks(i), decoded by the transport
  // (rpc/tensor_wire.h DecodePushRequest), used where (*dense)[i].present; like `request`, it
  // need only stay valid until PushAsync returns.
  void PushAsync(const PushRequest& request, PushDone done, WaitCancel* cancel = nullptr,
                 const DenseChunks* dense = nullptr);
  // A pull the same way (an ssp pull waits for the slowest worker). Fills `response` (passed in
  // so large payloads are written once, in place); `request` and `response` must stay valid
  // until `done` has run.
  void PullAsync(const PullRequest& request, PullResponse* response, PullDone done,
                 WaitCancel* cancel = nullptr);
  // Blocking forms of PushAsync and PullAsync (they wait on the calling thread).
  absl::StatusOr<PushResponse> Push(const PushRequest& request);
  absl::Status Pull(const PullRequest& request, PullResponse* response);
  // Pushes and pulls parked in this shard's policies now.
  int64_t waiting() const { return waiting_.waiting(); }
  absl::Status Finish(const FinishRequest& request);
  absl::StatusOr<JobInfoResponse> GetJobInfo(const JobInfoRequest& request);
  // Names of the jobs this shard holds, sorted.
  std::vector<std::string> JobNames() const;
  // Bytes reserved by the jobs held (InitJob estimates plus grown pull caches) and by the
  // open shared-memory channels (ReserveBytes), and the budget's limit.
  int64_t memory_reserved() const { return budget_.used(); }
  // Reserves `bytes` of the --max_memory_bytes budget for something other than a job (a
  // shared-memory channel's areas) until the reservation is destroyed (the shard outlives
  // it). RESOURCE_EXHAUSTED naming `what` and what is left when it does not fit.
  absl::StatusOr<MemoryReservation> ReserveBytes(int64_t bytes, const std::string& what);
  int64_t memory_limit() const { return budget_.limit(); }

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
  // Whether a job of layout.job() is held: kSame with this layout (incarnation aside), kStale
  // from another incarnation (both non-empty); FAILED_PRECONDITION if held with another layout.
  enum class Existing { kNone, kSame, kStale };
  absl::StatusOr<Existing> JobExists(const InitJobRequest& layout) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes job `name` (another incarnation than `incarnation`) and deletes its durable state.
  absl::Status DropStaleJob(const std::string& name, const std::string& incarnation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(init_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Reserves the memory of the job of validated layout `layout` with `partition`
  // (`restore`: beyond the budget if need be). RESOURCE_EXHAUSTED, naming what it needs and
  // what is left, when it does not fit.
  absl::StatusOr<MemoryReservation> ReserveMemory(const InitJobRequest& layout,
                                                  const Partition& partition, bool restore);
  // Builds an empty job (partition, optimizer, policy, chunks) from a validated layout whose
  // memory is reserved.
  absl::StatusOr<std::shared_ptr<Job>> BuildJob(const InitJobRequest& layout,
                                                MemoryReservation memory);
  // RESOURCE_EXHAUSTED if the shard holds max_jobs jobs.
  absl::Status CheckJobCount(const std::string& name) const ABSL_LOCKS_EXCLUDED(mu_);
  // Makes `job` durable (if it asks to be) and visible, unless one of its name exists by now.
  absl::StatusOr<bool> AddJob(const std::string& name, std::shared_ptr<Job> job)
      ABSL_LOCKS_EXCLUDED(init_mu_, mu_);
  // Logs (durable jobs, unless replaying) and applies an update; records its requests.
  absl::Status ApplyUpdate(Job* job, const ChunkUpdate& update, bool replay);
  absl::Status Restore();
  // Logs orphaned_update_log for each update log under the store whose job `stored` lacks.
  void WarnOrphanedLogs(const std::vector<ShardStore::StoredJob>& stored) const;
  absl::Status RestoreJob(const ShardStore::StoredJob& stored);
  // Validates a push completely and turns it into an update of `targets`; gradients that
  // need decoding or realignment live in `scratch`.
  absl::Status PushUpdate(const Job& job, const PushRequest& request, const DenseChunks* dense,
                          ChunkUpdate* update, std::vector<Chunk*>* targets,
                          std::vector<std::vector<float>>* scratch);
  // After a worker's first Finish: logs the job's statistics if every worker has finished.
  void MaybeLogJobStats(const Job& job);
  // PushAsync and PullAsync up to the policy: an error before the call reaches it is returned
  // (the caller completes with it); otherwise `*done` has been handed on.
  absl::Status StartPush(const PushRequest& request, const DenseChunks* dense, PushDone* done,
                         WaitCancel* cancel);
  struct PullPlan;
  // Checks a pull completely (job, worker, chunks, codec) and says what it reads. A bad worker
  // is reported for `worker_rpc` ("Pull", or "Push" for a push's own pull).
  absl::StatusOr<PullPlan> PlanPull(const PullRequest& request, const char* worker_rpc);
  // PushRequest.pull, planned: InvalidArgument unless it names the push's job and worker and
  // commits nothing; FailedPrecondition for a commit_steps job; otherwise what PlanPull says.
  absl::StatusOr<PullPlan> PlanFusedPull(const PushRequest& request);
  absl::Status StartPull(const PullRequest& request, PullResponse* response, PullDone* done,
                         WaitCancel* cancel);
  // Hands a planned pull to its job's policy, which encodes it into `response` (valid until
  // `done` has run) when the pull may proceed.
  void ReadPull(PullPlan plan, PullResponse* response, PullDone done, WaitCancel* cancel);
  // commit_steps jobs: commits request.commit() (server/sync_commits.h). False if the shard
  // does not hold the step (the pull answers commit_missing); INVALID_ARGUMENT if the job does
  // not commit its steps or the commit is malformed.
  absl::StatusOr<bool> CommitStep(const std::shared_ptr<Job>& job, const PullRequest& request);

  const ShardOptions options_;
  CodecCache codecs_{&options_.compressors};               // Codecs of pushes and fp16/bf16 pulls.
  MemoryBudget budget_{options_.limits.max_memory_bytes};  // Thread-safe; a leaf lock.
  // Pushes and pulls waiting in consistency policies (limits.max_waiting_pushes): a waiting
  // path calls waiting_.Enter() before it waits and Exit() after. Thread-safe; a leaf lock.
  WaitCounter waiting_{options_.limits.max_waiting_pushes};
  absl::Mutex init_mu_;  // Serialises job creation (taken before mu_).
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  // Deadlines of waiting pushes and pulls, and hand-offs, for every job's policy. Reset by the
  // destructor after every job's waits are aborted (and so before the jobs are destroyed).
  std::unique_ptr<WaitTimer> timer_ = std::make_unique<WaitTimer>();
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_SHARD_H_
