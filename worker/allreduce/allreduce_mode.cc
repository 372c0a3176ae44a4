#include "worker/allreduce/allreduce_mode.h"

#include <array>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "common/optimizer.h"
#include "common/safe_path.h"
#include "common/status.h"
#include "worker/allreduce/bucket_reducer.h"
#include "worker/allreduce/checkpoint.h"
#include "worker/allreduce/collective.h"
#include "worker/allreduce/collective_service.h"
#include "worker/allreduce/model_updater.h"

namespace gradmesh {
namespace {

class AllreduceMode : public TrainingMode {
 public:
  AllreduceMode(const TrainerOptions& options, CollectiveServiceImpl* local)
      : options_(options), spec_(options.spec), local_(local) {}
  ~AllreduceMode() override;

  absl::StatusOr<int64_t> Start(ModelView* model, const LoopInfo& info) override;
  std::vector<LogField> StartFields() const override;
  bool collective_stop() const override { return true; }
  void BeforeBackward(int64_t step, double loss, bool stop_requested) override {
    // A stop request travels with this step's last bucket: every rank stops after it.
    reducer_->StartStep({stop_requested ? 1.0f : 0.0f, static_cast<float>(loss)});
  }
  bool wants_gradient_hook() const override { return true; }
  void OnGradient(int param, absl::Span<const float> grad) override {
    reducer_->ParamReady(param, grad.data(), static_cast<int64_t>(grad.size()));
  }
  void AbortStep() override { (void)reducer_->FinishStep(); }
  // Every wait on the ring (set-up, all-reduces, the checkpoint transfer) ends with ABORTED.
  void Abort() override { abort_.store(true); }
  ClipCounters TakeClipCounters() override { return updater_->TakeClipCounters(); }
  // Loss scaling: the averaged gradient is unscaled and checked (model_updater.h).
  bool unscales_gradients() const override { return true; }
  void SetLossScale(float scale) override { updater_->set_loss_scale(scale); }
  absl::StatusOr<StepOutcome> Exchange(int64_t step,
                                       absl::Span<const absl::Span<const float>> grads, double loss,
                                       const StepTiming& timing) override;
  absl::StatusOr<bool> MaybeCheckpoint(int64_t steps_done) override;
  int64_t bytes_sent() const override { return collective_->bytes_sent(); }
  std::vector<LogField> ProgressFields(int64_t done, int64_t window) override;
  absl::StatusOr<bool> Finish(int64_t step, TrainResult* result) override;

 private:
  // What every rank must agree on before the first collective.
  std::string Fingerprint() const;
  absl::Status Handshake();
  // The step the ranks resume at (checkpoint.h PlanResume; 0: none), restored into the model
  // and slots: from each rank's own file, or sent by the rank holding it to those without.
  absl::StatusOr<int64_t> Resume();
  // Every array of `c` has the size this rank's model and optimizer give it.
  bool Matches(const RankCheckpoint& c) const;
  // The source's checkpoint `from` (null on the other ranks) on every rank: an all-reduce sum
  // of it against zeros (exact: x + 0 = x).
  absl::StatusOr<RankCheckpoint> Receive(int64_t step, const RankCheckpoint* from);

