// The one training loop against a scripted fake mode: the hook order, resume, both kinds of
// stop, gradient hooks, the progress schema, evaluation, and that a mode's writes through the
// model view are the model. The Device tests run the view, buffer, hook and update checks on
// every device: the CPU, and --device cuda, which on a GPU machine (a CUDA LibTorch build,
// tests/gpu/) must give the CPU's numbers and elsewhere must fail before anything starts. Uses
// MNIST from GRADMESH_DATA_DIR (set by .bazelrc; installed by deploy/setup.sh): a missing data set
// fails the test.
#include "worker/training_loop.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/status_testing.h"
#include "compression/compressor.h"
#include "compression/error_feedback.h"
#include "worker/core/dataset.h"
#include "worker/core/device_gradients.h"
#include "worker/model.h"
#include "worker/torch_device_gradients.h"

namespace gradmesh {
namespace {

class FakeMode : public TrainingMode {
 public:
  int64_t first_step = 0;
  bool hook = false;
  bool collective = false;
  int64_t stop_after_step = -1;  // Exchange of this step says stop (collective).
  bool evaluate = false;
  bool zero_model = false;  // Start writes zeros through the view.
  std::vector<std::string> calls;
  std::vector<double> losses;
  int64_t gradients_seen = 0;
  int64_t grad_elems_in_exchange = 0;
  bool finish_saw_stopped = false;
  ModelView* view = nullptr;

  absl::StatusOr<int64_t> Start(ModelView* model, const LoopInfo& info) override {
    view = model;
    calls.push_back(absl::StrCat("start total=", info.total_steps));
    if (zero_model) {
      for (absl::Span<float> p : model->params) std::fill(p.begin(), p.end(), 0.0f);
    }
    return first_step;
  }
  bool collective_stop() const override { return collective; }
  absl::Status BeforeForward(int64_t step) override {
    calls.push_back(absl::StrCat("forward ", step));
    return absl::OkStatus();
  }
  void BeforeBackward(int64_t step, double loss, bool stop_requested) override {
    calls.push_back(absl::StrCat("backward ", step, stop_requested ? " stop" : ""));
  }
  bool wants_gradient_hook() const override { return hook; }
  void OnGradient(int param, absl::Span<const float> grad) override {
    ++gradients_seen;
    EXPECT_EQ(grad.size(), view->params[param].size());
  }
  absl::StatusOr<StepOutcome> Exchange(int64_t step,
                                       absl::Span<const absl::Span<const float>> grads, double loss,
                                       const StepTiming& timing) override {
    calls.push_back(absl::StrCat("exchange ", step));
    EXPECT_EQ(grads.size(), view->params.size());
    for (absl::Span<const float> g : grads) grad_elems_in_exchange += g.size();
    EXPECT_GT(timing.compute_s, 0);
    losses.push_back(loss);
    StepOutcome out;
    out.loss = loss;
    out.stop = step == stop_after_step;
    return out;
  }
  absl::StatusOr<bool> MaybeCheckpoint(int64_t steps_done) override {
    calls.push_back(absl::StrCat("checkpoint? ", steps_done));
    return steps_done == 2;
  }
  int64_t bytes_sent() const override { return 1000 * static_cast<int64_t>(losses.size()); }
  std::vector<LogField> ProgressFields(int64_t done, int64_t window) override {
    return {Kv("fake_done", done), Kv("fake_window", window)};
  }
  absl::StatusOr<bool> Finish(int64_t step, TrainResult* result) override {
    calls.push_back(absl::StrCat("finish ", step));
    finish_saw_stopped = result->stopped_early;
    result->bytes_pushed = 7;
    return evaluate;
  }
};

TrainerOptions Options(int64_t steps) {
  TrainerOptions o;
  o.spec.set_name("loop");
  o.spec.set_mode("async");
  o.spec.mutable_model()->set_name("mlp");
  o.spec.mutable_dataset()->set_name("mnist");
  o.spec.set_num_workers(1);
  o.spec.set_batch_size(16);
  o.spec.set_steps(steps);
  o.spec.set_seed(3);
  o.spec.set_log_every(2);
  o.device = ComputeDevice::kCpu;  // The Device tests choose theirs.
  const char* root = std::getenv("GRADMESH_DATA_DIR");
  o.data_dir = root == nullptr ? "" : root;
  return o;
}

std::vector<std::string> Lines(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

TEST(TrainingLoopTest, CallsTheHooksInOrderAndReportsOneSchema) {
  ASSERT_NE(std::getenv("GRADMESH_DATA_DIR"), nullptr) << "run deploy/setup.sh";
  std::FILE* out = std::tmpfile();
  Logger logger({}, out);
  TrainerOptions o = Options(3);
  o.logger = &logger;
  std::vector<TrainProgress> reports;
  o.on_progress = [&reports](const TrainProgress& p) { reports.push_back(p); };
  FakeMode mode;
  std::atomic<bool> stop{false};
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));

  const std::vector<std::string> want = {"start total=3", "forward 0", "backward 0", "exchange 0",
                                         "checkpoint? 1", "forward 1", "backward 1", "exchange 1",
                                         "checkpoint? 2", "forward 2", "backward 2", "exchange 2",
                                         "checkpoint? 3", "finish 3"};
  EXPECT_EQ(mode.calls, want);
  EXPECT_EQ(mode.gradients_seen, 0);
  EXPECT_EQ(mode.grad_elems_in_exchange, 3 * (784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10));
  EXPECT_EQ(r.steps, 3);
  EXPECT_EQ(r.samples, 48);
  EXPECT_EQ(r.first_step, 0);
  EXPECT_FALSE(r.stopped_early);
  EXPECT_EQ(r.bytes_pushed, 7);
  EXPECT_EQ(r.test_accuracy, -1);                  // The mode did not ask for evaluation.
  EXPECT_DOUBLE_EQ(r.final_loss, mode.losses[2]);  // The last window holds step 2 only.

  // Progress at step 2 (log_every) and at the last step, with the common keys in order.
  std::vector<std::string> progress;
  for (const std::string& line : Lines(out)) {
    if (line.find("event=progress") != std::string::npos) progress.push_back(line);
  }
  ASSERT_EQ(progress.size(), 2u);
  for (const char* key :
       {" job=loop", " rank=0", " mode=async", " total=3", " epoch=1", " epochs=1",
        " loss=", " samples_per_s=", " data_ms=", " compute_ms=", " comm_ms=", " fake_done="}) {
    EXPECT_NE(progress[0].find(key), std::string::npos) << key << " in " << progress[0];
  }
  EXPECT_NE(progress[0].find(" step=2 "), std::string::npos);
  EXPECT_NE(progress[0].find(" bytes_per_step=1000 checkpoint_step=2 fake_done=2 fake_window=2"),
            std::string::npos)
      << progress[0];
  EXPECT_NE(progress[1].find(" step=3 "), std::string::npos);
  EXPECT_NE(progress[1].find(" fake_done=3 fake_window=1"), std::string::npos) << progress[1];
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_EQ(reports[0].step, 2);
  EXPECT_EQ(reports[0].checkpoint_step, 2);
  EXPECT_EQ(reports[1].step, 3);
  EXPECT_EQ(reports[1].total_steps, 3);
  EXPECT_EQ(reports[1].accuracy, -1);
  std::fclose(out);
}

TEST(TrainingLoopTest, ResumesAtTheModesStepAndCallsGradientHooks) {
  TrainerOptions o = Options(5);
  FakeMode mode;
  mode.first_step = 3;
  mode.hook = true;
  // Where the run starts is reported before its first step (a daemon's rank shows it while
  // it has no progress line yet).
  std::vector<std::string> starts;
  o.on_start = [&](int64_t step, int64_t total) {
    starts.push_back(absl::StrCat(step, "/", total, " after ", mode.calls.size(), " calls"));
  };
  std::atomic<bool> stop{false};
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
  EXPECT_EQ(starts, std::vector<std::string>{"3/5 after 1 calls"});  // Just after "start".
  EXPECT_EQ(r.first_step, 3);
  EXPECT_EQ(r.steps, 2);
  EXPECT_EQ(mode.calls[1], "forward 3");
  EXPECT_EQ(mode.calls.back(), "finish 5");
  EXPECT_EQ(mode.gradients_seen, 2 * 6);  // Every parameter, every step.
}

TEST(TrainingLoopTest, ALocalStopEndsBeforeTheNextStep) {
  TrainerOptions o = Options(5);
  FakeMode mode;
  std::atomic<bool> stop{true};
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
  EXPECT_TRUE(r.stopped_early);
  EXPECT_EQ(r.steps, 0);
  EXPECT_TRUE(mode.finish_saw_stopped);
  EXPECT_EQ(mode.calls, (std::vector<std::string>{"start total=5", "finish 0"}));
}

TEST(TrainingLoopTest, ACollectiveStopEndsAfterTheStepThatCarriesIt) {
  TrainerOptions o = Options(5);
  FakeMode mode;
  mode.collective = true;
  mode.stop_after_step = 1;
  std::atomic<bool> stop{true};  // Passed on to the mode, not acted on by the loop.
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
  EXPECT_TRUE(r.stopped_early);
  EXPECT_EQ(r.steps, 2);
  EXPECT_EQ(mode.calls[2], "backward 0 stop");
  EXPECT_EQ(mode.calls.back(), "finish 2");
}

class DeviceTest : public ::testing::TestWithParam<ComputeDevice> {
 protected:
  // Sets o's device. True if a run there can go ahead; for cuda without a GPU, checks instead
  // that the loop refuses it before the mode starts, and returns false.
  bool Usable(TrainerOptions& o) {
    o.device = GetParam();
    if (GetParam() != ComputeDevice::kCuda || torch::cuda::is_available()) return true;
    FakeMode mode;
    std::atomic<bool> stop{false};
    absl::StatusOr<TrainResult> r = RunTrainingLoop(o, &mode, stop);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
    EXPECT_NE(r.status().message().find("device cuda"), std::string::npos) << r.status();
    EXPECT_TRUE(mode.calls.empty());
    return false;
  }
};

TEST_P(DeviceTest, TheModelViewIsTheModelAndEvaluationUsesIt) {
  TrainerOptions o = Options(1);
  if (!Usable(o)) return;
  std::vector<TrainProgress> reports;
  o.on_progress = [&reports](const TrainProgress& p) { reports.push_back(p); };
  FakeMode mode;
  mode.zero_model = true;
  mode.evaluate = true;
  std::atomic<bool> stop{false};
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
  // All-zero weights give uniform logits: cross-entropy is exactly ln(10).
  ASSERT_EQ(mode.losses.size(), 1u);
  EXPECT_NEAR(mode.losses[0], std::log(10.0), 1e-6);
  // Still all zero (the fake mode never updates): every test sample gets class 0.
  EXPECT_NEAR(r.test_accuracy, 980.0 / 10000.0, 1e-12);  // MNIST's test set has 980 zeros.
  ASSERT_FALSE(reports.empty());
  EXPECT_NEAR(reports.back().accuracy, 0.098, 1e-12);
}

// A mode that follows the BatchNorm buffers of worker/testdata/bn_mnist.pt through the steps:
// what the loop hands over (deltas), and that what the mode writes into a buffer mirror is
// what the model's next forward starts from.
class BufferMode : public FakeMode {
 public:
  std::vector<std::vector<float>> deltas;   // Per step: running_mean's delta.
  std::vector<float> counted;               // Per step: num_batches_tracked's delta.
  std::vector<float> mirror_after_forward;  // Per step: running_mean[0]'s mirror at Exchange.
  ModelView seen;                           // The view at Start (without the spans).

