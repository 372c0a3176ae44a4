#include "worker/ps/ps_mode.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/background_task.h"
#include "common/job_spec.h"
#include "common/numeric.h"
#include "common/optimizer.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "worker/core/auto_codec.h"
#include "worker/core/grad_clip.h"
#include "worker/core/loss_scaler.h"
#include "worker/ps/backward_overlap.h"

namespace gradmesh {
namespace {

class PsMode : public TrainingMode {
 public:
  PsMode(const TrainerOptions& options, ParameterClientFactory client_factory)
      : options_(options),
        spec_(options.spec),
        client_factory_(std::move(client_factory)),
        active_ranks_(options.active_ranks),
        evaluate_(options.evaluate) {}
  // A run that ended between a step's exchange and its wait (overlap: 2, pipeline: 1; e.g. a
  // failed forward) leaves sends in flight: they stop retrying, so the mode's end does not
  // wait out their retry budget against a dead shard. After Finish nothing is in flight.
  ~PsMode() override {
    if (client_ != nullptr && (pipelined_ || spec_.overlap() == 2)) client_->StopRetrying();
  }

  absl::StatusOr<int64_t> Start(ModelView* model, const LoopInfo& info) override;
  std::vector<LogField> StartFields() const override;
  absl::StatusOr<StepOutcome> Exchange(int64_t step,
                                       absl::Span<const absl::Span<const float>> grads, double loss,
                                       const StepTiming& timing) override;
  absl::StatusOr<bool> MaybeCheckpoint(int64_t steps_done) override;
  int64_t bytes_sent() const override { return client_->bytes_pushed(); }
  std::vector<LogField> ProgressFields(int64_t done, int64_t window) override;
  absl::StatusOr<bool> Finish(int64_t step, TrainResult* result) override;

  // commit_steps (sync with clipping or dynamic loss scaling): the mode unscales, checks and
  // clips through the shards' two-phase apply (CommittedExchange).
  bool unscales_gradients() const override { return commit_ && scaling_; }
  void SetLossScale(float scale) override { loss_scale_ = scale; }
  ClipCounters TakeClipCounters() override { return std::exchange(clip_counters_, {}); }

  // A push codec on the device (worker/core/device_gradients.h) for the plain exchange: one
  // Push(Pull) per step of the whole gradient, whose codec does not change. The pipelined,
  // overlapped, committed, DiLoCo and auto-codec exchanges read the host gradient.
  bool UseDeviceGradients(DeviceGradients* gradients) override {
    if (pipelined_ || commit_ || overlap_ != nullptr || auto_codec_.has_value() ||
        options_.mode == Mode::kDiloco) {
      return false;  // DiLoCo (even with inner_steps 1) pushes pseudo-gradients, not .grad.
    }
    return client_->UseDeviceGradients(gradients);
  }

  // overlap: 1 (JobSpec.overlap): each shard's part leaves as backward produces it; 2: and
  // Exchange returns before the answers, which the next forward awaits entry by entry.
  bool wants_gradient_hook() const override { return overlap_ != nullptr; }
  absl::Status AwaitParameters(int begin, int end) override {
    return overlap_ != nullptr ? overlap_->AwaitEntries(begin, end) : absl::OkStatus();
  }
  void BeforeBackward(int64_t step, double loss, bool stop_requested) override {
    if (overlap_ != nullptr) overlap_begin_ = overlap_->BeginStep(step);
  }
  void OnGradient(int param, absl::Span<const float> grad) override {
    if (overlap_ != nullptr) overlap_->OnGradient(param, grad);
  }
  void OnBufferDeltas(absl::Span<const absl::Span<const float>> deltas) override {
    if (overlap_ == nullptr) return;
    for (size_t i = 0; i < deltas.size(); ++i) {
      overlap_->OnGradient(model_->num_params + static_cast<int>(i), deltas[i]);
    }
  }
  void AbortStep() override {
    if (overlap_ != nullptr) overlap_->Abort();
  }

  void SetGroup(std::vector<int32_t> active_ranks, bool evaluate) override {
    absl::MutexLock lock(&group_mu_);
    active_ranks_ = std::move(active_ranks);
    evaluate_ = evaluate;
  }
  // A cancelled job or a daemon shutting down: the client retries no more (a dead shard
  // would otherwise hold the rank for its whole retry budget), nor does the final wait.
  void OnStopRequested() override {
    absl::MutexLock lock(&stop_mu_);
    stop_requested_ = true;
    if (stoppable_ != nullptr) stoppable_->StopRetrying();
  }

