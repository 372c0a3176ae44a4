#include "worker/training_loop.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "common/status.h"
#include "worker/core/dataset.h"
#include "worker/core/examples.h"
#include "worker/core/grad_clip.h"
#include "worker/core/loss_scaler.h"
#include "worker/model.h"
#include "worker/torch_device_gradients.h"

namespace gradmesh {
namespace {

// A field of `batch` as a tensor over the batch's bytes ([size, dims...]; no copy).
torch::Tensor FieldTensor(std::vector<uint8_t>& bytes, int64_t size, const FieldMeta& meta) {
  std::vector<int64_t> shape = {size};
  shape.insert(shape.end(), meta.dims.begin(), meta.dims.end());
  return torch::from_blob(bytes.data(), shape, ToScalarType(meta.type));
}

// The first sample indices of `batch` ("12, 40, 7, ..."), for errors.
std::string SampleRange(const Batch& batch) {
  const size_t shown = std::min<size_t>(batch.indices.size(), 4);
  std::string s = absl::StrJoin(batch.indices.begin(), batch.indices.begin() + shown, ", ");
  return shown < batch.indices.size() ? absl::StrCat(s, ", ...") : s;
}

// Samples per evaluation batch: 1000, fewer for large samples (at most ~64 MiB of x).
int64_t EvalBatchSize(const ExampleSource& s) {
  const int64_t bytes = std::max<int64_t>(1, s.x().sample_bytes() + s.y().sample_bytes());
  return std::clamp<int64_t>((int64_t{64} << 20) / bytes, 1, 1000);
}

// Where this rank computes: `want` resolved against what this process's LibTorch sees. GPU
// index `gpu`, or rank % visible GPUs when it is -1.
absl::StatusOr<torch::Device> PickDevice(ComputeDevice want, int32_t gpu, int32_t rank) {
  if (want == ComputeDevice::kCpu) return torch::Device(torch::kCPU);
  int64_t gpus = 0;
  try {
    gpus = torch::cuda::is_available() ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
  } catch (const c10::Error& e) {
    gpus = 0;
  }
  if (gpus == 0) {
    if (want == ComputeDevice::kAuto) return torch::Device(torch::kCPU);
    return absl::FailedPreconditionError(
        absl::StrCat("trainer: device cuda, but this worker's LibTorch ", TORCH_VERSION,
                     " has no CUDA or sees no GPU (build with --config=cuda against a CUDA "
                     "LibTorch, or run with --device=cpu or auto)"));
  }
  const int64_t index = gpu >= 0 ? gpu : rank % gpus;
  if (index >= gpus) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer: GPU ", index, " asked for, but only ", gpus, " visible"));
  }
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

// Adds test samples [begin, begin + count) to *totals as one forward of `batch` samples
// (count <= batch): when count < batch, copies of the last sample pad the forward to `batch`
// and are left out of the figures.
absl::Status EvaluateRange(Model* model, LossKind loss, const ExampleSource& test, int64_t begin,
                           int64_t count, int64_t batch, const torch::Device& device,
                           EvalTotals* totals) {
  ASSIGN_OR_RETURN(Batch b, ReadBatch(test, begin, count));
  torch::Tensor x = FieldTensor(b.x, b.size, test.x());
  torch::Tensor y = FieldTensor(b.y, b.size, test.y());
  if (batch > count) {
    const torch::Tensor pad = torch::arange(batch).clamp_max(count - 1);
    x = x.index_select(0, pad);
    y = y.index_select(0, pad);
  }
  return Annotate(
      EvaluateBatch(model, loss, x.to(device), y.to(device), totals, batch > count ? count : -1),
      absl::StrCat("evaluating test samples ", begin, "..", begin + count - 1, " of ",
                   test.Describe()));
}

// Adds the whole test set to *totals in forwards of `batch` samples. With `fixed`, the last
// partial batch is padded to `batch`, or left out for a model computing its own loss (which
// cannot leave padding out); without, it is a smaller forward. *failed_first: the error came
// from the first forward.
absl::Status EvaluateInBatches(Model* model, LossKind loss, const ExampleSource& test,
                               int64_t batch, bool fixed, const torch::Device& device,
                               EvalTotals* totals, bool* failed_first) {
  const int64_t n = test.size();
  for (int64_t begin = 0; begin < n; begin += batch) {
    const int64_t count = std::min(batch, n - begin);
    if (fixed && count < batch && loss == LossKind::kModule) break;
    absl::Status st =
        EvaluateRange(model, loss, test, begin, count, fixed ? batch : count, device, totals);
    if (!st.ok()) {
      *failed_first = begin == 0;
      return st;
    }
  }
  return absl::OkStatus();
}

// Whether the model's forward takes the first `count` test samples as one batch (a failure
// there is the batch size's; past it, the loss's or the data's).
bool ForwardTakes(Model* model, const ExampleSource& test, int64_t count,
                  const torch::Device& device) {
  absl::StatusOr<Batch> b = ReadBatch(test, 0, count);
  if (!b.ok()) return false;
  return model->Forward(FieldTensor(b->x, b->size, test.x()).to(device)).ok();
}

struct TestSetResult {
  EvalMetrics metrics;
  int64_t batch = 0;    // Samples per forward.
  int64_t samples = 0;  // Samples in the figures.
};

// Test-set metrics of `model` (evaluation mode, no autograd) with batches moved to `device`,
// in batches of EvalBatchSize. A model whose forward fails on the first of those is evaluated
// again in batches of `train_batch`, the size it trained on: one written or traced for a fixed
// batch (x.view(64, -1), a zeros(64, h) state) works there (EvaluateInBatches' `fixed`). Leaves the
// model in evaluation mode.
absl::StatusOr<TestSetResult> Evaluate(Model* model, LossKind loss, const ExampleSource& test,
                                       int64_t train_batch, const torch::Device& device) {
  if (test.size() == 0) return absl::FailedPreconditionError("evaluate: empty test set");
  model->SetTraining(false);
  torch::NoGradGuard no_grad;
  TestSetResult r;
  r.batch = std::min(EvalBatchSize(test), test.size());
  EvalTotals totals;
  bool failed_first = false;
  absl::Status st = EvaluateInBatches(model, loss, test, r.batch, /*fixed=*/false, device, &totals,
                                      &failed_first);
  if (!st.ok() && failed_first && train_batch > 0 && train_batch != r.batch &&
      !ForwardTakes(model, test, r.batch, device)) {
    const int64_t tried = r.batch;
    r.batch = train_batch;
    totals = EvalTotals();
    st = EvaluateInBatches(model, loss, test, r.batch, /*fixed=*/true, device, &totals,
                           &failed_first);
    if (!st.ok()) {
      return absl::Status(st.code(), absl::StrCat(st.message(), " (in batches of ", train_batch,
                                                  ", the training batch size, tried as ",
                                                  "batches of ", tried, " failed)"));
    }
  }
  RETURN_IF_ERROR(st);
  r.samples = totals.samples;
  if (r.samples == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("evaluate: the test set's ", test.size(), " samples are fewer than one ",
                     "batch of ", train_batch, " for a model computing its own loss"));
  }
  r.metrics = Metrics(totals);
  return r;
}

// The forward pass under autocast to `dtype` on `device` (JobSpec.precision), for the guard's
// lifetime; nothing when `on` is false. Backward then runs each op in its forward's dtype.
class AutocastGuard {
 public:
  AutocastGuard(bool on, const torch::Device& device, at::ScalarType dtype)
      : on_(on), cuda_(device.is_cuda()) {
    if (!on_) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    const at::DeviceType type = cuda_ ? at::kCUDA : at::kCPU;
    was_ = at::autocast::is_autocast_enabled(type);
    dtype_was_ = at::autocast::get_autocast_dtype(type);
    at::autocast::set_autocast_dtype(type, dtype);
    at::autocast::set_autocast_enabled(type, true);
#else
    was_ = cuda_ ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
    dtype_was_ =
        cuda_ ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
    if (cuda_) {
      at::autocast::set_autocast_gpu_dtype(dtype);
      at::autocast::set_enabled(true);
    } else {
      at::autocast::set_autocast_cpu_dtype(dtype);
      at::autocast::set_cpu_enabled(true);
    }
#endif
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(cuda_ ? at::kCUDA : at::kCPU, was_);
    at::autocast::set_autocast_dtype(cuda_ ? at::kCUDA : at::kCPU, dtype_was_);
#else
    if (cuda_) {
      at::autocast::set_enabled(was_);
      at::autocast::set_autocast_gpu_dtype(dtype_was_);
    } else {
      at::autocast::set_cpu_enabled(was_);
      at::autocast::set_autocast_cpu_dtype(dtype_was_);
    }
#endif
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  const bool on_;
  const bool cuda_;
  bool was_ = false;
  at::ScalarType dtype_was_ = at::kBFloat16;
};

class TrainingLoop {
 public:
  TrainingLoop(const TrainerOptions& options, TrainingMode* mode, const std::atomic<bool>& stop)
      : options_(options), spec_(options.spec), log_(options.logger), mode_(mode), stop_(stop) {}

