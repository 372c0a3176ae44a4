// The ps mode with a fake ParameterClient: the job layout it builds from the model view
// (parameters, then buffers with TensorSpec.buffer and dtype), the initial values it offers
// (buffer mirrors included), resuming from the shards' values (buffers restored too), and an
// exchange that pushes buffer deltas and overwrites the mirrors with the pulled values.
#include "worker/ps/ps_mode.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/status.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

using Values = std::vector<std::vector<float>>;

// Shards as one in-memory model: InitJob keeps the first values offered, Push records the
// gradients and applies them as the shards would in async mode with sgd lr 1 (parameters:
// value -= grad; buffers: value += delta), Pull copies the values out.
class FakeClient : public ParameterClient {
 public:
  struct State {
    JobLayout layout;
    Values values;               // Empty until the job exists.
    std::vector<Values> pushes;  // Every Push's gradients.
    int64_t last_step = -1;      // This rank's last pushed step, as the shards record it.
    Values offered;              // The initial values of the last InitJob.
    // One version per tensor (= chunk here): the number of pushes applied. PushFrom records
    // the base versions it was given, Push the last pulled ones.
    std::vector<int64_t> pulled_versions;
    std::vector<std::vector<int64_t>> bases;
    std::vector<int64_t> pull_push_counts;  // Pushes applied when each Pull ran.
    int64_t fail_step = -1;                 // A push of this step fails (UNAVAILABLE).
    // Set: every push first waits (at most 5 s) for it, and records whether it was released.
    absl::Notification* gate = nullptr;
    std::vector<bool> released;
    // commit_steps: the flags and commits seen; the first `missing_commits` commits answer
    // that a shard lost the step.
    std::vector<bool> nonfinite;
    std::vector<SyncCommit> commits;
    int missing_commits = 0;
    // GetJobInfo: the chunk_elems the shards report, and the error it fails with (if set)
    // while the job does not exist yet. GetJobInfoWhereHeld answers for a second shard too when
    // second_shard is set: "lost" (it does not hold the job) or "other" (it holds it with
    // chunk_elems 1000).
    int64_t stored_chunk_elems = 0;
    std::string second_shard;
    absl::Status info_error_while_new;
    std::vector<int64_t> chunk_elems_made;  // The layout's chunk_elems of every client made.
    // PushPullShards: the shard of each tensor (empty: all on shard 0), the shard count, and
    // every call's (step, shards), in order.
    std::vector<int32_t> tensor_shard;
    int32_t shards = 1;
    // Shared so that State stays assignable; guards shard_calls.
    std::shared_ptr<absl::Mutex> calls_mu = std::make_shared<absl::Mutex>();
    std::vector<std::pair<int64_t, std::vector<int32_t>>> shard_calls;
    // A call that names shard s waits (at most 5 s) for shard_gates[s] first, if set.
    std::map<int32_t, absl::Notification*> shard_gates;
    std::vector<std::vector<int32_t>> shards_answered;  // Every call's shards, as it returns.
    // UseDeviceGradients: what the client was offered (it accepts).
    DeviceGradients* device = nullptr;
  };
  explicit FakeClient(State* state) : s_(state) {}