 protected:
  // pipeline: 1 (JobSpec.pipeline). Exchange(t) waits for step t-1's exchange, which pulled
  // into staging_; copies staging_ into the model (the parameters step t+1 computes on);
  // copies step t's gradients and starts their push (with the versions they were computed
  // on, model_versions_ before the copy) and the next pull into staging_ in the background.
  // Finish (and a stop) first waits for the exchange in flight.
  absl::StatusOr<StepOutcome> PipelinedExchange(int64_t step,
                                                absl::Span<const absl::Span<const float>> grads,
                                                double loss, const StepTiming& timing);
  // Waits for the exchange in flight, if any, and moves its pulled values into the model.
  absl::Status DrainPipeline();
  // The background half of a pipelined step: push grad_buf_, pull into staging_.
  absl::Status BackgroundExchange(int64_t step, std::vector<int64_t> base_versions);

  virtual JobLayout Layout(const ModelView& model, int64_t total_steps) const;
  // Training steps per push (diloco: a round of inner steps).
  virtual int64_t steps_per_push() const { return 1; }
  absl::Status MaybeSwitchCodec(int64_t step, double loss, double compute_s, double comm_s);
  // commit_steps: unscale and check the step's gradient, push it (zeros, flagged, if it is
  // not finite), decide the clip coefficient or a skip from every shard's figures, and pull
  // with the commit; again if a shard lost the step to a restart.
  absl::StatusOr<StepOutcome> CommittedExchange(int64_t step,
                                                absl::Span<const absl::Span<const float>> grads,
                                                double loss);
  // The spans CommittedExchange pushes: the gradient unscaled into grad_buf_ (or as given),
  // or zeros; sets *finite.
  std::vector<absl::Span<const float>> CommitPayload(
      absl::Span<const absl::Span<const float>> grads, bool* finite);
  // Waits (bounded by options.wait_for_workers) until every worker of the group finished;
  // CANCELLED once a stop is requested.
  absl::Status WaitForWorkers();
  // chunk_bytes 0 (auto): a job the shards already hold (e.g. made by a binary whose default
  // was 1 MiB chunks) keeps its chunking: if the shards that hold it report another
  // chunk_elems than `layout`'s, client_ is rebuilt with theirs (shards that lost it get it
  // back with that chunking). A job no shard holds keeps `layout`; shards that disagree are
  // FAILED_PRECONDITION.
  absl::Status AdoptStoredChunking(JobLayout layout);
  // client_ for `layout` (replacing one made before), reachable by OnStopRequested.
  absl::Status MakeClient(JobLayout layout);

  const TrainerOptions& options_;
  const JobSpec& spec_;
  const ParameterClientFactory client_factory_;
  ModelView* model_ = nullptr;
  std::unique_ptr<ParameterClient> client_;  // Set by MakeClient (training thread).
  std::optional<AutoCodec> auto_codec_;      // compression.push: auto (worker/auto_codec.h).
  // client_ as OnStopRequested (any thread) may reach it.
  absl::Mutex stop_mu_;
  bool stop_requested_ ABSL_GUARDED_BY(stop_mu_) = false;
  ParameterClient* stoppable_ ABSL_GUARDED_BY(stop_mu_) = nullptr;

  absl::Mutex group_mu_;
  std::vector<int32_t> active_ranks_ ABSL_GUARDED_BY(group_mu_);
  bool evaluate_ ABSL_GUARDED_BY(group_mu_);