  absl::StatusOr<int64_t> Start(ModelView* model, const LoopInfo& info) override {
    seen = *model;
    seen.params.clear();  // They die with the loop.
    return FakeMode::Start(model, info);
  }

  absl::StatusOr<StepOutcome> Exchange(int64_t step,
                                       absl::Span<const absl::Span<const float>> grads, double loss,
                                       const StepTiming& timing) override {
    const int mean = view->num_params;  // bn.running_mean, bn.running_var, num_batches_tracked.
    deltas.emplace_back(grads[mean].begin(), grads[mean].end());
    counted.push_back(grads[mean + 2][0]);
    mirror_after_forward.push_back(view->params[mean][0]);
    // The mode's verdict on the buffer (as a ps pull would): the next forward starts here.
    std::fill(view->params[mean].begin(), view->params[mean].end(), 7.0f);
    return FakeMode::Exchange(step, grads, loss, timing);
  }
};

TEST_P(DeviceTest, BuffersAreMirroredWithTheirDeltasAndTheModesValuesReachTheModel) {
  TrainerOptions o = Options(2);
  o.spec.mutable_model()->set_name("torchscript");
  o.spec.mutable_model()->set_path("worker/testdata/bn_mnist.pt");
  if (!Usable(o)) return;
  BufferMode mode;
  std::atomic<bool> stop{false};
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
  const ModelView& v = mode.seen;
  ASSERT_EQ(v.num_params, 6);  // conv, bn, fc: weight and bias each.
  ASSERT_EQ(v.names.size(), 9u);
  EXPECT_EQ(v.names[6], "bn.running_mean");
  EXPECT_EQ(v.names[7], "bn.running_var");
  EXPECT_EQ(v.names[8], "bn.num_batches_tracked");
  EXPECT_EQ(v.dtypes[6], ElemType::kFloat32);
  EXPECT_EQ(v.dtypes[8], ElemType::kInt64);
  EXPECT_TRUE(v.shapes[8].empty());
  EXPECT_TRUE(v.is_buffer(6));
  EXPECT_FALSE(v.is_buffer(5));
  ASSERT_EQ(mode.deltas.size(), 2u);
  // Every forward in training mode counts one batch.
  EXPECT_EQ(mode.counted, (std::vector<float>{1.0f, 1.0f}));
  // Step 0 starts from running_mean 0: the delta is 0.1 * the batch mean, and the mirror
  // holds the new value when Exchange runs.
  EXPECT_NE(mode.deltas[0][0], 0.0f);
  EXPECT_FLOAT_EQ(mode.mirror_after_forward[0], mode.deltas[0][0]);
  // Step 1 starts from the 7.0 the mode wrote: the momentum pulls it back by 0.1 * (7 - batch
  // mean), i.e. the model saw 7.0 (the batch means are within +-2 here).
  for (float d : mode.deltas[1]) {
    EXPECT_LT(d, -0.5f);
    EXPECT_GT(d, -0.9f);
  }
  EXPECT_FLOAT_EQ(mode.mirror_after_forward[1], 7.0f + mode.deltas[1][0]);
  EXPECT_EQ(r.steps, 2);
}

// A mode that records every buffer's deltas and mirror at each Exchange (one entry per step
// and buffer) and, with `set_first_to`, then sets the first buffer's first element to it (as a
// pull would): the next forward must start from there.
class BuffersMode : public FakeMode {
 public:
  std::vector<std::vector<float>> deltas, mirrors;
  std::optional<float> set_first_to;

  absl::StatusOr<StepOutcome> Exchange(int64_t step,
                                       absl::Span<const absl::Span<const float>> grads, double loss,
                                       const StepTiming& timing) override {
    for (size_t i = view->num_params; i < grads.size(); ++i) {
      deltas.emplace_back(grads[i].begin(), grads[i].end());
      mirrors.emplace_back(view->params[i].begin(), view->params[i].end());
    }
    if (set_first_to.has_value()) view->params[view->num_params][0] = *set_first_to;
    return FakeMode::Exchange(step, grads, loss, timing);
  }
};

// worker/testdata/ema_buffer.pt assigns its buffer anew in each training forward
// (`self.ema = 0.9 * self.ema + 0.1 * x.mean()`, export_buffer_models.py): the loop follows
// the new tensor, so the exchange sees the step's change and the mode's value reaches the
// model (holding on to the first tensor, both were lost: deltas of 0, the 5 never seen).
TEST(TrainingLoopTest, ABufferAssignedAnewInForwardIsFollowed) {
  TrainerOptions o = Options(3);
  o.spec.mutable_model()->set_name("torchscript");
  o.spec.mutable_model()->set_path("worker/testdata/ema_buffer.pt");
  BuffersMode mode;
  mode.set_first_to = 5.0f;
  std::atomic<bool> stop{false};
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
  ASSERT_EQ(r.steps, 3);
  ASSERT_EQ(mode.deltas.size(), 3u);  // One buffer (ema, one element), three steps.
  // Step 0 from 0: ema = 0.1 * mean(x), the batch's mean pixel (MNIST's is about 0.13 in
  // [0, 1], or about 0 normalised: not exactly 0 either way).
  EXPECT_NE(mode.deltas[0][0], 0.0f);
  EXPECT_FLOAT_EQ(mode.mirrors[0][0], mode.deltas[0][0]);
  // Steps 1 and 2 from the mode's 5: ema = 4.5 + 0.1 * mean(x).
  for (int s = 1; s < 3; ++s) {
    EXPECT_NEAR(mode.deltas[s][0], -0.5f, 0.1f) << "step " << s;
    EXPECT_FLOAT_EQ(mode.mirrors[s][0], 5.0f + mode.deltas[s][0]) << "step " << s;
  }
}

// worker/testdata/inf_mask.pt registers a causal mask of -inf as a buffer. The forward leaves
// it unchanged, so its delta is exactly 0 in every element (-inf - -inf would be NaN, and the
// modes would spread it: allreduce's mean delta, the shard's buffer, gossip's mix), and the
// mirror keeps the -inf.
TEST(TrainingLoopTest, AnUnchangedInfiniteBufferElementHasAZeroDelta) {
  TrainerOptions o = Options(3);
  o.spec.mutable_model()->set_name("torchscript");
  o.spec.mutable_model()->set_path("worker/testdata/inf_mask.pt");
  BuffersMode mode;
  std::atomic<bool> stop{false};
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
  ASSERT_EQ(r.steps, 3);
  ASSERT_EQ(mode.deltas.size(), 3u);  // One buffer, three steps.
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> mask = {0, -inf, -inf, 0, 0, -inf, 0, 0, 0};
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(mode.deltas[s], std::vector<float>(9, 0.0f)) << "step " << s;
    EXPECT_EQ(mode.mirrors[s], mask) << "step " << s;
  }
}

