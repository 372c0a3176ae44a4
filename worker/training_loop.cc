#include "worker/training_loop.h"

#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "worker/core/dataset.h"
#include "worker/model.h"

namespace gradmesh {
namespace {

// Test-set accuracy of `model` (evaluation mode, no autograd), in [0, 1]. Leaves the model in
// evaluation mode.
absl::StatusOr<double> EvaluateAccuracy(Model* model, const DatasetFiles& data) {
  model->SetTraining(false);
  int64_t correct = 0;
  std::vector<Batch> eval = MakeEvalBatches(data.test, data.mean, data.stddev, 1000);
  for (Batch& b : eval) {
    torch::Tensor x =
        torch::from_blob(b.x.data(), {b.size, 1, data.test.rows, data.test.cols}, torch::kFloat);
    torch::Tensor y = torch::from_blob(b.y.data(), {b.size}, torch::kLong);
    ASSIGN_OR_RETURN(int64_t c, CountCorrect(model, x, y));
    correct += c;
  }
  if (data.test.size == 0) return absl::FailedPreconditionError("evaluate: empty test set");
  return static_cast<double>(correct) / data.test.size;
}

class TrainingLoop {
 public:
  TrainingLoop(const TrainerOptions& options, TrainingMode* mode, const std::atomic<bool>& stop)
      : options_(options), spec_(options.spec), log_(options.logger), mode_(mode), stop_(stop) {}

  absl::StatusOr<TrainResult> Run();

 private:
  absl::Status Setup();
  absl::Status MakeModelView();
  void LogStart() const;
  // One step on `batch`: forward, backward, exchange. Fills *outcome.
  absl::Status Step(Batch& batch, StepOutcome* outcome);
  void Progress(const Batch& batch);
  absl::Status EvaluateAndSave();
  void Report(double samples_per_s, double accuracy) const;

  const TrainerOptions& options_;
  const JobSpec& spec_;
  const Logger* const log_;
  TrainingMode* const mode_;
  const std::atomic<bool>& stop_;

  DatasetFiles data_;
  std::unique_ptr<Model> model_;
  std::vector<torch::Tensor> params_;
  ModelView view_;
  std::unique_ptr<BatchLoader> loader_;
  BatchLoader::Options loader_options_;
  int64_t total_ = 0;
  int64_t epochs_ = 0;

  TrainResult result_;
  int64_t step_ = 0;
  int32_t epoch_ = 0;  // 1-based epoch of the last batch.
  int64_t checkpoint_step_ = -1;
  absl::Time window_start_;
  double window_loss_ = 0;
  int64_t window_steps_ = 0;
  std::vector<absl::Span<const float>> grads_;
};

absl::Status TrainingLoop::MakeModelView() {
  params_ = model_->Parameters();
  view_.names = model_->ParameterNames();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].scalar_type() != torch::kFloat || !params_[i].is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat("trainer: parameter ", view_.names[i],
                                                     " must be a contiguous float32 tensor"));
    }
    view_.shapes.emplace_back(params_[i].sizes().begin(), params_[i].sizes().end());
    view_.params.emplace_back(params_[i].data_ptr<float>(), params_[i].numel());
  }
  grads_.resize(params_.size());
  return absl::OkStatus();
}

absl::Status TrainingLoop::Setup() {
  torch::set_num_threads(options_.intra_op_threads);
  ASSIGN_OR_RETURN(data_, LoadJobData(spec_, options_.data_dir));
  ASSIGN_OR_RETURN(model_, CreateModel(spec_.model(), spec_.seed()));
  RETURN_IF_ERROR(MakeModelView());
  loader_options_ = LoaderOptions(spec_, options_.rank);
  ASSIGN_OR_RETURN(loader_,
                   BatchLoader::Create(&data_.train, data_.mean, data_.stddev, loader_options_));
  total_ = loader_->total_steps();
  const int64_t per_epoch = std::max<int64_t>(1, loader_->steps_per_epoch());
  epochs_ = spec_.steps() > 0 ? (total_ + per_epoch - 1) / per_epoch : spec_.epochs();

  LoopInfo info;
  info.total_steps = total_;
  info.steps_per_epoch = per_epoch;
  ASSIGN_OR_RETURN(const int64_t first_step, mode_->Start(&view_, info));
  if (first_step > 0) {
    loader_options_.first_step = std::min(first_step, total_);
    loader_.reset();  // Its prefetch thread first.
    ASSIGN_OR_RETURN(loader_,
                     BatchLoader::Create(&data_.train, data_.mean, data_.stddev, loader_options_));
  }
  step_ = loader_options_.first_step;
  result_.first_step = step_;

  if (mode_->wants_gradient_hook()) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const int index = static_cast<int>(i);
      const int64_t numel = params_[i].numel();
      TrainingMode* mode = mode_;
      params_[i].register_hook([mode, index, numel](const torch::Tensor& grad) {
        const torch::Tensor g = grad.contiguous();
        mode->OnGradient(index, absl::Span<const float>(g.data_ptr<float>(),
                                                        std::min<int64_t>(g.numel(), numel)));
      });
    }
  }
  return absl::OkStatus();
}

