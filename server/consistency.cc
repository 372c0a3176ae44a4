#include "server/consistency.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace gradmesh {
namespace {

// A copy of `s` sharing nothing with it. A status handed to several completions (one step's
// outcome, an abort) is copied this way, so that no status representation is shared between
// threads: its reference count lives in uninstrumented Abseil, where ThreadSanitizer cannot
// see it.
absl::Status Fresh(const absl::Status& s) {
  return s.ok() ? absl::OkStatus() : absl::Status(s.code(), s.message());
}

// Completions collected under a policy's lock, run after it is released. Each status is
// moved into its completion (the running thread keeps no reference).
class Completions {
 public:
  void Add(WaitDone done, absl::Status status) {
    if (done) items_.emplace_back(std::move(done), std::move(status));
  }
  ~Completions() {
    for (auto& [done, status] : items_) done(std::move(status));
  }

 private:
  std::vector<std::pair<WaitDone, absl::Status>> items_;
};

class AsyncPolicy final : public ConsistencyPolicy {
 public:
  std::string mode() const override { return "async"; }
  void StartPush(const ChunkUpdate& push, ApplyFn apply, WaitDone done, WaitCancel*) override {
    done(apply(push));
  }
  void StartPull(int32_t, WaitDone done, WaitCancel*) override { done(absl::OkStatus()); }
  void OnFinish(int32_t) override {}
  void Restore(const std::vector<int64_t>&, const std::vector<bool>&) override {}
  ConsistencyStats stats() const override { return {}; }
};

// Stale synchronous parallel: clocks are steps pushed per worker. A pull that may not proceed
// is parked; pushes, Finish and Restore release the parked pulls that became ready.
class SspPolicy final : public ConsistencyPolicy {
 public:
  SspPolicy(const ConsistencyConfig& config, int64_t bound)
      : bound_(bound),
        timeout_(config.barrier_timeout),
        clock_(config.num_workers, 0),
        finished_(config.num_workers, false) {}

  ~SspPolicy() override {
    StopOwnTimer();
    AbortWaits(absl::CancelledError("ssp policy destroyed"));
  }

  std::string mode() const override { return absl::StrCat("ssp:", bound_); }

  void StartPush(const ChunkUpdate& push, ApplyFn apply, WaitDone done, WaitCancel*) override {
    absl::Status st = apply(push);
    Completions released;
    if (st.ok()) {
      absl::MutexLock lock(&mu_);
      for (const RequestRef& r : push.requests) {
        clock_[r.worker] = std::max(clock_[r.worker], r.step + 1);
      }
      ReleaseReadyLocked(&released);
    }
    done(std::move(st));
  }

  void StartPull(int32_t worker, WaitDone done, WaitCancel* cancel) override {
    Completions completions;
    absl::MutexLock lock(&mu_);
    if (ReadyLocked(worker)) {
      max_lead_ = std::max(max_lead_, clock_[worker] - SlowestLocked(worker));
      completions.Add(std::move(done), absl::OkStatus());
      return;
    }
    if (absl::Status st = EnterWait(absl::StrCat("Pull: ssp:", bound_, " worker ", worker));
        !st.ok()) {
      completions.Add(std::move(done), std::move(st));
      return;
    }
    const uint64_t id = next_id_++;
    Waiter& w = waiters_[id];
    w.worker = worker;
    w.start = absl::Now();
    w.done = std::move(done);
    w.cancel = cancel;
    w.timer_id = timer()->Schedule(w.start + timeout_, [this, id] { Expire(id); });
    if (cancel != nullptr && !cancel->Watch([this, id] { Cancel(id); })) {
      w.cancel = nullptr;
      Drop(id,
           absl::CancelledError(absl::StrCat("ssp:", bound_, " pull of worker ", worker,
                                             " was cancelled by the caller")),
           &completions);
    }
  }

  void OnFinish(int32_t worker) override {
    Completions released;
    absl::MutexLock lock(&mu_);
    finished_[worker] = true;
    ReleaseReadyLocked(&released);
  }

  void Restore(const std::vector<int64_t>& pushed, const std::vector<bool>& finished) override {
    Completions released;
    absl::MutexLock lock(&mu_);
    for (size_t w = 0; w < clock_.size() && w < pushed.size(); ++w) {
      clock_[w] = pushed[w];
      finished_[w] = finished[w];
    }
    ReleaseReadyLocked(&released);
  }

