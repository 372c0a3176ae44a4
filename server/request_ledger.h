// RequestLedger: one job's record of its pushes on this shard: per worker the last step
// applied, whether it finished, the pushes applied, the request ids of the last
// `dedupe_window` applied pushes (retries of those are duplicates) and the pushes being
// applied now; and the job's counters (pushes applied, duplicates dropped, updates applied,
// staleness histogram).
//
// A push is admitted by BeginPush, which marks its request id and step "in progress" (a
// concurrent retry is ABORTED, which clients retry), and ended by EndPush; RecordUpdate marks
// the ids of the pushes an update completes "applied". A push that failed forgets its id, so
// that a corrected retry is applied.
//
// updates_applied() is also the sequence number of the last update: log records and
// snapshots are numbered by it (server/shard_durability.h).
//
// Thread safety: all methods may be called concurrently; one internal mutex, held only inside
// each call and never while calling out, so callers may hold any of their own locks (the
// shard's apply lock, ShardDurability's lock) when calling in: it is the innermost lock.
#ifndef GRADMESH_SERVER_REQUEST_LEDGER_H_
#define GRADMESH_SERVER_REQUEST_LEDGER_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/consistency.h"
#include "server/state.pb.h"

namespace gradmesh {

// Thread safety: every method is safe to call concurrently; internally locked by one leaf
// mutex. One job's pushes, progress and counters (see the file comment).
class RequestLedger {
 public:
  // `num_workers` > 0, `dedupe_window` > 0, `staleness_buckets` >= 2 (the last bucket counts
  // staleness >= buckets - 1). `job` names the job in messages.
  RequestLedger(std::string job, int32_t num_workers, int64_t dedupe_window,
                int32_t staleness_buckets);

  RequestLedger(const RequestLedger&) = delete;
  RequestLedger& operator=(const RequestLedger&) = delete;

  enum class Admission { kAdmitted, kDuplicate };

  // Admits the push (worker, step, request_id); `worker` must be in range (checked by the
  // caller). kDuplicate (counted as dropped) if the id was applied or the step is not after
  // the worker's last applied step; ABORTED "Push: job J worker W request R is still in
  // progress" or "... step S is already being applied" if that id or step is in progress;
  // else kAdmitted, and the caller must call EndPush.
  absl::StatusOr<Admission> BeginPush(int32_t worker, int64_t step, uint64_t request_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Ends an admitted push; if !applied, its id is forgotten unless an update applied it.
  void EndPush(int32_t worker, int64_t step, uint64_t request_id, bool applied)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Records an applied update: one more update, the staleness of each of its chunks, and the
  // pushes it completes (last step, pushes applied, ids remembered in the dedupe window).
  void RecordUpdate(absl::Span<const int64_t> staleness, absl::Span<const RequestRef> requests)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Marks `worker` finished; returns its pushes applied if this was its first Finish.
  std::optional<int64_t> MarkFinished(int32_t worker) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether a snapshot taken after `worker`'s Finish succeeded in this process (durable jobs
  // acknowledge a Finish only then), and recording that one did. Not restored: after a restart
  // a repeated Finish snapshots once more.
  bool FinishRecorded(int32_t worker) const ABSL_LOCKS_EXCLUDED(mu_);
  void MarkFinishRecorded(int32_t worker) ABSL_LOCKS_EXCLUDED(mu_);
  // True if every worker w with counted[w] has finished.
  bool AllFinished(const std::vector<bool>& counted) const ABSL_LOCKS_EXCLUDED(mu_);

  int64_t updates_applied() const ABSL_LOCKS_EXCLUDED(mu_);
  // The last step an update applied for `worker` (in range, checked by the caller); -1 if none.
  int64_t last_step(int32_t worker) const ABSL_LOCKS_EXCLUDED(mu_);

  struct WorkerProgress {
    int64_t last_step = -1;
    bool finished = false;
    int64_t pushes_applied = 0;
  };
  struct Stats {
    std::vector<WorkerProgress> workers;
    int64_t pushes_applied = 0;
    int64_t duplicates = 0;
    int64_t updates_applied = 0;
    std::vector<int64_t> staleness;  // Histogram, staleness_buckets entries.
  };
  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);

  // Per worker, steps pushed (last step + 1) and whether it finished: the policy's clocks.
  void Clocks(std::vector<int64_t>* pushed, std::vector<bool>* finished) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Writes seq (= updates applied), worker records with their applied ids (oldest first) and
  // the counters into `snapshot`, all from one instant.
  void SaveTo(state::JobSnapshot* snapshot) const ABSL_LOCKS_EXCLUDED(mu_);
  // Replaces the state by a snapshot's (extra workers or buckets in it are ignored).
  void RestoreFrom(const state::JobSnapshot& snapshot) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct WorkerRecord {
    WorkerProgress progress;
    // Request ids of the last dedupe_window applied pushes (true) and of pushes being applied
    // now (false); id_order lists the applied ones, oldest first.
    absl::flat_hash_map<uint64_t, bool> recent_ids;
    std::deque<uint64_t> id_order;
    // Steps whose push is being applied now (normally at most one).
    absl::flat_hash_set<int64_t> steps_in_progress;
    bool finish_recorded = false;  // FinishRecorded.
  };

  const std::string job_;
  const int64_t dedupe_window_;
  mutable absl::Mutex mu_;
  std::vector<WorkerRecord> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> staleness_ ABSL_GUARDED_BY(mu_);
  int64_t pushes_applied_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t duplicates_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t updates_applied_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_REQUEST_LEDGER_H_
