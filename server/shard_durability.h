// ShardDurability: one job's durability over the shard's ShardStore (server/shard_store.h):
// the write-ahead log of updates (every_update, server/update_log.h), snapshots and when to
// take them, and restoring the job from what the store holds (snapshot, then log replay).
//
//   Apply         every update goes through it. With every_update (and not replaying) it is a
//                 pipeline with group commit:
//                   1. the pushing thread encodes its UpdateRecord, referencing the gradients'
//                      bytes (no copy), outside every lock;
//                   2. it queues the record; the first queued thread while no write is in
//                      progress becomes the leader, takes the whole queue, gives the records
//                      consecutive seqs in queue order and writes them with one writev (and
//                      one fdatasync with fsync); the others wait for it. A failed write keeps
//                      nothing of the batch and takes no seqs: those updates fail, none is
//                      applied or acknowledged;
//                   3. the leader then applies the batch's updates in seq order (apply lock
//                      shared; the callers' `apply`, which stay valid while they wait), once
//                      the batch before has been applied, so the apply order is the log order
//                      and replay over the snapshot is exact, and completes them: each waiting
//                      thread is woken once. The next leader writes the next batch meanwhile.
//                 Otherwise it takes the apply lock shared and updates run concurrently
//                 (per-chunk locks).
//   MaybeSnapshot takes the apply lock exclusively, writes every chunk to a chunk file
//                 (server/chunks_file.h: the one of two the stored snapshot does not name, from
//                 the chunks' memory: a checksum pass and the kernel's copy) and copies the
//                 ledger, releases it, syncs the file with fsync, then writes one atomic batch
//                 naming the file (which also drops the RocksDB log records of older stores up
//                 to the snapshot) and rotates the log files, deleting the segments the
//                 snapshot covers. A disk that stalls the file's writes stalls pushes too; the
//                 log's writes, in every push, would stall them anyway. Due every
//                 snapshot_every_updates updates, every LogBytesPerSnapshot of log, or every
//                 snapshot_every_seconds (not for sync jobs, so all shards of a sync job snapshot
//                 at the same steps); a failed one is retried no sooner than 5 s later.
//   Restore       loads the stored chunks and ledger, then replays the log in order.
// The on-disk format is ShardStore's keys holding the messages of server/state.proto, and
// UpdateLog's segment files of UpdateRecords.
//
// Thread safety: all methods may be called concurrently (Restore before the job is shared).
// Lock order: apply_mu_ (shared by updates, exclusive for snapshots), then one Chunk::mu at a
// time (JobState), then mu_ (snapshot bookkeeping), then the RequestLedger's lock. log_mu_
// (the group-commit queue) and order_mu_ (whose turn it is to apply) are leaves, never held
// while another lock is taken; a batch waits for its turn before taking apply_mu_. mu_ is
// never held while apply_mu_ is taken or the store is written. log_ is used only by the
// thread that set writing_ (the leader, or a snapshot rotating the log).
#ifndef GRADMESH_SERVER_SHARD_DURABILITY_H_
#define GRADMESH_SERVER_SHARD_DURABILITY_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "server/consistency.h"
#include "server/job_state.h"
#include "server/request_ledger.h"
#include "server/shard_store.h"
#include "server/state.pb.h"
#include "server/update_log.h"

namespace gradmesh {

// every_update: snapshot once LogBytesPerSnapshot(the job's state bytes on this shard) have
// been logged: kLogBytesPerSnapshot, or kLogPerStateBytes times the state (values and
// optimizer slots) if that is more. It bounds replay and the log's files (about 4x it per job:
// the live segment, the previous one until the next snapshot, and two spares), and amortises
// snapshots: each writes the whole state (a chunk file, server/chunks_file.h), so with
// whole-state pushes a snapshot per push would double what the log costs. A fixed bound alone
// made a large shard snapshot after nearly every push (a 64 MiB state pushed whole: one
// snapshot per two pushes, every_update at 0.22x of none; 0.74x now, with the chunk files).
inline constexpr int64_t kLogBytesPerSnapshot = 128ll << 20;
inline constexpr int64_t kLogPerStateBytes = 4;
int64_t LogBytesPerSnapshot(int64_t state_bytes);

// Thread safety: every method may be called concurrently (Restore before the job is shared);
// lock order apply_mu_ > Chunk::mu > mu_ > the ledger's lock; log_mu_ and order_mu_ are
// leaves. One job's durability.
class ChunksFileWriter;

class ShardDurability {
 public:
  // `job` and `ledger` must outlive this; `store` may be null only for jobs without
  // durability. `logger` may be null.
  ShardDurability(const JobState* job, RequestLedger* ledger, ShardStore* store,
                  const Logger* logger);

