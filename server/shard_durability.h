// ShardDurability: one job's durability over the shard's ShardStore (server/shard_store.h):
// the write-ahead log of updates (every_update), snapshots and when to take them, and
// restoring the job from what the store holds (snapshot, then log replay).
//
//   Apply         every update goes through it. With every_update (and not replaying) it
//                 takes the apply lock exclusively, appends the UpdateRecord (gradients, base
//                 versions, requests, lr factor) to the log, then runs the update; so the log
//                 order is the apply order and replay over the snapshot is exact. Otherwise
//                 it takes the apply lock shared and updates run concurrently (per-chunk locks).
//   MaybeSnapshot takes the apply lock exclusively, copies every chunk and the ledger, releases
//                 it, then writes one atomic batch that also drops the log up to the snapshot.
//                 Due every snapshot_every_updates updates, every 32 MiB of log, or every
//                 snapshot_every_seconds (not for sync jobs, so all shards of a sync job
//                 snapshot at the same steps); a failed one is retried no sooner than 5 s later.
//   Restore       loads the stored chunks and ledger, then replays the log in order.
// The on-disk format is ShardStore's keys holding the messages of server/state.proto.
//
// Thread safety: all methods may be called concurrently (Restore before the job is shared).
// Lock order: apply_mu_ (shared by updates, exclusive when logging and for snapshots), then
// one Chunk::mu at a time (JobState), then mu_ (snapshot bookkeeping), then the
// RequestLedger's lock. mu_ is never held while apply_mu_ is taken or the store is written.
#ifndef GRADMESH_SERVER_SHARD_DURABILITY_H_
#define GRADMESH_SERVER_SHARD_DURABILITY_H_

#include <cstdint>
#include <functional>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "server/consistency.h"
#include "server/job_state.h"
#include "server/request_ledger.h"
#include "server/shard_store.h"
#include "server/state.pb.h"

namespace gradmesh {

// every_update: snapshot once this much has been logged (well below RocksDB's 64 MiB
// memtable), so that log records are deleted before they are flushed to disk.
inline constexpr int64_t kLogBytesPerSnapshot = 32ll << 20;

// Thread safety: every method may be called concurrently (Restore before the job is shared);
// lock order apply_mu_ > Chunk::mu > mu_ > the ledger's lock. One job's durability.
class ShardDurability {
 public:
  // `job` and `ledger` must outlive this; `store` may be null only for jobs without
  // durability. `logger` may be null.
  ShardDurability(const JobState* job, RequestLedger* ledger, ShardStore* store,
                  const Logger* logger);

  ShardDurability(const ShardDurability&) = delete;
  ShardDurability& operator=(const ShardDurability&) = delete;

  // Runs `apply` (which changes the chunks of `u` and records it in the ledger) under the
  // apply lock, after appending `u` to the log if the job logs every update and !replay.
  // Returns the store's error "Push: job J not applied: ..." (then `apply` did not run).
  absl::Status Apply(const ChunkUpdate& u, bool replay, absl::FunctionRef<void()> apply)
      ABSL_LOCKS_EXCLUDED(apply_mu_, mu_);

  // Writes a snapshot if one is due, or now if `force` (waiting for one in progress; a forced
  // snapshot also (re)writes the layout). No-op without durability. Errors are logged and
  // returned.
  absl::Status MaybeSnapshot(bool force) ABSL_LOCKS_EXCLUDED(apply_mu_, mu_);

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
    int64_t replayed = 0;  // Log records replayed by Restore.
  };
  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Appends `u` as log record number updates_applied + 1.
  absl::Status AppendToLog(const ChunkUpdate& u) ABSL_EXCLUSIVE_LOCKS_REQUIRED(apply_mu_);
  // Whether a snapshot should start now; if so marks it running.
  bool StartSnapshot(bool force) ABSL_LOCKS_EXCLUDED(mu_);
  // Copies every chunk and the ledger, from one instant.
  void Capture(std::map<int64_t, state::ChunkState>* chunks, state::JobSnapshot* snap)
      ABSL_LOCKS_EXCLUDED(apply_mu_);
  absl::Status RestoreChunks(const ShardStore::StoredJob& stored) const;
  absl::Status ReplayLog(const ShardStore::StoredJob& stored,
                         const std::function<absl::Status(const ChunkUpdate&)>& replay) const;

  const JobState* const job_;
  RequestLedger* const ledger_;
  ShardStore* const store_;  // Not owned.
  const Logger* const logger_;

  // Updates hold this shared (exclusive when logging, so log order is apply order);
  // snapshots hold it exclusive to see a consistent state.
  absl::Mutex apply_mu_;

  mutable absl::Mutex mu_;
  bool snapshot_running_ ABSL_GUARDED_BY(mu_) = false;
  int64_t snapshot_update_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t logged_bytes_ ABSL_GUARDED_BY(mu_) = 0;         // Log bytes since the last snapshot.
  absl::Time snapshot_retry_after_ ABSL_GUARDED_BY(mu_);  // Back-off after a failure.
  absl::Time snapshot_time_ ABSL_GUARDED_BY(mu_);
  int64_t snapshots_ ABSL_GUARDED_BY(mu_) = 0;
  double last_snapshot_s_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_snapshot_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool restored_ ABSL_GUARDED_BY(mu_) = false;
  int64_t replayed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_SHARD_DURABILITY_H_