  // pipeline: 1 only. The background exchange owns grad_buf_, staging_, staged_versions_ and
  // staged_exchange_s_ between BackgroundTask::Start and Wait; the training thread everything
  // else (it reads those after Wait, which orders them).
  bool pipelined_ = false;
  std::vector<std::vector<float>> grad_buf_;  // The gradients of the step in flight.
  std::vector<std::vector<float>> staging_;   // The pull target: the shards' last values.
  std::vector<int64_t> staged_versions_;      // Their versions.
  std::vector<int64_t> model_versions_;       // Versions of the values in the model.
  double staged_exchange_s_ = 0;              // How long the exchange in flight took.
  double exchange_s_ = 0;                     // Background exchanges, total seconds.
  double exposed_s_ = 0;                      // Of which the training thread waited.
  int64_t exchanges_ = 0;
  double last_wait_s_ = 0;  // What the last drain waited (the exposed part; auto codec).
  // commit_steps (sync jobs that clip or scale the loss; JobLayout.commit_steps).
  bool commit_ = false;
  bool scaling_ = false;  // Dynamic loss scaling: the mode unscales.
  float loss_scale_ = 1;  // The loop's scale for the current step.
  double clip_norm_ = 0;  // clip_grad_norm (0: off).
  ClipCounters clip_counters_;
  std::vector<std::vector<float>> zeros_;  // The payload of a non-finite step.
  // overlap: 1 and 2 only (after client_, which it uses).
  std::unique_ptr<BackwardOverlap> overlap_;
  absl::Status overlap_begin_;       // What the step's BeginStep returned.
  double overlap_exposed_seen_ = 0;  // overlap: 2: exposed_s at the last auto-codec probe.
  // Last: destroyed (waiting for a running exchange) before the buffers it uses.
  std::unique_ptr<BackgroundTask> background_;
};

JobLayout PsMode::Layout(const ModelView& model, int64_t total_steps) const {
  JobLayout layout;
  layout.job = spec_.name();
  std::vector<int64_t> numels;
  for (const absl::Span<float>& p : model.params) numels.push_back(static_cast<int64_t>(p.size()));
  layout.chunk_elems = spec_.chunk_bytes() > 0
                           ? spec_.chunk_bytes() / static_cast<int64_t>(sizeof(float))
                           : AutoChunkElems(numels, spec_.num_shards());
  // Every worker derives the same schedule length: chunk updates over the whole job (one per
  // step in sync mode, where a step's pushes are averaged; one per push of any worker
  // otherwise).
  layout.optimizer =
      WithDecayUpdates(ScaledOptimizer(spec_, spec_.num_workers()),
                       total_steps * (options_.mode == Mode::kSync ? 1 : spec_.num_workers()));
  layout.consistency = spec_.mode();
  layout.num_workers = spec_.num_workers();
  layout.durability = spec_.durability();
  layout.staleness_damping = spec_.staleness_damping();
  layout.barrier_timeout_s = spec_.barrier_timeout_s();
  layout.commit_steps = commit_;
  if (commit_) layout.clip_grad_value = spec_.clip_grad_value();
  if (spec_.placement() == "ordered") layout.placement = PLACEMENT_ORDERED;
  // Parameters, then the buffers: stored on the shards beside them, pushed as the deltas the
  // forward passes made and pulled back into the mirrors like parameters (TensorSpec.buffer).
  for (int i = 0; i < model.size(); ++i) {
    TensorSpec t;
    t.set_name(model.names[i]);
    for (int64_t d : model.shapes[i]) t.add_shape(d);
    if (model.is_buffer(i)) t.set_buffer(true);
    // FLOAT32 stays unset, as the shards normalise it.
    if (static_cast<size_t>(i) < model.dtypes.size() && model.dtypes[i] != ElemType::kFloat32) {
      t.set_dtype(ToProtoDType(model.dtypes[i]));
    }
    layout.tensors.push_back(t);
  }
  return layout;
}

absl::Status PsMode::AdoptStoredChunking(JobLayout layout) {
  absl::StatusOr<std::vector<JobInfoResponse>> got = client_->GetJobInfoWhereHeld();
  RETURN_IF_ERROR(Annotate(got.status(), "reading the job's layout from its shards"));
  const std::vector<JobInfoResponse>& infos = *got;
  int64_t stored = 0;
  int held_by = -1;
  for (size_t s = 0; s < infos.size(); ++s) {
    if (infos[s].job().empty()) continue;  // This shard does not hold the job.
    if (held_by >= 0 && infos[s].chunk_elems() != stored) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", spec_.name(), ": its shards hold it with different chunk sizes (shard ", held_by,
          ": chunk_elems ", stored, ", shard ", s, ": ", infos[s].chunk_elems(),
          "); remove the job from the shards or set chunk_bytes to the size it was made with"));
    }
    held_by = static_cast<int>(s);
    stored = infos[s].chunk_elems();
  }
  // A shard that lost the job (no durability) gets it again with the others' chunking.
  if (held_by < 0 || stored <= 0 || stored == layout.chunk_elems) return absl::OkStatus();
  LogInfo(options_.logger, "chunking_adopted",
          {Kv("job", spec_.name()), Kv("auto_chunk_elems", layout.chunk_elems),
           Kv("stored_chunk_elems", stored), Kv("from_shard", held_by)});
  layout.chunk_elems = stored;
  return MakeClient(std::move(layout));
}

absl::Status PsMode::MakeClient(JobLayout layout) {
  ASSIGN_OR_RETURN(std::unique_ptr<ParameterClient> client, client_factory_(std::move(layout)));
  {
    absl::MutexLock lock(&stop_mu_);
    stoppable_ = client.get();
    if (stop_requested_) client->StopRetrying();
  }
  client_ = std::move(client);  // The one replaced, if any, is no longer reachable.
  return absl::OkStatus();
}