  ShardDurability(const ShardDurability&) = delete;
  ShardDurability& operator=(const ShardDurability&) = delete;

  // Runs `apply` (which changes the chunks of `u` and records it in the ledger) under the
  // apply lock, after appending `u` to the log if the job logs every update and !replay (then
  // `u`'s gradients are referenced until the write is done, and updates are applied in log
  // order). Returns the log's error "Push: job J not applied: ..." (then `apply` did not run).
  absl::Status Apply(const ChunkUpdate& u, bool replay, absl::FunctionRef<void()> apply)
      ABSL_LOCKS_EXCLUDED(apply_mu_, mu_);

  // Writes a snapshot if one is due, or now if `force` (waiting for one in progress; a forced
  // snapshot also (re)writes the layout). No-op without durability. Errors are logged and
  // returned.
  absl::Status MaybeSnapshot(bool force) ABSL_LOCKS_EXCLUDED(apply_mu_, mu_);

  // Ends the job's durability before its files are deleted (the job is replaced): waits for a
  // snapshot or log write in progress; later snapshots do nothing, and later every_update
  // updates fail with ABORTED, not applied.
  void Close() ABSL_LOCKS_EXCLUDED(mu_, log_mu_);

  // Restores the job from `stored`: chunk states (DataLoss naming the store's directory and
  // the chunk if one is missing or has the wrong size), the ledger, then every log record in
  // order through `replay` (which must apply it via Apply(u, /*replay=*/true, ...)); DataLoss
  // if a record names a chunk this shard does not own or has the wrong size.
  absl::Status Restore(const ShardStore::StoredJob& stored,
                       const std::function<absl::Status(const ChunkUpdate&)>& replay)
      ABSL_LOCKS_EXCLUDED(apply_mu_, mu_);