  absl::StatusOr<TrainResult> Run();
  int64_t step() const { return step_; }
  // `st` is the CANCELLED of a stop that cut a mode's calls short (ParameterClient::
  // StopRetrying): the run ends as stopped, not failed.
  bool StoppedBy(const absl::Status& st) const { return absl::IsCancelled(st) && stop_.load(); }

 private:
  absl::Status Setup();
  absl::Status MakeModelView();
  // `t` on the compute device (itself on the CPU).
  torch::Tensor OnDevice(const torch::Tensor& t) const { return on_gpu_ ? t.to(device_) : t; }
  // GPU only (no-ops on the CPU, where the view aliases the model): the view's parameters
  // (host, where the modes write them) -> the model before a forward or an evaluation, and a
  // device gradient -> its pinned host copy, handed to the mode.
  void ParamsIn();
  absl::Span<const float> GradOut(int i, const torch::Tensor& grad);
  // After the mode's Start: offers it the gradients where backward leaves them
  // (TrainingMode::UseDeviceGradients), unless the loop itself needs them on the host.
  void OfferDeviceGradients();
  // Checks the model against one real batch before anything is started.
  absl::Status CheckFit();
  // Buffers: mirrors -> model before forward (remembering the values), model -> mirrors and
  // deltas after the step's last forward (backward leaves buffers alone), mirrors -> model at
  // the end.
  absl::Status BuffersIn(bool remember);
  // The model's buffers now (a forward may assign one anew); FailedPrecondition naming one
  // the model resized or set to None.
  absl::StatusOr<std::vector<torch::Tensor>> CurrentBuffers() const;
  absl::Status BuffersOut();
  // InvalidArgument for a non-finite loss `value` on micro-batch `k` (inputs x, targets y):
  // names the first sample with a non-finite input or target, or says the model diverged.
  absl::Status NonFiniteLoss(const Batch& batch, int k, double value, const torch::Tensor& x,
                             const torch::Tensor& y) const;
  // gossip/allreduce rank 0: hands the model to options.on_model.
  void PublishModel(bool final);
  void LogStart() const;
  // One step on `micro` (accumulation_steps micro-batches): forward and backward of each,
  // gradients accumulated (mean over the micro-batches), clipping, exchange. Fills *outcome.
  absl::Status Step(std::vector<Batch>& micro, StepOutcome* outcome);
  // Forward and backward of micro-batch `k` of the step; its loss into *loss_sum.
  absl::Status MicroStep(Batch& batch, int k, double* loss_sum);
  // async, ssp, gossip: the clipping of this worker's gradient (allreduce clips the averaged
  // one itself; sync clips through the shards' two-phase apply).
  void ClipLocal();
  // The same on the parameters' gradients where backward left them (device_encoded_: the host
  // copies are not made), with one synchronisation.
  void ClipOnDevice();
  // Loss scaling where the loop unscales (not allreduce): the parameters' gradients divided
  // by the scale in place; false if one of them or a buffer delta is not finite (the step is
  // skipped). Call after BuffersOut.
  bool UnscaleLocal();
  bool UnscaleOnDevice();
  // Whether every buffer delta of the step is finite (both unscaling paths check them).
  bool DeltasFinite() const;
  // Fault injection (options_.nonfinite_steps): a NaN in the first parameter's gradient.
  void Poison();
  // A skipped step leaves the buffers as they were before its forward (zero deltas).
  void RestoreBuffers();
  // The parameters' gradients of the step (grads_[0, num_params)) as writable spans.
  std::vector<absl::Span<float>> ParamGrads();
  void Progress(const Batch& batch);
  // The end of a run whose mode evaluates (rank 0): the test set's figures (none without a
  // test set), the report, the saved model.
  absl::Status EvaluateAndSave();
  absl::Status EvaluateTestSet();  // Fills result_'s test figures and logs them.
  void Report(double samples_per_s, double accuracy) const;

  const TrainerOptions& options_;
  const JobSpec& spec_;
  const Logger* const log_;
  TrainingMode* const mode_;
  const std::atomic<bool>& stop_;