// worker/testdata/nan_input: 8 MNIST-shaped samples, sample 5 with a NaN pixel. Without loss
// scaling (which would skip the step) a non-finite loss ends the run before anything of its
// step is exchanged, naming the sample: gossip and allreduce would otherwise spread the NaN
// into every replica without a word.
TEST(TrainingLoopTest, ANonFiniteLossEndsTheRunNamingTheSample) {
  TrainerOptions o = Options(4);
  o.spec.mutable_model()->set_name("torchscript");
  o.spec.mutable_model()->set_path("worker/testdata/ema_buffer.pt");
  o.spec.mutable_dataset()->set_name("tensors");
  o.spec.mutable_dataset()->set_path("worker/testdata/nan_input");
  o.spec.set_batch_size(4);
  FakeMode mode;
  std::atomic<bool> stop{false};
  absl::StatusOr<TrainResult> r = RunTrainingLoop(o, &mode, stop);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "trainer: the loss is nan at step "))
      << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "(micro-batch 0): sample 5 of "))
      << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), " has a non-finite x")) << r.status();
  // Each exchanged step had a finite loss; the bad one was not exchanged (nor backward begun).
  EXPECT_EQ(std::count_if(mode.calls.begin(), mode.calls.end(),
                          [](const std::string& c) { return absl::StartsWith(c, "exchange"); }),
            std::count_if(mode.calls.begin(), mode.calls.end(),
                          [](const std::string& c) { return absl::StartsWith(c, "backward"); }));
  EXPECT_LT(mode.losses.size(), 4u);
  for (double l : mode.losses) EXPECT_TRUE(std::isfinite(l));
}

// worker/testdata/train_only has train.pt and no test file: the run trains, is not
// evaluated (test figures -1, an event saying why) and still saves the model.
TEST(TrainingLoopTest, ADatasetWithoutTestFilesTrainsAndSavesWithoutEvaluating) {
  TrainerOptions o = Options(4);
  o.spec.mutable_model()->set_name("torchscript");
  o.spec.mutable_model()->set_path("worker/testdata/ema_buffer.pt");
  o.spec.mutable_dataset()->set_name("tensors");
  o.spec.mutable_dataset()->set_path("worker/testdata/train_only");
  o.spec.set_batch_size(4);
  const std::string out = absl::StrCat(testing::TempDir(), "/train_only_model.pt");
  std::remove(out.c_str());
  o.spec.set_output(out);
  std::FILE* log_file = std::tmpfile();
  Logger logger({}, log_file);
  o.logger = &logger;
  FakeMode mode;
  mode.evaluate = true;
  std::atomic<bool> stop{false};
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
  EXPECT_EQ(r.steps, 4);
  EXPECT_EQ(r.test_accuracy, -1);
  EXPECT_EQ(r.test_loss, -1);
  const std::vector<std::string> lines = Lines(log_file);
  EXPECT_EQ(std::count_if(lines.begin(), lines.end(),
                          [](const std::string& l) {
                            return absl::StrContains(l, "event=not_evaluated") &&
                                   absl::StrContains(l, "reason=no_test_files");
                          }),
            1)
      << absl::StrJoin(lines, "\n");
  EXPECT_TRUE(std::ifstream(out).good()) << out;
  std::fclose(log_file);
}

// Trains `model` (from worker/testdata) on worker/testdata/<dataset> for 2 steps of 4, saving
// it, and evaluates it; the log in *lines.
absl::StatusOr<TrainResult> RunOnTestData(const std::string& model, const std::string& dataset,
                                          const std::string& loss, const std::string& out,
                                          std::vector<std::string>* lines) {
  TrainerOptions o = Options(2);
  o.spec.mutable_model()->set_name("torchscript");
  o.spec.mutable_model()->set_path(absl::StrCat("worker/testdata/", model));
  o.spec.mutable_dataset()->set_name("tensors");
  o.spec.mutable_dataset()->set_path(absl::StrCat("worker/testdata/", dataset));
  o.spec.set_loss(loss);
  o.spec.set_batch_size(4);
  std::remove(out.c_str());
  o.spec.set_output(out);
  std::FILE* log_file = std::tmpfile();
  Logger logger({}, log_file);
  o.logger = &logger;
  FakeMode mode;
  mode.evaluate = true;
  std::atomic<bool> stop{false};
  absl::StatusOr<TrainResult> r = RunTrainingLoop(o, &mode, stop);
  *lines = Lines(log_file);
  std::fclose(log_file);
  return r;
}

int CountLines(const std::vector<std::string>& lines, const std::string& a, const std::string& b) {
  return static_cast<int>(std::count_if(lines.begin(), lines.end(), [&](const std::string& l) {
    return absl::StrContains(l, a) && absl::StrContains(l, b);
  }));
}

// fixed_batch.pt takes batches of exactly 4 (x.view(4, 784)); the test set has 10 samples, so
// batches of 10 fail. It is evaluated in batches of 4, the last one padded, with the figures
// of its any-batch twin free_batch.pt (same weights; FakeMode leaves them as they are) over
// all 10 samples.
TEST(TrainingLoopTest, AFixedBatchModelIsEvaluatedInItsTrainingBatchSize) {
  const std::string dir = testing::TempDir();
  std::vector<std::string> lines;
  ASSERT_OK_AND_ASSIGN(TrainResult free, RunOnTestData("free_batch.pt", "odd_test", "",
                                                       dir + "/free_batch_out.pt", &lines));
  EXPECT_EQ(CountLines(lines, "event=evaluated", "test_samples=10 eval_batch=10"), 1)
      << absl::StrJoin(lines, "\n");
  ASSERT_OK_AND_ASSIGN(TrainResult fixed, RunOnTestData("fixed_batch.pt", "odd_test", "",
                                                        dir + "/fixed_batch_out.pt", &lines));
  EXPECT_EQ(CountLines(lines, "event=evaluated", "test_samples=10 eval_batch=4"), 1)
      << absl::StrJoin(lines, "\n");
  EXPECT_GE(free.test_accuracy, 0);
  EXPECT_EQ(fixed.test_accuracy, free.test_accuracy);
  EXPECT_NEAR(fixed.test_loss, free.test_loss, 1e-6 * std::abs(free.test_loss));
  EXPECT_TRUE(std::ifstream(dir + "/fixed_batch_out.pt").good());

  // With its own loss (loss: module) the padding cannot be left out of the loss: the last 2
  // samples are, and the loss is the mean over the first 8.
  ASSERT_OK_AND_ASSIGN(TrainResult own, RunOnTestData("fixed_batch.pt", "odd_test", "module",
                                                      dir + "/fixed_batch_own.pt", &lines));
  EXPECT_EQ(CountLines(lines, "event=evaluated", "test_samples=8 eval_batch=4"), 1)
      << absl::StrJoin(lines, "\n");
  EXPECT_GT(own.test_loss, 0);
  EXPECT_NE(own.test_loss, fixed.test_loss);
}

// bad_test's test file labels sample 6 with 12 of 10 classes (past the first batch, which is
// checked before the run): the evaluation fails, saying so, and the trained model has been
// saved before it.
TEST(TrainingLoopTest, AFailedEvaluationKeepsTheSavedModel) {
  const std::string out = absl::StrCat(testing::TempDir(), "/bad_test_model.pt");
  std::vector<std::string> lines;
  absl::StatusOr<TrainResult> r = RunOnTestData("free_batch.pt", "bad_test", "", out, &lines);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  // The model takes the whole test set as one batch: the labels failed, not the batch size,
  // so there is no retry in the training batch size.
  EXPECT_TRUE(absl::StrContains(r.status().message(), "evaluating test samples 0..7 of "))
      << r.status();
  EXPECT_FALSE(absl::StrContains(r.status().message(), "training batch size")) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "target class index 12 is out of range"))
      << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(),
                                absl::StrCat("(the trained model is saved in ", out, ")")))
      << r.status();
  EXPECT_TRUE(std::ifstream(out).good()) << out;
  EXPECT_EQ(CountLines(lines, "event=model_saved", out), 1) << absl::StrJoin(lines, "\n");
}

// bad_first_test's test file labels sample 3 with 12 of 10 classes: the check before the run
// reads the test set's first batch too, so the job fails at once, naming the test files, not
// after its training.
TEST(TrainingLoopTest, ABadTestLabelInTheFirstBatchFailsBeforeTheRun) {
  const std::string out = absl::StrCat(testing::TempDir(), "/bad_first_test_model.pt");
  std::vector<std::string> lines;
  absl::StatusOr<TrainResult> r = RunOnTestData("free_batch.pt", "bad_first_test", "", out, &lines);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "worker/testdata/bad_first_test/test*.pt"))
      << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "target class index 12 is out of range"))
      << r.status();
  EXPECT_EQ(CountLines(lines, "event=progress", ""), 0) << absl::StrJoin(lines, "\n");
  EXPECT_FALSE(std::ifstream(out).good()) << out;
}