  const TrainerOptions& options_;
  const JobSpec& spec_;
  CollectiveServiceImpl* const local_;
  // Set by Abort; read by the ring's transports, which it outlives (declared before them).
  RingAbort abort_{false};
  int64_t total_ = 0;
  // Optimizer, slots and buffer averaging; its numels() are the entries' sizes.
  std::unique_ptr<ModelUpdater> updater_;
  std::string checkpoint_path_;
  std::unique_ptr<Collective> collective_;
  std::unique_ptr<BucketReducer> reducer_;
  double comm_busy_at_window_ = 0;
};

AllreduceMode::~AllreduceMode() {
  // Stop the communication thread, then close the collective, and only then free the buckets:
  // after a failed all-reduce the ring's transport may still hold in-place references to them
  // until it is closed.
  if (reducer_ != nullptr) reducer_->Stop();
  collective_.reset();
}

std::string AllreduceMode::Fingerprint() const {
  const std::vector<int64_t>& numels = updater_->numels();
  const auto buffers_begin = numels.begin() + updater_->num_params();
  return absl::StrCat(
      "model=", spec_.model().name(), " params=", absl::StrJoin(numels.begin(), buffers_begin, ","),
      " buffers=", absl::StrJoin(buffers_begin, numels.end(), ","), " steps=", total_,
      " batch=", spec_.batch_size(), " seed=", spec_.seed(),
      " bucket_bytes=", spec_.allreduce().bucket_bytes(), " optimizer=", spec_.optimizer().name(),
      " lr=", ScaledOptimizer(spec_, spec_.num_workers()).lr(),
      " accumulation_steps=", spec_.accumulation_steps(),
      " clip_grad_norm=", spec_.clip_grad_norm(), " clip_grad_value=", spec_.clip_grad_value(),
      " precision=", spec_.precision(), " loss_scale=", spec_.loss_scale().mode(), ":",
      spec_.loss_scale().init_scale(), ":", spec_.loss_scale().growth_factor(), ":",
      spec_.loss_scale().backoff_factor(), ":", spec_.loss_scale().growth_interval());
}

absl::Status AllreduceMode::Handshake() {
  // Every rank must run the same model and schedule, or the ring would mix garbage.
  const std::string fingerprint = Fingerprint();
  absl::StatusOr<std::vector<std::string>> gathered = collective_->Allgather(fingerprint);
  if (!gathered.ok()) return Annotate(gathered.status(), "allreduce: handshake");
  for (int r = 0; r < spec_.num_workers(); ++r) {
    if ((*gathered)[r] != fingerprint) {
      return absl::FailedPreconditionError(
          absl::StrCat("allreduce: rank ", r, " runs a different job (", (*gathered)[r],
                       ") than rank ", options_.rank, " (", fingerprint, ")"));
    }
  }
  return absl::OkStatus();
}

bool AllreduceMode::Matches(const RankCheckpoint& c) const {
  const std::vector<absl::Span<const float>> mine = updater_->CheckpointArrays();
  if (c.arrays.size() != mine.size()) return false;
  for (size_t a = 0; a < mine.size(); ++a) {
    if (c.arrays[a].size() != mine[a].size()) return false;
  }
  return true;
}

absl::StatusOr<RankCheckpoint> AllreduceMode::Receive(int64_t step, const RankCheckpoint* from) {
  RankCheckpoint got;
  got.step = step;
  for (absl::Span<const float> a : updater_->CheckpointArrays()) got.arrays.emplace_back(a.size());
  if (from != nullptr) got.arrays = from->arrays;  // Matches(): the same sizes.
  for (std::vector<float>& a : got.arrays) {
    RETURN_IF_ERROR(
        Annotate(collective_->AllreduceSum(absl::MakeSpan(a)), "allreduce: sending a checkpoint"));
  }
  return got;
}

absl::StatusOr<int64_t> AllreduceMode::Resume() {
  if (spec_.checkpoint().every_steps() <= 0) return 0;
  std::vector<RankCheckpoint> available = ReadAvailableCheckpoints(checkpoint_path_);
  std::string mine;
  for (const RankCheckpoint& c : available) {
    if (!Matches(c)) continue;  // Another model.
    absl::StrAppend(&mine, mine.empty() ? "" : ",", c.step);
  }
  absl::StatusOr<std::vector<std::string>> gathered = collective_->Allgather(mine);
  if (!gathered.ok()) return Annotate(gathered.status(), "allreduce: checkpoint handshake");
  std::vector<std::vector<int64_t>> steps(spec_.num_workers());
  for (int r = 0; r < spec_.num_workers(); ++r) {
    for (absl::string_view s : absl::StrSplit((*gathered)[r], ',', absl::SkipEmpty())) {
      int64_t v;
      if (absl::SimpleAtoi(s, &v)) steps[r].push_back(v);
    }
  }
  const ResumePlan plan = PlanResume(steps);
  if (plan.step == 0) return 0;
  const RankCheckpoint* use = nullptr;
  for (const RankCheckpoint& c : available) {
    if (c.step == plan.step && Matches(c)) use = &c;
  }
  RankCheckpoint received;
  if (plan.source >= 0) {
    // No step in common: the newest one travels from the rank holding it.
    if (options_.rank == plan.source && use == nullptr) {
      return absl::InternalError("allreduce: the checkpoint to send vanished");
    }
    ASSIGN_OR_RETURN(received, Receive(plan.step, options_.rank == plan.source ? use : nullptr));
    use = &received;
  }
  if (use == nullptr) return absl::InternalError("allreduce: chosen checkpoint vanished");
  RETURN_IF_ERROR(updater_->Restore(*use, checkpoint_path_));
  std::vector<LogField> f = {Kv("job", spec_.name()), Kv("rank", options_.rank),
                             Kv("step", plan.step), Kv("checkpoint", checkpoint_path_)};
  if (plan.source >= 0) f.push_back(Kv("checkpoint_from_rank", plan.source));
  LogInfo(options_.logger, "resuming", f);
  return plan.step;
}

absl::StatusOr<int64_t> AllreduceMode::Start(ModelView* model, const LoopInfo& info) {
  total_ = info.total_steps;
  // The optimizer runs here, on every rank, on the averaged gradient: one update per step.
  ASSIGN_OR_RETURN(
      updater_,
      ModelUpdater::Create(model->params, model->names, model->num_params,
                           WithDecayUpdates(ScaledOptimizer(spec_, spec_.num_workers()), total_)));
  updater_->set_clip(ClipOptions{spec_.clip_grad_norm(), spec_.clip_grad_value()});

  CollectiveContext ctx;
  ctx.abort = &abort_;
  // Under a daemon the ring is the generation's: a rank restarted for a new generation
  // (a lost peer, a moved rank) would otherwise link with a peer still running the old one,
  // whose stop then stopped it too, restarting the ranks again and again.
  ctx.job = options_.generation > 0 ? absl::StrCat(spec_.name(), "/g", options_.generation)
                                    : spec_.name();
  ctx.rank = options_.rank;
  ctx.peers = options_.peers;
  ctx.rpc = options_.peer_rpc;
  ctx.local = local_;
  ctx.job_token = options_.job_token;
  ctx.rank_token = options_.rank_token;
  ctx.rank_token_hashes = options_.rank_token_hashes;
  ctx.timeout =
      absl::Seconds(spec_.allreduce().timeout_s() > 0 ? spec_.allreduce().timeout_s() : 30);
  ctx.transport = spec_.allreduce().transport().empty() ? "tcp" : spec_.allreduce().transport();
  ASSIGN_OR_RETURN(collective_, CollectiveRegistry::WithBuiltins().Create(
                                    ResolveBackend(spec_.allreduce().backend()), ctx));
  RETURN_IF_ERROR(Handshake());
  ASSIGN_OR_RETURN(checkpoint_path_,
                   RankCheckpointPath(spec_.checkpoint().dir().empty() ? options_.checkpoint_dir
                                                                       : spec_.checkpoint().dir(),
                                      spec_.name(), options_.rank));
  ASSIGN_OR_RETURN(const int64_t first_step, Resume());
  reducer_ =
      std::make_unique<BucketReducer>(collective_.get(), updater_->numels(),
                                      spec_.allreduce().bucket_bytes(), updater_->num_params());
  return first_step;
}

std::vector<LogField> AllreduceMode::StartFields() const {
  return {Kv("backend", collective_->backend()), Kv("transport", collective_->transport()),
          Kv("buckets", reducer_->buckets().size()),
          Kv("bucket_bytes", spec_.allreduce().bucket_bytes())};
}

absl::StatusOr<StepOutcome> AllreduceMode::Exchange(int64_t step,
                                                    absl::Span<const absl::Span<const float>> grads,
                                                    double loss, const StepTiming& timing) {
  // Parameters: the optimizer on the mean gradient; buffers: before + mean delta
  // (model_updater.h).
  RETURN_IF_ERROR(Annotate(updater_->FinishStep(reducer_.get(), step, grads), "allreduce"));
  const std::array<float, BucketReducer::kExtras> extras = reducer_->extras();
  StepOutcome out;
  out.stop = extras[0] > 0;
  out.loss = extras[1] / spec_.num_workers();
  out.skipped = updater_->last_step_skipped();
  return out;
}

absl::StatusOr<bool> AllreduceMode::MaybeCheckpoint(int64_t steps_done) {
  const int64_t every = spec_.checkpoint().every_steps();
  if (every <= 0 || steps_done % every != 0) return false;
  RETURN_IF_ERROR(WriteCheckpoint(checkpoint_path_, steps_done, updater_->CheckpointArrays()));
  LogInfo(options_.logger, "checkpoint",
          {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("step", steps_done),
           Kv("path", checkpoint_path_)});
  return true;
}

std::vector<LogField> AllreduceMode::ProgressFields(int64_t done, int64_t window) {
  const double comm_busy = reducer_->comm_seconds();
  std::vector<LogField> f = {
      Kv("opt_ms", absl::StrFormat("%.1f", 1e3 * updater_->optimizer_seconds() / done)),
      Kv("allreduce_ms",
         absl::StrFormat("%.1f", 1e3 * (comm_busy - comm_busy_at_window_) / window))};
  comm_busy_at_window_ = comm_busy;
  return f;
}

absl::StatusOr<bool> AllreduceMode::Finish(int64_t step, TrainResult* result) {
  result->bytes_pushed = result->raw_bytes_pushed = collective_->bytes_sent();
  // In a ring every rank receives as much as it sends.
  result->bytes_pulled = result->raw_bytes_pulled = collective_->bytes_sent();
  return options_.evaluate && !result->stopped_early;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TrainingMode>> NewAllreduceMode(const TrainerOptions& options,
                                                               CollectiveServiceImpl* local) {
  if (local == nullptr) return absl::InvalidArgumentError("allreduce: no CollectiveService");
  if (static_cast<int>(options.peers.size()) != options.spec.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat("allreduce: ", options.peers.size(),
                                                   " peer addresses for ",
                                                   options.spec.num_workers(), " workers"));
  }
  return std::unique_ptr<TrainingMode>(new AllreduceMode(options, local));
}

}  // namespace gradmesh