absl::StatusOr<int64_t> PsMode::Start(ModelView* model, const LoopInfo& info) {
  model_ = model;
  scaling_ = spec_.loss_scale().mode() == "dynamic";
  clip_norm_ = spec_.clip_grad_norm();
  commit_ = options_.mode == Mode::kSync &&
            (scaling_ || spec_.clip_grad_norm() > 0 || spec_.clip_grad_value() > 0);
  JobLayout layout = Layout(*model, info.total_steps);
  RETURN_IF_ERROR(MakeClient(layout));
  if (spec_.chunk_bytes() == 0) RETURN_IF_ERROR(AdoptStoredChunking(std::move(layout)));
  if (spec_.compression().push() == "auto") auto_codec_.emplace();
  // Every worker offers the same seeded initial values; the first InitJob wins, the rest see
  // the job already exists. Then everyone starts from the shards' values.
  std::vector<absl::Span<const float>> initial(model->params.begin(), model->params.end());
  RETURN_IF_ERROR(client_->InitJob(initial));
  RETURN_IF_ERROR(client_->Pull(model->params));
  // Resume where the shards say this rank got to (0 for a new job).
  int64_t first_step = std::numeric_limits<int64_t>::max();
  ASSIGN_OR_RETURN(std::vector<JobInfoResponse> infos, client_->GetJobInfo());
  for (const JobInfoResponse& job : infos) {
    first_step = std::min(first_step, job.workers(options_.rank).last_step() + 1);
  }
  if (first_step > 0) {
    // The shards count pushes: steps, or rounds of steps_per_push() steps (diloco).
    LogInfo(options_.logger, "resuming",
            {Kv("job", spec_.name()), Kv("rank", options_.rank),
             Kv("step", std::min(first_step * steps_per_push(), info.total_steps)),
             Kv("pushes_done", first_step)});
  }
  if (spec_.overlap() > 0) {
    overlap_ = std::make_unique<BackwardOverlap>(client_.get(), model, spec_.overlap() == 2);
  }
  if (spec_.pipeline() > 0) {
    pipelined_ = true;
    // staging_ holds what the client last pulled ("changes" pulls update it in place).
    for (const absl::Span<float>& p : model->params) staging_.emplace_back(p.begin(), p.end());
    grad_buf_.resize(model->params.size());
    model_versions_ = client_->PulledVersions();
    background_ = std::make_unique<BackgroundTask>();
  }
  return first_step;
}

std::vector<LogField> PsMode::StartFields() const {
  std::vector<LogField> f = {
      Kv("shards", spec_.num_shards()),
      Kv("push_codec", spec_.compression().push().empty() ? "float32" : spec_.compression().push()),
      Kv("pull_codec",
         spec_.compression().pull().empty() ? "float32" : spec_.compression().pull())};
  if (commit_) f.push_back(Kv("commit_steps", 1));
  if (overlap_ != nullptr) f.push_back(Kv("overlap", spec_.overlap()));
  if (spec_.placement() == "ordered") f.push_back(Kv("placement", "ordered"));
  // Every gradient is computed on parameters one exchange older than without the pipeline.
  if (pipelined_) {
    f.push_back(Kv("pipeline", 1));
    f.push_back(Kv("added_staleness", 1));
  }
  return f;
}

absl::Status PsMode::MaybeSwitchCodec(int64_t step, double loss, double compute_s, double comm_s) {
  std::optional<std::string> next = auto_codec_->Observe(loss, compute_s, comm_s);
  if (!next.has_value()) return absl::OkStatus();
  RETURN_IF_ERROR(client_->SetPushCodec(*next));
  LogInfo(options_.logger, auto_codec_->fell_back() ? "auto_codec_fallback" : "auto_codec",
          {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("step", step),
           Kv("codec", next->empty() ? "dense" : *next),
           Kv("comm_over_compute", absl::StrFormat("%.2f", auto_codec_->ratio()))});
  return absl::OkStatus();
}

absl::Status PsMode::BackgroundExchange(int64_t step, std::vector<int64_t> base_versions) {
  const absl::Time start = absl::Now();
  std::vector<absl::Span<const float>> grads(grad_buf_.begin(), grad_buf_.end());
  // Named with its own step: it is reported by the next step's exchange.
  const std::string where = absl::StrCat("pipelined exchange of step ", step);
  std::vector<absl::Span<float>> into(staging_.begin(), staging_.end());
  RETURN_IF_ERROR(Annotate(client_->PushPull(step, grads, into, &base_versions), where));
  staged_versions_ = client_->PulledVersions();
  staged_exchange_s_ = absl::ToDoubleSeconds(absl::Now() - start);
  return absl::OkStatus();
}

absl::Status PsMode::DrainPipeline() {
  if (!background_->pending()) return absl::OkStatus();
  const absl::Time start = absl::Now();
  absl::Status st = background_->Wait();
  last_wait_s_ = absl::ToDoubleSeconds(absl::Now() - start);
  exposed_s_ += last_wait_s_;
  RETURN_IF_ERROR(st);
  exchange_s_ += staged_exchange_s_;
  ++exchanges_;
  for (size_t i = 0; i < staging_.size(); ++i) {
    std::copy(staging_[i].begin(), staging_[i].end(), model_->params[i].begin());
  }
  model_versions_ = staged_versions_;
  return absl::OkStatus();
}