// worker/testdata/late_label: sample 6 has label 12 of 10 classes. The check before the run
// reads the first batch (samples 0-3) only; the step that meets sample 6 fails saying which
// step and samples.
TEST(TrainingLoopTest, ABadSampleAfterTheFirstBatchIsPlaced) {
  TrainerOptions o = Options(4);
  o.spec.mutable_model()->set_name("torchscript");
  o.spec.mutable_model()->set_path("worker/testdata/ema_buffer.pt");
  o.spec.mutable_dataset()->set_name("tensors");
  o.spec.mutable_dataset()->set_path("worker/testdata/late_label");
  o.spec.set_batch_size(4);
  FakeMode mode;
  std::atomic<bool> stop{false};
  absl::StatusOr<TrainResult> r = RunTrainingLoop(o, &mode, stop);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_TRUE(absl::StartsWith(r.status().message(), "trainer: step ")) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "(micro-batch 0, samples ")) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "6")) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "worker/testdata/late_label")) << r.status();
}

// A stop that cuts an exchange short (a ps client whose retries against a dead shard end with
// CANCELLED once the stop is requested) stops the run there, as stopped early: the step is not
// counted, and the mode still finishes. Any other error, or CANCELLED without a stop, fails.
class CancelledExchangeMode : public FakeMode {
 public:
  std::atomic<bool>* stop = nullptr;  // Set at step 2's exchange when non-null.
  absl::StatusOr<StepOutcome> Exchange(int64_t step,
                                       absl::Span<const absl::Span<const float>> grads, double loss,
                                       const StepTiming& timing) override {
    if (step < 2) return FakeMode::Exchange(step, grads, loss, timing);
    calls.push_back(absl::StrCat("cancelled ", step));
    if (stop != nullptr) stop->store(true);
    return absl::CancelledError("stop requested: not retrying after 3 attempt(s)");
  }
};

TEST(TrainingLoopTest, AnExchangeCutShortByAStopEndsTheRunAsStopped) {
  TrainerOptions o = Options(5);
  std::atomic<bool> stop{false};
  CancelledExchangeMode mode;
  mode.stop = &stop;
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
  EXPECT_TRUE(r.stopped_early);
  EXPECT_EQ(r.steps, 2);
  EXPECT_TRUE(mode.finish_saw_stopped);
  EXPECT_EQ(mode.calls.back(), "finish 2");

  std::atomic<bool> never{false};
  CancelledExchangeMode without_stop;
  absl::StatusOr<TrainResult> failed = RunTrainingLoop(o, &without_stop, never);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kCancelled) << failed.status();
}

// overlap: 2, as the loop sees it: Exchange returns owing the model zeros, and hands each
// entry over only when AwaitParameters names it. A built-in model's forward asks layer by
// layer, then the loop asks for everything before backward; a model that cannot gate (a
// TorchScript module with buffers) is waited for whole before its forward. Either way the
// forward computes on what was handed over (all zeros: an MLP's loss is then exactly ln 10),
// and a failed wait ends the run with its status.
class DeferringMode : public FakeMode {
 public:
  std::vector<bool> owed;  // Per entry: Exchange's zeros not yet handed over.
  bool fail = false;       // Waits fail once something is owed.
  absl::Status AwaitParameters(int begin, int end) override {
    calls.push_back(absl::StrCat("await ", begin, "-", end));
    for (int i = begin; i < end && i < static_cast<int>(owed.size()); ++i) {
      if (fail && owed[i]) return absl::UnavailableError("shard 1 is down");
      if (owed[i]) std::fill(view->params[i].begin(), view->params[i].end(), 0.0f);
      owed[i] = false;
    }
    return absl::OkStatus();
  }
  absl::StatusOr<StepOutcome> Exchange(int64_t step,
                                       absl::Span<const absl::Span<const float>> grads, double loss,
                                       const StepTiming& timing) override {
    owed.assign(view->params.size(), true);
    return FakeMode::Exchange(step, grads, loss, timing);
  }
};

TEST(TrainingLoopTest, TheForwardAwaitsEachLayersValuesWhereTheModelCan) {
  {
    SCOPED_TRACE("mlp: layer by layer");
    TrainerOptions o = Options(2);
    o.spec.set_overlap(2);
    DeferringMode mode;
    std::atomic<bool> stop{false};
    ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
    const auto at = std::find(mode.calls.begin(), mode.calls.end(), "forward 1");
    ASSERT_LE(at + 7, mode.calls.end()) << absl::StrJoin(mode.calls, ", ");
    EXPECT_EQ(std::vector<std::string>(at, at + 7),
              (std::vector<std::string>{"forward 1", "await 0-2", "await 2-4", "await 4-6",
                                        "await 0-6", "backward 1", "exchange 1"}))
        << absl::StrJoin(mode.calls, ", ");
    ASSERT_EQ(mode.losses.size(), 2u);
    EXPECT_NEAR(mode.losses[1], std::log(10.0), 1e-6);  // The zeros handed over were used.
    EXPECT_GT(mode.losses[0], 0);
    EXPECT_NE(mode.losses[0], mode.losses[1]);
  }
  {
    SCOPED_TRACE("torchscript with buffers: the whole model first");
    TrainerOptions o = Options(2);
    o.spec.mutable_model()->set_name("torchscript");
    o.spec.mutable_model()->set_path("worker/testdata/bn_mnist.pt");
    o.spec.set_overlap(2);
    DeferringMode mode;
    std::atomic<bool> stop{false};
    ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
    const auto at = std::find(mode.calls.begin(), mode.calls.end(), "forward 1");
    ASSERT_LE(at + 4, mode.calls.end()) << absl::StrJoin(mode.calls, ", ");
    // 6 parameters and 3 buffers, before the forward; again (nothing owed) before backward.
    EXPECT_EQ(std::vector<std::string>(at, at + 4),
              (std::vector<std::string>{"forward 1", "await 0-9", "await 0-9", "backward 1"}))
        << absl::StrJoin(mode.calls, ", ");
  }
  {
    SCOPED_TRACE("a failed wait");
    TrainerOptions o = Options(3);
    o.spec.set_overlap(2);
    DeferringMode mode;
    mode.fail = true;
    std::atomic<bool> stop{false};
    absl::StatusOr<TrainResult> r = RunTrainingLoop(o, &mode, stop);
    EXPECT_STATUS_MSG(r.status(), absl::StatusCode::kUnavailable, "shard 1 is down");
    EXPECT_EQ(mode.losses.size(), 1u);  // Step 1 never reached its exchange.
  }
}

// The same before the first step (Start cut short) and at the end (Finish cut short: rank 0
// stopped while waiting for the others): stopped, not failed, so the rank can move.
class CancelledStartOrFinishMode : public FakeMode {
 public:
  std::atomic<bool>* stop = nullptr;
  bool in_start = true;
  absl::StatusOr<int64_t> Start(ModelView* model, const LoopInfo& info) override {
    absl::StatusOr<int64_t> first = FakeMode::Start(model, info);
    if (!in_start) return first;
    stop->store(true);
    return absl::CancelledError("stop requested: not retrying after 1 attempt(s)");
  }
  absl::StatusOr<bool> Finish(int64_t step, TrainResult* result) override {
    calls.push_back(absl::StrCat("finish ", step));
    stop->store(true);
    return absl::CancelledError("trainer: stop requested while 1 of 2 workers had finished");
  }
};

TEST(TrainingLoopTest, AStartOrFinishCutShortByAStopEndsTheRunAsStopped) {
  for (const bool in_start : {true, false}) {
    SCOPED_TRACE(in_start ? "start" : "finish");
    TrainerOptions o = Options(3);
    std::atomic<bool> stop{false};
    CancelledStartOrFinishMode mode;
    mode.stop = &stop;
    mode.in_start = in_start;
    ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
    EXPECT_TRUE(r.stopped_early);
    EXPECT_EQ(r.steps, in_start ? 0 : 3);
    EXPECT_EQ(r.test_accuracy, -1);
  }
}

// worker/testdata/resizing_buffer.pt shrinks its buffer `hist` from 4 to 2 elements in
// place in its third training-mode forward (export_resizing_buffer.py), after the check
// before the run. Read with the shape the exchange has, it would be read past its end (and
// the next step's copy into it threw out of the loop): the run ends with an error naming it.
TEST(TrainingLoopTest, AModelThatResizesABufferIsRefusedByName) {
  TrainerOptions o = Options(6);
  o.spec.mutable_model()->set_name("torchscript");
  o.spec.mutable_model()->set_path("worker/testdata/resizing_buffer.pt");
  FakeMode mode;
  std::atomic<bool> stop{false};
  absl::StatusOr<TrainResult> r = RunTrainingLoop(o, &mode, stop);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  // The check's forwards are the first two (a training batch, a test batch): step 0's
  // forward resizes it.
  EXPECT_NE(r.status().message().find("resized buffer hist from 4 to 2 elements (step 0)"),
            std::string::npos)
      << r.status();
  // Step 0 is never handed to the mode.
  EXPECT_EQ(mode.calls, (std::vector<std::string>{"start total=6", "forward 0"}));
}