  absl::Status InitJob(const std::vector<absl::Span<const float>>& initial) override {
    s_->offered.clear();
    for (const auto& t : initial) s_->offered.emplace_back(t.begin(), t.end());
    if (s_->values.empty()) s_->values = s_->offered;
    return absl::OkStatus();
  }
  absl::Status Push(int64_t step, const std::vector<absl::Span<const float>>& grads) override {
    return PushFrom(step, grads, s_->pulled_versions);
  }
  absl::Status PushFrom(int64_t step, const std::vector<absl::Span<const float>>& grads,
                        const std::vector<int64_t>& base) override {
    if (s_->gate != nullptr) {
      s_->released.push_back(s_->gate->WaitForNotificationWithTimeout(absl::Seconds(5)));
    }
    if (step == s_->fail_step) return absl::UnavailableError("shard 0 is down");
    s_->bases.push_back(base);
    Values g;
    for (const auto& t : grads) g.emplace_back(t.begin(), t.end());
    for (size_t t = 0; t < g.size(); ++t) {
      const float sign = s_->layout.tensors[t].buffer() ? 1.0f : -1.0f;
      for (size_t i = 0; i < g[t].size(); ++i) s_->values[t][i] += sign * g[t][i];
    }
    s_->pushes.push_back(std::move(g));
    s_->last_step = step;
    return absl::OkStatus();
  }
  absl::Status Pull(const std::vector<absl::Span<float>>& params) override {
    if (params.size() != s_->values.size()) return absl::InvalidArgumentError("tensor count");
    for (size_t t = 0; t < params.size(); ++t) {
      if (params[t].size() != s_->values[t].size()) return absl::InvalidArgumentError("size");
      std::copy(s_->values[t].begin(), s_->values[t].end(), params[t].begin());
    }
    s_->pulled_versions.assign(params.size(), static_cast<int64_t>(s_->pushes.size()));
    s_->pull_push_counts.push_back(static_cast<int64_t>(s_->pushes.size()));
    return absl::OkStatus();
  }
  // commit_steps: one shard holding the whole model; the figures are the pushed parameters'.
  absl::StatusOr<PreparedFigures> PushPrepared(int64_t step,
                                               const std::vector<absl::Span<const float>>& grads,
                                               bool nonfinite) override {
    Values g;
    PreparedFigures f;
    f.nonfinite = nonfinite;
    for (size_t t = 0; t < grads.size(); ++t) {
      g.emplace_back(grads[t].begin(), grads[t].end());
      if (s_->layout.tensors[t].buffer()) continue;
      for (float v : grads[t]) f.grad_sq_norm += static_cast<double>(v) * v;
    }
    s_->pushes.push_back(std::move(g));
    s_->nonfinite.push_back(nonfinite);
    return f;
  }
  absl::StatusOr<bool> PullCommitted(const SyncCommit& commit,
                                     const std::vector<absl::Span<float>>& params) override {
    s_->commits.push_back(commit);
    if (s_->missing_commits > 0) {
      --s_->missing_commits;
      return false;
    }
    const Values& g = s_->pushes.back();
    for (size_t t = 0; t < g.size() && !commit.skip(); ++t) {
      const bool buffer = s_->layout.tensors[t].buffer();
      const float c = buffer ? 1.0f : static_cast<float>(commit.clip_coef());
      for (size_t i = 0; i < g[t].size(); ++i) {
        s_->values[t][i] += (buffer ? 1.0f : -1.0f) * c * g[t][i];
      }
    }
    s_->last_step = commit.step();
    RETURN_IF_ERROR(Pull(params));
    return true;
  }
  std::vector<int64_t> PulledVersions() const override { return s_->pulled_versions; }
  absl::Status Finish(int64_t step) override { return absl::OkStatus(); }
  absl::StatusOr<std::vector<JobInfoResponse>> GetJobInfo() override {
    if (s_->values.empty() && !s_->info_error_while_new.ok()) return s_->info_error_while_new;
    JobInfoResponse info;
    info.set_chunk_elems(s_->stored_chunk_elems);
    WorkerState* w = info.add_workers();
    w->set_worker(0);
    w->set_last_step(s_->last_step);
    return std::vector<JobInfoResponse>{info};
  }
  absl::StatusOr<std::vector<JobInfoResponse>> GetJobInfoWhereHeld() override {
    std::vector<JobInfoResponse> infos(1);
    if (s_->values.empty()) {
      if (!s_->info_error_while_new.ok() && !absl::IsNotFound(s_->info_error_while_new)) {
        return s_->info_error_while_new;
      }
    } else {
      infos[0].set_job(s_->layout.job);
      infos[0].set_chunk_elems(s_->stored_chunk_elems);
    }
    if (s_->second_shard == "lost") infos.emplace_back();
    if (s_->second_shard == "other") {
      infos.push_back(infos[0]);
      infos[1].set_job(s_->layout.job);
      infos[1].set_chunk_elems(1000);
    }
    return infos;
  }
  int32_t num_shards() const override { return s_->shards; }
  bool UseDeviceGradients(DeviceGradients* gradients) override {
    s_->device = gradients;
    return true;
  }
  std::vector<std::vector<int32_t>> TensorShards() const override {
    std::vector<std::vector<int32_t>> out;
    for (size_t t = 0; t < s_->layout.tensors.size(); ++t) out.push_back({ShardOf(t)});
    return out;
  }
  // Applies and returns the tensors of `shards` only, as PushFrom and Pull do.
  absl::Status PushPullShards(int64_t step, const std::vector<absl::Span<const float>>& grads,
                              const std::vector<absl::Span<float>>& params,
                              const std::vector<int32_t>& shards) override {
    // A gated call is recorded before it waits (so a test can see it held).
    std::vector<absl::Notification*> gates;
    for (int32_t s : shards) {
      if (const auto gate = s_->shard_gates.find(s); gate != s_->shard_gates.end()) {
        gates.push_back(gate->second);
      }
    }
    if (!gates.empty()) {
      absl::MutexLock lock(s_->calls_mu.get());
      s_->shard_calls.emplace_back(step, shards);
    }
    for (absl::Notification* gate : gates) gate->WaitForNotificationWithTimeout(absl::Seconds(5));
    absl::MutexLock lock(s_->calls_mu.get());
    if (gates.empty()) s_->shard_calls.emplace_back(step, shards);
    if (step == s_->fail_step) return absl::UnavailableError("shard 1 is down");
    for (size_t t = 0; t < grads.size(); ++t) {
      if (std::find(shards.begin(), shards.end(), ShardOf(t)) == shards.end()) continue;
      const float sign = s_->layout.tensors[t].buffer() ? 1.0f : -1.0f;
      for (size_t i = 0; i < grads[t].size(); ++i) s_->values[t][i] += sign * grads[t][i];
      std::copy(s_->values[t].begin(), s_->values[t].end(), params[t].begin());
    }
    s_->last_step = step;
    s_->shards_answered.push_back(shards);
    return absl::OkStatus();
  }
  int64_t bytes_pushed() const override { return 0; }
  int64_t bytes_pulled() const override { return 0; }
  int64_t raw_bytes_pushed() const override { return 0; }
  int64_t raw_bytes_pulled() const override { return 0; }
  double codec_seconds() const override { return 0; }
  absl::Status SetPushCodec(const std::string& spec) override { return absl::OkStatus(); }

 private:
  int32_t ShardOf(size_t t) const { return t < s_->tensor_shard.size() ? s_->tensor_shard[t] : 0; }

  State* s_;
};

// A BatchNorm-like model: parameter w[2], buffers rm[2] (float32) and nbt (an int64 scalar).
struct Model {
  std::vector<float> w = {1.0f, 2.0f};
  std::vector<float> rm = {0.5f, -0.5f};
  std::vector<float> nbt = {0.0f};
  ModelView view;
  Model() {
    view.names = {"w", "rm", "nbt"};
    view.shapes = {{2}, {2}, {}};
    view.params = {absl::MakeSpan(w), absl::MakeSpan(rm), absl::MakeSpan(nbt)};
    view.dtypes = {ElemType::kFloat32, ElemType::kFloat32, ElemType::kInt64};
    view.num_params = 1;
  }
};

class PsModeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.spec.set_name("bn");
    options_.spec.set_mode("async");
    options_.spec.set_num_workers(1);
    options_.spec.set_chunk_bytes(16);
    options_.spec.mutable_optimizer()->set_name("sgd");
    options_.spec.mutable_optimizer()->set_lr(1);
    options_.mode = Mode::kAsync;
    options_.rank = 0;
  }

  // JobSpec overlap `overlap` over two ordered shards, the TwoLayerModel's a and rm on shard
  // 0 and b on shard 1.
  void TwoOrderedShards(int overlap) {
    options_.spec.set_overlap(overlap);
    options_.spec.set_placement("ordered");
    options_.spec.set_num_shards(2);
    state_.shards = 2;
    state_.tensor_shard = {0, 1, 0};
  }

  std::unique_ptr<TrainingMode> MakeMode() {
    auto mode = NewPsMode(options_, [this](JobLayout layout) {
      state_.layout = layout;
      state_.chunk_elems_made.push_back(layout.chunk_elems);
      return absl::StatusOr<std::unique_ptr<ParameterClient>>(
          std::make_unique<FakeClient>(&state_));
    });
    EXPECT_OK(mode);
    return mode.ok() ? std::move(mode).value() : nullptr;
  }

  // A run of `steps` steps in one epoch.
  static LoopInfo Steps(int64_t steps) {
    LoopInfo info;
    info.total_steps = steps;
    info.steps_per_epoch = steps;
    return info;
  }

  TrainerOptions options_;
  FakeClient::State state_;
};

TEST_F(PsModeTest, LayoutHasTheBuffersAfterTheParametersWithTheirDTypes) {
  Model m;
  std::unique_ptr<TrainingMode> mode = MakeMode();
  ASSERT_NE(mode, nullptr);
  const LoopInfo info = Steps(10);
  ASSERT_OK_AND_ASSIGN(int64_t first, mode->Start(&m.view, info));
  EXPECT_EQ(first, 0);
  const std::vector<TensorSpec>& t = state_.layout.tensors;
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0].name(), "w");
  EXPECT_FALSE(t[0].buffer());
  EXPECT_EQ(t[0].dtype(), DTYPE_UNSPECIFIED);
  EXPECT_EQ(t[1].name(), "rm");
  EXPECT_TRUE(t[1].buffer());
  EXPECT_EQ(t[1].dtype(), DTYPE_UNSPECIFIED);  // float32, left unset as the shards store it.
  EXPECT_EQ(t[2].name(), "nbt");
  EXPECT_TRUE(t[2].buffer());
  EXPECT_EQ(t[2].dtype(), INT64);
  EXPECT_EQ(t[2].shape_size(), 0);  // A scalar.
  EXPECT_EQ(state_.layout.chunk_elems, 4);
  // The initial values offered are the model's, buffer mirrors included.
  EXPECT_EQ(state_.offered, (Values{{1.0f, 2.0f}, {0.5f, -0.5f}, {0.0f}}));
}

TEST_F(PsModeTest, AutoChunkingForANewJobAndTheStoredChunkingForAnExistingOne) {
  options_.spec.set_chunk_bytes(0);  // Auto.
  options_.spec.set_num_shards(2);
  {
    // A new job: the shards answer NOT_FOUND; the auto size (5 elements: the floor, 16,384).
    state_.info_error_while_new = absl::NotFoundError("job bn not found");
    Model m;
    std::unique_ptr<TrainingMode> mode = MakeMode();
    ASSERT_NE(mode, nullptr);
    ASSERT_OK(mode->Start(&m.view, Steps(10)).status());
    EXPECT_EQ(state_.chunk_elems_made, (std::vector<int64_t>{16384}));
  }
  {
    // The job exists with 1 MiB chunks (a binary before auto): the client is made again.
    state_.chunk_elems_made.clear();
    state_.stored_chunk_elems = 262144;
    Model m;
    std::unique_ptr<TrainingMode> mode = MakeMode();
    ASSERT_NE(mode, nullptr);
    ASSERT_OK(mode->Start(&m.view, Steps(10)).status());
    EXPECT_EQ(state_.chunk_elems_made, (std::vector<int64_t>{16384, 262144}));
    EXPECT_EQ(state_.layout.chunk_elems, 262144);
  }
  {
    // A second shard lost the job (no durability): it gets it back with the job's chunking.
    state_.chunk_elems_made.clear();
    state_.second_shard = "lost";
    Model m;
    std::unique_ptr<TrainingMode> mode = MakeMode();
    ASSERT_NE(mode, nullptr);
    ASSERT_OK(mode->Start(&m.view, Steps(10)).status());
    EXPECT_EQ(state_.chunk_elems_made, (std::vector<int64_t>{16384, 262144}));
  }
  {
    // Shards that disagree: nothing is guessed.
    state_.chunk_elems_made.clear();
    state_.second_shard = "other";
    Model m;
    std::unique_ptr<TrainingMode> mode = MakeMode();
    ASSERT_NE(mode, nullptr);
    EXPECT_STATUS_MSG(mode->Start(&m.view, Steps(10)).status(),
                      absl::StatusCode::kFailedPrecondition,
                      "its shards hold it with different chunk sizes (shard 0: chunk_elems "
                      "262144, shard 1: 1000)");
    EXPECT_EQ(state_.chunk_elems_made, (std::vector<int64_t>{16384}));
    state_.second_shard.clear();
  }
  {
    // Other errors end the start, saying what was being done.
    state_ = FakeClient::State();
    state_.info_error_while_new = absl::PermissionDeniedError("bad token");
    Model m;
    std::unique_ptr<TrainingMode> mode = MakeMode();
    ASSERT_NE(mode, nullptr);
    EXPECT_STATUS_MSG(mode->Start(&m.view, Steps(10)).status(), absl::StatusCode::kPermissionDenied,
                      "reading the job's layout from its shards");
  }
  // An explicit chunk_bytes is used as given, whatever the shards hold.
  state_ = FakeClient::State();
  state_.values = {{3.0f, 4.0f}, {0.25f, 0.75f}, {5.0f}};
  state_.stored_chunk_elems = 262144;
  options_.spec.set_chunk_bytes(8);
  Model m;
  std::unique_ptr<TrainingMode> mode = MakeMode();
  ASSERT_NE(mode, nullptr);
  ASSERT_OK(mode->Start(&m.view, Steps(10)).status());
  EXPECT_EQ(state_.chunk_elems_made, (std::vector<int64_t>{2}));
}

