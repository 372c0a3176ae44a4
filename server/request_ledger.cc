#include "server/request_ledger.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace gradmesh {

RequestLedger::RequestLedger(std::string job, int32_t num_workers, int64_t dedupe_window,
                             int32_t staleness_buckets)
    : job_(std::move(job)), dedupe_window_(dedupe_window) {
  absl::MutexLock lock(&mu_);
  workers_.resize(num_workers);
  staleness_.assign(staleness_buckets, 0);
}

absl::StatusOr<RequestLedger::Admission> RequestLedger::BeginPush(int32_t worker, int64_t step,
                                                                  uint64_t request_id) {
  absl::MutexLock lock(&mu_);
  WorkerRecord& w = workers_[worker];
  auto it = w.recent_ids.find(request_id);
  if (it != w.recent_ids.end()) {
    if (!it->second) {
      // The original is still being applied (e.g. waiting at a barrier): the client retries
      // ABORTED with backoff and will then be told it is a duplicate, or may apply it if the
      // original failed.
      return absl::AbortedError(absl::StrCat("Push: job ", job_, " worker ", worker, " request ",
                                             request_id, " is still in progress"));
    }
    ++duplicates_;
    return Admission::kDuplicate;
  }
  if (step <= w.progress.last_step) {
    // This worker's step was already applied here (a worker that resumed from a shard that is
    // behind this one re-pushes it): applying it again would count it twice.
    ++duplicates_;
    return Admission::kDuplicate;
  }
  if (w.steps_in_progress.contains(step)) {
    // Another push of this step, with another request id, is being applied: a restarted
    // worker re-pushing what its previous incarnation sent. Once that one is done, the
    // client's retry is told it is a duplicate (or is applied, if the first one failed).
    return absl::AbortedError(absl::StrCat("Push: job ", job_, " worker ", worker, " step ", step,
                                           " is already being applied"));
  }
  w.recent_ids.emplace(request_id, false);
  w.steps_in_progress.insert(step);
  return Admission::kAdmitted;
}

void RequestLedger::EndPush(int32_t worker, int64_t step, uint64_t request_id, bool applied) {
  absl::MutexLock lock(&mu_);
  WorkerRecord& w = workers_[worker];
  w.steps_in_progress.erase(step);
  if (!applied) {
    // Not applied: forget the id so that a retry can succeed.
    auto it = w.recent_ids.find(request_id);
    if (it != w.recent_ids.end() && !it->second) w.recent_ids.erase(it);
  }
}

void RequestLedger::RecordUpdate(absl::Span<const int64_t> staleness,
                                 absl::Span<const RequestRef> requests) {
  absl::MutexLock lock(&mu_);
  ++updates_applied_;
  const int64_t last = static_cast<int64_t>(staleness_.size()) - 1;
  for (int64_t st : staleness) ++staleness_[std::min(st, last)];
  for (const RequestRef& r : requests) {
    WorkerRecord& w = workers_[r.worker];
    w.progress.last_step = std::max(w.progress.last_step, r.step);
    ++w.progress.pushes_applied;
    ++pushes_applied_;
    w.recent_ids[r.request_id] = true;
    w.id_order.push_back(r.request_id);
    if (static_cast<int64_t>(w.id_order.size()) > dedupe_window_) {
      w.recent_ids.erase(w.id_order.front());
      w.id_order.pop_front();
    }
  }
}

std::optional<int64_t> RequestLedger::MarkFinished(int32_t worker) {
  absl::MutexLock lock(&mu_);
  WorkerProgress& w = workers_[worker].progress;
  if (w.finished) return std::nullopt;
  w.finished = true;
  return w.pushes_applied;
}

bool RequestLedger::FinishRecorded(int32_t worker) const {
  absl::MutexLock lock(&mu_);
  return workers_[worker].finish_recorded;
}

void RequestLedger::MarkFinishRecorded(int32_t worker) {
  absl::MutexLock lock(&mu_);
  workers_[worker].finish_recorded = true;
}

bool RequestLedger::AllFinished(const std::vector<bool>& counted) const {
  absl::MutexLock lock(&mu_);
  for (size_t w = 0; w < workers_.size(); ++w) {
    if (!workers_[w].progress.finished && counted[w]) return false;
  }
  return true;
}

int64_t RequestLedger::updates_applied() const {
  absl::MutexLock lock(&mu_);
  return updates_applied_;
}

int64_t RequestLedger::last_step(int32_t worker) const {
  absl::MutexLock lock(&mu_);
  return workers_[worker].progress.last_step;
}

RequestLedger::Stats RequestLedger::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s;
  for (const WorkerRecord& w : workers_) s.workers.push_back(w.progress);
  s.pushes_applied = pushes_applied_;
  s.duplicates = duplicates_;
  s.updates_applied = updates_applied_;
  s.staleness = staleness_;
  return s;
}

void RequestLedger::Clocks(std::vector<int64_t>* pushed, std::vector<bool>* finished) const {
  absl::MutexLock lock(&mu_);
  for (const WorkerRecord& w : workers_) {
    pushed->push_back(w.progress.last_step + 1);
    finished->push_back(w.progress.finished);
  }
}

void RequestLedger::SaveTo(state::JobSnapshot* snap) const {
  absl::MutexLock lock(&mu_);
  snap->set_seq(updates_applied_);
  for (const WorkerRecord& w : workers_) {
    state::WorkerSnapshot* ws = snap->add_workers();
    ws->set_last_step(w.progress.last_step);
    ws->set_finished(w.progress.finished);
    ws->set_pushes_applied(w.progress.pushes_applied);
    for (uint64_t id : w.id_order) ws->add_recent_ids(id);
  }
  snap->set_pushes_applied(pushes_applied_);
  snap->set_duplicates(duplicates_);
  for (int64_t s : staleness_) snap->add_staleness(s);
}

void RequestLedger::RestoreFrom(const state::JobSnapshot& snap) {
  absl::MutexLock lock(&mu_);
  for (int w = 0; w < snap.workers_size() && w < static_cast<int>(workers_.size()); ++w) {
    const state::WorkerSnapshot& ws = snap.workers(w);
    WorkerRecord& r = workers_[w];
    r.progress.last_step = ws.last_step();
    r.progress.finished = ws.finished();
    r.progress.pushes_applied = ws.pushes_applied();
    for (uint64_t id : ws.recent_ids()) {
      r.recent_ids[id] = true;
      r.id_order.push_back(id);
    }
  }
  pushes_applied_ = snap.pushes_applied();
  duplicates_ = snap.duplicates();
  for (int i = 0; i < snap.staleness_size() && i < static_cast<int>(staleness_.size()); ++i) {
    staleness_[i] = snap.staleness(i);
  }
  updates_applied_ = snap.seq();
}

}  // namespace gradmesh