TEST(TrainingLoopTest, AModelWhoseOutputDoesNotFitTheLossFailsBeforeTheModeStarts) {
  TrainerOptions o = Options(2);
  o.spec.set_loss("mse");  // Logits [N, 10] against int64 labels [N].
  FakeMode mode;
  std::atomic<bool> stop{false};
  absl::StatusOr<TrainResult> r = RunTrainingLoop(o, &mode, stop);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("mse"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("int64"), std::string::npos) << r.status();
  EXPECT_TRUE(mode.calls.empty());  // Nothing started.
}

// A mode that applies plain SGD to the view (what every mode's update amounts to) and keeps
// the final parameters: the same run on two devices must end in the same model.
class SgdMode : public FakeMode {
 public:
  bool keep_first = false;                       // Keep the parameters at Start too.
  std::vector<std::vector<float>> first_params;  // (then) the parameters at Start.
  std::vector<std::vector<float>> final_params;
  absl::StatusOr<int64_t> Start(ModelView* model, const LoopInfo& info) override {
    for (int i = 0; keep_first && i < model->num_params; ++i) {
      first_params.emplace_back(model->params[i].begin(), model->params[i].end());
    }
    return FakeMode::Start(model, info);
  }
  absl::StatusOr<StepOutcome> Exchange(int64_t step,
                                       absl::Span<const absl::Span<const float>> grads, double loss,
                                       const StepTiming& timing) override {
    for (int i = 0; i < view->num_params; ++i) {
      for (size_t j = 0; j < grads[i].size(); ++j) view->params[i][j] -= 0.1f * grads[i][j];
    }
    return FakeMode::Exchange(step, grads, loss, timing);
  }
  absl::StatusOr<bool> Finish(int64_t step, TrainResult* result) override {
    for (int i = 0; i < view->num_params; ++i) {
      final_params.emplace_back(view->params[i].begin(), view->params[i].end());
    }
    return FakeMode::Finish(step, result);
  }
};

// worker/testdata/sparse_embedding.pt's nn.Embedding(sparse=True) gives its weight a sparse
// gradient; the loop exchanges the dense gradient it stands for, with and without the
// per-gradient hook and with accumulation (where LibTorch sums sparse gradients): the runs
// end in the model of dense_embedding.pt, the same module with sparse=False.
TEST(TrainingLoopTest, ASparseGradientIsExchangedAsTheDenseOne) {
  for (const bool hook : {false, true}) {
    for (const int accum : {1, 2}) {
      SCOPED_TRACE(absl::StrCat("hook=", hook, " accumulation=", accum));
      std::vector<std::vector<float>> finals[2];
      std::vector<float> first_embedding;
      for (const bool sparse : {false, true}) {
        TrainerOptions o = Options(3);
        o.spec.set_accumulation_steps(accum);
        o.spec.mutable_model()->set_name("torchscript");
        o.spec.mutable_model()->set_path(sparse ? "worker/testdata/sparse_embedding.pt"
                                                : "worker/testdata/dense_embedding.pt");
        SgdMode mode;
        mode.hook = hook;
        mode.keep_first = true;
        std::atomic<bool> stop{false};
        ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
        ASSERT_EQ(r.steps, 3);
        EXPECT_EQ(mode.gradients_seen, hook ? 3 * 3 : 0);  // embed.weight, fc.weight, fc.bias.
        ASSERT_FALSE(mode.first_params.empty());
        first_embedding = mode.first_params[0];
        finals[sparse] = mode.final_params;
      }
      ASSERT_EQ(finals[0].size(), 3u);
      ASSERT_EQ(finals[1].size(), 3u);
      // The embedding moved, and both runs moved it alike (the sparse gradient's duplicates
      // are summed in another order than the dense backward's).
      EXPECT_NE(finals[0][0], first_embedding);
      for (size_t t = 0; t < 3; ++t) {
        ASSERT_EQ(finals[0][t].size(), finals[1][t].size());
        for (size_t j = 0; j < finals[0][t].size(); ++j) {
          EXPECT_NEAR(finals[1][t][j], finals[0][t][j], 1e-5) << "tensor " << t << " [" << j << "]";
        }
      }
    }
  }
}

TEST_P(DeviceTest, GradientsReachTheHookAndTheExchange) {
  TrainerOptions o = Options(3);
  if (!Usable(o)) return;
  FakeMode mode;
  mode.hook = true;
  std::atomic<bool> stop{false};
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
  EXPECT_EQ(r.steps, 3);
  EXPECT_EQ(mode.gradients_seen, 3 * 6);  // mlp: 6 parameters.
  // mlp 784-256-256-10: 200704 + 256 + 65536 + 256 + 2560 + 10 elements.
  EXPECT_EQ(mode.grad_elems_in_exchange, 3 * 269322);
}

TEST_P(DeviceTest, UpdatesThroughTheViewGiveTheCpusModel) {
  TrainerOptions o = Options(5);
  SgdMode cpu;
  std::atomic<bool> stop{false};
  o.device = ComputeDevice::kCpu;
  ASSERT_OK(RunTrainingLoop(o, &cpu, stop).status());
  if (!Usable(o)) return;
  SgdMode here;
  ASSERT_OK(RunTrainingLoop(o, &here, stop).status());
  ASSERT_EQ(here.final_params.size(), cpu.final_params.size());
  for (size_t i = 0; i < cpu.final_params.size(); ++i) {
    ASSERT_EQ(here.final_params[i].size(), cpu.final_params[i].size());
    for (size_t j = 0; j < cpu.final_params[i].size(); ++j) {
      ASSERT_NEAR(here.final_params[i][j], cpu.final_params[i][j], 1e-5) << i << " " << j;
    }
  }
  for (size_t k = 0; k < cpu.losses.size(); ++k) EXPECT_NEAR(here.losses[k], cpu.losses[k], 1e-5);
}

// Gradient accumulation and clipping against a reference written here with plain LibTorch:
// the same seeded model, batches of 32 in the loader's order, SGD lr 0.1, the mean loss's
// gradient, clipping by hand (value clamp, then scale by c / (norm + 1e-6)). The loop runs
// the same 5 steps as 2 micro-batches of 16 (async: the loop clips this worker's gradient).
struct RefOptions {
  double clip_norm = 0;
  double clip_value = 0;
  int64_t skip_step = -1;  // Loss scaling: this step is skipped (its batch consumed).
};

std::vector<std::vector<float>> ReferenceSgd(const TrainerOptions& o, int64_t batch, int64_t steps,
                                             const RefOptions& ref, std::vector<double>* losses) {
  auto model = CreateModel(o.spec.model(), o.spec.seed());
  EXPECT_OK(model.status());
  auto data = LoadJobData(o.spec, o.data_dir);
  EXPECT_OK(data.status());
  BatchLoader::Options lo;
  lo.batch_size = batch;
  lo.max_steps = steps;
  lo.seed = o.spec.seed();
  auto loader = BatchLoader::Create(data->train.get(), lo);
  EXPECT_OK(loader.status());
  std::vector<torch::Tensor> params = (*model)->Parameters();
  for (int64_t s = 0; s < steps; ++s) {
    std::optional<Batch> b = (*loader)->Next();
    EXPECT_TRUE(b.has_value());
    const FieldMeta& xm = data->train->x();
    const FieldMeta& ym = data->train->y();
    std::vector<int64_t> xs = {b->size}, ys = {b->size};
    xs.insert(xs.end(), xm.dims.begin(), xm.dims.end());
    ys.insert(ys.end(), ym.dims.begin(), ym.dims.end());
    torch::Tensor x = torch::from_blob(b->x.data(), xs, ToScalarType(xm.type));
    torch::Tensor y = torch::from_blob(b->y.data(), ys, ToScalarType(ym.type));
    for (torch::Tensor& p : params) p.mutable_grad() = torch::Tensor();
    auto loss = ComputeLoss(model->get(), LossKind::kCrossEntropy, x, y);
    EXPECT_OK(loss.status());
    losses->push_back(loss->item<double>());
    if (s == ref.skip_step) continue;
    loss->backward();
    torch::NoGradGuard no_grad;
    if (ref.clip_value > 0) {
      for (torch::Tensor& p : params) p.grad().clamp_(-ref.clip_value, ref.clip_value);
    }
    if (ref.clip_norm > 0) {
      double sq = 0;
      for (torch::Tensor& p : params) sq += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
      const double coef = ref.clip_norm / (std::sqrt(sq) + 1e-6);
      if (coef < 1) {
        for (torch::Tensor& p : params) p.grad().mul_(static_cast<float>(coef));
      }
    }
    for (torch::Tensor& p : params) p.sub_(0.1 * p.grad());
  }
  std::vector<std::vector<float>> out;
  for (torch::Tensor& p : params) {
    torch::Tensor c = p.detach().contiguous();
    out.emplace_back(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return out;
}

void ExpectSameModel(const std::vector<std::vector<float>>& got,
                     const std::vector<std::vector<float>>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size());
    for (size_t j = 0; j < want[i].size(); ++j) {
      ASSERT_NEAR(got[i][j], want[i][j], tol) << "parameter " << i << " element " << j;
    }
  }
}