  void AbortWaits(const absl::Status& why) override {
    Completions completions;
    absl::MutexLock lock(&mu_);
    while (!waiters_.empty()) Drop(waiters_.begin()->first, Fresh(why), &completions);
  }

  int64_t waiting() const override {
    absl::MutexLock lock(&mu_);
    return static_cast<int64_t>(waiters_.size());
  }

  ConsistencyStats stats() const override {
    absl::MutexLock lock(&mu_);
    return {max_lead_, wait_s_};
  }

 private:
  struct Waiter {
    int32_t worker = 0;
    absl::Time start;
    WaitDone done;
    WaitCancel* cancel = nullptr;
    WaitTimer::Id timer_id = 0;
  };

  bool ReadyLocked(int32_t worker) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return clock_[worker] - SlowestLocked(worker) <= bound_;
  }

  // Clock of the slowest unfinished worker other than `me` (or me's own clock if none).
  int64_t SlowestLocked(int32_t me) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    int64_t slowest = clock_[me];
    for (size_t w = 0; w < clock_.size(); ++w) {
      if (!finished_[w]) slowest = std::min(slowest, clock_[w]);
    }
    return slowest;
  }

  // Removes waiter `id` and queues its completion with `status`.
  void Drop(uint64_t id, absl::Status status, Completions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = waiters_.find(id);
    if (it == waiters_.end()) return;
    Waiter& w = it->second;
    if (w.cancel != nullptr) w.cancel->Unwatch();
    if (w.timer_id != 0) timer()->Cancel(w.timer_id);
    wait_s_ += absl::ToDoubleSeconds(absl::Now() - w.start);
    ExitWait();
    out->Add(std::move(w.done), std::move(status));
    waiters_.erase(it);
  }

  void ReleaseReadyLocked(Completions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<uint64_t> ready;
    for (const auto& [id, w] : waiters_) {
      if (ReadyLocked(w.worker)) ready.push_back(id);
    }
    for (uint64_t id : ready) {
      const int32_t worker = waiters_[id].worker;
      max_lead_ = std::max(max_lead_, clock_[worker] - SlowestLocked(worker));
      Drop(id, absl::OkStatus(), out);
    }
  }

  void Expire(uint64_t id) {
    Completions completions;
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(id);
    if (it == waiters_.end()) return;
    const int32_t worker = it->second.worker;
    it->second.timer_id = 0;  // Running now.
    std::vector<int32_t> slow;
    for (size_t w = 0; w < clock_.size(); ++w) {
      if (!finished_[w] && clock_[worker] - clock_[w] > bound_) {
        slow.push_back(static_cast<int32_t>(w));
      }
    }
    Drop(id,
         absl::FailedPreconditionError(
             absl::StrCat("ssp:", bound_, " pull of worker ", worker, " at clock ", clock_[worker],
                          " waited ", absl::FormatDuration(timeout_), " for workers [",
                          absl::StrJoin(slow, ", "), "] to catch up")),
         &completions);
  }

  void Cancel(uint64_t id) {
    Completions completions;
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(id);
    if (it == waiters_.end()) return;
    Drop(id,
         absl::CancelledError(absl::StrCat("ssp:", bound_, " pull of worker ", it->second.worker,
                                           " was cancelled by the caller while it waited")),
         &completions);
  }

  const int64_t bound_;
  const absl::Duration timeout_;
  mutable absl::Mutex mu_;
  std::vector<int64_t> clock_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> finished_ ABSL_GUARDED_BY(mu_);
  int64_t max_lead_ ABSL_GUARDED_BY(mu_) = 0;
  double wait_s_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
};

// "[0, 2, 3]" for a membership mask.
std::string RankList(const std::vector<bool>& members) {
  std::vector<int32_t> ranks;
  for (size_t w = 0; w < members.size(); ++w) {
    if (members[w]) ranks.push_back(static_cast<int32_t>(w));
  }
  return absl::StrCat("[", absl::StrJoin(ranks, ", "), "]");
}

// Bulk-synchronous parallel: one barrier per step, over the step's group.
//
// A step is decided under mu_: the push (or SetGroup) that finds all of its group present
// seals it, so it is completed exactly once and nothing else changes it; then it is averaged
// and applied without mu_ (the apply writes the log of durable jobs), and published under mu_.
class SyncPolicy final : public ConsistencyPolicy {
 public:
  explicit SyncPolicy(const ConsistencyConfig& config)
      : job_(config.job),
        num_workers_(config.num_workers),
        timeout_(config.barrier_timeout),
        logger_(config.logger),
        active_(config.num_workers, true) {}