  JobData data_;
  LossKind loss_kind_ = LossKind::kCrossEntropy;
  std::unique_ptr<Model> model_;
  std::vector<torch::Tensor> params_;
  torch::Device device_{torch::kCPU};
  bool on_gpu_ = false;
  std::vector<torch::Tensor> host_params_;  // GPU: pinned host copies the view points to.
  std::vector<torch::Tensor> host_grads_;   // GPU: pinned host gradients for the mode.
  int64_t dense_to_host_ = 0;               // GPU: gradient bytes copied to host_grads_.
  // The mode reads the parameters' gradients through device_grads_ (encoded where they are).
  std::unique_ptr<TorchDeviceGradients> device_grads_;
  bool device_encoded_ = false;
  std::string device_codec_why_;             // Why not (train_start's device_codec_off).
  std::vector<std::vector<float>> mirrors_;  // Float32 copies of the model's buffers (the view's).
  std::vector<std::vector<float>> before_;   // Mirrors before the step's forward.
  std::vector<std::vector<float>> deltas_;   // The step's buffer deltas.
  absl::Time last_publish_ = absl::InfinitePast();
  ModelView view_;
  std::unique_ptr<BatchLoader> loader_;
  BatchLoader::Options loader_options_;
  int64_t total_ = 0;
  int64_t epochs_ = 0;
  int accum_ = 1;             // Micro-batches per step (JobSpec.accumulation_steps).
  std::vector<char> hooked_;  // Per parameter: the hook fired in the last micro-batch's backward.
  bool hook_live_ = true;     // The gradient hook hands gradients to the mode (last micro).
  bool autocast_ = false;     // JobSpec.precision bf16 or fp16: forward under autocast.
  at::ScalarType autocast_dtype_ = at::kBFloat16;
  LossScaler scaler_{LossScaleSpec()};  // JobSpec.loss_scale (off unless dynamic).
  ClipOptions clip_;                    // Clipping done by the loop (async, ssp, gossip).
  ClipCounters clip_window_;            // Since the last progress line.
  double window_grad_norm_ = -1;        // The last progress line's (-1: not clipping).
  double window_clipped_ = -1;

  TrainResult result_;
  int64_t step_ = 0;
  int32_t epoch_ = 0;  // 1-based epoch of the last batch.
  int64_t checkpoint_step_ = -1;
  absl::Time window_start_;
  double window_loss_ = 0;
  int64_t window_steps_ = 0;
  int64_t window_loss_steps_ = 0;  // Steps in window_loss_ (skipped steps' losses are not).
  std::vector<absl::Span<const float>> grads_;
  // ps overlap: 2: the model's forward opens each layer through mode_->AwaitParameters (a
  // built-in model on the CPU without buffers); otherwise the loop waits for every entry
  // before the forward. gate_status_: the first error a gate met (the step then ends with
  // it); gate_wait_s_: the step's wait in the gates, counted as communication.
  bool gated_ = false;
  absl::Status gate_status_;
  double gate_wait_s_ = 0;
  // Waits for entries [begin, end) (mode_->AwaitParameters), timing the wait.
  absl::Status AwaitParameters(int begin, int end);
};

absl::Status TrainingLoop::MakeModelView() {
  params_ = model_->Parameters();
  view_.names = model_->ParameterNames();
  // The types the model was saved in, which exports write back (float32 unless converted).
  const std::vector<torch::ScalarType> saved_params = model_->SavedParameterTypes();
  const std::vector<torch::ScalarType> saved_buffers = model_->SavedBufferTypes();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].scalar_type() != torch::kFloat || !params_[i].is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat("trainer: parameter ", view_.names[i],
                                                     " must be a contiguous float32 tensor"));
    }
    view_.shapes.emplace_back(params_[i].sizes().begin(), params_[i].sizes().end());
    torch::Tensor viewed = params_[i];
    if (on_gpu_) {
      const auto pinned = torch::TensorOptions().dtype(torch::kFloat32).pinned_memory(true);
      host_params_.push_back(torch::empty(params_[i].sizes(), pinned));
      host_params_.back().copy_(params_[i].detach());
      host_grads_.push_back(torch::zeros(params_[i].sizes(), pinned));
      viewed = host_params_.back();
    }
    view_.params.emplace_back(viewed.data_ptr<float>(), viewed.numel());
    ElemType saved = ElemType::kFloat32;
    if (i < saved_params.size()) {
      ASSIGN_OR_RETURN(saved, ToElemType(saved_params[i], "parameter " + view_.names[i]));
    }
    view_.dtypes.push_back(saved);
  }
  view_.num_params = static_cast<int>(params_.size());
  const std::vector<torch::Tensor> buffers = model_->Buffers();
  const std::vector<std::string> buffer_names = model_->BufferNames();
  mirrors_.resize(buffers.size());
  before_.resize(buffers.size());
  deltas_.resize(buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    ASSIGN_OR_RETURN(
        const ElemType type,
        ToElemType(i < saved_buffers.size() ? saved_buffers[i] : buffers[i].scalar_type(),
                   "buffer " + buffer_names[i]));
    const torch::Tensor values = buffers[i].detach().to(torch::kCPU, torch::kFloat32).contiguous();
    mirrors_[i].assign(values.data_ptr<float>(), values.data_ptr<float>() + values.numel());
    before_[i] = mirrors_[i];
    deltas_[i].assign(mirrors_[i].size(), 0.0f);
    view_.names.push_back(buffer_names[i]);
    view_.shapes.emplace_back(buffers[i].sizes().begin(), buffers[i].sizes().end());
    view_.params.emplace_back(mirrors_[i].data(), mirrors_[i].size());
    view_.dtypes.push_back(type);
  }
  grads_.resize(view_.params.size());
  return absl::OkStatus();
}

void TrainingLoop::ParamsIn() {
  if (!on_gpu_) return;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) params_[i].copy_(host_params_[i]);
}

absl::Span<const float> TrainingLoop::GradOut(int i, const torch::Tensor& grad) {
  torch::Tensor g = grad;
  if (on_gpu_) {
    host_grads_[i].copy_(grad);
    g = host_grads_[i];
    dense_to_host_ += g.numel() * static_cast<int64_t>(sizeof(float));
  }
  const int64_t n = static_cast<int64_t>(view_.params[i].size());
  return absl::Span<const float>(g.data_ptr<float>(), std::min<int64_t>(g.numel(), n));
}

absl::StatusOr<std::vector<torch::Tensor>> TrainingLoop::CurrentBuffers() const {
  if (mirrors_.empty()) return std::vector<torch::Tensor>();
  std::vector<torch::Tensor> now = model_->Buffers();
  if (now.size() != mirrors_.size()) {
    return absl::InternalError(
        absl::StrCat("trainer: the model has ", now.size(), " buffers, not ", mirrors_.size()));
  }
  for (size_t i = 0; i < now.size(); ++i) {
    // The exchange has the shapes the model started with; a buffer resized in place (or
    // assigned anew with another size) would be read past its end.
    const std::string change = BufferChange(view_.names[view_.num_params + i], now[i],
                                            static_cast<int64_t>(mirrors_[i].size()));
    if (!change.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "trainer: the model ", change, " (step ", step_, "); buffers must keep their shapes"));
    }
  }
  return now;
}

