// SyncCommits: the two-phase apply of a sync job's steps (InitJobRequest.commit_steps).
//
// Why: clipping by the norm of the averaged gradient over the whole model (torch's
// clip_grad_norm_) and skipping a step whose gradient is not finite (dynamic loss scaling)
// need a figure no shard has alone. So a commit_steps job applies each step in two phases:
//   1. Prepare. When the step's barrier completes, the sync policy's apply function
//      (server/consistency.h) hands the averaged update here instead of to the optimizer. It
//      is copied, its parameter chunks are clamped to [-clip_grad_value, clip_grad_value]
//      (if set), and this shard's part of the squared norm (parameters only, in double) and
//      whether the step is non-finite (a worker flagged it, or the average overflowed) are
//      computed. Every push of the step is answered with them (PushResponse.prepared).
//   2. Commit. Each worker adds the parts of every shard in shard order (so every worker
//      gets the same bits), decides the clip coefficient (torch's min(1, C / (norm + 1e-6)))
//      or a skip, and sends that with its next pull (PullRequest.commit) to every shard. The
//      first commit of a step applies it through the shard's normal apply (log record of the
//      scaled gradient for every_update, optimizer, ledger), or, for a skip, applies an update
//      with no chunks (the pushes count as done, nothing else changes: no optimizer step, as
//      torch's GradScaler skips optimizer.step()). Later commits of the step find it done.
// The pull that carries a commit is served after the step is applied, so the next forward
// sees the step, as in plain sync.
//
// Retries and restarts: a push of a step held here (prepared, or among the last committed) by
// a worker that contributed to it is answered as a duplicate with the step's figures, whatever
// its request id (a retried push, or a worker restarted before the commit). Nothing prepared
// is durable, and nothing of it was acknowledged as applied: a shard restarted between the
// phases answers a commit of a step it neither holds nor has applied with commit_missing, and
// the workers push the step again (the shards that applied it answer duplicate) and commit
// again. A prepared step whose apply fails (a log write error) is dropped the same way.
//
// Bounds: at most kMaxPrepared steps wait for their commit (preparing one more fails that
// step's pushes with FAILED_PRECONDITION); committing step t drops prepared steps before t
// (orphans: every worker of step t committed t-1 before pushing t); the figures of the last
// kRemembered committed steps are kept for duplicates.
//
// Thread safety: all methods may be called concurrently. commit_mu_ serialises commits and is
// held while a commit applies (so a second commit of the step waits and then finds it
// applied); it is taken before the shard's apply locks and before mu_, a leaf.
#ifndef GRADMESH_SERVER_SYNC_COMMITS_H_
#define GRADMESH_SERVER_SYNC_COMMITS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/gradmesh.pb.h"
#include "server/consistency.h"

namespace gradmesh {

class SyncCommits {
 public:
  static constexpr int kMaxPrepared = 4;
  static constexpr int kRemembered = 16;

  // `clip_value` >= 0 (0: no value clipping). `is_param_chunk(idx)`: whether partition chunk
  // idx belongs to a parameter (not a buffer); buffers are never clipped nor counted.
  SyncCommits(std::string job, double clip_value, std::function<bool(int64_t)> is_param_chunk);

  SyncCommits(const SyncCommits&) = delete;
  SyncCommits& operator=(const SyncCommits&) = delete;

  // The sync policy's ApplyFn: holds the averaged update `avg` (copied) as its step.
  // FAILED_PRECONDITION if kMaxPrepared steps already wait for their commit.
  absl::Status Prepare(const ChunkUpdate& avg) ABSL_LOCKS_EXCLUDED(mu_);

  // The figures of `step` if it is held (prepared or recently committed) and `worker`
  // contributed to it.
  std::optional<PreparedStep> Find(int64_t step, int32_t worker) const ABSL_LOCKS_EXCLUDED(mu_);

  enum class Outcome { kApplied, kAlreadyApplied, kAppliedOtherwise, kMissing };
  // Commits `commit` of `worker`: kApplied (this call applied it through `apply`),
  // kAlreadyApplied (an earlier commit did, or `applied_before(step)` says the shard applied
  // it before a restart), kAppliedOtherwise (an earlier commit did, with another decision:
  // workers that saw different figures after restarts; nothing changes, the step stands),
  // kMissing (not held: push it again). INVALID_ARGUMENT (nothing changes) for a clip_coef
  // outside (0, 1]; `apply`'s error (the step is dropped: kMissing from then on).
  absl::StatusOr<Outcome> Commit(const SyncCommit& commit, int32_t worker, const ApplyFn& apply,
                                 const std::function<bool(int64_t)>& applied_before)
      ABSL_LOCKS_EXCLUDED(commit_mu_, mu_);

  // Steps committed and, of those, skipped since the job was built.
  int64_t committed() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t skipped() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Held {
    ChunkUpdate update;  // Points into grads.
    std::vector<std::vector<float>> grads;
    std::vector<bool> param_chunk;
    PreparedStep figures;
  };
  struct Done {
    PreparedStep figures;
    std::vector<int32_t> workers;
    bool skip = false;
    double clip_coef = 1;
  };
  static bool Contributed(const std::vector<RequestRef>& requests, int32_t worker);

  const std::string job_;
  const double clip_value_;
  const std::function<bool(int64_t)> is_param_chunk_;
  absl::Mutex commit_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  std::map<int64_t, Held> prepared_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, Done> committed_ ABSL_GUARDED_BY(mu_);
  int64_t commits_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t skips_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_SYNC_COMMITS_H_
