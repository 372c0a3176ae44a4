// Coordinator: the control plane's core (jobs, node membership, placement, failure handling),
// behind gradmesh_coordinator's JobService and NodeService (proto/coordinator.proto). It knows
// nothing of gRPC: coordinator/service.h adapts it, and tests drive it with a FakeClock.
//
// # Model
//
// Nodes are daemons that registered with NodeInfo (name, role SERVER or WORKER, address,
// slots, host). A job is a JobSpec placed on nodes: shard s on a server node (ps modes only)
// and rank r on a worker node. Each placed unit is a Task; a node's heartbeat answer is the
// complete list of its tasks, which is how every decision below reaches the daemons.
//
// # Nodes and liveness
//
// * Register upserts by name (alive, last seen now). A node keeps its name across restarts
//   and with it its placements. Changing role is refused (FAILED_PRECONDITION) while jobs
//   that are active or SUCCEEDED reference the node. Limits (INVALID_ARGUMENT): slots in
//   1..kMaxNodeSlots, cores and gpus in 0..kMaxNodeSlots, name/address/host at most
//   kMaxNodeFieldBytes bytes.
// * Heartbeat: unknown name -> register_again=true (nothing else happens). A known node that
//   had been declared dead is revived as if it had registered again with its stored NodeInfo.
//   Otherwise last seen = now, its TaskReports are applied, and the answer lists its tasks.
// * A node is dead after heartbeat_timeout_ms without a heartbeat (checked by a monitor thread
//   every heartbeat_interval_ms and at the start of every call that writes), or at once when a
//   heartbeat says `leaving` (the reports of that heartbeat are applied first).
// * Restart: nodes and jobs are in RocksDB (coordinator_store.h). Nodes stored as alive count
//   as alive for restart_grace_ms after start (grace), so running jobs go on; jobs keep
//   their placements, so restarting every daemon with its old name resumes every job.
//
// # Node identity
//
// Every NodeService call comes with NodeCredentials: the per-node token the caller presents
// (metadata `x-gradmesh-node-token`) and, when the transport proved a name (an mTLS client
// certificate, service.h NodeIdentityFn), that name. A call is "as node N" only if
// (a) the proved name is N (with a proved name, a request for another name is
// PERMISSION_DENIED whatever token it holds), or (b) no name was proved and the token's
// SHA-256 equals N's stored hash (token_hash.h; only hashes are kept, in RocksDB too, so a
// coordinator restart keeps every node's token valid).
// * Register of an unknown name, or of a known name whose node is dead, is accepted (the
//   service has already checked the shared node token) and issues a new random 128-bit token
//   (RegisterResponse.node_token); the previous one stops working. Register as node N of a
//   live node N is accepted too (a daemon restarted with the token it kept in its
//   NodeTokenStore, runtime/node_agent.h) and also issues a new token: an older instance
//   still holding the previous one (a copied token file) is locked out, not run beside it.
//   Register of a live node's name not as that node is PERMISSION_DENIED and changes
//   nothing: its address, slots and tasks cannot be taken over. So a daemon that restarts
//   without its token (no store, or a store that lost it) registers again once its previous
//   registration is declared dead (no heartbeat for heartbeat_timeout_ms; at once after a
//   clean `leaving` heartbeat), and the NodeAgent retries until then.
// * Heartbeat not as the named node: PERMISSION_DENIED, nothing happens (no liveness, no
//   reports, no tasks, no job tokens). A known node without a stored hash (a record from
//   before node tokens) is answered register_again; an unknown name too.
// * Reports count only from the node a rank or shard is placed on (see "# Reports"), so with
//   identities bound a node can finish, fail or move only its own tasks.
//
// # Jobs
//
// * SubmitJob: an empty spec.name becomes "job-<unix s>-<4 hex>"; ApplyJobSpecDefaults with
//   num_shards defaulting to the number of alive server nodes; ValidateJobSpec
//   (INVALID_ARGUMENT). An existing id is ALREADY_EXISTS unless `resume` and the job is
//   SUCCEEDED, FAILED or CANCELLED: then it is placed again under the same id and job token,
//   its shards on the same server nodes (their data dirs hold its state; FAILED_PRECONDITION
//   if one of them is not alive, or if num_shards changed), its ranks anew; workers resume
//   from the shards' record (ps) or their checkpoints. Placement refusals are
//   FAILED_PRECONDITION with what is missing and how to fix it (placement.h). The record is
//   written with a synced RocksDB write before the call returns. dry_run does every check and
//   the placement and returns the would-be status (no job token), storing nothing. A refused
//   call changes nothing.
// * The job token is 128 random bits (hex), the same in every task of the job, and kept when
//   the job is resumed. JobService returns it in JobStatus.job_token (the service requires the
//   API token when one is configured, so only authenticated callers see it).
// * States: PENDING at submit -> RUNNING once every rank has reported "running" (or finished);
//   it stays RUNNING while a moved rank restarts (that rank's WorkerPlacement shows
//   "pending"). PAUSED while a shard's node is dead; back to RUNNING (PENDING if it never ran)
//   when that node registers again or heartbeats. SUCCEEDED when every rank reported
//   "succeeded" (also from PAUSED). FAILED when a task reports "failed": message "rank R on
//   node N: <message>" ("shard S on node N: ..." for a server). CANCELLED by CancelJob
//   (FAILED_PRECONDITION for a job that already ended). Final states never change (except by
//   a resume).
// * Tasks a node is given: worker nodes get their ranks of PENDING/RUNNING/PAUSED jobs whose
//   state is pending or running (a rank that succeeded is no longer listed). Server nodes get
//   their shards of PENDING/RUNNING/PAUSED *and SUCCEEDED* jobs, so a finished job's shards keep
//   serving the final model (`gradmesh export` pulls it with the job token); FAILED and
//   CANCELLED jobs' shards are withdrawn. Withdrawing a task means "stop serving/training it";
//   durable shard state stays on disk for a later resume.
// * Task fields: spec (defaults applied), servers = shard addresses in shard order (ps modes),
//   peers = every rank's worker address in rank order (gossip/allreduce; "" for a lost rank),
//   job_token, active_ranks and lr_scale (see sync below; otherwise empty and 1), generation.
// * Generations: one counter per job; whenever something a task depends on changes, the job's
//   counter is incremented and the affected tasks take its value: a moved rank (every rank
//   of a gossip/allreduce job, whose peers changed), a re-formed sync group (every rank and
//   shard), a server that came back at another address (every rank). A task's generation
//   never decreases.
//
// # Reports (HeartbeatRequest.tasks)
//
// A report counts only from the node the rank (or shard) is placed on now; others (e.g. the
// old daemon of a moved rank) are ignored, and so are reports for jobs that ended. Figures
// (step, loss, ...) and "running" (pending -> running) are taken from any generation; the
// final states "succeeded", "failed" and "stopped" only when the report's generation is the
// task's current one or 0 (unknown), so a daemon stopping an outdated task (e.g. to restart
// it with a new generation) cannot fail, finish or move the current one. "stopped" (a daemon
// leaving cleanly, e.g. SIGTERM) moves the rank as if its node had died. Unknown jobs and
// states are ignored (the latter logged).
//
// One rank per node per job in gossip/allreduce: a worker daemon has one peer-service
// address, and peers address ranks by it, so placement, moves and lost-rank assignment never
// give a node a second rank of such a job (placement refuses; a move skips the node). ps-mode
// ranks talk only to shards, so one node may run several ranks of one ps job.
//
// JobProgress: step = minimum over ranks that are not lost; total_steps = the largest reported
// (spec.steps until reports arrive); epoch = that of the slowest rank; epochs = spec.epochs;
// loss = mean over ranks that reported one; samples_per_s = sum over running ranks; accuracy =
// rank 0's once >= 0, else -1; eta_s = remaining steps / step rate over the last 30 s of
// reports (-1 until two distinct steps were seen; 0 when done); checkpoint_step = minimum over
// non-lost ranks that reported (-1 if none has one). Progress-only changes are written to
// RocksDB at most once per progress_persist_interval_ms per job (the monitor thread writes the
// last one); state and placement changes are written at once.
//
// # History
//
// Whenever a job's progress is recomputed and its step is > 0, the progress (step, loss,
// accuracy, samples_per_s, time; a rate of 0, as when the ranks have finished, is replaced by
// the last point's) is offered to the job's history (job_history.h): at most
// history_capacity points spanning the job's life, downsampled when full. It is part of the
// job's record, so it is written with the job's progress (same rate limit) and restored after a
// restart. A resumed job starts a new history.
//
// # Logs
//
// Worker reports carry their task's new log lines (TaskReport.log_lines). Those from the
// rank's current node are kept in memory in a LogTail per (job, rank) (the last 200 lines /
// 64 KiB; common/log_tail.h), also after the job ended, numbered by one counter per job;
// GetLogs reads them. They are not persisted: a restarted coordinator starts empty tails.
//
// # Failures
//
// * Dead worker node: each of its unfinished ranks of active jobs moves to the least-loaded
//   other alive worker node, state "pending", reassignments+1, generation bumped. The new
//   daemon resumes the rank from the shards' record, so no sample range is dropped. A moved
//   rank may exceed its new node's slots (async, ssp, gossip, allreduce), with two limits:
//   gossip/allreduce only consider nodes without a rank of that job (one peer address serves
//   one rank per job), and sync only considers nodes with a free slot: a sync step runs at the
//   pace of its slowest rank, so doubling up one node would slow every rank, and re-forming
//   the group (below) keeps the survivors at full speed.
// * With no candidate the rank is "lost" (node ""), and it is given to the next worker node
//   that registers (or revives) and qualifies (not for sync: see below).
// * sync jobs: while ranks are lost the barrier group is re-formed: active_ranks = ranks not
//   lost (ascending), lr_scale = |active| / num_workers (sync_lr_scaling "linear") or 1
//   ("none"), sent to every rank and shard with a new generation; JobStatus.active_workers =
//   |active|. A re-formed sync job finishes with its survivors (SUCCEEDED once every rank
//   still in the group succeeded; the lowest of them evaluates): a worker that registers
//   later is not given a lost sync rank, because that rank's record is behind the group's
//   step and a lock-step group cannot wait for it. The workers take the new group in place
//   (no restart). If every rank is lost the last group is kept.
// * Dead server node: every active job with a shard there goes PAUSED ("shard S on node N
//   (addr) is down; workers wait for it to come back"); shards never move (their state is on
//   that node). When the node registers again under the same name the jobs resume.
//
// # Reads and compaction
//
// GetJob, ListJobs, ListNodes, GetJobHistory and GetLogs only read (a shared lock; no failure
// checks, no RocksDB writes): liveness is decided on the write paths (Register, Heartbeat,
// SubmitJob, CancelJob) and by the monitor thread (CheckNodes). The job table keeps an index
// in submission order, so heartbeats do not sort it.
// A finished job (SUCCEEDED, FAILED, CANCELLED) stays readable (GetJob, ListJobs, GetLogs;
// its shards keep serving a SUCCEEDED job's model for export) until it is compacted:
// removed from memory and RocksDB once it ended more than finished_job_retention_ms ago, or
// when more than max_finished_jobs finished jobs exist (the oldest ended first). The monitor
// thread compacts (CompactJobs). A compacted job's id is free again; it cannot be resumed.
//
// # Published models
//
// gossip/allreduce jobs have no shards, so worker rank 0 publishes its model (MODEL_STATE) and,
// for TorchScript jobs of any mode, the module file (MODEL_MODULE) with NodeService.PublishModel;
// `gradmesh export` reads them with GetModel (proto/coordinator.proto "Published models").
// A publish is accepted only as the node rank 0 of the job is placed on now (identity as in
// "# Node identity"), for a job that exists (any state), with a consistent header (names,
// shapes, dtypes, total_bytes = 4 x values) and at most max_model_bytes of header and payload;
// everything is checked before anything is written, so a refused publish leaves the stored
// model as it was. The latest model per job and kind is kept in RocksDB (replaced atomically,
// written outside the mutex: a large model does not stall heartbeats) and deleted with the job
// when it is compacted. A model written while its job was compacted is deleted again.
//
// # Watching
//
// Every change of a job's status (state, placement or progress) increments its version and
// wakes WaitForJobChange callers. A waiter never holds a thread beyond its deadline, so the
// service can poll for client cancellation.
//
// Thread safety: every public method may be called concurrently; one mutex guards all state
// (RocksDB writes happen under it: the control plane's rate is a few calls per node per
// second; reads take it shared). WaitForJobChange blocks up to its deadline. The destructor stops
// the monitor thread and writes pending progress.
#ifndef GRADMESH_COORDINATOR_COORDINATOR_H_
#define GRADMESH_COORDINATOR_COORDINATOR_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/log_tail.h"
#include "common/logging.h"
#include "coordinator/clock.h"
#include "coordinator/coordinator_store.h"
#include "coordinator/job_history.h"
#include "coordinator/placement.h"
#include "coordinator/state.pb.h"
#include "coordinator/task_state.h"
#include "proto/coordinator.pb.h"