TEST_F(PsModeTest, ResumesBuffersFromTheShardsAndPushesTheirDeltas) {
  // The job exists: the shards hold other values, and rank 0 pushed steps up to 4.
  state_.values = {{3.0f, 4.0f}, {0.25f, 0.75f}, {5.0f}};
  state_.last_step = 4;
  Model m;
  std::unique_ptr<TrainingMode> mode = MakeMode();
  ASSERT_NE(mode, nullptr);
  const LoopInfo info = Steps(10);
  ASSERT_OK_AND_ASSIGN(int64_t first, mode->Start(&m.view, info));
  EXPECT_EQ(first, 5);
  EXPECT_EQ(m.w, (std::vector<float>{3.0f, 4.0f}));
  EXPECT_EQ(m.rm, (std::vector<float>{0.25f, 0.75f}));  // Buffers restored too.
  EXPECT_EQ(m.nbt, (std::vector<float>{5.0f}));

  // The loop's step: the forward moved the buffers (the loop writes the new values into the
  // mirrors and hands over the deltas).
  m.rm = {0.5f, 1.0f};
  m.nbt = {6.0f};
  const std::vector<float> gw = {0.5f, -1.0f}, drm = {0.25f, 0.25f}, dnbt = {1.0f};
  // Meanwhile another worker moved the shards' buffers too.
  state_.values[1] = {1.25f, 1.75f};
  state_.values[2] = {7.0f};
  const std::vector<absl::Span<const float>> grads = {gw, drm, dnbt};
  ASSERT_OK_AND_ASSIGN(StepOutcome out, mode->Exchange(5, grads, 0.5, StepTiming()));
  EXPECT_FALSE(out.stop);
  ASSERT_EQ(state_.pushes.size(), 1u);
  EXPECT_EQ(state_.pushes[0], (Values{gw, drm, dnbt}));  // Deltas pushed as given.
  // The mirrors hold the shards' values after the pull (the delta added once, on the shards).
  EXPECT_EQ(m.w, (std::vector<float>{2.5f, 5.0f}));
  EXPECT_EQ(m.rm, (std::vector<float>{1.5f, 2.0f}));
  EXPECT_EQ(m.nbt, (std::vector<float>{8.0f}));
}

// mode diloco with the fake shards (outer SGD lr 1 in the fake, whatever the layout says):
// two inner SGD steps (lr 0.5) on the parameter, then one round: the pushed pseudo-gradient is
// global - local for the parameter and local - global for the buffers, where the buffers'
// local values are the mirrors the loop wrote (each step's delta is not added again: a
// regression test for the review's finding), and the pull brings the new global model.
TEST_F(PsModeTest, DilocoPushesOnePseudoGradientPerRoundWithBuffersCountedOnce) {
  options_.spec.set_mode("diloco");
  options_.mode = Mode::kDiloco;
  options_.spec.mutable_optimizer()->set_lr(0.5);
  options_.spec.mutable_diloco()->set_inner_steps(2);
  options_.spec.mutable_diloco()->set_outer_optimizer("sgd");
  options_.spec.mutable_diloco()->set_outer_lr(1);
  Model m;
  std::unique_ptr<TrainingMode> mode = MakeMode();
  ASSERT_NE(mode, nullptr);
  const LoopInfo info = Steps(4);
  ASSERT_OK_AND_ASSIGN(int64_t first, mode->Start(&m.view, info));
  EXPECT_EQ(first, 0);
  EXPECT_EQ(state_.layout.consistency, "sync");
  EXPECT_EQ(state_.layout.optimizer.name(), "sgd");
  EXPECT_EQ(state_.layout.optimizer.lr(), 1);
  EXPECT_FALSE(state_.layout.optimizer.nesterov());
  const std::vector<float> gw = {1.0f, -2.0f}, drm = {0.25f, 0.25f}, dnbt = {1.0f};
  const std::vector<absl::Span<const float>> grads = {gw, drm, dnbt};
  // Step 0: the loop wrote the buffers' new values (+delta) before the exchange.
  m.rm = {0.75f, -0.25f};
  m.nbt = {1.0f};
  ASSERT_OK(mode->Exchange(0, grads, 0.5, StepTiming()).status());
  EXPECT_TRUE(state_.pushes.empty());                    // Inside the round: local only.
  EXPECT_EQ(m.w, (std::vector<float>{0.5f, 3.0f}));      // w -= 0.5 * g.
  EXPECT_EQ(m.rm, (std::vector<float>{0.75f, -0.25f}));  // Not moved twice.
  EXPECT_EQ(m.nbt, (std::vector<float>{1.0f}));
  // Step 1 ends the round.
  m.rm = {1.0f, 0.0f};
  m.nbt = {2.0f};
  ASSERT_OK(mode->Exchange(1, grads, 0.5, StepTiming()).status());
  ASSERT_EQ(state_.pushes.size(), 1u);
  EXPECT_EQ(state_.last_step, 0);  // Pushed as round 0.
  // Parameter: global (1, 2) - local (0, 4); buffers: local - global.
  EXPECT_EQ(state_.pushes[0], (Values{{1.0f, -2.0f}, {0.5f, 0.5f}, {2.0f}}));
  // The fake shards applied it with lr 1 (and added the buffer deltas): the workers' model.
  EXPECT_EQ(m.w, (std::vector<float>{0.0f, 4.0f}));
  EXPECT_EQ(m.rm, (std::vector<float>{1.0f, 0.0f}));
  EXPECT_EQ(m.nbt, (std::vector<float>{2.0f}));
}

