#include "server/consistency.h"

#include <algorithm>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace gradmesh {
namespace {

class AsyncPolicy final : public ConsistencyPolicy {
 public:
  std::string mode() const override { return "async"; }
  absl::Status OnPush(const ChunkUpdate& push, const ApplyFn& apply) override {
    return apply(push);
  }
  absl::Status BeforePull(int32_t) override { return absl::OkStatus(); }
  void OnFinish(int32_t) override {}
  void Restore(const std::vector<int64_t>&, const std::vector<bool>&) override {}
  ConsistencyStats stats() const override { return {}; }
};

// Stale synchronous parallel: clocks are steps pushed per worker.
class SspPolicy final : public ConsistencyPolicy {
 public:
  SspPolicy(const ConsistencyConfig& config, int64_t bound)
      : bound_(bound),
        timeout_(config.barrier_timeout),
        clock_(config.num_workers, 0),
        finished_(config.num_workers, false) {}

  std::string mode() const override { return absl::StrCat("ssp:", bound_); }

  absl::Status OnPush(const ChunkUpdate& push, const ApplyFn& apply) override {
    absl::Status st = apply(push);
    if (!st.ok()) return st;
    absl::MutexLock lock(&mu_);
    for (const RequestRef& r : push.requests) {
      clock_[r.worker] = std::max(clock_[r.worker], r.step + 1);
    }
    return absl::OkStatus();
  }

  absl::Status BeforePull(int32_t worker) override {
    absl::MutexLock lock(&mu_);
    const absl::Time start = absl::Now();
    const absl::Time deadline = start + timeout_;
    auto ready = [this, worker]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return clock_[worker] - SlowestLocked(worker) <= bound_;
    };
    while (!ready()) {
      if (mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) break;
      std::vector<int32_t> slow;
      for (size_t w = 0; w < clock_.size(); ++w) {
        if (!finished_[w] && clock_[worker] - clock_[w] > bound_) {
          slow.push_back(static_cast<int32_t>(w));
        }
      }
      wait_s_ += absl::ToDoubleSeconds(absl::Now() - start);
      return absl::FailedPreconditionError(
          absl::StrCat("ssp:", bound_, " pull of worker ", worker, " at clock ", clock_[worker],
                       " waited ", absl::FormatDuration(timeout_), " for workers [",
                       absl::StrJoin(slow, ", "), "] to catch up"));
    }
    wait_s_ += absl::ToDoubleSeconds(absl::Now() - start);
    max_lead_ = std::max(max_lead_, clock_[worker] - SlowestLocked(worker));
    return absl::OkStatus();
  }

  void OnFinish(int32_t worker) override {
    absl::MutexLock lock(&mu_);
    finished_[worker] = true;
  }

  void Restore(const std::vector<int64_t>& pushed, const std::vector<bool>& finished) override {
    absl::MutexLock lock(&mu_);
    for (size_t w = 0; w < clock_.size() && w < pushed.size(); ++w) {
      clock_[w] = pushed[w];
      finished_[w] = finished[w];
    }
  }

  ConsistencyStats stats() const override {
    absl::MutexLock lock(&mu_);
    return {max_lead_, wait_s_};
  }

 private:
  // Clock of the slowest unfinished worker other than `me` (or me's own clock if none).
  int64_t SlowestLocked(int32_t me) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    int64_t slowest = clock_[me];
    for (size_t w = 0; w < clock_.size(); ++w) {
      if (!finished_[w]) slowest = std::min(slowest, clock_[w]);
    }
    return slowest;
  }

  const int64_t bound_;
  const absl::Duration timeout_;
  mutable absl::Mutex mu_;
  std::vector<int64_t> clock_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> finished_ ABSL_GUARDED_BY(mu_);
  int64_t max_lead_ ABSL_GUARDED_BY(mu_) = 0;
  double wait_s_ ABSL_GUARDED_BY(mu_) = 0;
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
// Everything, including `apply`, runs under mu_: a step is completed exactly once, by the
// push that finds all of its group present (the last to arrive, or a waiter that notices
// after the group shrank), and nothing else of the policy moves meanwhile.
class SyncPolicy final : public ConsistencyPolicy {
 public:
  explicit SyncPolicy(const ConsistencyConfig& config)
      : job_(config.job),
        num_workers_(config.num_workers),
        timeout_(config.barrier_timeout),
        active_(config.num_workers, true) {}