absl::Status TrainingLoop::BuffersIn(bool remember) {
  torch::NoGradGuard no_grad;
  ASSIGN_OR_RETURN(std::vector<torch::Tensor> buffers, CurrentBuffers());
  for (size_t i = 0; i < buffers.size(); ++i) {
    torch::Tensor m = torch::from_blob(mirrors_[i].data(), buffers[i].sizes(), torch::kFloat32);
    const bool integral = !torch::isFloatingType(buffers[i].scalar_type());
    if (integral) m = m.round();
    buffers[i].copy_(m);
    if (!remember) continue;
    // The value the forward starts from: for an integer buffer the rounded mirror, so that
    // its delta is what the forward did (a counter's +1), not that plus the rounding (a
    // mixed or averaged counter can be fractional; the mode keeps its fraction).
    if (integral) {
      const float* r = m.data_ptr<float>();
      before_[i].assign(r, r + mirrors_[i].size());
    } else {
      before_[i] = mirrors_[i];
    }
  }
  return absl::OkStatus();
}

absl::Status TrainingLoop::BuffersOut() {
  // Fetched again: the forward may have assigned a buffer anew rather than updated it.
  ASSIGN_OR_RETURN(const std::vector<torch::Tensor> buffers, CurrentBuffers());
  for (size_t i = 0; i < buffers.size(); ++i) {
    const torch::Tensor values = buffers[i].detach().to(torch::kCPU, torch::kFloat32).contiguous();
    const float* v = values.data_ptr<float>();
    for (size_t j = 0; j < mirrors_[i].size(); ++j) {
      mirrors_[i][j] = v[j];
      // Unchanged is a zero delta, also for an infinite element (a causal mask of -inf,
      // registered as a buffer: -inf - -inf would be NaN and poison every replica).
      deltas_[i][j] = v[j] == before_[i][j] ? 0.0f : v[j] - before_[i][j];
    }
    grads_[view_.num_params + i] = absl::Span<const float>(deltas_[i]);
  }
  return absl::OkStatus();
}

absl::Status TrainingLoop::CheckFit() {
  const ExampleSource& train = *data_.train;
  const int64_t n = std::min<int64_t>(train.size(), std::max(1, spec_.batch_size()));
  if (n == 0) return absl::InvalidArgumentError(absl::StrCat(train.Describe(), ": no samples"));
  // The model on the first n samples of `source`.
  auto first_batch_fits = [&](const ExampleSource& source) -> absl::Status {
    ASSIGN_OR_RETURN(Batch b, ReadBatch(source, 0, n));
    return CheckModelFitsData(model_.get(), loss_kind_,
                              OnDevice(FieldTensor(b.x, b.size, source.x())),
                              OnDevice(FieldTensor(b.y, b.size, source.y())), source.Describe());
  };
  RETURN_IF_ERROR(first_batch_fits(train));
  const ExampleSource* test = data_.test.get();
  if (test == nullptr || test->size() == 0) return absl::OkStatus();
  if (!TestFitsTraining(train, *test)) {
    return absl::InvalidArgumentError(absl::StrCat(
        test->Describe(), ": samples x ", test->x().Describe(), ", y ", test->y().Describe(),
        " differ from the training set's x ", train.x().Describe(), ", y ", train.y().Describe()));
  }
  // The test set's first batch too (a class index out of range, targets that do not fit the
  // output): found now rather than after the training. A test set smaller than one batch is
  // left to the evaluation, which handles models written for a fixed batch.
  return test->size() < n ? absl::OkStatus() : first_batch_fits(*test);
}

void TrainingLoop::PublishModel(bool final) {
  // Rank 0 publishes; another rank only its final model, when it gathered the finals in
  // rank 0's place (a gossip fallback root).
  if (!options_.on_model || (options_.rank != 0 && !final)) return;
  if (options_.mode != Mode::kGossip && options_.mode != Mode::kAllreduce) return;
  ModelSnapshot snap;
  snap.step = step_;
  snap.final = final;
  snap.names = view_.names;
  snap.shapes = view_.shapes;
  snap.dtypes = view_.dtypes;
  for (int i = 0; i < view_.size(); ++i) {
    snap.buffer.push_back(view_.is_buffer(i));
    snap.values.emplace_back(view_.params[i].begin(), view_.params[i].end());
  }
  options_.on_model(snap);
  last_publish_ = absl::Now();
}

absl::Status TrainingLoop::Setup() {
  torch::set_num_threads(options_.intra_op_threads);
  ASSIGN_OR_RETURN(loss_kind_, ParseLoss(spec_.loss()));
  ASSIGN_OR_RETURN(data_, LoadJobData(spec_, options_.data_dir));
  ASSIGN_OR_RETURN(model_, CreateModel(spec_.model(), spec_.seed()));
  ASSIGN_OR_RETURN(device_, PickDevice(options_.device, options_.gpu, options_.rank));
  on_gpu_ = !device_.is_cpu();
  if (on_gpu_) RETURN_IF_ERROR(model_->ToDevice(device_));
  RETURN_IF_ERROR(MakeModelView());
  RETURN_IF_ERROR(CheckFit());
  accum_ = std::max(1, spec_.accumulation_steps());
  autocast_ = spec_.precision() == "bf16" || spec_.precision() == "fp16";
  autocast_dtype_ = spec_.precision() == "fp16" ? at::kHalf : at::kBFloat16;
  if (spec_.precision() == "fp16" && !on_gpu_) {
    return absl::FailedPreconditionError(
        absl::StrCat("trainer: precision fp16 needs a CUDA device, and this worker computes on ",
                     device_.str(), " (LibTorch's CPU autocast has no fp16); use bf16"));
  }
  scaler_ = LossScaler(spec_.loss_scale());
  if (options_.mode == Mode::kAsync || options_.mode == Mode::kSsp ||
      options_.mode == Mode::kGossip || options_.mode == Mode::kDiloco) {
    clip_.max_norm = spec_.clip_grad_norm();
    clip_.max_value = spec_.clip_grad_value();
  }
  // The loader counts micro-batches: accumulation_steps of them make one step.
  loader_options_ = LoaderOptions(spec_, options_.rank);
  loader_options_.max_steps *= accum_;
  ASSIGN_OR_RETURN(loader_, BatchLoader::Create(data_.train.get(), loader_options_));
  total_ = loader_->total_steps() / accum_;
  if (total_ == 0 && loader_->total_steps() > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer: accumulation_steps ", accum_,
                     " needs that many micro-batches per step, but the "
                     "run has only ",
                     loader_->total_steps(), " (raise epochs or steps, or lower it)"));
  }
  const int64_t per_epoch = std::max<int64_t>(1, loader_->steps_per_epoch() / accum_);
  epochs_ = spec_.steps() > 0 ? (total_ + per_epoch - 1) / per_epoch : spec_.epochs();

  LoopInfo info;
  info.total_steps = total_;
  info.steps_per_epoch = per_epoch;
  ASSIGN_OR_RETURN(const int64_t first_step, mode_->Start(&view_, info));
  if (first_step > 0) {
    loader_options_.first_step = std::min(first_step, total_) * accum_;
    loader_.reset();  // Its prefetch thread first.
    ASSIGN_OR_RETURN(loader_, BatchLoader::Create(data_.train.get(), loader_options_));
  }
  step_ = loader_options_.first_step / accum_;
  result_.first_step = step_;

  OfferDeviceGradients();
  RETURN_IF_ERROR(
      BuffersIn(/*remember=*/true));  // The mode may have set them (shards, checkpoint, rank 0).
  // overlap: 2: a gate inside the forward only where the view's spans are the parameters the
  // forward reads (the CPU) and no buffer (copied in before the forward) is owed.
  if (spec_.overlap() == 2 && !on_gpu_ && view_.size() == view_.num_params) {
    gated_ = model_->SetParameterGate([this](int begin, int end) {
      const absl::Status st = AwaitParameters(begin, end);
      if (!st.ok() && gate_status_.ok()) gate_status_ = st;
    });
  }
  if (mode_->wants_gradient_hook()) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const int index = static_cast<int>(i);
      TrainingMode* mode = mode_;
      params_[i].register_hook([this, mode, index](const torch::Tensor& grad) {
        // Accumulation: only the last micro-batch's backward communicates (DDP no_sync), with
        // the accumulated gradient: this backward's share plus what .grad holds already (a
        // leaf's hook runs before its gradient is accumulated).
        if (!hook_live_) return;
        hooked_[index] = 1;
        const torch::Tensor& held = params_[index].grad();
        torch::Tensor whole = held.defined() ? grad + held : grad;
        // A sparse gradient (nn.Embedding(sparse=True)) is exchanged as the dense one it
        // stands for: every rank's exchange has the parameter's shape.
        if (whole.is_sparse()) whole = whole.to_dense();
        mode->OnGradient(index, GradOut(index, whole.contiguous()));
      });
    }
  }
  return absl::OkStatus();
}