absl::StatusOr<StepOutcome> PsMode::PipelinedExchange(
    int64_t step, absl::Span<const absl::Span<const float>> grads, double loss,
    const StepTiming& timing) {
  // The versions step t's gradients were computed on, before the model moves on.
  std::vector<int64_t> base = model_versions_;
  RETURN_IF_ERROR(DrainPipeline());
  // The auto codec weighs what the step waited for, not the exchange hidden behind compute.
  if (auto_codec_.has_value() && exchanges_ > 0) {
    RETURN_IF_ERROR(MaybeSwitchCodec(step, loss, timing.compute_s, last_wait_s_));
  }
  for (size_t i = 0; i < grads.size(); ++i) grad_buf_[i].assign(grads[i].begin(), grads[i].end());
  RETURN_IF_ERROR(background_->Start(
      [this, step, base = std::move(base)]() mutable { return BackgroundExchange(step, base); }));
  StepOutcome out;
  out.loss = loss;
  return out;
}

absl::StatusOr<StepOutcome> PsMode::Exchange(int64_t step,
                                             absl::Span<const absl::Span<const float>> grads,
                                             double loss, const StepTiming& timing) {
  if (pipelined_) return PipelinedExchange(step, grads, loss, timing);
  if (commit_) return CommittedExchange(step, grads, loss);
  const absl::Time start = absl::Now();
  if (overlap_ != nullptr) {
    RETURN_IF_ERROR(std::exchange(overlap_begin_, absl::OkStatus()));
    RETURN_IF_ERROR(overlap_->Finish(grads));
  } else {
    RETURN_IF_ERROR(
        client_->PushPull(step, std::vector<absl::Span<const float>>(grads.begin(), grads.end()),
                          model_->params, nullptr));
  }
  if (auto_codec_.has_value()) {
    double waited = absl::ToDoubleSeconds(absl::Now() - start);
    if (spec_.overlap() == 2) {
      // Exchange did not wait: the step's wait is the forward's for the previous answers.
      const double exposed = overlap_->totals().exposed_s;
      waited = exposed - overlap_exposed_seen_;
      overlap_exposed_seen_ = exposed;
    }
    RETURN_IF_ERROR(MaybeSwitchCodec(step, loss, timing.compute_s, waited));
  }
  StepOutcome out;
  out.loss = loss;
  return out;
}

std::vector<absl::Span<const float>> PsMode::CommitPayload(
    absl::Span<const absl::Span<const float>> grads, bool* finite) {
  std::vector<absl::Span<const float>> push(grads.begin(), grads.end());
  *finite = true;
  if (!scaling_) return push;  // The client refuses a non-finite gradient, as in plain sync.
  grad_buf_.resize(grads.size());
  std::vector<absl::Span<float>> params;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (model_->is_buffer(static_cast<int>(i))) {
      // Buffer deltas come from the forward, unscaled; an overflowing forward can still make
      // them non-finite.
      *finite &= FirstNonFinite(grads[i].data(), static_cast<int64_t>(grads[i].size())) < 0;
      continue;
    }
    grad_buf_[i].assign(grads[i].begin(), grads[i].end());
    params.emplace_back(grad_buf_[i].data(), grad_buf_[i].size());
    push[i] = grad_buf_[i];
  }
  *finite &= UnscaleAndCheck(params, loss_scale_);
  if (*finite) return push;
  if (zeros_.empty()) {
    for (const absl::Span<const float>& g : grads) zeros_.emplace_back(g.size(), 0.0f);
  }
  return std::vector<absl::Span<const float>>(zeros_.begin(), zeros_.end());
}

absl::StatusOr<StepOutcome> PsMode::CommittedExchange(
    int64_t step, absl::Span<const absl::Span<const float>> grads, double loss) {
  bool finite = true;
  const std::vector<absl::Span<const float>> push = CommitPayload(grads, &finite);
  // Shards that keep restarting between the phases keep the step going round: each round is
  // progress (a shard came back), so the bound is time, not a count (4 rounds failed jobs whose
  // shards were killed every few seconds). A stop ends it through the push.
  constexpr absl::Duration kRecommitFor = absl::Minutes(30);
  const absl::Time give_up = absl::Now() + kRecommitFor;
  for (int attempt = 1;; ++attempt) {
    ASSIGN_OR_RETURN(const PreparedFigures f, client_->PushPrepared(step, push, !finite));
    if (f.forgotten > 0) {
      // A shard applied the step and restarted while another lost it (held steps are not
      // durable): the others decide from their parts alone, so this one step's clip
      // coefficient may differ between those shards and the ones that applied it before. The
      // job goes on rather than refusing the step for good.
      LogWarning(options_.logger, "step_figures_forgotten",
                 {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("step", step),
                  Kv("shards", f.forgotten)});
    }
    // Every worker adds the same figures in the same order, so all decide alike.
    const double norm = std::sqrt(f.grad_sq_norm);
    SyncCommit commit;
    commit.set_step(step);
    commit.set_skip(f.nonfinite || !std::isfinite(norm));
    const double coef = commit.skip() ? 1 : ClipCoefficient(clip_norm_, norm);
    commit.set_clip_coef(coef);
    ASSIGN_OR_RETURN(const bool committed, client_->PullCommitted(commit, model_->params));
    if (committed) {
      if (!commit.skip() && (clip_norm_ > 0 || spec_.clip_grad_value() > 0)) {
        clip_counters_.Add(ClipStats{norm, coef < 1 || f.value_clipped});
      }
      StepOutcome out;
      out.loss = loss;
      out.skipped = commit.skip();
      return out;
    }
    if (absl::Now() >= give_up) {
      return absl::UnavailableError(
          absl::StrCat("sync step ", step, " of job ", spec_.name(), ": ", attempt, " commits in ",
                       absl::FormatDuration(kRecommitFor),
                       " found a shard that no longer held the step (restarting?)"));
    }
    // A shard restarted between the phases: push the step again (shards that applied it
    // answer duplicate) and commit again.
    LogWarning(options_.logger, "step_recommit",
               {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("step", step),
                Kv("attempt", attempt)});
  }
}

