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
      return absl::FailedPreconditionError(absl::StrCat(
          "ssp:", bound_, " pull of worker ", worker, " at clock ", clock_[worker],
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

// Bulk-synchronous parallel: one barrier per step.
class SyncPolicy final : public ConsistencyPolicy {
 public:
  explicit SyncPolicy(const ConsistencyConfig& config)
      : num_workers_(config.num_workers), timeout_(config.barrier_timeout) {}

  std::string mode() const override { return "sync"; }

  absl::Status OnPush(const ChunkUpdate& push, const ApplyFn& apply) override {
    const RequestRef& me = push.requests.at(0);
    absl::MutexLock lock(&mu_);
    std::shared_ptr<Step>& slot = steps_[me.step];
    if (slot == nullptr) slot = std::make_shared<Step>(num_workers_);
    std::shared_ptr<Step> step = slot;
    if (step->contributions[me.worker].has_value()) {
      return absl::AbortedError(absl::StrCat("sync step ", me.step, ": worker ", me.worker,
                                             " already pushed for this step"));
    }
    if (step->arrived > 0 && step->chunks != push.chunks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sync step ", me.step, ": worker ", me.worker,
          " pushed a different set of chunks than the other workers"));
    }
    // Copy: the caller's buffers are only valid during this call, and the step may complete
    // in another worker's call.
    Contribution c;
    c.request = me;
    for (size_t i = 0; i < push.chunks.size(); ++i) {
      c.grads.emplace_back(push.grads[i], push.grads[i] + push.numels[i]);
    }
    step->contributions[me.worker] = std::move(c);
    step->withdrew[me.worker] = false;
    step->chunks = push.chunks;
    step->numels = push.numels;
    // Staleness of the averaged update is measured from rank 0's view when it is here (so it
    // does not depend on arrival order).
    if (me.worker == 0 || step->arrived == 0) step->base_versions = push.base_versions;
    ++step->arrived;

    if (step->arrived == num_workers_) {
      // Last to arrive: average in rank order, apply once, release everyone.
      ChunkUpdate avg;
      avg.chunks = step->chunks;
      avg.numels = step->numels;
      avg.base_versions = step->base_versions;
      std::vector<std::vector<float>> sums(step->chunks.size());
      const float inv = 1.0f / static_cast<float>(num_workers_);
      for (size_t i = 0; i < step->chunks.size(); ++i) {
        std::vector<float>& sum = sums[i];
        sum = step->contributions[0]->grads[i];
        for (int32_t w = 1; w < num_workers_; ++w) {
          const std::vector<float>& g = step->contributions[w]->grads[i];
          for (size_t k = 0; k < sum.size(); ++k) sum[k] += g[k];
        }
        for (float& v : sum) v *= inv;
        avg.grads.push_back(sum.data());
      }
      for (int32_t w = 0; w < num_workers_; ++w) {
        avg.requests.push_back(step->contributions[w]->request);
      }
      step->result = apply(avg);
      step->done = true;
      steps_.erase(me.step);
      return step->result;
    }

    const absl::Time start = absl::Now();
    const absl::Time deadline = start + timeout_;
    auto done = [&step]() { return step->done; };
    const bool ok = mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
    wait_s_ += absl::ToDoubleSeconds(absl::Now() - start);
    if (ok) return step->result;
    // Timed out: withdraw this worker's contribution so nothing of it is applied.
    std::vector<int32_t> missing, gave_up;
    for (int32_t w = 0; w < num_workers_; ++w) {
      if (step->withdrew[w]) {
        gave_up.push_back(w);
      } else if (!step->contributions[w].has_value()) {
        missing.push_back(w);
      }
    }
    step->contributions[me.worker].reset();
    step->withdrew[me.worker] = true;
    --step->arrived;
    if (step->arrived == 0) steps_.erase(me.step);
    return absl::FailedPreconditionError(absl::StrCat(
        "sync barrier for step ", me.step, " timed out after ", absl::FormatDuration(timeout_),
        ": workers [", absl::StrJoin(missing, ", "), "] did not push",
        gave_up.empty() ? "" : absl::StrCat(" (workers [", absl::StrJoin(gave_up, ", "),
                                            "] pushed but gave up first)"),
        "; nothing was applied"));
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
    std::vector<std::vector<float>> grads;  // Per chunk.
  };
  struct Step {
    explicit Step(int32_t n) : contributions(n), withdrew(n, false) {}
    std::vector<std::optional<Contribution>> contributions;
    std::vector<bool> withdrew;  // Pushed, then timed out and withdrew.
    std::vector<int64_t> chunks, numels, base_versions;
    int32_t arrived = 0;
    bool done = false;
    absl::Status result;
  };

  const int32_t num_workers_;
  const absl::Duration timeout_;
  mutable absl::Mutex mu_;
  std::map<int64_t, std::shared_ptr<Step>> steps_ ABSL_GUARDED_BY(mu_);
  double wait_s_ ABSL_GUARDED_BY(mu_) = 0;
};

absl::Status NoParam(const std::string& name, const std::string& param) {
  if (param.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("consistency mode \"", name, "\" takes no parameter, got \"", param, "\""));
}

}  // namespace

ConsistencyRegistry ConsistencyRegistry::WithBuiltins() {
  ConsistencyRegistry r;
  r.Register("async", [](const ConsistencyConfig&, const std::string& param)
                          -> absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> {
    if (absl::Status st = NoParam("async", param); !st.ok()) return st;
    return std::unique_ptr<ConsistencyPolicy>(new AsyncPolicy());
  });
  r.Register("sync", [](const ConsistencyConfig& config, const std::string& param)
                         -> absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> {
    if (absl::Status st = NoParam("sync", param); !st.ok()) return st;
    return std::unique_ptr<ConsistencyPolicy>(new SyncPolicy(config));
  });
  r.Register("ssp", [](const ConsistencyConfig& config, const std::string& param)
                        -> absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> {
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