  std::string mode() const override { return "sync"; }

  absl::Status OnPush(const ChunkUpdate& push, const ApplyFn& apply) override {
    const RequestRef& me = push.requests.at(0);
    absl::MutexLock lock(&mu_);
    std::shared_ptr<Step> step;
    if (auto it = steps_.find(me.step); it != steps_.end()) step = it->second;
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
    if (step == nullptr) {
      step = std::make_shared<Step>(active_, lr_scale_);
      steps_[me.step] = step;
    }
    if (step->contributions[me.worker].has_value()) {
      return absl::AbortedError(absl::StrCat("sync step ", me.step, ": worker ", me.worker,
                                             " already pushed for this step"));
    }
    if (step->arrived > 0 && step->chunks != push.chunks) {
      return absl::InvalidArgumentError(
          absl::StrCat("sync step ", me.step, ": worker ", me.worker,
                       " pushed a different set of chunks than the other workers"));
    }
    // Copy: the caller's buffers are only valid during this call, and the step may complete
    // in another worker's call.
    Contribution c;
    c.request = me;
    c.base_versions = push.base_versions;
    for (size_t i = 0; i < push.chunks.size(); ++i) {
      c.grads.emplace_back(push.grads[i], push.grads[i] + push.numels[i]);
    }
    step->contributions[me.worker] = std::move(c);
    step->withdrew[me.worker] = false;
    step->chunks = push.chunks;
    step->numels = push.numels;
    ++step->arrived;
    if (step->Complete()) return FinishStepLocked(me.step, step.get(), apply);

    const absl::Time start = absl::Now();
    const absl::Time deadline = start + timeout_;
    const int32_t w = me.worker;
    // Re-evaluated whenever mu_ is released, so also after SetGroup.
    auto wake = [&step, w]() { return step->done || step->evicted[w] || step->Complete(); };
    const bool ok = mu_.AwaitWithDeadline(absl::Condition(&wake), deadline);
    wait_s_ += absl::ToDoubleSeconds(absl::Now() - start);
    if (step->evicted[w]) {
      // SetGroup already removed this contribution from the step.
      return absl::FailedPreconditionError(absl::StrCat(
          "worker ", w, " was removed from the sync group of job ", job_,
          " (active: ", RankList(active_), ") while its push for step ", me.step,
          " waited at the barrier; the push was dropped and nothing of it was applied"));
    }
    if (step->done) return step->result;
    if (ok) return FinishStepLocked(me.step, step.get(), apply);  // Complete after a shrink.
    // Timed out: withdraw this worker's contribution so nothing of it is applied.
    std::vector<int32_t> missing, gave_up;
    for (int32_t v = 0; v < num_workers_; ++v) {
      if (!step->members[v]) continue;
      if (step->withdrew[v]) {
        gave_up.push_back(v);
      } else if (!step->contributions[v].has_value()) {
        missing.push_back(v);
      }
    }
    step->contributions[w].reset();
    step->withdrew[w] = true;
    --step->arrived;
    if (step->arrived == 0) EraseLocked(me.step, step.get());
    return absl::FailedPreconditionError(absl::StrCat(
        "sync barrier for step ", me.step, " timed out after ", absl::FormatDuration(timeout_),
        ": workers [", absl::StrJoin(missing, ", "), "] did not push",
        gave_up.empty() ? ""
                        : absl::StrCat(" (workers [", absl::StrJoin(gave_up, ", "),
                                       "] pushed but gave up first)"),
        "; nothing was applied"));
  }