absl::StatusOr<bool> PsMode::MaybeCheckpoint(int64_t steps_done) {
  // The shards snapshot durably every checkpoint.every_steps steps of every worker.
  const int64_t every = spec_.checkpoint().every_steps();
  if (every <= 0 || steps_done % every != 0) return false;
  // overlap: 2: the step is reported once the shards acknowledged its push.
  if (overlap_ != nullptr) RETURN_IF_ERROR(overlap_->Settle());
  return true;
}

std::vector<LogField> PsMode::ProgressFields(int64_t done, int64_t window) {
  const int64_t pushed = client_->bytes_pushed();
  std::vector<LogField> f = {
      Kv("codec_ms", absl::StrFormat("%.2f", 1e3 * client_->codec_seconds() / done)),
      Kv("push_ratio",
         absl::StrFormat("%.1f", pushed > 0
                                     ? static_cast<double>(client_->raw_bytes_pushed()) / pushed
                                     : 1.0))};
  if (overlap_ != nullptr && overlap_->totals().steps > 0) {
    // The timeline, per step: the time sends were in flight while backward still ran plus
    // the wait after backward (exposed_ms) is exchange_ms; hidden is the first's share of it;
    // early_shards the share of the shards' parts the background thread sent (during
    // backward, or just after it, before Exchange began).
    const BackwardOverlap::Totals t = overlap_->totals();
    const double exchange_s = t.hidden_s + t.exposed_s;
    f.push_back(Kv("exchange_ms", absl::StrFormat("%.2f", 1e3 * exchange_s / t.steps)));
    f.push_back(Kv("exposed_ms", absl::StrFormat("%.2f", 1e3 * t.exposed_s / t.steps)));
    f.push_back(
        Kv("hidden", absl::StrFormat("%.2f", exchange_s > 0 ? t.hidden_s / exchange_s : 0.0)));
    f.push_back(
        Kv("early_shards", absl::StrFormat("%.2f", static_cast<double>(t.shards_early) /
                                                       std::max<int64_t>(1, t.shards_total))));
  }
  if (pipelined_ && exchanges_ > 0) {
    // The timeline: a step's exchange took exchange_ms in the background; the training
    // thread waited exposed_ms of it; the rest (hidden) overlapped the next step's compute.
    f.push_back(Kv("exchange_ms", absl::StrFormat("%.2f", 1e3 * exchange_s_ / exchanges_)));
    f.push_back(Kv("exposed_ms", absl::StrFormat("%.2f", 1e3 * exposed_s_ / exchanges_)));
    f.push_back(
        Kv("hidden",
           absl::StrFormat("%.2f",
                           exchange_s_ > 0 ? std::max(0.0, 1 - exposed_s_ / exchange_s_) : 0.0)));
  }
  return f;
}