namespace gradmesh {

// allreduce: how many times a job's ranks start again after one lost a peer before the next
// such failure ends the job (Coordinator::RestartAfterPeerLossLocked).
inline constexpr int kMaxPeerLossRestarts = 5;

class Coordinator {
 public:
  struct Options {
    // Tables (required). Records found there are loaded by Create.
    std::unique_ptr<CoordinatorStore> store;
    // Time source (required, not owned, must outlive the Coordinator).
    const Clock* clock = nullptr;
    // Structured log lines; null discards them. Not owned.
    const Logger* logger = nullptr;
    // Interval daemons are told to heartbeat at (RegisterResponse), ms. Default 500.
    int64_t heartbeat_interval_ms = 500;
    // A node without heartbeats for longer than this is dead, ms. Default 3000.
    int64_t heartbeat_timeout_ms = 3000;
    // After a restart, nodes stored as alive count as alive this long (at least one
    // heartbeat timeout) before their work moves: daemons reconnect only after gRPC's
    // reconnect backoff (up to 5 s) and their heartbeat backoff (up to 2 s), so one timeout
    // of 3 s declared live daemons dead and ran their ranks twice. Default 15000.
    int64_t restart_grace_ms = 15000;
    // Minimum time between two writes of one job's progress-only changes, ms. Default 1000.
    int64_t progress_persist_interval_ms = 1000;
    // How often the monitor thread checks liveness and writes held-back progress, ms (real
    // time). Default 0 = heartbeat_interval_ms; negative = no thread (tests call CheckNodes
    // and FlushProgress themselves).
    int64_t monitor_interval_ms = 0;
    // Placement strategies by name (the job's mode picks one: DefaultPlacementFor).
    PlacementRegistry placements = PlacementRegistry::WithBuiltins();
    // Source of job tokens. Default: 128 bits from std::random_device, as 32 hex digits.
    std::function<std::string()> token_source;
    // Most progress points kept per job for the dashboard (job_history.h). Default 240.
    int history_capacity = kDefaultHistoryCapacity;
    // A finished job is compacted this long after it ended, ms. Default 86400000 (1 day);
    // 0 = no time limit.
    int64_t finished_job_retention_ms = 86'400'000;
    // At most this many finished jobs are kept (the oldest ended are compacted first).
    // Default 1000; 0 = no count limit.
    int64_t max_finished_jobs = 1000;
    // Most bytes (header and payload) of one published model. Default 2 GiB.
    int64_t max_model_bytes = int64_t{2} << 30;
  };