void TrainingLoop::LogStart() const {
  if (log_ == nullptr) return;
  std::vector<LogField> f = {Kv("job", spec_.name()),
                             Kv("rank", options_.rank),
                             Kv("mode", spec_.mode()),
                             Kv("model", spec_.model().name()),
                             Kv("dataset", spec_.dataset().name()),
                             Kv("params", view_.numel()),
                             Kv("steps", total_),
                             Kv("steps_per_epoch", loader_->steps_per_epoch()),
                             Kv("epochs", epochs_),
                             Kv("batch", spec_.batch_size()),
                             Kv("workers", spec_.num_workers())};
  for (LogField& e : mode_->StartFields()) f.push_back(std::move(e));
  log_->Info("train_start", f);
}

absl::Status TrainingLoop::Step(Batch& batch, StepOutcome* outcome) {
  RETURN_IF_ERROR(mode_->BeforeForward(step_));
  const absl::Time compute_start = absl::Now();
  const ImageSet& img = data_.train;
  torch::Tensor x =
      torch::from_blob(batch.x.data(), {batch.size, 1, img.rows, img.cols}, torch::kFloat);
  torch::Tensor y = torch::from_blob(batch.y.data(), {batch.size}, torch::kLong);
  for (torch::Tensor& p : params_) p.mutable_grad() = torch::Tensor();
  ASSIGN_OR_RETURN(torch::Tensor loss, CrossEntropyLoss(model_.get(), x, y));
  const double loss_value = loss.item<double>();
  mode_->BeforeBackward(step_, loss_value, stop_.load());
  try {
    loss.backward();
  } catch (const c10::Error& e) {
    mode_->AbortStep();
    return absl::InternalError(
        absl::StrCat("trainer: backward failed at step ", step_, ": ", e.what_without_backtrace()));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const torch::Tensor& g = params_[i].grad();
    if (!g.defined()) {
      return absl::InternalError(absl::StrCat("trainer: no gradient for ", view_.names[i]));
    }
    grads_[i] = absl::Span<const float>(g.data_ptr<float>(), g.numel());
  }
  StepTiming timing;
  timing.compute_s = SecondsSince(compute_start);
  result_.compute_s += timing.compute_s;

  const absl::Time comm_start = absl::Now();
  torch::NoGradGuard no_grad;
  absl::StatusOr<StepOutcome> out = mode_->Exchange(step_, grads_, loss_value, timing);
  if (!out.ok()) return Annotate(out.status(), absl::StrCat("step ", step_));
  *outcome = *out;
  result_.comm_s += SecondsSince(comm_start);
  return absl::OkStatus();
}

void TrainingLoop::Progress(const Batch& batch) {
  const double dt = SecondsSince(window_start_);
  const int64_t done = step_ - result_.first_step;
  result_.final_loss = window_loss_ / window_steps_;
  const double samples_per_s = dt > 0 ? window_steps_ * spec_.batch_size() / dt : 0;
  if (log_ != nullptr) {
    auto ms = [done](double s) { return absl::StrFormat("%.1f", 1e3 * s / done); };
    std::vector<LogField> f = {Kv("job", spec_.name()),
                               Kv("rank", options_.rank),
                               Kv("mode", spec_.mode()),
                               Kv("step", step_),
                               Kv("total", total_),
                               Kv("epoch", epoch_),
                               Kv("epochs", epochs_),
                               Kv("loss", absl::StrFormat("%.4f", result_.final_loss)),
                               Kv("samples_per_s", absl::StrFormat("%.0f", samples_per_s)),
                               Kv("data_ms", ms(result_.data_s)),
                               Kv("compute_ms", ms(result_.compute_s)),
                               Kv("comm_ms", ms(result_.comm_s)),
                               Kv("bytes_per_step", mode_->bytes_sent() / done)};
    if (checkpoint_step_ >= 0) f.push_back(Kv("checkpoint_step", checkpoint_step_));
    for (LogField& e : mode_->ProgressFields(done, window_steps_)) f.push_back(std::move(e));
    log_->Info("progress", f);
  }
  Report(samples_per_s, -1);
  window_start_ = absl::Now();
  window_loss_ = 0;
  window_steps_ = 0;
}