// pipeline: 1 (async). Step t's exchange runs in the background: step t+1 computes on the
// values pulled after step t-1, each push carries the versions its gradient was computed on
// (so the shards see exactly one more step of staleness), and Finish waits for the last one.
TEST_F(PsModeTest, PipelineOverlapsStepTsExchangeWithStepTPlusOneAndPushesItsBaseVersions) {
  options_.spec.set_pipeline(1);
  options_.evaluate = false;
  Model m;
  std::unique_ptr<TrainingMode> mode = MakeMode();
  ASSERT_NE(mode, nullptr);
  const LoopInfo info = Steps(3);
  ASSERT_OK_AND_ASSIGN(int64_t first, mode->Start(&m.view, info));
  EXPECT_EQ(first, 0);
  const std::vector<LogField> fields = mode->StartFields();
  EXPECT_NE(std::find_if(
                fields.begin(), fields.end(),
                [](const LogField& f) { return f.first == "added_staleness" && f.second == "1"; }),
            fields.end());
  const std::vector<float> g0 = {1, 1}, g1 = {2, 2}, g2 = {4, 4}, drm = {0.25f, 0.25f},
                           dnbt = {1.0f};
  // Step 0 computed on the initial values; its exchange starts, the model stays.
  ASSERT_OK(mode->Exchange(0, {g0, drm, dnbt}, 0.5, StepTiming()).status());
  EXPECT_EQ(m.w, (std::vector<float>{1.0f, 2.0f}));
  // Step 1 also computed on the initial values (one step stale); now the model holds the
  // values pulled after step 0's push.
  ASSERT_OK(mode->Exchange(1, {g1, drm, dnbt}, 0.5, StepTiming()).status());
  EXPECT_EQ(m.w, (std::vector<float>{0.0f, 1.0f}));
  EXPECT_EQ(m.rm, (std::vector<float>{0.75f, -0.25f}));  // The shards' buffer, delta once.
  ASSERT_OK(mode->Exchange(2, {g2, drm, dnbt}, 0.5, StepTiming()).status());
  EXPECT_EQ(m.w, (std::vector<float>{-2.0f, -1.0f}));
  TrainResult result;
  ASSERT_OK_AND_ASSIGN(bool evaluates, mode->Finish(3, &result));
  EXPECT_FALSE(evaluates);
  // Every push arrived, in order, with the gradients as given.
  ASSERT_EQ(state_.pushes.size(), 3u);
  EXPECT_EQ(state_.pushes[1], (Values{g1, drm, dnbt}));
  EXPECT_EQ(state_.last_step, 2);
  // Base versions: step 0 and 1 on the initial pull (version 0), step 2 on the pull after
  // step 0 (version 1): staleness 0, 1, 1 as the shards count it (pushes applied - base).
  EXPECT_EQ(state_.bases, (std::vector<std::vector<int64_t>>{{0, 0, 0}, {0, 0, 0}, {1, 1, 1}}));
  // Finish waited for step 2's exchange and left its pulled values in the model.
  EXPECT_EQ(m.w, (std::vector<float>{-6.0f, -5.0f}));
  EXPECT_EQ(m.rm, (std::vector<float>{1.25f, 0.25f}));
  EXPECT_EQ(m.nbt, (std::vector<float>{3.0f}));
}

// A pipelined push that fails is reported by the next exchange (the run ends with it).
TEST_F(PsModeTest, PipelineReportsAFailedBackgroundPushAtTheNextExchange) {
  options_.spec.set_pipeline(1);
  options_.evaluate = false;
  state_.fail_step = 1;
  Model m;
  std::unique_ptr<TrainingMode> mode = MakeMode();
  ASSERT_NE(mode, nullptr);
  const LoopInfo info = Steps(3);
  ASSERT_OK(mode->Start(&m.view, info).status());
  const std::vector<float> g = {1, 1}, drm = {0, 0}, dnbt = {0};
  ASSERT_OK(mode->Exchange(0, {g, drm, dnbt}, 0.5, StepTiming()).status());
  ASSERT_OK(mode->Exchange(1, {g, drm, dnbt}, 0.5, StepTiming()).status());
  const absl::Status st = mode->Exchange(2, {g, drm, dnbt}, 0.5, StepTiming()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(state_.pushes.size(), 1u);  // Step 2 was not started.
  EXPECT_EQ(m.w, (std::vector<float>{0.0f, 1.0f}));
}

// The overlap itself: Exchange(0) returns while step 0's push is still held by the shard (the
// gate), and the gradients it pushes are its own copy: the loop reuses its gradient buffers
// for the next step, which must not change what is in flight.
TEST_F(PsModeTest, PipelinedExchangeReturnsBeforeItsPushEndsAndOwnsItsGradients) {
  options_.spec.set_pipeline(1);
  options_.evaluate = false;
  absl::Notification gate;
  state_.gate = &gate;
  Model m;
  std::unique_ptr<TrainingMode> mode = MakeMode();
  ASSERT_NE(mode, nullptr);
  const LoopInfo info = Steps(2);
  ASSERT_OK(mode->Start(&m.view, info).status());
  std::vector<float> g = {1, 2}, drm = {0, 0}, dnbt = {0};
  ASSERT_OK(mode->Exchange(0, {g, drm, dnbt}, 0.5, StepTiming()).status());
  // Step 1's backward overwrites the loop's gradient buffers while step 0's push waits.
  g = {100, 200};
  gate.Notify();
  ASSERT_OK(mode->Exchange(1, {g, drm, dnbt}, 0.5, StepTiming()).status());
  TrainResult result;
  ASSERT_OK(mode->Finish(2, &result).status());
  ASSERT_EQ(state_.pushes.size(), 2u);
  EXPECT_EQ(state_.pushes[0][0], (std::vector<float>{1, 2}));
  EXPECT_EQ(state_.pushes[1][0], (std::vector<float>{100, 200}));
  // Step 0's push was still waiting when Exchange(0) returned: released, not timed out.
  EXPECT_EQ(state_.released, (std::vector<bool>{true, true}));
}

}  // namespace
}  // namespace gradmesh