  ~SyncPolicy() override {
    StopOwnTimer();
    AbortWaits(absl::CancelledError("sync policy destroyed"));
  }

  std::string mode() const override { return "sync"; }

  void StartPush(const ChunkUpdate& push, ApplyFn apply, WaitDone done,
                 WaitCancel* cancel) override {
    const RequestRef& me = push.requests.at(0);
    Completions completions;
    std::shared_ptr<Step> sealed;
    std::vector<std::pair<int64_t, std::shared_ptr<Step>>> passed;
    absl::Cleanup complete_passed = [&] {
      for (const auto& [number, done] : passed) CompleteStep(number, done);
    };
    {
      absl::MutexLock lock(&mu_);
      std::shared_ptr<Step> step;
      if (auto it = steps_.find(me.step); it != steps_.end()) step = it->second;
      absl::Status admitted = AdmitLocked(push, step.get());
      bool created = false;
      if (admitted.ok()) {
        ReleasePassedLocked(me.worker, me.step, /*finished=*/false, &passed);
        if (step == nullptr) {
          step = std::make_shared<Step>(active_, lr_scale_, std::move(apply));
          steps_[me.step] = step;
          created = true;
        }
        ExcludeAheadLocked(me.step, step.get(), me.worker);
      }
      // A push that does not complete its step parks: it needs room to wait.
      if (admitted.ok() && !CompletesLocked(step.get())) {
        // Left by UnparkLocked.
        admitted =
            EnterWait(absl::StrCat("Push: job ", job_, " worker ", me.worker, " step ", me.step));
      }
      if (!admitted.ok()) {
        if (created) EraseLocked(me.step, step.get());
        completions.Add(std::move(done), std::move(admitted));
        return;
      }
      // Copy: the caller's buffers are only valid during this call, and the step may complete
      // in another worker's call.
      Contribution c;
      c.request = me;
      c.base_versions = push.base_versions;
      c.nonfinite = push.nonfinite;
      for (size_t i = 0; i < push.chunks.size(); ++i) {
        c.grads.emplace_back(push.grads[i], push.grads[i] + push.numels[i]);
      }
      const int32_t w = me.worker;
      step->contributions[w] = std::move(c);
      step->withdrew[w] = false;
      step->chunks = push.chunks;
      step->numels = push.numels;
      ++step->arrived;
      Waiter& waiter = step->waiters[w];
      waiter = Waiter{};
      waiter.done = std::move(done);
      waiter.start = absl::Now();
      if (step->Complete()) {
        step->sealed = true;
        sealed = step;
      } else {
        ParkLocked(me.step, step, w, cancel, &completions);
      }
    }
    // Earlier steps first.
    std::move(complete_passed).Invoke();
    if (sealed != nullptr) CompleteStep(me.step, sealed);
  }

  absl::Status SetGroup(const std::vector<int32_t>& active, float lr_scale) override;

  void StartPull(int32_t, WaitDone done, WaitCancel*) override { done(absl::OkStatus()); }

  // A finished worker pushes no more: open steps go on without it (a shard restored from an
  // older snapshot lost the job's last step after answering it to this worker, which then
  // finished, while another worker waits there with that step again). Steps started after
  // the Finish still count it: a job resumed with more steps pushes again, and which step
  // a finished worker got to is not known here.
  void OnFinish(int32_t worker) override {
    std::vector<std::pair<int64_t, std::shared_ptr<Step>>> passed;
    {
      absl::MutexLock lock(&mu_);
      if (worker < 0 || worker >= num_workers_) return;
      ReleasePassedLocked(worker, std::numeric_limits<int64_t>::max(), /*finished=*/true, &passed);
    }
    for (const auto& [number, step] : passed) CompleteStep(number, step);
  }
  void Restore(const std::vector<int64_t>&, const std::vector<bool>&) override {}

  void AbortWaits(const absl::Status& why) override {
    Completions completions;
    absl::MutexLock lock(&mu_);
    std::vector<uint64_t> ids;
    for (const auto& [id, where] : waits_) {
      if (!where.step->sealed) ids.push_back(id);
    }
    for (uint64_t id : ids) {
      const Where where = waits_[id];
      WithdrawLocked(where, &completions, Fresh(why));
    }
  }