absl::Status PsMode::WaitForWorkers() {
  const absl::Time deadline = absl::Now() + options_.wait_for_workers;
  while (true) {
    ASSIGN_OR_RETURN(std::vector<JobInfoResponse> infos, client_->GetJobInfo());
    // A sync job re-formed after losing workers waits only for the ranks still in it.
    std::vector<int32_t> active;
    {
      absl::MutexLock lock(&group_mu_);
      active = active_ranks_;
    }
    const int32_t needed =
        active.empty() ? spec_.num_workers() : static_cast<int32_t>(active.size());
    int32_t finished = 0;
    for (const WorkerState& w : infos[0].workers()) {
      const bool counted =
          active.empty() || std::find(active.begin(), active.end(), w.worker()) != active.end();
      finished += counted && w.finished() ? 1 : 0;
    }
    if (finished == needed) return absl::OkStatus();
    {
      absl::MutexLock lock(&stop_mu_);
      if (stop_requested_) {
        return absl::CancelledError(absl::StrCat("trainer: stop requested while ", finished, " of ",
                                                 needed, " workers had finished job ",
                                                 spec_.name()));
      }
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("trainer: only ", finished, " of ", needed,
                                                      " workers finished job ", spec_.name(),
                                                      " within the wait bound"));
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
}

absl::StatusOr<bool> PsMode::Finish(int64_t step, TrainResult* result) {
  // The last step's exchange (also after a stop: its push is acknowledged before we go,
  // unless the stop cut its retries short).
  if (pipelined_) {
    const absl::Status drained = DrainPipeline();
    if (!drained.ok() && !(result->stopped_early && absl::IsCancelled(drained))) return drained;
  }
  if (overlap_ != nullptr) {
    const absl::Status settled = overlap_->Settle();  // overlap: 2 leaves the last step open.
    if (!settled.ok() && !(result->stopped_early && absl::IsCancelled(settled))) return settled;
  }
  result->bytes_pushed = client_->bytes_pushed();
  result->bytes_pulled = client_->bytes_pulled();
  result->raw_bytes_pushed = client_->raw_bytes_pushed();
  result->raw_bytes_pulled = client_->raw_bytes_pulled();
  result->codec_s = client_->codec_seconds();
  // A worker stopped early (SIGTERM) has not finished the job: it may be resumed, and the
  // shards must keep waiting for (and counting) its clock.
  if (result->stopped_early) return false;
  RETURN_IF_ERROR(client_->Finish(step));
  bool evaluate;
  {
    absl::MutexLock lock(&group_mu_);
    evaluate = evaluate_;
  }
  if (!evaluate) return false;
  // Wait for every worker so the evaluated model is the job's final one.
  RETURN_IF_ERROR(WaitForWorkers());
  RETURN_IF_ERROR(client_->Pull(model_->params));
  return true;
}

// mode "diloco" (proto DilocoSpec): the shards hold the global parameters and the outer
// optimizer (SGD, Nesterov or plain momentum, lr outer_lr) under a sync barrier per round;
// each worker keeps its own parameters in the model and its inner optimizer (the job's
// optimizer, lr schedule over all its local steps) here. Step t updates the model locally;
// after every inner_steps steps (and after the last one) the worker pushes the round's
// pseudo-gradient, global - local for parameters and local - global for buffers (the
// shards add the mean of buffer deltas), as push `step` = the round number, then pulls the
// new global values into the model. With outer SGD at lr 1 and no momentum a round is exactly
// the average of the workers' local models (tested).
//
// Resume: the shards know the rounds each worker pushed; a worker restarts at the first step
// of its next round with a fresh inner optimizer (its inner state is not checkpointed).
class DilocoMode : public PsMode {
 public:
  using PsMode::PsMode;

  absl::StatusOr<int64_t> Start(ModelView* model, const LoopInfo& info) override {
    inner_steps_ = std::max(1, spec_.diloco().inner_steps());
    total_ = info.total_steps;
    inner_spec_ = WithDecayUpdates(ScaledOptimizer(spec_, spec_.num_workers()), total_);
    ASSIGN_OR_RETURN(const int64_t rounds_done, PsMode::Start(model, info));
    ASSIGN_OR_RETURN(inner_, OptimizerRegistry::WithBuiltins().Create(inner_spec_));
    for (int i = 0; i < model->size(); ++i) {
      global_.emplace_back(model->params[i].begin(), model->params[i].end());
      pseudo_.emplace_back(model->params[i].size());
      if (!model->is_buffer(i)) {
        slots_.emplace_back(inner_->num_slots(), std::vector<float>(model->params[i].size()));
      }
    }
    slot_ptrs_.resize(inner_->num_slots());
    const int64_t first = std::min(rounds_done * inner_steps_, total_);
    round_start_ = first;
    return first;
  }

  std::vector<LogField> StartFields() const override {
    std::vector<LogField> f = PsMode::StartFields();
    f.push_back(Kv("inner_steps", inner_steps_));
    f.push_back(Kv("inner_optimizer", inner_spec_.name()));
    f.push_back(Kv("outer_optimizer", spec_.diloco().outer_optimizer()));
    f.push_back(Kv("outer_lr", spec_.diloco().outer_lr()));
    return f;
  }

  absl::StatusOr<StepOutcome> Exchange(int64_t step,
                                       absl::Span<const absl::Span<const float>> grads, double loss,
                                       const StepTiming& timing) override {
    // The inner step, local.
    const float lr_factor = LrScheduleFactor(inner_spec_, step);
    int p = 0;
    for (int i = 0; i < model_->size(); ++i) {
      absl::Span<float> x = model_->params[i];
      // A buffer's mirror already holds its new local value (the loop wrote it after the
      // step's last forward; grads[i] is that step's delta): nothing to apply.
      if (model_->is_buffer(i)) continue;
      for (size_t k = 0; k < slot_ptrs_.size(); ++k) slot_ptrs_[k] = slots_[p][k].data();
      inner_->Apply(step + 1 - round_start_, lr_factor, grads[i].data(), x.data(),
                    slot_ptrs_.data(), static_cast<int64_t>(x.size()));
      ++p;
    }
    RETURN_IF_ERROR(MaybeRound(step));
    StepOutcome out;
    out.loss = loss;
    return out;
  }

  // Loss scaling found the step's gradient not finite: no inner step, but a round that ends
  // here still happens (with the local progress so far).
  absl::StatusOr<StepOutcome> SkipStep(int64_t step, double loss) override {
    RETURN_IF_ERROR(MaybeRound(step));
    StepOutcome out;
    out.loss = loss;
    out.skipped = true;
    return out;
  }

  // After step `step`: if it ends a round (or the run), the round's pseudo-gradients out and
  // the new global model in.
  absl::Status MaybeRound(int64_t step) {
    const int64_t done = step + 1;
    if (done % inner_steps_ != 0 && done != total_) return absl::OkStatus();
    const int64_t round = step / inner_steps_;
    for (int i = 0; i < model_->size(); ++i) {
      const absl::Span<const float> x = model_->params[i];
      const std::vector<float>& g = global_[i];
      std::vector<float>& d = pseudo_[i];
      if (model_->is_buffer(i)) {
        for (size_t j = 0; j < x.size(); ++j) d[j] = x[j] - g[j];
      } else {
        for (size_t j = 0; j < x.size(); ++j) d[j] = g[j] - x[j];
      }
    }
    std::vector<absl::Span<const float>> push(pseudo_.begin(), pseudo_.end());
    RETURN_IF_ERROR(client_->PushPull(round, push, model_->params, nullptr));
    for (int i = 0; i < model_->size(); ++i) {
      std::copy(model_->params[i].begin(), model_->params[i].end(), global_[i].begin());
    }
    ++rounds_;
    return absl::OkStatus();
  }

  int64_t steps_per_push() const override { return inner_steps_; }

  absl::StatusOr<bool> MaybeCheckpoint(int64_t steps_done) override {
    // The shards snapshot durably every ceil(every_steps / inner_steps) rounds (one update per
    // round; ApplyJobSpecDefaults): at those rounds' last steps.
    const int64_t every = spec_.checkpoint().every_steps();
    if (every <= 0) return false;
    const int64_t rounds = (every + inner_steps_ - 1) / inner_steps_;
    return steps_done % (rounds * inner_steps_) == 0;
  }

  std::vector<LogField> ProgressFields(int64_t done, int64_t window) override {
    std::vector<LogField> f = PsMode::ProgressFields(done, window);
    f.push_back(Kv("rounds", rounds_));
    return f;
  }

 protected:
  JobLayout Layout(const ModelView& model, int64_t total_steps) const override {
    JobLayout layout = PsMode::Layout(model, total_steps);
    // The shards: a sync barrier per round and the outer optimizer, constant lr.
    layout.consistency = "sync";
    OptimizerSpec outer;
    outer.set_name("sgd");
    outer.set_lr(spec_.diloco().outer_lr());
    outer.set_momentum(spec_.diloco().outer_momentum());
    outer.set_nesterov(spec_.diloco().outer_optimizer() == "nesterov");
    layout.optimizer = outer;
    return layout;
  }

 private:
  // The inner optimizer: the job's, lr scaled as lr_scaling says, its schedule over the
  // worker's local steps (set in Start).
  OptimizerSpec inner_spec_;
  int inner_steps_ = 1;
  int64_t total_ = 0;
  int64_t round_start_ = 0;  // The first step of this run (resume: a round's first).
  int64_t rounds_ = 0;
  std::unique_ptr<Optimizer> inner_;
  std::vector<std::vector<float>> global_;              // The round's global values.
  std::vector<std::vector<float>> pseudo_;              // The round's pushes.
  std::vector<std::vector<std::vector<float>>> slots_;  // [param][slot][element].
  std::vector<float*> slot_ptrs_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<TrainingMode>> NewPsMode(const TrainerOptions& options,
                                                        ParameterClientFactory client_factory) {
  if (!client_factory) return absl::InvalidArgumentError("trainer: no client factory");
  if (options.mode == Mode::kDiloco) {
    return std::unique_ptr<TrainingMode>(new DilocoMode(options, std::move(client_factory)));
  }
  return std::unique_ptr<TrainingMode>(new PsMode(options, std::move(client_factory)));
}

}  // namespace gradmesh