namespace gradmesh {
namespace {

// sync with clip_grad_norm and dynamic loss scaling commits its steps (JobLayout.commit_steps):
// the mode unscales the loss-scaled gradient itself, pushes it, clips by the norm the shards
// report (torch's max_norm / (norm + 1e-6)), skips a non-finite step on the shards' word
// (pushing zeros flagged non-finite), and pushes and commits again when a shard lost the step.
TEST_F(PsModeTest, SyncCommitsClipsByTheShardsNormAndSkipsNonFiniteSteps) {
  options_.spec.set_mode("sync");
  options_.mode = Mode::kSync;
  options_.spec.set_clip_grad_norm(1);
  options_.spec.mutable_loss_scale()->set_mode("dynamic");
  Model m;
  std::unique_ptr<TrainingMode> mode = MakeMode();
  ASSERT_NE(mode, nullptr);
  ASSERT_OK(mode->Start(&m.view, Steps(10)).status());
  EXPECT_TRUE(state_.layout.commit_steps);
  EXPECT_TRUE(mode->unscales_gradients());

  // Loss scale 4: the gradient {3, 4} (norm 5) arrives as {12, 16}; buffer deltas unscaled.
  mode->SetLossScale(4);
  std::vector<float> gw = {12.0f, 16.0f}, drm = {0.25f, 0.25f}, dnbt = {1.0f};
  std::vector<absl::Span<const float>> grads = {gw, drm, dnbt};
  ASSERT_OK_AND_ASSIGN(StepOutcome out, mode->Exchange(0, grads, 0.5, StepTiming()));
  EXPECT_FALSE(out.skipped);
  ASSERT_EQ(state_.pushes.size(), 1u);
  EXPECT_EQ(state_.pushes[0], (Values{{3.0f, 4.0f}, {0.25f, 0.25f}, {1.0f}}));
  EXPECT_EQ(state_.nonfinite, std::vector<bool>{false});
  ASSERT_EQ(state_.commits.size(), 1u);
  EXPECT_EQ(state_.commits[0].step(), 0);
  EXPECT_FALSE(state_.commits[0].skip());
  EXPECT_DOUBLE_EQ(state_.commits[0].clip_coef(), 1.0 / (5.0 + 1e-6));
  const float c = static_cast<float>(1.0 / (5.0 + 1e-6));
  EXPECT_EQ(m.w, (std::vector<float>{1.0f - c * 3.0f, 2.0f - c * 4.0f}));
  EXPECT_EQ(m.rm, (std::vector<float>{0.75f, -0.25f}));
  const ClipCounters clip = mode->TakeClipCounters();
  EXPECT_EQ(clip.steps, 1);
  EXPECT_EQ(clip.clipped, 1);
  EXPECT_DOUBLE_EQ(clip.norm_sum, 5.0);

  // A NaN (an overflow): zeros go out flagged, the shards say skip, nothing changes.
  const std::vector<float> w_before = m.w, rm_before = m.rm;
  gw = {std::numeric_limits<float>::quiet_NaN(), 1.0f};
  ASSERT_OK_AND_ASSIGN(StepOutcome skipped, mode->Exchange(1, grads, 0.5, StepTiming()));
  EXPECT_TRUE(skipped.skipped);
  EXPECT_EQ(state_.pushes[1], (Values{{0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f}}));
  EXPECT_EQ(state_.nonfinite.back(), true);
  EXPECT_TRUE(state_.commits.back().skip());
  EXPECT_EQ(m.w, w_before);
  EXPECT_EQ(m.rm, rm_before);
  EXPECT_EQ(mode->TakeClipCounters().steps, 0);  // A skipped step is not clipped.

  // A shard restarted between the phases: the step is pushed and committed again.
  state_.missing_commits = 1;
  gw = {0.0f, 2.0f};  // Unscaled {0, 0.5}: norm 0.5, not clipped.
  ASSERT_OK_AND_ASSIGN(StepOutcome again, mode->Exchange(2, grads, 0.5, StepTiming()));
  EXPECT_FALSE(again.skipped);
  EXPECT_EQ(state_.pushes.size(), 4u);
  ASSERT_EQ(state_.commits.size(), 4u);
  EXPECT_EQ(state_.commits[2].step(), 2);
  EXPECT_EQ(state_.commits[3].step(), 2);
  EXPECT_EQ(state_.commits[3].clip_coef(), 1.0);
  EXPECT_EQ(mode->TakeClipCounters().clipped, 0);

  // Shards that keep losing the step (restarting every few seconds): it goes round as often as
  // it takes (bounded by 30 minutes, not by a count: 4 rounds used to fail the job).
  state_.missing_commits = 20;
  ASSERT_OK(mode->Exchange(3, grads, 0.5, StepTiming()).status());
  EXPECT_EQ(state_.commits.size(), 4u + 21u);
  EXPECT_EQ(state_.commits.back().step(), 3);
}

// Plain sync (no clipping, no dynamic scaling) keeps the one-phase apply.
TEST_F(PsModeTest, PlainSyncDoesNotCommitSteps) {
  options_.spec.set_mode("sync");
  options_.mode = Mode::kSync;
  Model m;
  std::unique_ptr<TrainingMode> mode = MakeMode();
  ASSERT_NE(mode, nullptr);
  ASSERT_OK(mode->Start(&m.view, Steps(10)).status());
  EXPECT_FALSE(state_.layout.commit_steps);
  EXPECT_FALSE(mode->unscales_gradients());
  const std::vector<float> gw = {1.0f, 1.0f}, drm = {0.0f, 0.0f}, dnbt = {0.0f};
  const std::vector<absl::Span<const float>> grads = {gw, drm, dnbt};
  ASSERT_OK(mode->Exchange(0, grads, 0.5, StepTiming()).status());
  EXPECT_TRUE(state_.commits.empty());
  EXPECT_EQ(state_.pushes.size(), 1u);
}

}  // namespace
}  // namespace gradmesh