  absl::Status SetGroup(const std::vector<int32_t>& active, float lr_scale) override {
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
    absl::MutexLock lock(&mu_);
    active_ = members;
    lr_scale_ = lr_scale;
    // Shrink the steps in progress; growth waits for new steps. A waiter whose condition
    // became true wakes when mu_ is released.
    for (auto it = steps_.begin(); it != steps_.end();) {
      Step& step = *it->second;
      bool shrunk = false;
      for (int32_t w = 0; w < num_workers_; ++w) {
        if (!step.members[w] || members[w]) continue;
        step.members[w] = false;
        shrunk = true;
        if (step.contributions[w].has_value()) {
          step.contributions[w].reset();
          step.evicted[w] = true;
          --step.arrived;
        }
      }
      if (shrunk) step.lr_scale = lr_scale;
      // Nobody left waiting on it: forget it, so the next push starts it with the new group.
      if (step.arrived == 0) {
        it = steps_.erase(it);
      } else {
        ++it;
      }
    }
    return absl::OkStatus();
  }

  absl::Status BeforePull(int32_t) override { return absl::OkStatus(); }
  void OnFinish(int32_t) override {}
  void Restore(const std::vector<int64_t>&, const std::vector<bool>&) override {}

  ConsistencyStats stats() const override {
    absl::MutexLock lock(&mu_);
    return {0, wait_s_};
  }

 private:
  struct Contribution {
    RequestRef request;
    std::vector<int64_t> base_versions;
    std::vector<std::vector<float>> grads;  // Per chunk.
  };
  struct Step {
    Step(std::vector<bool> group, float scale)
        : members(std::move(group)),
          lr_scale(scale),
          contributions(members.size()),
          withdrew(members.size(), false),
          evicted(members.size(), false) {}
    // All members have pushed (and none of them withdrew).
    bool Complete() const {
      if (done || arrived == 0) return false;
      int32_t n = 0;
      for (bool m : members) n += m ? 1 : 0;
      return arrived == n;
    }
    std::vector<bool> members;  // The step's group: fixed at creation, shrunk by SetGroup.
    float lr_scale;
    std::vector<std::optional<Contribution>> contributions;  // Only members have one.
    std::vector<bool> withdrew;                              // Pushed, then timed out and withdrew.
    std::vector<bool> evicted;  // Pushed, then left the group while waiting.
    std::vector<int64_t> chunks, numels;
    int32_t arrived = 0;  // Contributions present.
    bool done = false;
    absl::Status result;
  };

  // Averages the complete step's contributions in rank order, applies them once and releases
  // its waiters.
  absl::Status FinishStepLocked(int64_t number, Step* step, const ApplyFn& apply)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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
    for (const Contribution* c : in) avg.requests.push_back(c->request);
    step->result = apply(avg);
    step->done = true;
    EraseLocked(number, step);
    return step->result;
  }

  // Removes step `number` if it is still `step` (not a newer step of the same number).
  void EraseLocked(int64_t number, const Step* step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = steps_.find(number);
    if (it != steps_.end() && it->second.get() == step) steps_.erase(it);
  }

  const std::string job_;
  const int32_t num_workers_;
  const absl::Duration timeout_;
  mutable absl::Mutex mu_;
  std::vector<bool> active_ ABSL_GUARDED_BY(mu_);  // The group new steps start with.
  float lr_scale_ ABSL_GUARDED_BY(mu_) = 1.0f;
  std::map<int64_t, std::shared_ptr<Step>> steps_ ABSL_GUARDED_BY(mu_);
  double wait_s_ ABSL_GUARDED_BY(mu_) = 0;
};

absl::Status NoParam(const std::string& name, const std::string& param) {
  if (param.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("consistency mode \"", name, "\" takes no parameter, got \"", param, "\""));
}

}  // namespace

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