void TrainingLoop::OfferDeviceGradients() {
  const DeviceCodecUse use = options_.device_codec;
  device_codec_why_ = use == DeviceCodecUse::kOff ? "flag" : on_gpu_ ? "" : "cpu";
  if (use == DeviceCodecUse::kOff || (use == DeviceCodecUse::kAuto && !on_gpu_)) return;
  // The per-gradient hook copies every gradient to the host as backward produces it (the
  // loop's clipping, unscaling and fault injection run on the device: ClipOnDevice, ...).
  if (mode_->wants_gradient_hook()) {
    device_codec_why_ = "gradient_hook";
    return;
  }
  device_grads_ = std::make_unique<TorchDeviceGradients>(&params_, &view_.names);
  device_encoded_ = mode_->UseDeviceGradients(device_grads_.get());
  // The mode (its exchange or its push codec) reads the host gradient.
  if (!device_encoded_) device_codec_why_ = "mode";
  if (!device_encoded_) device_grads_.reset();
}

void TrainingLoop::LogStart() const {
  if (log_ == nullptr) return;
  std::vector<LogField> f = {
      Kv("job", spec_.name()),
      Kv("rank", options_.rank),
      Kv("mode", spec_.mode()),
      Kv("model", spec_.model().name()),
      Kv("dataset", spec_.dataset().name()),
      Kv("loss", LossName(loss_kind_)),
      Kv("device", device_.str()),
      Kv("device_codec", device_encoded_ ? "on" : "off"),
      Kv("train_samples", data_.train->size()),
      Kv("x", data_.train->x().Describe()),
      Kv("y", data_.train->y().Describe()),
      Kv("params", view_.numel()),
      Kv("buffers", view_.size() - view_.num_params),
      Kv("frozen_params", model_->FrozenParameterNames().size()),
      Kv("steps", total_),
      Kv("steps_per_epoch", loader_->steps_per_epoch() / accum_),
      Kv("epochs", epochs_),
      Kv("batch", spec_.batch_size()),
      Kv("workers", spec_.num_workers()),
      Kv("accumulation_steps", accum_),
      Kv("precision", spec_.precision().empty() ? "fp32" : spec_.precision())};
  if (scaler_.enabled()) {
    f.push_back(Kv("loss_scale", "dynamic"));
    f.push_back(Kv("init_scale", absl::StrFormat("%g", scaler_.scale())));
  }
  if (spec_.clip_grad_norm() > 0) f.push_back(Kv("clip_grad_norm", spec_.clip_grad_norm()));
  if (spec_.clip_grad_value() > 0) f.push_back(Kv("clip_grad_value", spec_.clip_grad_value()));
  if (spec_.lr_scaling().rule() != "none" && !spec_.lr_scaling().rule().empty()) {
    const OptimizerSpec scaled = ScaledOptimizer(spec_, spec_.num_workers());
    f.push_back(Kv("lr_scaling", spec_.lr_scaling().rule()));
    f.push_back(Kv("lr", absl::StrFormat("%.6g", scaled.lr())));
    f.push_back(Kv("lr_base", absl::StrFormat("%.6g", spec_.optimizer().lr())));
    f.push_back(Kv("lr_warmup_steps", spec_.lr_scaling().warmup_steps()));
  }
  // Why the push codec does not run where the gradients are: flag, cpu, gradient_hook, or mode
  // (its exchange or codec).
  if (!device_encoded_) f.push_back(Kv("device_codec_off", device_codec_why_));
  // overlap: 2: whether the forward waits layer by layer or for the whole model.
  if (spec_.overlap() == 2) f.push_back(Kv("forward_gate", gated_ ? "layers" : "model"));
  for (LogField& e : mode_->StartFields()) f.push_back(std::move(e));
  log_->Info("train_start", f);
}