namespace gradmesh {
namespace {

// Parameters a[2] (shard 0) and b[2] (shard 1), buffer rm[1] (shard 0).
struct TwoLayerModel {
  std::vector<float> a = {1.0f, 2.0f};
  std::vector<float> b = {3.0f, 4.0f};
  std::vector<float> rm = {0.5f};
  ModelView view;
  TwoLayerModel() {
    view.names = {"a", "b", "rm"};
    view.shapes = {{2}, {2}, {1}};
    view.params = {absl::MakeSpan(a), absl::MakeSpan(b), absl::MakeSpan(rm)};
    view.dtypes = {ElemType::kFloat32, ElemType::kFloat32, ElemType::kFloat32};
    view.num_params = 2;
  }
};

// Waits (at most 5 s) until `n` PushPullShards calls were made; returns them.
std::vector<std::pair<int64_t, std::vector<int32_t>>> AwaitCalls(FakeClient::State* state,
                                                                 size_t n) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (true) {
    {
      absl::MutexLock lock(state->calls_mu.get());
      if (state->shard_calls.size() >= n || absl::Now() > deadline) return state->shard_calls;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
}

using Calls = std::vector<std::pair<int64_t, std::vector<int32_t>>>;

TEST_F(PsModeTest, OverlapSendsAShardsPartOnceBackwardProducedItAndTheRestAfter) {
  TwoOrderedShards(1);
  TwoLayerModel m;
  std::unique_ptr<TrainingMode> mode = MakeMode();
  ASSERT_NE(mode, nullptr);
  ASSERT_OK(mode->Start(&m.view, Steps(2)).status());
  EXPECT_EQ(state_.layout.placement, PLACEMENT_ORDERED);
  ASSERT_TRUE(mode->wants_gradient_hook());
  mode->BeforeBackward(0, 1.0, false);
  // Backward produces b (the last layer) first: shard 1 holds nothing else, so it leaves now.
  std::vector<float> gb = {0.5f, 0.25f}, ga = {1.0f, 1.0f}, drm = {0.25f};
  mode->OnGradient(1, gb);
  EXPECT_EQ(AwaitCalls(&state_, 1), (Calls{{0, {1}}}));
  // The model is not written while backward may still read it.
  EXPECT_EQ(m.b, (std::vector<float>{3.0f, 4.0f}));
  // Shard 0 also holds the buffer, whose delta exists only after backward.
  mode->OnGradient(0, ga);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(AwaitCalls(&state_, 1).size(), 1u);
  const std::vector<absl::Span<const float>> grads = {ga, gb, drm};
  ASSERT_OK(mode->Exchange(0, grads, 1.0, StepTiming()).status());
  EXPECT_EQ(AwaitCalls(&state_, 2), (Calls{{0, {1}}, {0, {0}}}));
  EXPECT_EQ(m.a, (std::vector<float>{0.0f, 1.0f}));
  EXPECT_EQ(m.b, (std::vector<float>{2.5f, 3.75f}));
  EXPECT_EQ(m.rm, (std::vector<float>{0.75f}));
  bool early = false;
  for (const LogField& f : mode->ProgressFields(1, 1)) {
    if (f.first == "early_shards") {
      EXPECT_EQ(f.second, "0.50");
      early = true;
    }
  }
  EXPECT_TRUE(early);

  // A failed backward: the part already sent completes, nothing else is sent, and the next
  // step starts afresh.
  mode->BeforeBackward(1, 1.0, false);
  mode->OnGradient(1, gb);
  EXPECT_EQ(AwaitCalls(&state_, 3).size(), 3u);
  mode->AbortStep();
  // With the buffer's delta given after the forward (as the loop does), shard 0 is ready as
  // soon as a is; nothing is left for the exchange to send.
  mode->BeforeBackward(1, 1.0, false);
  const std::vector<absl::Span<const float>> deltas = {drm};
  mode->OnBufferDeltas(deltas);
  mode->OnGradient(0, ga);
  mode->OnGradient(0, ga);  // A repeated gradient is ignored.
  EXPECT_EQ(AwaitCalls(&state_, 4), (Calls{{0, {1}}, {0, {0}}, {1, {1}}, {1, {0}}}));
  mode->OnGradient(1, gb);
  EXPECT_EQ(AwaitCalls(&state_, 5).size(), 5u);
  ASSERT_OK(mode->Exchange(1, grads, 1.0, StepTiming()).status());
  EXPECT_EQ(AwaitCalls(&state_, 5), (Calls{{0, {1}}, {0, {0}}, {1, {1}}, {1, {0}}, {1, {1}}}));
  EXPECT_EQ(m.a, (std::vector<float>{-1.0f, 0.0f}));
  EXPECT_EQ(m.rm, (std::vector<float>{1.0f}));
}

TEST_F(PsModeTest, OverlapReportsAFailedEarlySendAtTheExchange) {
  options_.spec.set_overlap(1);
  options_.spec.set_num_shards(2);
  state_.shards = 2;
  state_.tensor_shard = {0, 1, 0};
  state_.fail_step = 0;
  TwoLayerModel m;
  std::unique_ptr<TrainingMode> mode = MakeMode();
  ASSERT_NE(mode, nullptr);
  ASSERT_OK(mode->Start(&m.view, Steps(2)).status());
  mode->BeforeBackward(0, 1.0, false);
  std::vector<float> gb = {0.5f, 0.25f}, ga = {1.0f, 1.0f}, drm = {0.25f};
  mode->OnGradient(1, gb);
  mode->OnGradient(0, ga);
  const std::vector<absl::Span<const float>> grads = {ga, gb, drm};
  EXPECT_STATUS_MSG(mode->Exchange(0, grads, 1.0, StepTiming()).status(),
                    absl::StatusCode::kUnavailable, "shard 1 is down");
  EXPECT_EQ(m.a, (std::vector<float>{1.0f, 2.0f}));  // The model is not written.
}

// overlap: 2 (BytePS's priority): Exchange returns before the answers; the next forward's
// first layer (a, on shard 0) is in as soon as shard 0 answered, while shard 1 (b) is still
// held; b arrives when it answers. Nothing is copied before its shard answered.
TEST_F(PsModeTest, DeferredOverlapHandsEachLayerOverAsItsShardAnswers) {
  TwoOrderedShards(2);
  absl::Notification hold_b;
  state_.shard_gates[1] = &hold_b;
  TwoLayerModel m;
  std::unique_ptr<TrainingMode> mode = MakeMode();
  ASSERT_NE(mode, nullptr);
  ASSERT_OK(mode->Start(&m.view, Steps(2)).status());
  std::vector<float> gb = {0.5f, 0.25f}, ga = {1.0f, 1.0f}, drm = {0.25f};
  const std::vector<absl::Span<const float>> deltas = {drm};
  const std::vector<absl::Span<const float>> grads = {ga, gb, drm};
  mode->BeforeBackward(0, 1.0, false);
  mode->OnBufferDeltas(deltas);
  mode->OnGradient(1, gb);  // Shard 1 leaves and is held.
  ASSERT_EQ(AwaitCalls(&state_, 1), (Calls{{0, {1}}}));
  mode->OnGradient(0, ga);  // Shard 0 is ready behind it.
  ASSERT_OK(mode->Exchange(0, grads, 1.0, StepTiming()).status());
  {  // Returned while shard 1's call is still held.
    absl::MutexLock lock(state_.calls_mu.get());
    for (const std::vector<int32_t>& answered : state_.shards_answered) {
      EXPECT_EQ(std::count(answered.begin(), answered.end(), 1), 0);
    }
  }
  // Nothing is in the model yet.
  EXPECT_EQ(m.a, (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(m.b, (std::vector<float>{3.0f, 4.0f}));
  // The first layer: shard 0 went on the second thread, and answers.
  ASSERT_OK(mode->AwaitParameters(0, 1));
  EXPECT_EQ(m.a, (std::vector<float>{0.0f, 1.0f}));
  EXPECT_EQ(m.b, (std::vector<float>{3.0f, 4.0f}));
  EXPECT_EQ(m.rm, (std::vector<float>{0.5f}));  // On shard 0, but not asked for yet.
  hold_b.Notify();
  ASSERT_OK(mode->AwaitParameters(1, 3));
  EXPECT_EQ(m.b, (std::vector<float>{2.5f, 3.75f}));
  EXPECT_EQ(m.rm, (std::vector<float>{0.75f}));
  ASSERT_OK(mode->AwaitParameters(0, 3));  // Nothing owed: at once.
  std::map<std::string, std::string> fields;
  for (const LogField& f : mode->ProgressFields(1, 1)) fields[f.first] = f.second;
  EXPECT_EQ(fields["early_shards"], "0.50");  // Shard 1 during backward; shard 0 at Exchange.
  EXPECT_TRUE(fields.count("exposed_ms") == 1 && fields.count("hidden") == 1);

  // Step 1 fails on its shards: the error comes from the wait, and Finish (which settles)
  // reports it too; the model keeps step 0's values.
  state_.fail_step = 1;
  mode->BeforeBackward(1, 1.0, false);
  mode->OnBufferDeltas(deltas);
  mode->OnGradient(1, gb);
  mode->OnGradient(0, ga);
  const absl::Status exchanged = mode->Exchange(1, grads, 1.0, StepTiming()).status();
  if (exchanged.ok()) {
    EXPECT_STATUS_MSG(mode->AwaitParameters(0, 3), absl::StatusCode::kUnavailable,
                      "shard 1 is down");
    TrainResult result;
    EXPECT_STATUS_MSG(mode->Finish(2, &result).status(), absl::StatusCode::kUnavailable,
                      "shard 1 is down");
  } else {  // The early send had already failed when Exchange began.
    EXPECT_STATUS_MSG(exchanged, absl::StatusCode::kUnavailable, "shard 1 is down");
  }
  EXPECT_EQ(m.a, (std::vector<float>{0.0f, 1.0f}));
  EXPECT_EQ(m.b, (std::vector<float>{2.5f, 3.75f}));
}

// Device gradients (worker/core/device_gradients.h) are passed on to the client for the plain
// exchange only: every other exchange reads the host gradient (DiLoCo pushes pseudo-gradients,
// even with one inner step; the pipelined one copies the gradient).
TEST_F(PsModeTest, DeviceGradientsAreTakenOnlyByThePlainExchange) {
  class NoDevice : public DeviceGradients {
    absl::Status Encode(absl::Span<const DeviceChunk>, const DeviceCodec&,
                        const ErrorFeedbackOptions*, std::vector<std::string>*) override {
      return absl::UnimplementedError("not in this test");
    }
    void ResetFeedback() override {}
    int64_t bytes_to_host() const override { return 0; }
  } device;
  const auto offered = [&](const std::function<void(TrainerOptions*)>& set) -> bool {
    options_.spec.set_mode("async");
    options_.mode = Mode::kAsync;
    options_.spec.set_pipeline(0);
    set(&options_);
    state_ = FakeClient::State();
    Model m;
    std::unique_ptr<TrainingMode> mode = MakeMode();
    EXPECT_NE(mode, nullptr);
    if (mode == nullptr || !mode->Start(&m.view, Steps(4)).ok()) return false;
    const bool taken = mode->UseDeviceGradients(&device);
    EXPECT_EQ(taken, state_.device == &device);
    return taken;
  };
  EXPECT_TRUE(offered([](TrainerOptions*) {}));
  EXPECT_FALSE(offered([](TrainerOptions* o) { o->spec.set_pipeline(1); }));
  EXPECT_FALSE(offered([](TrainerOptions* o) {
    o->spec.set_mode("diloco");
    o->mode = Mode::kDiloco;
    o->spec.mutable_diloco()->set_inner_steps(1);
    o->spec.mutable_diloco()->set_outer_optimizer("sgd");
    o->spec.mutable_diloco()->set_outer_lr(1);
  }));
}

}  // namespace
}  // namespace gradmesh
