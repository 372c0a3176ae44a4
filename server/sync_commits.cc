#include "server/sync_commits.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/numeric.h"

namespace gradmesh {

SyncCommits::SyncCommits(std::string job, double clip_value,
                         std::function<bool(int64_t)> is_param_chunk)
    : job_(std::move(job)), clip_value_(clip_value), is_param_chunk_(std::move(is_param_chunk)) {}

bool SyncCommits::Contributed(const std::vector<RequestRef>& requests, int32_t worker) {
  return std::any_of(requests.begin(), requests.end(),
                     [worker](const RequestRef& r) { return r.worker == worker; });
}

absl::Status SyncCommits::Prepare(const ChunkUpdate& avg) {
  const int64_t step = avg.requests.empty() ? -1 : avg.requests.front().step;
  Held held;
  held.update = avg;
  held.update.grads.clear();
  const float v = static_cast<float>(clip_value_);
  double sq = 0;
  bool finite = true, clamped = false;
  for (size_t i = 0; i < avg.chunks.size(); ++i) {
    std::vector<float> g(avg.grads[i], avg.grads[i] + avg.numels[i]);
    const bool param = is_param_chunk_(avg.chunks[i]);
    if (param) {
      for (float& x : g) {
        if (v > 0 && (x > v || x < -v)) {
          x = x > v ? v : -v;
          clamped = true;
        }
        finite &= std::isfinite(x);
        sq += static_cast<double>(x) * x;
      }
    } else {
      finite &= FirstNonFinite(g.data(), static_cast<int64_t>(g.size())) < 0;
    }
    held.param_chunk.push_back(param);
    held.grads.push_back(std::move(g));
  }
  // A finite sum of squares can still overflow to Inf: that step is as unusable as a NaN.
  held.figures.set_nonfinite(avg.nonfinite || !finite || !std::isfinite(sq));
  held.figures.set_grad_sq_norm(std::isfinite(sq) ? sq : 0);
  held.figures.set_value_clipped(clamped);
  absl::MutexLock lock(&mu_);
  if (static_cast<int>(prepared_.size()) >= kMaxPrepared) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sync step ", step, " of job ", job_, ": ", prepared_.size(), " earlier steps (from ",
        prepared_.begin()->first, ") still wait for their commit; nothing was applied"));
  }
  prepared_[step] = std::move(held);
  return absl::OkStatus();
}

std::optional<PreparedStep> SyncCommits::Find(int64_t step, int32_t worker) const {
  absl::MutexLock lock(&mu_);
  if (auto it = prepared_.find(step);
      it != prepared_.end() && Contributed(it->second.update.requests, worker)) {
    return it->second.figures;
  }
  if (auto it = committed_.find(step); it != committed_.end()) {
    const std::vector<int32_t>& w = it->second.workers;
    if (std::find(w.begin(), w.end(), worker) != w.end()) return it->second.figures;
  }
  return std::nullopt;
}

absl::StatusOr<SyncCommits::Outcome> SyncCommits::Commit(
    const SyncCommit& commit, int32_t worker, const ApplyFn& apply,
    const std::function<bool(int64_t)>& applied_before) {
  const int64_t step = commit.step();
  const std::string where =
      absl::StrCat("Pull: job ", job_, " worker ", worker, " commit of sync step ", step);
  if (!commit.skip() && !(commit.clip_coef() > 0 && commit.clip_coef() <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": clip_coef ", commit.clip_coef(), " is not in (0, 1]"));
  }
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat(where, ": negative step"));
  absl::MutexLock commit_lock(&commit_mu_);
  Held held;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = committed_.find(step); it != committed_.end()) {
      const Done& d = it->second;
      // Workers decide alike from the same figures; after restarts they may not have had the
      // same (a shard that lost the step and settled it with fewer pushes, one that forgot
      // its figures). The step stands as it was applied.
      const bool differs =
          d.skip != commit.skip() || (!d.skip && d.clip_coef != commit.clip_coef());
      return differs ? Outcome::kAppliedOtherwise : Outcome::kAlreadyApplied;
    }
    auto it = prepared_.find(step);
    if (it == prepared_.end()) {
      return applied_before(step) ? Outcome::kAlreadyApplied : Outcome::kMissing;
    }
    held = std::move(it->second);
    // Orphans before it (see the file comment) go with it.
    prepared_.erase(prepared_.begin(), std::next(it));
    // Recorded before it is applied, so that the step's pushes still being answered (and
    // their retries) find its figures meanwhile; undone if the apply fails.
    Done& d = committed_[step];
    d.figures = held.figures;
    for (const RequestRef& r : held.update.requests) d.workers.push_back(r.worker);
    d.skip = commit.skip();
    d.clip_coef = commit.clip_coef();
  }
  ChunkUpdate u = held.update;
  if (commit.skip()) {
    u.chunks.clear();
    u.numels.clear();
    u.base_versions.clear();
  } else {
    const float coef = static_cast<float>(commit.clip_coef());
    for (size_t i = 0; i < held.grads.size(); ++i) {
      if (coef != 1.0f && held.param_chunk[i]) {
        for (float& x : held.grads[i]) x *= coef;
      }
      u.grads.push_back(held.grads[i].data());
    }
  }
  const absl::Status st = apply(u);
  absl::MutexLock lock(&mu_);
  if (!st.ok()) {
    committed_.erase(step);
    return absl::Status(st.code(), absl::StrCat(where, ": ", st.message()));
  }
  while (static_cast<int>(committed_.size()) > kRemembered) committed_.erase(committed_.begin());
  ++commits_;
  skips_ += commit.skip() ? 1 : 0;
  return Outcome::kApplied;
}

int64_t SyncCommits::committed() const {
  absl::MutexLock lock(&mu_);
  return commits_;
}

int64_t SyncCommits::skipped() const {
  absl::MutexLock lock(&mu_);
  return skips_;
}

}  // namespace gradmesh