TEST(TrainingFeaturesTest, AccumulatedMicroBatchesEqualOneBigBatch) {
  for (const bool hook : {false, true}) {
    SCOPED_TRACE(hook ? "with the gradient hook" : "without the hook");
    TrainerOptions o = Options(5);
    o.spec.set_accumulation_steps(2);  // 2 x 16 = 32 per step.
    SgdMode mode;
    mode.hook = hook;
    std::atomic<bool> stop{false};
    ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
    EXPECT_EQ(r.steps, 5);
    EXPECT_EQ(r.samples, 5 * 32);
    // One exchange per step; the hook only during the last micro-batch's backward.
    EXPECT_EQ(mode.losses.size(), 5u);
    EXPECT_EQ(mode.gradients_seen, hook ? 5 * 6 : 0);
    std::vector<double> ref_losses;
    const auto want = ReferenceSgd(o, 32, 5, RefOptions{}, &ref_losses);
    ExpectSameModel(mode.final_params, want, 1e-5);
    // The step's loss is the mean of its micro-batches' losses: the big batch's loss.
    for (size_t k = 0; k < ref_losses.size(); ++k) {
      EXPECT_NEAR(mode.losses[k], ref_losses[k], 1e-5) << k;
    }
  }
}

TEST(TrainingFeaturesTest, ClippingMatchesTorchSemantics) {
  std::FILE* out = std::tmpfile();
  Logger logger({}, out);
  TrainerOptions o = Options(5);
  o.logger = &logger;
  o.spec.set_accumulation_steps(2);
  o.spec.set_clip_grad_value(0.05);
  o.spec.set_clip_grad_norm(0.5);  // MNIST MLP gradients start well above it.
  std::vector<TrainProgress> reports;
  o.on_progress = [&reports](const TrainProgress& p) { reports.push_back(p); };
  SgdMode mode;
  std::atomic<bool> stop{false};
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
  std::vector<double> ref_losses;
  const auto want = ReferenceSgd(o, 32, 5, RefOptions{0.5, 0.05}, &ref_losses);
  ExpectSameModel(mode.final_params, want, 1e-5);
  EXPECT_EQ(r.clip_steps, 5);
  EXPECT_EQ(r.clipped_steps, 5);
  // Progress lines carry the pre-clip norm and the clipped fraction.
  int with_norm = 0;
  for (const std::string& line : Lines(out)) {
    if (line.find("event=progress") == std::string::npos) continue;
    EXPECT_NE(line.find(" clipped=1.000"), std::string::npos) << line;
    with_norm += line.find(" grad_norm=") != std::string::npos ? 1 : 0;
  }
  EXPECT_EQ(with_norm, 3);  // log_every 2: steps 2, 4 and the last.
  // And the reports (heartbeats, metrics) carry them.
  ASSERT_FALSE(reports.empty());
  EXPECT_GT(reports.back().grad_norm, 0.5);
  EXPECT_EQ(reports.back().clipped_fraction, 1.0);
  // Without clipping the same run ends elsewhere (the bounds bite).
  TrainerOptions plain = Options(5);
  plain.spec.set_accumulation_steps(2);
  SgdMode free;
  ASSERT_OK(RunTrainingLoop(plain, &free, stop).status());
  EXPECT_GT(std::fabs(free.final_params[4][0] - mode.final_params[4][0]), 1e-4);
}

// Dynamic loss scaling (GradScaler semantics), scale 2^16, growth every 4 good steps. At step
// 5 the mode poisons a weight before the forward (NaN), so that step's gradient is not finite:
// the loop must skip it (no Exchange, the batch consumed), halve the scale and log it; the
// mode then restores the weight. Every other step is exactly the unscaled SGD step (scaling
// by a power of two is exact in float32), so the model equals the reference that skips step 5.
class PoisonMode : public SgdMode {
 public:
  int64_t poison_step = 5;
  float saved = 0;
  std::vector<int64_t> skipped;
  absl::Status BeforeForward(int64_t step) override {
    if (step == poison_step) {
      saved = view->params[0][0];
      view->params[0][0] = std::numeric_limits<float>::quiet_NaN();
    }
    return SgdMode::BeforeForward(step);
  }
  absl::StatusOr<StepOutcome> SkipStep(int64_t step, double loss) override {
    skipped.push_back(step);
    if (step == poison_step) view->params[0][0] = saved;
    return SgdMode::SkipStep(step, loss);
  }
};

TEST(TrainingFeaturesTest, LossScalingSkipsANonFiniteStepAndOtherwiseEqualsUnscaledSgd) {
  std::FILE* out = std::tmpfile();
  Logger logger({}, out);
  TrainerOptions o = Options(8);
  o.logger = &logger;
  LossScaleSpec* ls = o.spec.mutable_loss_scale();
  ls->set_mode("dynamic");
  ls->set_init_scale(65536);
  ls->set_growth_factor(2);
  ls->set_backoff_factor(0.5);
  ls->set_growth_interval(4);
  std::vector<TrainProgress> reports;
  o.on_progress = [&reports](const TrainProgress& p) { reports.push_back(p); };
  PoisonMode mode;
  std::atomic<bool> stop{false};
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
  EXPECT_EQ(r.steps, 8);
  EXPECT_EQ(r.skipped_steps, 1);
  EXPECT_EQ(mode.skipped, (std::vector<int64_t>{5}));
  EXPECT_EQ(mode.losses.size(), 7u);  // Exchange only for finite steps.
  // Steps 0-3 good: 2^16 -> 2^17; step 4 good; step 5 skipped: 2^16 (the count restarts);
  // steps 6, 7 good: still 2^16.
  EXPECT_EQ(r.loss_scale, 65536.0);
  std::vector<std::string> skips;
  for (const std::string& line : Lines(out)) {
    if (line.find("event=step_skipped") != std::string::npos) skips.push_back(line);
  }
  ASSERT_EQ(skips.size(), 1u);
  EXPECT_NE(skips[0].find(" step=5 "), std::string::npos) << skips[0];
  EXPECT_NE(skips[0].find(" loss_scale=131072 next_scale=65536"), std::string::npos) << skips[0];
  std::vector<double> ref_losses;
  RefOptions ref;
  ref.skip_step = 5;
  const auto want = ReferenceSgd(o, 16, 8, ref, &ref_losses);
  ExpectSameModel(mode.final_params, want, 1e-6);
  ASSERT_FALSE(reports.empty());
  EXPECT_EQ(reports.back().skipped_steps, 1);
  EXPECT_EQ(reports.back().loss_scale, 65536.0);
}

// A skipped step must not keep what its forward did to the buffers: a NaN conv weight makes
// BatchNorm's running statistics NaN, and the loop puts them back (and num_batches_tracked
// does not count the skipped step), so the next steps and the final model stay finite.
class BnPoisonMode : public PoisonMode {
 public:
  std::vector<std::vector<float>> final_entries;
  absl::StatusOr<bool> Finish(int64_t step, TrainResult* result) override {
    for (const absl::Span<float>& e : view->params) final_entries.emplace_back(e.begin(), e.end());
    return PoisonMode::Finish(step, result);
  }
};

TEST(TrainingFeaturesTest, ASkippedStepLeavesTheBuffersAsTheyWere) {
  TrainerOptions o = Options(4);
  o.spec.mutable_model()->set_name("torchscript");
  o.spec.mutable_model()->set_path("worker/testdata/bn_mnist.pt");
  LossScaleSpec* ls = o.spec.mutable_loss_scale();
  ls->set_mode("dynamic");
  ls->set_init_scale(1024);
  ls->set_growth_factor(2);
  ls->set_backoff_factor(0.5);
  ls->set_growth_interval(1000);
  BnPoisonMode mode;
  mode.poison_step = 1;
  std::atomic<bool> stop{false};
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &mode, stop));
  EXPECT_EQ(r.skipped_steps, 1);
  EXPECT_EQ(mode.skipped, (std::vector<int64_t>{1}));
  ASSERT_EQ(mode.final_entries.size(), 9u);  // 6 parameters, 3 buffers.
  for (const auto& e : mode.final_entries) {
    for (float v : e) ASSERT_TRUE(std::isfinite(v));
  }
  EXPECT_EQ(mode.final_entries[8], (std::vector<float>{3.0f}));  // num_batches_tracked: 4 - 1.
  EXPECT_TRUE(std::isfinite(r.final_loss));  // The skipped step's NaN loss is not in it.
}

// fp16 autocast exists only on CUDA in LibTorch: a CPU worker says so before training.
TEST(TrainingFeaturesTest, Fp16OnTheCpuFailsBeforeTraining) {
  TrainerOptions o = Options(2);
  o.spec.set_precision("fp16");
  o.spec.mutable_loss_scale()->set_mode("dynamic");
  o.spec.mutable_loss_scale()->set_init_scale(65536);
  SgdMode mode;
  std::atomic<bool> stop{false};
  absl::StatusOr<TrainResult> r = RunTrainingLoop(o, &mode, stop);
  EXPECT_STATUS_MSG(r.status(), absl::StatusCode::kFailedPrecondition,
                    "precision fp16 needs a CUDA device");
  EXPECT_TRUE(mode.losses.empty());
}