  // Who is calling NodeService (see "# Node identity").
  struct NodeCredentials {
    std::string token;        // Presented per-node token ("" if none).
    std::string proved_name;  // Node name proved by the transport (mTLS); "" if none.
  };

  // Bounds of NodeInfo (Register refuses more with INVALID_ARGUMENT).
  static constexpr int kMaxNodeSlots = 1024;
  static constexpr size_t kMaxNodeFieldBytes = 256;

  // Validates options (INVALID_ARGUMENT naming the field), loads the tables and starts the
  // monitor thread.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(Options options);
  ~Coordinator();

  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // ---- JobService (see the header comment and proto/coordinator.proto).
  absl::StatusOr<JobStatus> SubmitJob(const SubmitJobRequest& request);
  // NOT_FOUND for an unknown id.
  absl::StatusOr<JobStatus> GetJob(const std::string& job_id);
  // Newest first (created_ms, then submission order).
  std::vector<JobStatus> ListJobs();
  // NOT_FOUND for an unknown id; FAILED_PRECONDITION if the job already ended.
  absl::StatusOr<JobStatus> CancelJob(const std::string& job_id);
  // The job's progress history (see "# History" above). NOT_FOUND for an unknown id.
  absl::StatusOr<coordinator_state::JobHistory> GetJobHistory(const std::string& job_id);
  // The job's log lines (see "# Logs" above) of rank `rank` (-1: every rank) with a sequence
  // number above `after_sequence`, ascending, at most kMaxLogLinesPerCall lines / 1 MiB (the
  // oldest; call again for the rest), and the job's state. NOT_FOUND for an unknown id;
  // INVALID_ARGUMENT for a rank outside -1..num_workers-1.
  absl::StatusOr<GetLogsResponse> GetLogs(const std::string& job_id, int rank,
                                          int64_t after_sequence);
  static constexpr int kMaxLogLinesPerCall = 2000;
  // Every registered node (info and liveness as last decided), by name.
  std::vector<coordinator_state::NodeRecord> ListNodes();