  int64_t waiting() const override {
    absl::MutexLock lock(&mu_);
    return static_cast<int64_t>(waits_.size());
  }

  ConsistencyStats stats() const override {
    absl::MutexLock lock(&mu_);
    return {0, wait_s_};
  }

 private:
  struct Contribution {
    RequestRef request;
    std::vector<int64_t> base_versions;
    std::vector<std::vector<float>> grads;  // Per chunk.
    bool nonfinite = false;
  };
  // A member's push that is in its step: its completion, and, while parked, its wait's id,
  // deadline timer and canceller.
  struct Waiter {
    WaitDone done;
    absl::Time start;
    uint64_t id = 0;  // 0: not parked (the push that sealed the step).
    WaitTimer::Id timer_id = 0;
    WaitCancel* cancel = nullptr;
  };
  struct Step {
    Step(std::vector<bool> group, float scale, ApplyFn fn)
        : members(std::move(group)),
          lr_scale(scale),
          apply(std::move(fn)),
          contributions(members.size()),
          withdrew(members.size(), false),
          waiters(members.size()) {}
    // All members have pushed (and none of them withdrew).
    bool Complete() const {
      if (sealed || arrived == 0) return false;
      int32_t n = 0;
      for (bool m : members) n += m ? 1 : 0;
      return arrived == n;
    }
    std::vector<bool> members;  // The step's group: fixed at creation, shrunk by SetGroup.
    float lr_scale;
    ApplyFn apply;                                           // The first push's.
    std::vector<std::optional<Contribution>> contributions;  // Only members have one.
    std::vector<bool> withdrew;   // Pushed, then timed out (or was cancelled) and withdrew.
    std::vector<Waiter> waiters;  // Of the members with a contribution.
    std::vector<int64_t> chunks, numels;
    int32_t arrived = 0;  // Contributions present.
    bool sealed = false;  // Being completed: fixed from now on.
  };
  // Where a parked push waits.
  struct Where {
    int64_t number = 0;
    std::shared_ptr<Step> step;
    int32_t worker = 0;
  };