absl::Status TrainingLoop::MicroStep(Batch& batch, int k, double* loss_sum) {
  torch::Tensor x = OnDevice(FieldTensor(batch.x, batch.size, data_.train->x()));
  torch::Tensor y = OnDevice(FieldTensor(batch.y, batch.size, data_.train->y()));
  torch::Tensor loss;
  {
    AutocastGuard autocast(autocast_, device_, autocast_dtype_);
    absl::StatusOr<torch::Tensor> computed = ComputeLoss(model_.get(), loss_kind_, x, y);
    // The check before the run saw one batch; a bad sample later (a label out of range) is
    // found here: say where.
    if (!computed.ok()) {
      return Annotate(computed.status(),
                      absl::StrCat("trainer: step ", step_, " (micro-batch ", k, ", samples ",
                                   SampleRange(batch), " of ", data_.train->Describe(), ")"));
    }
    loss = *std::move(computed);
  }
  // overlap: 2: what a gate met ends the step; every entry is in before backward (a parameter
  // the forward did not read is copied now, while nothing reads it).
  RETURN_IF_ERROR(std::exchange(gate_status_, absl::OkStatus()));
  RETURN_IF_ERROR(AwaitParameters(0, view_.size()));
  if (loss.scalar_type() != torch::kFloat) loss = loss.to(torch::kFloat);
  const double value = loss.item<double>();
  // With loss scaling a non-finite step is skipped (and the scale lowered); without, it would
  // be exchanged: ps shards refuse it, but gossip and allreduce would spread it silently.
  if (!std::isfinite(value) && !scaler_.enabled()) return NonFiniteLoss(batch, k, value, x, y);
  *loss_sum += value;
  const bool last = k == accum_ - 1;
  // The step's last forward has moved the buffers as far as they go (backward leaves them
  // alone): their deltas are known now, before backward.
  if (last) {
    RETURN_IF_ERROR(BuffersOut());
    mode_->BeforeBackward(step_, *loss_sum / accum_, stop_.load());
    if (mode_->wants_gradient_hook() && view_.size() > view_.num_params) {
      mode_->OnBufferDeltas(absl::MakeConstSpan(grads_).subspan(view_.num_params));
    }
  }
  hook_live_ = last;
  if (last) hooked_.assign(params_.size(), 0);
  try {
    torch::Tensor scaled = accum_ > 1 ? loss / static_cast<double>(accum_) : loss;
    if (scaler_.enabled()) scaled = scaled * scaler_.scale();
    scaled.backward();
  } catch (const c10::Error& e) {
    hook_live_ = true;
    if (last) mode_->AbortStep();
    return absl::InternalError(absl::StrCat("trainer: backward failed at step ", step_,
                                            " (micro-batch ", k,
                                            "): ", e.what_without_backtrace()));
  }
  hook_live_ = true;
  return absl::OkStatus();
}

absl::Status TrainingLoop::NonFiniteLoss(const Batch& batch, int k, double value,
                                         const torch::Tensor& x, const torch::Tensor& y) const {
  std::string why = "the model diverged (lower optimizer.lr, clip gradients, or use loss_scale)";
  for (const auto& [field, t] : {std::pair<const char*, const torch::Tensor*>{"x", &x},
                                 std::pair<const char*, const torch::Tensor*>{"y", &y}}) {
    if (!t->is_floating_point() || t->dim() == 0) continue;
    const torch::Tensor bad = torch::isfinite(*t).reshape({t->size(0), -1}).all(1).logical_not();
    const torch::Tensor rows = bad.nonzero().to(torch::kCPU);
    if (rows.numel() == 0) continue;
    const int64_t row = rows[0][0].item<int64_t>();
    const int64_t index =
        row < static_cast<int64_t>(batch.indices.size()) ? batch.indices[row] : row;
    why = absl::StrCat("sample ", index, " of ", data_.train->Describe(), " has a non-finite ",
                       field);
    break;
  }
  return absl::InvalidArgumentError(absl::StrCat("trainer: the loss is ", value, " at step ", step_,
                                                 " (micro-batch ", k, "): ", why));
}

void TrainingLoop::ClipLocal() {
  if (!clip_.enabled()) return;
  clip_window_.Add(ClipGradients(ParamGrads(), clip_));
}

std::vector<absl::Span<float>> TrainingLoop::ParamGrads() {
  // The spans point into this loop's gradient tensors (or their host copies): ours to write.
  std::vector<absl::Span<float>> g;
  for (int i = 0; i < view_.num_params; ++i) {
    g.emplace_back(const_cast<float*>(grads_[i].data()), grads_[i].size());
  }
  return g;
}

void TrainingLoop::ClipOnDevice() {
  if (!clip_.enabled() || params_.empty()) return;
  const double max_value = clip_.max_value;
  std::vector<torch::Tensor> clamped, squares;
  for (torch::Tensor& p : params_) {
    torch::Tensor& g = p.mutable_grad();
    if (max_value > 0) {
      clamped.push_back(g.abs().gt(static_cast<float>(max_value)).any().to(torch::kDouble));
      g.clamp_(-static_cast<float>(max_value), static_cast<float>(max_value));
    }
    squares.push_back(g.to(torch::kDouble).square().sum());
  }
  // One copy: the sum of squares (in double, as ClipGradients) and whether a value was clamped.
  clamped.push_back(torch::zeros({}, squares[0].options()));
  const torch::Tensor figures =
      torch::stack({torch::stack(squares).sum(), torch::stack(clamped).sum()}).to(torch::kCPU);
  ClipStats stats;
  stats.norm = std::sqrt(figures[0].item<double>());
  stats.clipped = figures[1].item<double>() > 0;
  if (const double coef = ClipCoefficient(clip_.max_norm, stats.norm); coef < 1) {
    for (torch::Tensor& p : params_) p.mutable_grad().mul_(static_cast<float>(coef));
    stats.clipped = true;
  }
  clip_window_.Add(stats);
}

bool TrainingLoop::UnscaleOnDevice() {
  // A multiplication by the reciprocal, as UnscaleAndCheck (worker/core/loss_scaler.h).
  const float inv = 1.0f / scaler_.scale();
  std::vector<torch::Tensor> finite;
  for (torch::Tensor& p : params_) {
    torch::Tensor& g = p.mutable_grad();
    g.mul_(inv);
    finite.push_back(torch::isfinite(g).all());
  }
  const bool ok = finite.empty() || torch::stack(finite).all().item<bool>();
  return ok && DeltasFinite();
}

void TrainingLoop::Poison() {
  if (view_.num_params == 0) return;
  if (device_encoded_) {
    params_[0].mutable_grad().view({-1}).narrow(0, 0, 1).fill_(
        std::numeric_limits<float>::quiet_NaN());
  } else {
    ParamGrads()[0][0] = std::numeric_limits<float>::quiet_NaN();
  }
}

bool TrainingLoop::DeltasFinite() const {
  // Buffer deltas are not scaled (the forward made them), but an overflowing forward can
  // make them Inf/NaN too: such a step must not reach the mode either.
  for (const std::vector<float>& d : deltas_) {
    for (float v : d) {
      if (!std::isfinite(v)) return false;
    }
  }
  return true;
}

bool TrainingLoop::UnscaleLocal() {
  const bool finite = scaler_.Unscale(ParamGrads());
  return DeltasFinite() && finite;
}

void TrainingLoop::RestoreBuffers() {
  for (size_t i = 0; i < mirrors_.size(); ++i) {
    mirrors_[i] = before_[i];
    std::fill(deltas_[i].begin(), deltas_[i].end(), 0.0f);
  }
}

absl::Status TrainingLoop::AwaitParameters(int begin, int end) {
  const absl::Time start = absl::Now();
  absl::Status st = mode_->AwaitParameters(begin, end);
  gate_wait_s_ += SecondsSince(start);
  return st;
}