  struct JobView {
    JobStatus status;
    int64_t version = 0;  // Increases with every change of the job's status; starts at 1.
  };
  // Waits until the job's version exceeds `after_version` or `deadline` passes (real time),
  // then returns its status and version (unchanged version = timed out). NOT_FOUND for an
  // unknown id; CANCELLED once the coordinator is shutting down.
  absl::StatusOr<JobView> WaitForJobChange(const std::string& job_id, int64_t after_version,
                                           absl::Time deadline);

  // ---- NodeService.
  // INVALID_ARGUMENT for a missing name/address, a role other than SERVER/WORKER, or NodeInfo
  // outside the limits above; PERMISSION_DENIED for a live node's name not as that node.
  absl::StatusOr<RegisterResponse> Register(const RegisterRequest& request,
                                            const NodeCredentials& credentials);
  // INVALID_ARGUMENT for an empty node name; PERMISSION_DENIED when not as that node.
  absl::StatusOr<HeartbeatResponse> Heartbeat(const HeartbeatRequest& request,
                                              const NodeCredentials& credentials);

  // ---- Published models (see "# Published models").
  // Longest tensor name and largest header of a published model (INVALID_ARGUMENT /
  // RESOURCE_EXHAUSTED beyond them).
  static constexpr size_t kMaxModelTensorNameBytes = 1024;
  static constexpr int64_t kMaxModelHeaderBytes = 8 << 20;
  // Every check of PublishModel that does not need the payload, so the service can refuse a
  // publish before receiving it: INVALID_ARGUMENT for a malformed header, RESOURCE_EXHAUSTED
  // above max_model_bytes, NOT_FOUND for an unknown job, PERMISSION_DENIED unless the call is
  // as header.node and rank 0 of the job is placed there. Who publishes is checked first, under
  // the coordinator's lock; the header's tensors (up to kMaxModelHeaderBytes of them) after,
  // outside it, so that a refused caller costs the other RPCs nothing.
  absl::Status CheckModelHeader(const ModelHeader& header, const NodeCredentials& credentials);
  // One publish of each kind per job at a time (the service holds one between a checked
  // header and the end of its payload, which it buffers up to header.total_bytes, so two
  // publishers' writes cannot land out of order either): ABORTED while another is in flight,
  // which publishers retry with backoff (one left by a node that lost rank 0 holds it until
  // that call ends: its deadline, or its connection found dead). EndPublish frees it.
  absl::Status BeginPublish(const ModelHeader& header);
  void EndPublish(const ModelHeader& header);
  // CheckModelHeader, then INVALID_ARGUMENT unless the payload has header.total_bytes bytes;
  // then stores the model (published_ms = now), replacing the previous one of that kind.
  absl::Status PublishModel(ModelHeader header, absl::string_view payload,
                            const NodeCredentials& credentials);
  // Streams the job's latest model of `kind` to the callbacks (CoordinatorStore::ReadModel; a
  // callback returning false ends it with CANCELLED). NOT_FOUND for an unknown job;
  // INVALID_ARGUMENT for an unspecified kind; FAILED_PRECONDITION when none was published
  // yet, or for MODEL_MODULE when the job's model is not "torchscript".
  absl::Status GetModel(const std::string& job_id, ModelKind kind,
                        const std::function<bool(const ModelHeader&)>& on_header,
                        const std::function<bool(absl::string_view)>& on_data);