TEST(TrainingFeaturesTest, Bf16AutocastTrainsAndKeepsFloat32Parameters) {
  TrainerOptions o = Options(20);
  o.spec.set_precision("bf16");
  SgdMode bf16;
  std::atomic<bool> stop{false};
  ASSERT_OK_AND_ASSIGN(TrainResult r, RunTrainingLoop(o, &bf16, stop));
  TrainerOptions f = Options(20);
  SgdMode fp32;
  ASSERT_OK(RunTrainingLoop(f, &fp32, stop).status());
  // Same data, same start: the losses agree to bf16's precision (8 bits of mantissa), yet
  // not exactly (autocast did run the matmuls in bf16), and both learn.
  ASSERT_EQ(bf16.losses.size(), 20u);
  double max_diff = 0;
  for (size_t k = 0; k < 20; ++k) {
    max_diff = std::max(max_diff, std::fabs(bf16.losses[k] - fp32.losses[k]));
    EXPECT_NEAR(bf16.losses[k], fp32.losses[k], 0.05 * fp32.losses[k] + 0.02) << k;
  }
  EXPECT_GT(max_diff, 0);
  EXPECT_LT(bf16.losses.back(), bf16.losses.front());
  EXPECT_EQ(bf16.final_params[0].size(), 784u * 256u);  // Float32 master weights in the view.
}

// The device codec against the host's: the same gradients (bit for bit, uploaded to the
// device) must give the same payloads, byte for byte, step after step (so the error-feedback
// state on the device follows the host's), for every codec the device encodes, with plain
// error feedback, DGC momentum (masked or not) and none.
TEST_P(DeviceTest, DeviceEncodingGivesTheHostCodecsPayloadsStepAfterStep) {
  TrainerOptions o = Options(1);
  if (!Usable(o)) return;
  const torch::Device device(GetParam() == ComputeDevice::kCuda ? torch::kCUDA : torch::kCPU);
  const std::vector<std::string> names = {"a", "b"};
  const std::vector<int64_t> sizes = {5000, 3001};
  const std::vector<std::pair<int, std::pair<int64_t, int64_t>>> chunks = {
      {0, {0, 2500}}, {0, {2500, 2500}}, {1, {0, 3001}}};
  struct Feedback {
    const char* name;
    std::optional<ErrorFeedbackOptions> options;
  };
  ErrorFeedbackOptions plain, masked, unmasked;
  masked.momentum = 0.9f;
  unmasked.momentum = 0.5f;
  unmasked.momentum_masking = false;
  const std::vector<Feedback> feedbacks = {
      {"none", std::nullopt}, {"plain", plain}, {"dgc", masked}, {"dgc_unmasked", unmasked}};
  const CompressorRegistry registry = CompressorRegistry::WithBuiltins();
  // One pass for all chunks, and (pass_elements 3000) a pass per chunk.
  for (const auto& [spec, pass] :
       std::vector<std::pair<const char*, int64_t>>{{"topk:0.01", 0},
                                                    {"topk:0.05+fp16", 0},
                                                    {"topk:0.2+bf16", 0},
                                                    {"topk:1+fp16", 0},
                                                    {"fp16", 0},
                                                    {"bf16", 0},
                                                    {"topk:0.05+fp16", 3000},
                                                    {"fp16", 3000}}) {
    std::unique_ptr<Compressor> codec = registry.Create(spec).value();
    const DeviceCodec dc = DeviceCodecOf(*codec).value();
    for (const Feedback& fb : feedbacks) {
      SCOPED_TRACE(absl::StrCat(spec, " pass ", pass, " feedback ", fb.name));
      torch::manual_seed(11);
      std::vector<torch::Tensor> params;
      for (int64_t n : sizes) {
        params.push_back(torch::zeros({n}, torch::dtype(torch::kFloat).device(device)));
      }
      TorchDeviceGradients dg(&params, &names,
                              pass > 0 ? pass : TorchDeviceGradients::kPassElements);
      std::vector<ErrorFeedback> host;
      for (const auto& c : chunks) {
        host.emplace_back(c.second.second, fb.options.value_or(ErrorFeedbackOptions()));
      }
      for (int step = 0; step < 4; ++step) {
        std::vector<torch::Tensor> cpu;
        for (size_t i = 0; i < params.size(); ++i) {
          // Heavy-tailed, with values beyond fp16's range, 60 equal magnitudes among the
          // largest (ties at top-k's k-th magnitude, which go to the lower indices), and at
          // step 2 a gradient of b with fewer non-zeros than top-k sends (ties at zero).
          torch::Tensor g = torch::randn({sizes[i]}) * torch::exp(2 * torch::randn({sizes[i]}));
          g[7] = 1e6f * (step % 2 == 0 ? 1 : -1);
          g.narrow(0, 100, 60).copy_(1e3f * torch::randn({60}).sign());
          if (i == 1 && step == 2) g.narrow(0, 100, sizes[i] - 100).zero_();
          cpu.push_back(g.contiguous());
          params[i].mutable_grad() = g.to(device);
        }
        std::vector<DeviceChunk> batch;
        for (size_t j = 0; j < chunks.size(); ++j) {
          batch.push_back({chunks[j].first, chunks[j].second.first, chunks[j].second.second,
                           static_cast<int64_t>(j)});
        }
        std::vector<std::string> on_device;
        ASSERT_OK(dg.Encode(batch, dc, fb.options ? &*fb.options : nullptr, &on_device));
        ASSERT_EQ(on_device.size(), chunks.size());
        for (size_t j = 0; j < chunks.size(); ++j) {
          const int p = chunks[j].first;
          const auto [offset, numel] = chunks[j].second;
          std::string on_host;
          const absl::Span<const float> g(cpu[p].data_ptr<float>() + offset, numel);
          ASSERT_OK(fb.options ? host[j].Compress(*codec, g, 0, &on_host)
                               : codec->Encode(g, 0, &on_host));
          ASSERT_EQ(on_device[j].size(), on_host.size()) << "step " << step << " chunk " << j;
          ASSERT_TRUE(on_device[j] == on_host) << "step " << step << " chunk " << j;
        }
      }
      EXPECT_GT(dg.bytes_to_host(), 0);
    }
  }
}

// A gradient that is not finite: Encode names the first bad element, refuses the whole batch
// and keeps its error-feedback state (the next finite step encodes as if the bad one never
// happened); bad chunks and slots are refused the same way.
TEST_P(DeviceTest, ANonFiniteGradientIsNamedAndChangesNoState) {
  TrainerOptions o = Options(1);
  if (!Usable(o)) return;
  const torch::Device device(GetParam() == ComputeDevice::kCuda ? torch::kCUDA : torch::kCPU);
  const std::vector<std::string> names = {"fc.weight", "fc.bias"};
  std::vector<torch::Tensor> params = {torch::zeros({100}, torch::device(device)),
                                       torch::zeros({10}, torch::device(device))};
  // A pass per chunk: a bad second pass must not leave the first one's state committed.
  TorchDeviceGradients dg(&params, &names, /*pass_elements=*/100);
  std::unique_ptr<Compressor> codec = CompressorRegistry::WithBuiltins().Create("topk:0.1").value();
  const DeviceCodec dc = DeviceCodecOf(*codec).value();
  const ErrorFeedbackOptions ef;
  ErrorFeedback host0(100, ef), host1(10, ef);
  torch::manual_seed(5);
  const torch::Tensor g0 = torch::randn({100}), g1 = torch::randn({100});
  const torch::Tensor b0 = torch::randn({10}), b1 = torch::randn({10});
  const std::vector<DeviceChunk> both = {{0, 0, 100, 0}, {1, 0, 10, 1}};
  auto check = [&](const torch::Tensor& w, const torch::Tensor& b) {
    params[0].mutable_grad() = w.to(device);
    params[1].mutable_grad() = b.to(device);
    std::vector<std::string> on_device;
    ASSERT_OK(dg.Encode(both, dc, &ef, &on_device));
    std::string on_host;
    ASSERT_OK(
        host0.Compress(*codec, absl::Span<const float>(w.data_ptr<float>(), 100), 0, &on_host));
    EXPECT_TRUE(on_device[0] == on_host);
    ASSERT_OK(
        host1.Compress(*codec, absl::Span<const float>(b.data_ptr<float>(), 10), 0, &on_host));
    EXPECT_TRUE(on_device[1] == on_host);
  };
  check(g0, b0);

  torch::Tensor bad = b1.clone();
  bad[6] = std::numeric_limits<float>::infinity();
  torch::Tensor nan = g1.clone();
  nan[42] = std::numeric_limits<float>::quiet_NaN();
  params[0].mutable_grad() = nan.to(device);
  params[1].mutable_grad() = bad.to(device);
  std::vector<std::string> out;
  absl::Status st = dg.Encode(both, dc, &ef, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "gradient of fc.weight element 42 is not finite");
  st = dg.Encode({{1, 0, 10, 1}}, dc, &ef, &out);
  EXPECT_EQ(st.message(), "gradient of fc.bias element 6 is not finite");
  params[0].mutable_grad() = g1.to(device);  // Finite now: the first pass succeeds.
  st = dg.Encode(both, dc, &ef, &out);
  EXPECT_EQ(st.message(), "gradient of fc.bias element 6 is not finite");
  const auto code = [&](std::vector<DeviceChunk> chunks) {
    return dg.Encode(chunks, dc, &ef, &out).code();
  };
  EXPECT_EQ(code({{0, 90, 20, 0}}), absl::StatusCode::kInvalidArgument);  // Past the end.
  EXPECT_EQ(code({{0, 0, 50, 0}}), absl::StatusCode::kInvalidArgument);   // Slot 0 holds 100.
  EXPECT_EQ(code({{2, 0, 1, 9}}), absl::StatusCode::kInvalidArgument);    // No parameter 2.
  EXPECT_EQ(code({{0, 0, 50, 3}, {0, 50, 50, 3}}), absl::StatusCode::kInvalidArgument);  // Twice.
  ErrorFeedbackOptions with_momentum;
  with_momentum.momentum = 0.5f;
  EXPECT_EQ(dg.Encode(both, dc, &with_momentum, &out).code(), absl::StatusCode::kInvalidArgument);

  check(g1, b1);
}