absl::Status TrainingLoop::Step(std::vector<Batch>& micro, StepOutcome* outcome) {
  RETURN_IF_ERROR(mode_->BeforeForward(step_));
  const absl::Time compute_start = absl::Now();
  gate_wait_s_ = 0;
  if (!gated_) RETURN_IF_ERROR(AwaitParameters(0, view_.size()));
  ParamsIn();
  RETURN_IF_ERROR(BuffersIn(/*remember=*/true));
  for (torch::Tensor& p : params_) p.mutable_grad() = torch::Tensor();
  double loss_sum = 0;
  for (int k = 0; k < accum_; ++k) RETURN_IF_ERROR(MicroStep(micro[k], k, &loss_sum));
  const double loss_value = loss_sum / accum_;
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor& g = params_[i].mutable_grad();
    // A parameter the forward did not use has no gradient: it counts as zero (and is still
    // exchanged, so every rank's exchange has the same shape).
    if (!g.defined()) g = torch::zeros_like(params_[i]);
    if (g.is_sparse()) g = g.to_dense();  // As in the hook: the dense gradient it stands for.
    // With the hook, a parameter the last micro-batch's forward did not use (no hook call) is
    // handed over now: zeros, or what the earlier micro-batches accumulated.
    if (mode_->wants_gradient_hook() && !hooked_[i]) {
      mode_->OnGradient(static_cast<int>(i), GradOut(i, g.contiguous()));
    }
    if (!g.is_contiguous()) g = g.contiguous();
    // On a GPU with the hook, the hook has already copied the gradient to the host; with
    // device encoding the mode reads it where it is (the host copy is not refreshed).
    grads_[i] = on_gpu_ && (mode_->wants_gradient_hook() || device_encoded_)
                    ? absl::Span<const float>(host_grads_[i].data_ptr<float>(), g.numel())
                    : GradOut(i, g);
  }
  const std::vector<int64_t>& poison = options_.nonfinite_steps;
  if (std::find(poison.begin(), poison.end(), step_) != poison.end()) Poison();
  // Loss scaling (GradScaler order): unscale, skip a non-finite step, then clip.
  const bool skip = scaler_.enabled() && !mode_->unscales_gradients() &&
                    !(device_encoded_ ? UnscaleOnDevice() : UnscaleLocal());
  if (skip) RestoreBuffers();
  if (!skip) device_encoded_ ? ClipOnDevice() : ClipLocal();
  // Device encoding: nothing has waited for backward's kernels yet (the host copies did);
  // waiting here keeps their time in compute, not in the exchange's codec time.
  if (device_encoded_ && on_gpu_) torch::cuda::synchronize();
  StepTiming timing;
  // The wait for the previous step's values (overlap: 2) is communication, not compute.
  timing.compute_s = std::max(0.0, SecondsSince(compute_start) - gate_wait_s_);
  result_.compute_s += timing.compute_s;
  result_.comm_s += gate_wait_s_;

  const absl::Time comm_start = absl::Now();
  torch::NoGradGuard no_grad;
  if (scaler_.enabled()) mode_->SetLossScale(scaler_.scale());
  absl::StatusOr<StepOutcome> out = skip ? mode_->SkipStep(step_, loss_value)
                                         : mode_->Exchange(step_, grads_, loss_value, timing);
  if (!out.ok()) return Annotate(out.status(), absl::StrCat("step ", step_));
  *outcome = *out;
  result_.comm_s += SecondsSince(comm_start);
  if (scaler_.enabled()) {
    const float was = scaler_.scale();
    scaler_.Update(out->skipped);
    if (out->skipped && log_ != nullptr) {
      log_->Info("step_skipped",
                 {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("step", step_),
                  Kv("reason", "non_finite_gradient"), Kv("loss_scale", absl::StrFormat("%g", was)),
                  Kv("next_scale", absl::StrFormat("%g", scaler_.scale()))});
    }
  }
  return absl::OkStatus();
}

void TrainingLoop::Progress(const Batch& batch) {
  const double dt = SecondsSince(window_start_);
  const int64_t done = step_ - result_.first_step;
  result_.final_loss =
      window_loss_steps_ > 0 ? window_loss_ / window_loss_steps_ : result_.final_loss;
  const double samples_per_s =
      dt > 0 ? static_cast<double>(window_steps_) * spec_.batch_size() * accum_ / dt : 0;
  // Clipping: the mean pre-clip gradient norm and the fraction of steps clipped in the window
  // (the loop's for async/ssp/gossip/diloco, the mode's for allreduce).
  const ClipCounters clip = clip_.enabled() ? clip_window_ : mode_->TakeClipCounters();
  clip_window_ = ClipCounters{};
  if (clip.steps > 0) {
    window_grad_norm_ = clip.norm_sum / static_cast<double>(clip.steps);
    window_clipped_ = static_cast<double>(clip.clipped) / static_cast<double>(clip.steps);
    result_.clip_steps += clip.steps;
    result_.clipped_steps += clip.clipped;
  }
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
    if (on_gpu_ || device_encoded_) {
      // Gradient bytes that crossed from the device to the host (dense copies, or payloads).
      const int64_t to_host =
          dense_to_host_ + (device_grads_ != nullptr ? device_grads_->bytes_to_host() : 0);
      f.push_back(Kv("to_host_bytes_per_step", to_host / done));
    }
    if (clip.steps > 0) {
      f.push_back(Kv("grad_norm", absl::StrFormat("%.4g", window_grad_norm_)));
      f.push_back(Kv("clipped", absl::StrFormat("%.3f", window_clipped_)));
    }
    if (scaler_.enabled()) {
      f.push_back(Kv("loss_scale", absl::StrFormat("%g", scaler_.scale())));
      f.push_back(Kv("skipped", scaler_.skipped_steps()));
    }
    for (LogField& e : mode_->ProgressFields(done, window_steps_)) f.push_back(std::move(e));
    log_->Info("progress", f);
  }
  Report(samples_per_s, -1);
  window_start_ = absl::Now();
  window_loss_ = 0;
  window_steps_ = 0;
  window_loss_steps_ = 0;
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
  p.test_loss = result_.test_loss;  // -1 until evaluated.
  p.perplexity = result_.perplexity;
  p.checkpoint_step = checkpoint_step_;
  p.grad_norm = window_grad_norm_;
  p.clipped_fraction = window_clipped_;
  if (scaler_.enabled()) {
    p.skipped_steps = scaler_.skipped_steps();
    p.loss_scale = scaler_.scale();
  }
  options_.on_progress(p);
}

absl::Status TrainingLoop::EvaluateAndSave() {
  // Saved before the evaluation, so that a test set the model fails on does not lose it.
  if (!spec_.output().empty()) {
    if (on_gpu_) RETURN_IF_ERROR(model_->ToDevice(torch::kCPU));  // Loadable without a GPU.
    RETURN_IF_ERROR(model_->Save(spec_.output()));
    LogInfo(log_, "model_saved", {Kv("job", spec_.name()), Kv("path", spec_.output())});
    if (on_gpu_) RETURN_IF_ERROR(model_->ToDevice(device_));
  }
  // A dataset without test files (or with empty ones) trains and saves; it just has no
  // test-set figures (-1).
  if (data_.test == nullptr || data_.test->size() == 0) {
    LogInfo(log_, "not_evaluated",
            {Kv("job", spec_.name()), Kv("rank", options_.rank),
             Kv("reason", data_.test == nullptr ? "no_test_files" : "empty_test_set")});
  } else if (absl::Status st = EvaluateTestSet(); !st.ok()) {
    if (spec_.output().empty()) return st;
    return absl::Status(st.code(), absl::StrCat(st.message(), " (the trained model is saved in ",
                                                spec_.output(), ")"));
  }
  Report(result_.samples_per_s, result_.test_accuracy);
  return absl::OkStatus();
}