  // Whether one more push completes `step`.
  bool CompletesLocked(const Step* step) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    int32_t n = 0;
    for (bool m : step->members) n += m ? 1 : 0;
    return step->arrived + 1 == n;
  }
  // Whether `push` may join `step` (null: none yet): group, repeats and chunk set.
  absl::Status AdmitLocked(const ChunkUpdate& push, const Step* step) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Member `worker` pushes step `number`: it is past every earlier open step it has no push
  // in, which it got applied before this shard lost it (a restore from an older snapshot: a
  // periodic job's shard, killed after answering one worker's push of the step and not yet
  // the other's). Those steps would wait for a push that never comes, and then the next step
  // for theirs: both time out and the job fails. So they go on without it, as if it had left
  // the group for them: each then completes with the pushes it has (their mean, as in any
  // step), appended to `*done` to be completed without the lock, or is forgotten if none is
  // left. `finished`: the worker finished (`number` is then past every step) rather than
  // pushed step `number`, as the log line says.
  void ReleasePassedLocked(int32_t worker, int64_t number, bool finished,
                           std::vector<std::pair<int64_t, std::shared_ptr<Step>>>* done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After members left unsealed `step` (number `number`): forgets it when no push is left in
  // it (the next push starts it again with the group of then); true when the pushes left
  // complete it, which is then sealed for the caller to complete.
  bool SettleShrunkLocked(int64_t number, const std::shared_ptr<Step>& step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same, the other way round: `worker` pushes step `number` (`step`) after members that
  // are past it already wait at later steps; the step goes on without them.
  void ExcludeAheadLocked(int64_t number, Step* step, int32_t worker)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Parks member `w`'s push in `step`: deadline, canceller.
  void ParkLocked(int64_t number, const std::shared_ptr<Step>& step, int32_t w, WaitCancel* cancel,
                  Completions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes a parked push out of its (unsealed) step: nothing of it will be applied.
  void WithdrawLocked(const Where& where, Completions* out, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the wait bookkeeping of `waiter` (not its completion).
  void UnparkLocked(Waiter* waiter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Expire(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  void Cancel(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // Averages the sealed step's contributions in rank order and applies them once, without
  // mu_; then releases its pushes with the outcome.
  void CompleteStep(int64_t number, const std::shared_ptr<Step>& step) ABSL_LOCKS_EXCLUDED(mu_);

  // Removes step `number` if it is still `step` (not a newer step of the same number).
  void EraseLocked(int64_t number, const Step* step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = steps_.find(number);
    if (it != steps_.end() && it->second.get() == step) steps_.erase(it);
  }

  const std::string job_;
  const int32_t num_workers_;
  const absl::Duration timeout_;
  const Logger* const logger_;
  mutable absl::Mutex mu_;
  std::vector<bool> active_ ABSL_GUARDED_BY(mu_);  // The group new steps start with.
  float lr_scale_ ABSL_GUARDED_BY(mu_) = 1.0f;
  std::map<int64_t, std::shared_ptr<Step>> steps_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Where> waits_ ABSL_GUARDED_BY(mu_);  // Parked pushes by wait id.
  double wait_s_ ABSL_GUARDED_BY(mu_) = 0;
};

absl::Status SyncPolicy::AdmitLocked(const ChunkUpdate& push, const Step* step) const {
  const RequestRef& me = push.requests.at(0);
  const std::vector<bool>& group = step != nullptr ? step->members : active_;
  if (!group[me.worker]) {
    if (active_[me.worker]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker ", me.worker, " is not in the sync group of job ", job_, " for step ", me.step,
          " (active: ", RankList(group),
          "): that step was in progress when the "
          "worker joined the group, which applies from the next step with no pushes yet"));
    }
    return absl::FailedPreconditionError(absl::StrCat("worker ", me.worker,
                                                      " is not in the sync group of job ", job_,
                                                      " (active: ", RankList(group), ")"));
  }
  // One push per worker waits at a time: a worker needs step s's result before it computes
  // step s + 1. A push for another step while one of the worker's pushes waits comes from a
  // broken client (or a restarted worker whose old push is not yet withdrawn): ABORTED, which
  // clients retry with backoff until that one completes, times out or is withdrawn. Without
  // this one client could park a gradient for every future step.
  for (const auto& [number, other] : steps_) {
    if (number != me.step && !other->sealed && other->contributions[me.worker].has_value()) {
      return absl::AbortedError(absl::StrCat("sync step ", me.step, ": worker ", me.worker,
                                             " still waits at step ", number, " of job ", job_,
                                             "; a worker's pushes wait one at a time"));
    }
  }
  if (step == nullptr) return absl::OkStatus();
  if (step->contributions[me.worker].has_value()) {
    return absl::AbortedError(absl::StrCat("sync step ", me.step, ": worker ", me.worker,
                                           " already pushed for this step"));
  }
  if (step->arrived > 0 && step->chunks != push.chunks) {
    return absl::InvalidArgumentError(
        absl::StrCat("sync step ", me.step, ": worker ", me.worker,
                     " pushed a different set of chunks than the other workers"));
  }
  return absl::OkStatus();
}

bool SyncPolicy::SettleShrunkLocked(int64_t number, const std::shared_ptr<Step>& step) {
  if (step->arrived == 0) {
    EraseLocked(number, step.get());
    return false;
  }
  if (!step->Complete()) return false;
  step->sealed = true;
  return true;
}

void SyncPolicy::ReleasePassedLocked(int32_t worker, int64_t number, bool finished,
                                     std::vector<std::pair<int64_t, std::shared_ptr<Step>>>* done) {
  for (auto it = steps_.begin(); it != steps_.end() && it->first < number;) {
    const int64_t earlier = it->first;
    std::shared_ptr<Step> step = it->second;
    ++it;  // Before the step may be erased.
    if (step->sealed || !step->members[worker] || step->contributions[worker].has_value()) {
      continue;
    }
    step->members[worker] = false;
    LogWarning(
        logger_, "sync_step_without_worker",
        {Kv("job", job_), Kv("step", earlier), Kv("worker", worker), Kv("pushes", step->arrived),
         Kv("because",
            finished ? std::string("it finished") : absl::StrCat("it pushed step ", number))});
    if (SettleShrunkLocked(earlier, step)) done->emplace_back(earlier, std::move(step));
  }
}

void SyncPolicy::ExcludeAheadLocked(int64_t number, Step* step, int32_t worker) {
  for (int32_t v = 0; v < num_workers_; ++v) {
    if (v == worker || !step->members[v] || step->contributions[v].has_value()) continue;
    for (auto it = steps_.upper_bound(number); it != steps_.end(); ++it) {
      if (it->second->sealed || !it->second->contributions[v].has_value()) continue;
      step->members[v] = false;
      LogWarning(logger_, "sync_step_without_worker",
                 {Kv("job", job_), Kv("step", number), Kv("worker", v), Kv("pushes", step->arrived),
                  Kv("because", absl::StrCat("it waits at step ", it->first))});
      break;
    }
  }
}

void SyncPolicy::ParkLocked(int64_t number, const std::shared_ptr<Step>& step, int32_t w,
                            WaitCancel* cancel, Completions* out) {
  const uint64_t id = next_id_++;
  Waiter& waiter = step->waiters[w];
  waiter.id = id;
  waits_[id] = Where{number, step, w};
  waiter.timer_id = timer()->Schedule(waiter.start + timeout_, [this, id] { Expire(id); });
  if (cancel == nullptr) return;
  if (cancel->Watch([this, id] { Cancel(id); })) {
    waiter.cancel = cancel;
    return;
  }
  WithdrawLocked(waits_[id], out,
                 absl::CancelledError(
                     absl::StrCat("push of worker ", w, " for sync step ", number, " of job ", job_,
                                  " was cancelled by the caller; nothing of it was applied")));
}

void SyncPolicy::UnparkLocked(Waiter* waiter) {
  if (waiter->id == 0) return;
  if (waiter->cancel != nullptr) waiter->cancel->Unwatch();
  if (waiter->timer_id != 0) timer()->Cancel(waiter->timer_id);
  waits_.erase(waiter->id);
  ExitWait();
  wait_s_ += absl::ToDoubleSeconds(absl::Now() - waiter->start);
  waiter->id = 0;
  waiter->cancel = nullptr;
  waiter->timer_id = 0;
}

void SyncPolicy::WithdrawLocked(const Where& where, Completions* out, absl::Status status) {
  // Copies: `where` may be the entry UnparkLocked erases.
  const std::shared_ptr<Step> step = where.step;
  const int64_t number = where.number;
  const int32_t w = where.worker;
  Waiter& waiter = step->waiters[w];
  UnparkLocked(&waiter);
  out->Add(std::move(waiter.done), std::move(status));
  waiter = Waiter{};
  step->contributions[w].reset();
  step->withdrew[w] = true;
  --step->arrived;
  if (step->arrived == 0) EraseLocked(number, step.get());
}

void SyncPolicy::Expire(uint64_t id) {
  Completions completions;
  absl::MutexLock lock(&mu_);
  auto it = waits_.find(id);
  if (it == waits_.end()) return;
  const Where where = it->second;
  Step& step = *where.step;
  step.waiters[where.worker].timer_id = 0;  // Running now.
  // A sealed step is being applied: its outcome will come.
  if (step.sealed) return;
  std::vector<int32_t> missing, gave_up;
  for (int32_t v = 0; v < num_workers_; ++v) {
    if (!step.members[v]) continue;
    if (step.withdrew[v]) {
      gave_up.push_back(v);
    } else if (!step.contributions[v].has_value()) {
      missing.push_back(v);
    }
  }
  WithdrawLocked(where, &completions,
                 absl::FailedPreconditionError(absl::StrCat(
                     "sync barrier for step ", where.number, " timed out after ",
                     absl::FormatDuration(timeout_), ": workers [", absl::StrJoin(missing, ", "),
                     "] did not push",
                     gave_up.empty() ? ""
                                     : absl::StrCat(" (workers [", absl::StrJoin(gave_up, ", "),
                                                    "] pushed but gave up first)"),
                     "; nothing was applied")));
}

void SyncPolicy::Cancel(uint64_t id) {
  Completions completions;
  absl::MutexLock lock(&mu_);
  auto it = waits_.find(id);
  if (it == waits_.end() || it->second.step->sealed) return;
  const Where where = it->second;
  WithdrawLocked(
      where, &completions,
      absl::CancelledError(absl::StrCat(
          "push of worker ", where.worker, " for sync step ", where.number, " of job ", job_,
          " was cancelled by the caller while it waited at the barrier; "
          "nothing of it was applied")));
}

void SyncPolicy::CompleteStep(int64_t number, const std::shared_ptr<Step>& step) {
  // Sealed: nothing changes the step's contributions until it is published below.
  std::vector<const Contribution*> in;  // Rank order.
  for (const auto& c : step->contributions) {
    if (c.has_value()) in.push_back(&*c);
  }
  ChunkUpdate avg;
  avg.chunks = step->chunks;
  avg.numels = step->numels;
  // Staleness from the lowest rank's view (independent of arrival order).
  avg.base_versions = in.front()->base_versions;
  avg.lr_scale = step->lr_scale;
  std::vector<std::vector<float>> sums(step->chunks.size());
  const float inv = 1.0f / static_cast<float>(in.size());
  for (size_t i = 0; i < step->chunks.size(); ++i) {
    std::vector<float>& sum = sums[i];
    sum = in[0]->grads[i];
    for (size_t k = 1; k < in.size(); ++k) {
      const std::vector<float>& g = in[k]->grads[i];
      for (size_t e = 0; e < sum.size(); ++e) sum[e] += g[e];
    }
    for (float& v : sum) v *= inv;
    avg.grads.push_back(sum.data());
  }
  for (const Contribution* c : in) {
    avg.requests.push_back(c->request);
    avg.nonfinite = avg.nonfinite || c->nonfinite;
  }
  // The log write of durable jobs happens here, with no policy lock held.
  const absl::Status result = step->apply(avg);
  Completions completions;
  absl::MutexLock lock(&mu_);
  for (Waiter& waiter : step->waiters) {
    UnparkLocked(&waiter);
    completions.Add(std::move(waiter.done), Fresh(result));
    waiter = Waiter{};
  }
  EraseLocked(number, step.get());
}

absl::Status SyncPolicy::SetGroup(const std::vector<int32_t>& active, float lr_scale) {
  if (active.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sync group of job ", job_, ": the group is empty"));
  }
  if (!(lr_scale > 0.0f && lr_scale <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sync group of job ", job_, ": lr_scale ", lr_scale, " not in (0, 1]"));
  }
  std::vector<bool> members(num_workers_, false);
  for (int32_t r : active) {
    if (r < 0 || r >= num_workers_) {
      return absl::InvalidArgumentError(absl::StrCat("sync group of job ", job_, ": rank ", r,
                                                     " not in [0, ", num_workers_, ")"));
    }
    if (members[r]) {
      return absl::InvalidArgumentError(
          absl::StrCat("sync group of job ", job_, ": rank ", r, " appears twice"));
    }
    members[r] = true;
  }
  Completions completions;
  absl::MutexLock lock(&mu_);
  active_ = members;
  lr_scale_ = lr_scale;
  // Shrink the steps in progress (not a sealed one: it is being applied); growth waits for
  // new steps.
  for (auto it = steps_.begin(); it != steps_.end();) {
    const int64_t number = it->first;
    std::shared_ptr<Step> step = it->second;
    ++it;  // Before the step may be erased.
    if (step->sealed) continue;
    bool shrunk = false;
    for (int32_t w = 0; w < num_workers_; ++w) {
      if (!step->members[w] || members[w]) continue;
      step->members[w] = false;
      shrunk = true;
      if (!step->contributions[w].has_value()) continue;
      Waiter& waiter = step->waiters[w];
      UnparkLocked(&waiter);
      completions.Add(
          std::move(waiter.done),
          absl::FailedPreconditionError(absl::StrCat(
              "worker ", w, " was removed from the sync group of job ", job_,
              " (active: ", RankList(active_), ") while its push for step ", number,
              " waited at the barrier; the push was dropped and nothing of it was applied")));
      waiter = Waiter{};
      step->contributions[w].reset();
      --step->arrived;
    }
    if (shrunk) step->lr_scale = lr_scale;
    // Its remaining members have all pushed: complete it on the timer's thread (this call
    // applies nothing itself).
    if (SettleShrunkLocked(number, step)) {
      timer()->Schedule(absl::Now(), [this, number, step] { CompleteStep(number, step); });
    }
  }
  return absl::OkStatus();
}

absl::Status NoParam(const std::string& name, const std::string& param) {
  if (param.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("consistency mode \"", name, "\" takes no parameter, got \"", param, "\""));
}

}  // namespace

void WaitCancel::Cancel() {
  std::function<void()> handler;
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return;
    cancelled_ = true;
    handler = std::move(on_cancel_);
    on_cancel_ = nullptr;
  }
  if (handler) handler();
}

bool WaitCancel::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

bool WaitCancel::Watch(std::function<void()> on_cancel) {
  absl::MutexLock lock(&mu_);
  if (cancelled_) return false;
  on_cancel_ = std::move(on_cancel);
  return true;
}

void WaitCancel::Unwatch() {
  std::function<void()> old;  // Destroyed outside the lock.
  absl::MutexLock lock(&mu_);
  old = std::move(on_cancel_);
  on_cancel_ = nullptr;
}

WaitTimer* ConsistencyPolicy::timer() {
  if (shared_timer_ != nullptr) return shared_timer_;
  absl::MutexLock lock(&own_timer_mu_);
  if (own_timer_ == nullptr) own_timer_ = std::make_unique<WaitTimer>();
  return own_timer_.get();
}

namespace {

// The outcome of a call made blocking, shared with its completion (which may still be running
// after Set when the caller returns). A mutex and condition variable rather than a
// Notification, so that ThreadSanitizer runs see the hand-off.
struct Outcome {
  void Set(absl::Status st) {
    absl::MutexLock lock(&mu);
    status = std::move(st);
    done = true;
    cv.Signal();
  }
  absl::Status Wait() {
    absl::MutexLock lock(&mu);
    while (!done) cv.Wait(&mu);
    return std::move(status);
  }
  absl::Mutex mu;
  absl::CondVar cv;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
};

}  // namespace

void ConsistencyPolicy::StopOwnTimer() {
  std::unique_ptr<WaitTimer> own;
  {
    absl::MutexLock lock(&own_timer_mu_);
    own = std::move(own_timer_);
  }
  own.reset();  // Runs what is pending (outside own_timer_mu_: callbacks may call timer()).
}

absl::Status ConsistencyPolicy::OnPush(const ChunkUpdate& push, const ApplyFn& apply) {
  auto outcome = std::make_shared<Outcome>();
  StartPush(
      push, apply, [outcome](absl::Status st) { outcome->Set(std::move(st)); }, nullptr);
  return outcome->Wait();
}

absl::Status ConsistencyPolicy::BeforePull(int32_t worker) {
  auto outcome = std::make_shared<Outcome>();
  StartPull(
      worker, [outcome](absl::Status st) { outcome->Set(std::move(st)); }, nullptr);
  return outcome->Wait();
}

void ConsistencyPolicy::AbortWaits(const absl::Status&) {}

absl::Status ConsistencyPolicy::SetGroup(const std::vector<int32_t>&, float) {
  return absl::FailedPreconditionError(
      absl::StrCat("consistency mode ", mode(), " has no barrier group; only sync jobs have one"));
}

ConsistencyRegistry ConsistencyRegistry::WithBuiltins() {
  ConsistencyRegistry r;
  r.Register("async",
             [](const ConsistencyConfig&,
                const std::string& param) -> absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> {
               if (absl::Status st = NoParam("async", param); !st.ok()) return st;
               return std::unique_ptr<ConsistencyPolicy>(new AsyncPolicy());
             });
  r.Register("sync",
             [](const ConsistencyConfig& config,
                const std::string& param) -> absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> {
               if (absl::Status st = NoParam("sync", param); !st.ok()) return st;
               return std::unique_ptr<ConsistencyPolicy>(new SyncPolicy(config));
             });
  r.Register(
      "ssp",
      [](const ConsistencyConfig& config,
         const std::string& param) -> absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> {
        int64_t bound = -1;
        if (!absl::SimpleAtoi(param, &bound) || bound < 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "consistency mode ssp needs a staleness bound >= 0, as in \"ssp:3\"; got \"ssp:",
              param, "\""));
        }
        return std::unique_ptr<ConsistencyPolicy>(new SspPolicy(config, bound));
      });
  return r;
}

void ConsistencyRegistry::Register(const std::string& name, Factory factory) {
  factories_.Set(name, std::move(factory));
}

std::vector<std::string> ConsistencyRegistry::names() const { return factories_.Names(); }

absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> ConsistencyRegistry::Create(
    const ConsistencyConfig& config) const {
  const size_t colon = config.mode.find(':');
  const std::string name = config.mode.substr(0, colon);
  const std::string param = colon == std::string::npos ? "" : config.mode.substr(colon + 1);
  auto factory = factories_.Find(name, config.mode, "ssp takes a bound, e.g. ssp:3");
  if (!factory.ok()) return factory.status();
  if (config.num_workers <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers must be > 0, got ", config.num_workers));
  }
  if (config.barrier_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("barrier timeout must be > 0");
  }
  return (**factory)(config, param);
}

}  // namespace gradmesh