// A mode that takes the device gradients and encodes parameter 0 through them each step, or
// (when not offered) encodes the host span: the two runs must push the same thing.
class DeviceCodecMode : public FakeMode {
 public:
  bool accept = true;
  DeviceGradients* gradients = nullptr;
  std::vector<std::vector<float>> sent;  // Per step: parameter 0's decoded payload.

  bool UseDeviceGradients(DeviceGradients* g) override {
    gradients = g;
    return accept;
  }
  absl::StatusOr<StepOutcome> Exchange(int64_t step,
                                       absl::Span<const absl::Span<const float>> grads, double loss,
                                       const StepTiming& timing) override {
    std::unique_ptr<Compressor> codec =
        CompressorRegistry::WithBuiltins().Create("topk:0.05+fp16").value();
    std::string payload;
    if (gradients != nullptr && accept) {
      std::vector<std::string> out;
      RETURN_IF_ERROR(gradients->Encode({{0, 0, static_cast<int64_t>(grads[0].size()), 0}},
                                        *DeviceCodecOf(*codec), nullptr, &out));
      payload = out[0];
    } else {
      RETURN_IF_ERROR(codec->Encode(grads[0], 0, &payload));
    }
    sent.emplace_back(grads[0].size());
    RETURN_IF_ERROR(codec->Decode(payload, absl::MakeSpan(sent.back())));
    return FakeMode::Exchange(step, grads, loss, timing);
  }
};

// What two runs pushed agree: exactly, or within `tolerance` of the L1 norm per step (two runs
// on a GPU, or a clip coefficient summed in another order, can differ in the last bits, and
// then top-k may swap the element at the k-th magnitude).
void ExpectSameSent(const DeviceCodecMode& host, const DeviceCodecMode& device, double tolerance) {
  ASSERT_EQ(device.sent.size(), host.sent.size());
  for (size_t s = 0; s < host.sent.size(); ++s) {
    double diff = 0, norm = 0;
    for (size_t j = 0; j < host.sent[s].size(); ++j) {
      diff += std::fabs(device.sent[s][j] - host.sent[s][j]);
      norm += std::fabs(host.sent[s][j]);
    }
    EXPECT_GT(norm, 0);
    if (tolerance == 0) {
      EXPECT_EQ(device.sent[s], host.sent[s]) << "step " << s;
    } else {
      EXPECT_LE(diff, tolerance * norm) << "step " << s;
    }
  }
}

TEST_P(DeviceTest, TheLoopOffersDeviceGradientsAndTheModePushesWhatTheHostWould) {
  TrainerOptions o = Options(3);
  if (!Usable(o)) return;
  std::atomic<bool> stop{false};
  o.device_codec = DeviceCodecUse::kOff;
  DeviceCodecMode host;
  ASSERT_OK(RunTrainingLoop(o, &host, stop).status());
  EXPECT_EQ(host.gradients, nullptr);  // Not offered.
  o.device_codec = DeviceCodecUse::kOn;
  DeviceCodecMode device;
  ASSERT_OK(RunTrainingLoop(o, &device, stop).status());
  ASSERT_NE(device.gradients, nullptr);
  ASSERT_EQ(host.sent.size(), 3u);
  // The same gradients on the CPU; on a GPU, two runs of the same kernels.
  ExpectSameSent(host, device, GetParam() == ComputeDevice::kCpu ? 0 : 1e-3);
  // Not offered to a mode that wants the gradient hook (it copies each gradient to the host
  // during backward), nor by default on the CPU.
  DeviceCodecMode hooked;
  hooked.hook = true;
  ASSERT_OK(RunTrainingLoop(o, &hooked, stop).status());
  EXPECT_EQ(hooked.gradients, nullptr);
  TrainerOptions by_default = o;
  by_default.device_codec = DeviceCodecUse::kAuto;
  DeviceCodecMode m;
  ASSERT_OK(RunTrainingLoop(by_default, &m, stop).status());
  if (GetParam() == ComputeDevice::kCuda) {
    EXPECT_NE(m.gradients, nullptr);  // auto: on the GPU.
  } else {
    EXPECT_EQ(m.gradients, nullptr);
  }
  // A mode that declines keeps the host gradients.
  DeviceCodecMode declines;
  declines.accept = false;
  ASSERT_OK(RunTrainingLoop(o, &declines, stop).status());
  EXPECT_EQ(declines.sent, host.sent);
}

// The loop's own work on the gradient, done where it is when the mode reads it there: value and
// norm clipping, loss scaling (a NaN injected at step 2 skips that step, the scale backs off)
// must push what the host path pushes and report the same figures.
TEST_P(DeviceTest, ClippingLossScalingAndFaultsRunWhereTheGradientsAre) {
  TrainerOptions o = Options(5);
  if (!Usable(o)) return;
  o.spec.set_clip_grad_value(0.05);
  o.spec.set_clip_grad_norm(0.5);
  o.spec.set_log_every(5);
  LossScaleSpec* ls = o.spec.mutable_loss_scale();
  ls->set_mode("dynamic");
  ls->set_init_scale(1024);
  ls->set_growth_factor(2);
  ls->set_backoff_factor(0.5);
  ls->set_growth_interval(2000);
  o.nonfinite_steps = {2};
  std::atomic<bool> stop{false};
  TrainProgress host_report, device_report;
  DeviceCodecMode host, device;
  o.device_codec = DeviceCodecUse::kOff;
  o.on_progress = [&](const TrainProgress& p) { host_report = p; };
  ASSERT_OK(RunTrainingLoop(o, &host, stop).status());
  EXPECT_EQ(host.gradients, nullptr);
  o.device_codec = DeviceCodecUse::kOn;
  o.on_progress = [&](const TrainProgress& p) { device_report = p; };
  ASSERT_OK(RunTrainingLoop(o, &device, stop).status());
  ASSERT_NE(device.gradients, nullptr);
  ASSERT_EQ(host.sent.size(), 4u) << absl::StrJoin(host.calls, "; ");  // Step 2 was skipped.
  // The sum of squares is taken in another order on the device: the clip coefficient can differ
  // in its last bits.
  ExpectSameSent(host, device, 1e-4);
  EXPECT_EQ(device_report.skipped_steps, 1);
  EXPECT_EQ(device_report.skipped_steps, host_report.skipped_steps);
  EXPECT_EQ(device_report.loss_scale, host_report.loss_scale);
  EXPECT_EQ(device_report.clipped_fraction, host_report.clipped_fraction);
  EXPECT_GT(host_report.grad_norm, 0);
  EXPECT_NEAR(device_report.grad_norm, host_report.grad_norm, 1e-5 * host_report.grad_norm);
}

INSTANTIATE_TEST_SUITE_P(Devices, DeviceTest,
                         ::testing::Values(ComputeDevice::kCpu, ComputeDevice::kCuda),
                         [](const ::testing::TestParamInfo<ComputeDevice>& info) {
                           return std::string(ComputeDeviceName(info.param));
                         });

TEST(DeviceCodecUseTest, ParsesTheKnownNamesAndListsThemOtherwise) {
  for (DeviceCodecUse use : {DeviceCodecUse::kAuto, DeviceCodecUse::kOff, DeviceCodecUse::kOn}) {
    ASSERT_OK_AND_ASSIGN(DeviceCodecUse back, ParseDeviceCodecUse(DeviceCodecUseName(use)));
    EXPECT_EQ(back, use);
  }
  absl::StatusOr<DeviceCodecUse> bad = ParseDeviceCodecUse("gpu");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("auto, off, on"), std::string::npos) << bad.status();
}

TEST(ComputeDeviceTest, ParsesTheKnownNamesAndListsThemOtherwise) {
  ASSERT_OK_AND_ASSIGN(ComputeDevice d, ParseComputeDevice("cuda"));
  EXPECT_EQ(d, ComputeDevice::kCuda);
  ASSERT_OK_AND_ASSIGN(d, ParseComputeDevice("cpu"));
  EXPECT_EQ(d, ComputeDevice::kCpu);
  ASSERT_OK_AND_ASSIGN(d, ParseComputeDevice("auto"));
  EXPECT_EQ(d, ComputeDevice::kAuto);
  absl::StatusOr<ComputeDevice> bad = ParseComputeDevice("gpu");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("auto, cpu, cuda"), std::string::npos) << bad.status();
}

}  // namespace
}  // namespace gradmesh