absl::Status TrainingLoop::EvaluateTestSet() {
  ASSIGN_OR_RETURN(const TestSetResult t,
                   Evaluate(model_.get(), loss_kind_, *data_.test, spec_.batch_size(), device_));
  const EvalMetrics& m = t.metrics;
  result_.test_accuracy = m.accuracy;
  result_.test_loss = m.test_loss;
  result_.perplexity = m.perplexity;
  if (log_ != nullptr) {
    std::vector<LogField> f = {Kv("job", spec_.name()), Kv("rank", options_.rank),
                               Kv("test_loss", absl::StrFormat("%.4f", m.test_loss))};
    if (m.accuracy >= 0) f.push_back(Kv("accuracy", absl::StrFormat("%.4f", m.accuracy)));
    if (m.perplexity >= 0) f.push_back(Kv("perplexity", absl::StrFormat("%.3f", m.perplexity)));
    f.push_back(Kv("test_samples", t.samples));
    f.push_back(Kv("eval_batch", t.batch));
    for (LogField& e : mode_->EvaluatedFields()) f.push_back(std::move(e));
    log_->Info("evaluated", f);
  }
  return absl::OkStatus();
}

absl::StatusOr<TrainResult> TrainingLoop::Run() {
  // A stop that cut the start's calls short (a shard down while the rank connects) ends the
  // run as stopped, not failed: the rank can move and start again.
  if (absl::Status setup = Setup(); !setup.ok()) {
    if (!StoppedBy(setup)) return setup;
    result_.stopped_early = true;
    return result_;
  }
  LogStart();
  if (options_.on_start) options_.on_start(step_, total_);
  model_->SetTraining(true);
  const absl::Time start = absl::Now();
  window_start_ = start;
  last_publish_ = start;
  while (true) {
    if (!mode_->collective_stop() && stop_.load()) {
      result_.stopped_early = true;
      LogInfo(log_, "stop_requested",
              {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("step", step_)});
      break;
    }
    std::vector<Batch> micro;
    while (static_cast<int>(micro.size()) < accum_) {
      std::optional<Batch> b = NextBatch(loader_.get(), options_.step_delay, &result_.data_s);
      if (!b.has_value()) break;
      micro.push_back(*std::move(b));
    }
    if (static_cast<int>(micro.size()) < accum_) {
      // The end (micro-batches short of a whole step are dropped), or a read error.
      RETURN_IF_ERROR(Annotate(loader_->status(), absl::StrCat("reading batch ", step_)));
      break;
    }
    StepOutcome outcome;
    const absl::Status stepped = Step(micro, &outcome);
    // A stop that found the exchange failing (a shard down) ends its retries with CANCELLED:
    // the run stops there, its step not done (a resumed rank does it again).
    if (StoppedBy(stepped)) {
      result_.stopped_early = true;
      LogInfo(log_, "stop_requested",
              {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("step", step_),
               Kv("step_interrupted", stepped.ToString())});
      break;
    }
    RETURN_IF_ERROR(stepped);
    ++step_;
    const Batch* batch = &micro.back();
    epoch_ = static_cast<int32_t>(batch->epoch + 1);
    for (const Batch& m : micro) result_.samples += m.size;
    // A skipped step's loss is Inf/NaN when its forward overflowed: not in the mean.
    if (!outcome.skipped) {
      window_loss_ += outcome.loss;
      ++window_loss_steps_;
    }
    ++window_steps_;
    absl::StatusOr<bool> checkpointed = mode_->MaybeCheckpoint(step_);
    // overlap: 2 waits there for the step's answers: a stop that cuts that wait short stops.
    if (StoppedBy(checkpointed.status())) {
      result_.stopped_early = true;
      LogInfo(log_, "stop_requested",
              {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("step", step_),
               Kv("step_interrupted", checkpointed.status().ToString())});
      break;
    }
    if (!checkpointed.ok()) return checkpointed.status();
    if (*checkpointed) checkpoint_step_ = step_;
    if (*checkpointed || absl::Now() - last_publish_ >= options_.model_publish_interval) {
      PublishModel(/*final=*/false);
    }
    const bool last = step_ == total_ || outcome.stop;
    if ((spec_.log_every() > 0 && step_ % spec_.log_every() == 0) || last) Progress(*batch);
    if (outcome.stop) {
      result_.stopped_early = step_ < total_;
      LogInfo(log_, "stop_requested",
              {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("step", step_)});
      break;
    }
  }
  if (window_loss_steps_ > 0) result_.final_loss = window_loss_ / window_loss_steps_;
  result_.steps = step_ - result_.first_step;
  result_.skipped_steps = scaler_.skipped_steps();
  result_.loss_scale = scaler_.scale();
  result_.wall_s = SecondsSince(start);
  result_.samples_per_s = result_.wall_s > 0 ? result_.samples / result_.wall_s : 0;

  absl::StatusOr<bool> evaluate;
  {
    torch::NoGradGuard no_grad;
    evaluate = mode_->Finish(step_, &result_);
  }
  if (!evaluate.ok()) {
    // Likewise at the end (rank 0 stopped while waiting for the others to finish): reported
    // stopped, a resumed rank 0 finishes the job.
    if (!StoppedBy(evaluate.status())) return evaluate.status();
    result_.stopped_early = true;
    LogInfo(log_, "stop_requested",
            {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("step", step_),
             Kv("finish_interrupted", evaluate.status().ToString())});
    return result_;
  }
  ParamsIn();  // The final model, as the mode left it in the view.
  RETURN_IF_ERROR(
      BuffersIn(/*remember=*/false));  // The final model's buffers, as the mode left them.
  if (*evaluate) {
    PublishModel(/*final=*/true);
    RETURN_IF_ERROR(EvaluateAndSave());
  }
  return result_;
}

}  // namespace

absl::StatusOr<TrainResult> RunTrainingLoop(const TrainerOptions& options, TrainingMode* mode,
                                            const std::atomic<bool>& stop) {
  TrainingLoop loop(options, mode, stop);
  // The LibTorch edge: the loop catches what it expects (the model's forward and loss,
  // backward); anything else LibTorch throws (a device copy, a kernel, out of memory) ends
  // the run with an error instead of the process.
  try {
    return loop.Run();
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("trainer: LibTorch failed at step ", loop.step(), ": ",
                                            e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("trainer: failed at step ", loop.step(), ": ", e.what()));
  }
}

}  // namespace gradmesh