  // Declares nodes dead whose last heartbeat is older than the timeout, and acts on it.
  void CheckNodes();
  // Compacts finished jobs past the retention period or count (see "# Reads and compaction").
  // Returns how many were removed; on a RocksDB error nothing is removed (logged, retried by
  // the next call).
  int CompactJobs();
  // Writes progress held back by progress_persist_interval_ms that is due.
  void FlushProgress();

 private:
  struct NodeEntry {
    coordinator_state::NodeRecord record;
    int64_t last_seen_ms = 0;
    int64_t grace_until_ms = 0;  // Alive until then whatever last_seen_ms says (restart).
  };
  struct JobEntry {
    coordinator_state::JobRecord record;
    int64_t version = 1;
    std::string published;  // Status as of the last version bump (updated_ms cleared).
    int64_t last_persist_ms = 0;
    bool dirty = false;                                    // Progress changed since the last write.
    std::deque<std::pair<int64_t, int64_t>> step_samples;  // (ms, job step), for eta.
    // Index = rank: the last log lines the rank's heartbeats brought (memory only), numbered
    // by log_sequence across the job's ranks.
    std::vector<std::shared_ptr<LogTail>> rank_logs;
    int64_t log_sequence = 0;
    // Index = rank: each rank's state, parsed once when the record entered (submit, load).
    // record.status().workers(r).state() is its name, kept equal by SetRankState.
    std::vector<TaskState> rank_states;
    // allreduce: restarts after a rank lost a peer since the job's checkpoint last moved, and
    // that checkpoint step (RestartAfterPeerLossLocked; memory only).
    int peer_restarts = 0;
    int64_t restart_checkpoint = -1;
    // A final model (MODEL_STATE, final) was published (read back from the store at Load for
    // active gossip jobs).
    bool final_published = false;
    // sync: when the group was last re-formed without lost ranks (memory only).
    int64_t reformed_ms = 0;
  };
  // The rank whose node publishes the job's model: 0; in gossip, with rank 0 lost, the lowest
  // rank not lost (it gathers the finals in rank 0's place: worker/gossip/gossip_mode.cc).
  static int PublisherRank(const JobEntry& job);
  // Sets rank `rank`'s state: the enum and the placement's state string.
  static void SetRankState(JobEntry* job, int rank, TaskState state);