void TrainingLoop::Report(double samples_per_s, double accuracy) const {
  if (!options_.on_progress) return;
  TrainProgress p;
  p.step = step_;
  p.total_steps = total_;
  p.epoch = epoch_;
  p.loss = result_.final_loss;
  p.samples_per_s = samples_per_s;
  p.accuracy = accuracy;
  p.checkpoint_step = checkpoint_step_;
  options_.on_progress(p);
}

absl::Status TrainingLoop::EvaluateAndSave() {
  ASSIGN_OR_RETURN(result_.test_accuracy, EvaluateAccuracy(model_.get(), data_));
  if (log_ != nullptr) {
    std::vector<LogField> f = {Kv("job", spec_.name()), Kv("rank", options_.rank),
                               Kv("accuracy", absl::StrFormat("%.4f", result_.test_accuracy)),
                               Kv("test_samples", data_.test.size)};
    for (LogField& e : mode_->EvaluatedFields()) f.push_back(std::move(e));
    log_->Info("evaluated", f);
  }
  Report(result_.samples_per_s, result_.test_accuracy);
  if (!spec_.output().empty()) {
    RETURN_IF_ERROR(model_->Save(spec_.output()));
    LogInfo(log_, "model_saved", {Kv("job", spec_.name()), Kv("path", spec_.output())});
  }
  return absl::OkStatus();
}

absl::StatusOr<TrainResult> TrainingLoop::Run() {
  RETURN_IF_ERROR(Setup());
  LogStart();
  model_->SetTraining(true);
  const absl::Time start = absl::Now();
  window_start_ = start;
  while (true) {
    if (!mode_->collective_stop() && stop_.load()) {
      result_.stopped_early = true;
      LogInfo(log_, "stop_requested",
              {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("step", step_)});
      break;
    }
    std::optional<Batch> batch = NextBatch(loader_.get(), options_.step_delay, &result_.data_s);
    if (!batch.has_value()) break;
    StepOutcome outcome;
    RETURN_IF_ERROR(Step(*batch, &outcome));
    ++step_;
    epoch_ = static_cast<int32_t>(batch->epoch + 1);
    result_.samples += batch->size;
    window_loss_ += outcome.loss;
    ++window_steps_;
    ASSIGN_OR_RETURN(const bool checkpointed, mode_->MaybeCheckpoint(step_));
    if (checkpointed) checkpoint_step_ = step_;
    const bool last = step_ == total_ || outcome.stop;
    if ((spec_.log_every() > 0 && step_ % spec_.log_every() == 0) || last) Progress(*batch);
    if (outcome.stop) {
      result_.stopped_early = step_ < total_;
      LogInfo(log_, "stop_requested",
              {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("step", step_)});
      break;
    }
  }
  if (window_steps_ > 0) result_.final_loss = window_loss_ / window_steps_;
  result_.steps = step_ - result_.first_step;
  result_.wall_s = SecondsSince(start);
  result_.samples_per_s = result_.wall_s > 0 ? result_.samples / result_.wall_s : 0;

  absl::StatusOr<bool> evaluate;
  {
    torch::NoGradGuard no_grad;
    evaluate = mode_->Finish(step_, &result_);
  }
  if (!evaluate.ok()) return evaluate.status();
  if (*evaluate) RETURN_IF_ERROR(EvaluateAndSave());
  return result_;
}

}  // namespace

absl::StatusOr<TrainResult> RunTrainingLoop(const TrainerOptions& options, TrainingMode* mode,
                                            const std::atomic<bool>& stop) {
  TrainingLoop loop(options, mode, stop);
  return loop.Run();
}

}  // namespace gradmesh