  struct Stats {
    int64_t snapshots = 0;
    double last_snapshot_s = 0;
    int64_t last_snapshot_bytes = 0;
    int64_t snapshot_update = 0;  // Updates covered by the last snapshot.
    bool restored = false;
    int64_t replayed = 0;     // Log records replayed by Restore.
    int64_t log_records = 0;  // Records written to the log (every_update).
    int64_t log_writes = 0;   // Writes that wrote them (group commit: <= log_records).
    int64_t state_bytes = 0;  // The job's values and optimizer slots here (StateBytes).
  };
  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // An update waiting in the group-commit queue (on its thread's stack).
  struct Pending {
    const EncodedRecord* record;
    const absl::FunctionRef<void()>* apply;
    bool done = false;  // Logged and applied, or failed (status).
    absl::Status status;
  };
  static std::vector<absl::string_view> GradientBytes(const ChunkUpdate& u);
  // `u` as an UpdateRecord without seq and gradient bytes.
  state::UpdateRecord Record(const ChunkUpdate& u) const;
  // Logs `record` and runs `apply` (group commit: by whichever thread leads its batch).
  absl::Status Commit(const EncodedRecord& record, absl::FunctionRef<void()> apply)
      ABSL_LOCKS_EXCLUDED(log_mu_);
  // The leader: writes every queued record and applies the batch (releasing log_mu_
  // meanwhile), then completes them.
  void LeadBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(log_mu_);
  // Writes `batch` as records first, first + 1, ... (opening the log if needed).
  absl::Status WriteBatch(int64_t first, const std::vector<Pending*>& batch, bool fresh)
      ABSL_LOCKS_EXCLUDED(log_mu_, mu_);
  // Applies `batch` in order once the update with seq first - 1 has been applied.
  void ApplyBatch(int64_t first, const std::vector<Pending*>& batch)
      ABSL_LOCKS_EXCLUDED(order_mu_, apply_mu_, log_mu_);
  // After a snapshot at `snapshot_seq`: a new log segment, the covered ones deleted.
  absl::Status RotateLog(int64_t snapshot_seq) ABSL_LOCKS_EXCLUDED(log_mu_);
  // Before a new job's first snapshot: deletes log files left under its name.
  absl::Status RemoveStaleLog() ABSL_LOCKS_EXCLUDED(mu_);
  // Whether a snapshot should start now; if so marks it running.
  bool StartSnapshot(bool force) ABSL_LOCKS_EXCLUDED(mu_);
  // The job's values and optimizer slots on this shard, in bytes (fixed by its layout).
  int64_t StateBytes() const;
  // Writes every chunk to `file` and the ledger to `snap`, with the apply lock exclusive.
  void Capture(ChunksFileWriter* file, state::JobSnapshot* snap) ABSL_LOCKS_EXCLUDED(apply_mu_);
  // Writes a chunk file no stored snapshot may name (Capture; its slot in `slot`), then the
  // snapshot naming it (the layout too if `force`; `store_written` once that write was
  // attempted); the bytes written.
  absl::StatusOr<int64_t> WriteSnapshot(bool force, state::JobSnapshot* snap, int* slot,
                                        bool* store_written) ABSL_LOCKS_EXCLUDED(apply_mu_, mu_);
  absl::Status RestoreChunks(const ShardStore::StoredJob& stored) const;
  absl::Status ReplayLog(const ShardStore::StoredJob& stored,
                         const std::function<absl::Status(const ChunkUpdate&)>& replay) const;

  const JobState* const job_;
  RequestLedger* const ledger_;
  ShardStore* const store_;  // Not owned.
  const Logger* const logger_;

  // Updates hold this shared; snapshots hold it exclusive to see a consistent state.
  absl::Mutex apply_mu_;

  // every_update's group commit.
  absl::Mutex log_mu_;
  std::deque<Pending*> queue_ ABSL_GUARDED_BY(log_mu_);
  bool writing_ ABSL_GUARDED_BY(log_mu_) = false;       // Someone uses log_ (see Thread safety).
  int64_t next_seq_ ABSL_GUARDED_BY(log_mu_) = 1;       // Of the next record written.
  bool log_restored_ ABSL_GUARDED_BY(log_mu_) = false;  // Restore ran: keep the segments.
  bool log_closed_ ABSL_GUARDED_BY(log_mu_) = false;    // Close ran.
  std::unique_ptr<UpdateLog> log_;  // Opened by the first write; used only by writing_'s owner.
  // Seq of the last update applied in log order (every_update).
  absl::Mutex order_mu_;
  int64_t applied_seq_ ABSL_GUARDED_BY(order_mu_) = 0;

  mutable absl::Mutex mu_;
  bool snapshot_running_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // Close ran: no more snapshots.
  int64_t snapshot_update_ ABSL_GUARDED_BY(mu_) = 0;
  // The chunk file the stored snapshot names (-1: none), and the one a failed store write
  // may have named (-1: none).
  int stored_slot_ ABSL_GUARDED_BY(mu_) = -1;
  int uncertain_slot_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t logged_bytes_ ABSL_GUARDED_BY(mu_) = 0;         // Log bytes since the last snapshot.
  absl::Time snapshot_retry_after_ ABSL_GUARDED_BY(mu_);  // Back-off after a failure.
  absl::Time snapshot_time_ ABSL_GUARDED_BY(mu_);
  int64_t snapshots_ ABSL_GUARDED_BY(mu_) = 0;
  double last_snapshot_s_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_snapshot_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool restored_ ABSL_GUARDED_BY(mu_) = false;
  int64_t replayed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t log_records_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t log_writes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_SHARD_DURABILITY_H_