  explicit Coordinator(Options options);
  absl::Status Load();
  void MonitorLoop();
  int CompactJobsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK if `credentials` act as node `name` (see "# Node identity"); PERMISSION_DENIED naming
  // `what` (the call) otherwise. `node` is the stored entry (null: unknown name).
  absl::Status CheckIdentityLocked(const std::string& name, const NodeEntry* node,
                                   const NodeCredentials& credentials, absl::string_view what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // CheckModelHeader's checks of the caller, job and kind (not the tensors); returns the job's
  // record.sequence() (which tells a job compacted and submitted again under the same id from
  // the one that was checked).
  absl::StatusOr<int64_t> CheckPublisherLocked(const ModelHeader& header,
                                               const NodeCredentials& credentials)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // All *Locked methods need mu_.
  int64_t Now() const { return options_.clock->NowMs(); }
  void CheckNodesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t last_check_ms_ ABSL_GUARDED_BY(mu_) = 0;  // CheckNodesLocked's last run.
  // This process's start (Unix µs): the in-memory log lines' numbering (GetLogs).
  const int64_t incarnation_;
  // Acts on nodes that the caller has just set alive=false, each with why: moves the ranks of
  // all of them before any job's sync group is re-formed, so nodes lost in one sweep count as
  // lost together.
  struct DeadNode {
    NodeEntry* node;
    std::string reason;
  };
  void MarkDeadLocked(const std::vector<DeadNode>& dead) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // MarkDeadLocked's parts for one job and dead node: moves its unfinished ranks off a worker
  // node (no group update), or marks its shards on a server node down and pauses it. True if
  // anything changed.
  bool MoveRanksOffLocked(JobEntry* job, const NodeEntry& node, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool PauseShardsOnLocked(JobEntry* job, const NodeEntry& node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Node (re)appeared: addresses, paused jobs, lost ranks.
  void NodeUpLocked(NodeEntry* node, bool address_changed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves rank `rank` of `job` off its node (which must not be chosen again). Callers have
  // marked the node dead (alive=false) first.
  void MoveRankLocked(JobEntry* job, int rank, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An allreduce job with checkpoints whose rank `rank` (on `node`) failed with `message`:
  // if the failure is a lost peer (UNAVAILABLE / DEADLINE_EXCEEDED) and the job has restarts
  // left (kMaxPeerLossRestarts since its checkpoint last moved), starts every rank again (new
  // generation) and returns true; false: the job fails.
  bool RestartAfterPeerLossLocked(JobEntry* job, int rank, const std::string& node,
                                  const std::string& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AssignRankLocked(JobEntry* job, int rank, const NodeEntry& node)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // sync jobs: re-forms the barrier group from the ranks that are not lost, if it changed;
  // with every rank lost, keeps the group whole (record.awaiting_whole_group) if it was whole,
  // and re-forms nothing until every rank is placed again.
  void UpdateGroupLocked(JobEntry* job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void BumpGenerationLocked(JobEntry* job, bool all_ranks, bool all_shards, int rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyReportLocked(const NodeEntry& node, const TaskReport& report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends a worker report's log lines to its rank's tail (from the rank's current node).
  void AppendLogsLocked(const NodeEntry& node, const TaskReport& report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetStateLocked(JobEntry* job, JobState state, const std::string& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Recomputes progress and the derived state transitions (RUNNING, SUCCEEDED).
  void RefreshLocked(JobEntry* job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A gossip job with a lost rank whose every other rank has succeeded, and whose final model
  // was published (by rank 0, or by the rank that gathered in its place): it is done.
  static bool GossipSurvivorsDone(const JobEntry& job);
  // The SUCCEEDED message of such a job: which ranks were lost.
  static std::string LostRanksNote(const JobEntry& job);
  // Offers the job's progress (once its step is > 0) to its history.
  void RecordHistoryLocked(JobEntry* job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes a change (version, updated_ms, watchers) and schedules the write: at once when
  // `persist_now`, else progress-rate-limited.
  void ChangedLocked(JobEntry* job, bool persist_now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes the scheduled records; errors are logged and returned (the records stay
  // scheduled, so the next call or the monitor thread retries).
  absl::Status PersistLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<JobPlacement> PlaceLocked(const JobSpec& spec, const std::string& strategy,
                                           const std::string& exclude_job, bool skip_shards) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // SubmitJob of an id in use: ALREADY_EXISTS unless `resume` and the job ended; then the
  // shard nodes a ps job must keep (FAILED_PRECONDITION if one is not alive or num_shards
  // changed; empty when there are none to keep). Empty for a new id.
  absl::StatusOr<std::vector<std::string>> ResumableShardNodesLocked(const JobSpec& spec,
                                                                     const JobEntry* existing,
                                                                     bool resume) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A PENDING job's record as placed (every rank "pending"; no token, no sequence yet).
  coordinator_state::JobRecord NewJobRecordLocked(const JobSpec& spec,
                                                  const JobPlacement& placement,
                                                  const std::string& strategy, int64_t generation,
                                                  int64_t created_ms, int64_t now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Jobs in submission order (deterministic handling of several jobs at once).
  std::vector<JobEntry*> JobsInOrderLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a job from jobs_ and the index (memory only).
  void EraseJobLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ranks/shards of active jobs per node name.
  std::map<std::string, int> UsedSlotsLocked(const std::string& exclude_job) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<Task> TasksForLocked(const NodeEntry& node) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NodeAddressLocked(const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NewToken();

  // Constant after construction.
  std::unique_ptr<CoordinatorStore> store_;
  const Options options_;  // Without the store (moved to store_).

  absl::Mutex mu_;
  absl::CondVar changed_;  // Signalled on every job version bump and on shutdown.
  std::map<std::string, NodeEntry> nodes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, JobEntry> jobs_ ABSL_GUARDED_BY(mu_);
  // jobs_ by record.sequence() (submission order); entries point into jobs_ (std::map nodes
  // are stable).
  std::map<int64_t, JobEntry*> by_sequence_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> persist_jobs_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> persist_nodes_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<std::string, int>> publishing_ ABSL_GUARDED_BY(mu_);  // (job, kind).
  int64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;

  std::thread monitor_;
};

}  // namespace gradmesh

#endif  // GRADMESH_COORDINATOR_COORDINATOR_H_
