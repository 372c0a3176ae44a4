// End-to-end tests of the consistency modes with the real daemons on 127.0.0.1 (2 shards,
// 2 workers as subprocesses; see tests/e2e/e2e_harness.h).
//
// * SyncMatchesSingleProcessSgd: --mode=sync training is, up to float rounding, the same
//   computation as one LibTorch process running plain SGD with the combined batch. The final
//   parameters pulled from the shards are compared with a reference trained in this process;
//   also with accumulation_steps 2 (2 micro-batches of 16 per worker per step).
// * DilocoMatchesLocalSgdWithANesterovOuterStep: mode diloco against local SGD + an outer
//   Nesterov step written with torch::optim.
// * SyncGlobalClippingAndLossScalingMatchOneProcess: sync with clip_grad_norm and dynamic loss
//   scaling (the shards' two-phase apply) against one process with clip_grad_norm_, skipping
//   the same overflowed steps.
// * SspBoundsClockLead: with a slow worker (--step_delay_ms), ssp:2 lets the fast worker run
//   exactly 2 clocks ahead and never more; ssp:0 is lock-step (lead 0).
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "common/partitioner.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "proto/gradmesh.pb.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/e2e/torch_reference.h"
#include "tests/testing/subprocess.h"
#include "worker/core/dataset.h"
#include "worker/model.h"
#include "worker/ps/parameter_client.h"

namespace gradmesh {
namespace e2e {
namespace {

using testutil::LinesWith;
using testutil::LogField;
using testutil::ReadFile;

constexpr int kShards = 2;
constexpr int kWorkers = 2;

class ConsistencyTest : public E2eHarness {
 protected:
  // The layout the workers register for job `job`'s tensors `names`, shaped like `like`
  // (sync, the default chunk size: auto).
  static JobLayout ShardLayout(const std::string& job, const std::vector<std::string>& names,
                               const std::vector<torch::Tensor>& like) {
    JobLayout layout;
    layout.job = job;
    layout.consistency = "sync";
    layout.num_workers = kWorkers;
    std::vector<int64_t> numels;
    for (size_t i = 0; i < like.size(); ++i) {
      TensorSpec t;
      t.set_name(names[i]);
      for (int64_t d : like[i].sizes()) t.add_shape(d);
      layout.tensors.push_back(t);
      numels.push_back(like[i].numel());
    }
    // The default chunk_bytes: auto (17,408 elements for the MLP on 2 shards).
    layout.chunk_elems = AutoChunkElems(numels, kShards);
    return layout;
  }

  // The shards' current values of job `job`'s tensors `names`, shaped like `like`, pulled with
  // the real client (the job exists: no InitJob).
  std::vector<torch::Tensor> PullFromShards(const std::string& job,
                                            const std::vector<std::string>& names,
                                            const std::vector<torch::Tensor>& like) {
    return PullFromShards(job, names, like, ShardLayout(job, names, like));
  }
  // The same in a given layout (chunking and placement).
  std::vector<torch::Tensor> PullFromShards(const std::string& job,
                                            const std::vector<std::string>& names,
                                            const std::vector<torch::Tensor>& like,
                                            const JobLayout& layout) {
    GrpcParameterClientOptions client_options;
    client_options.servers = addresses_;
    absl::StatusOr<std::unique_ptr<ParameterClient>> client =
        NewGrpcParameterClient(layout, client_options);
    EXPECT_OK(client.status());
    if (!client.ok()) return {};
    std::vector<torch::Tensor> pulled;
    std::vector<absl::Span<float>> spans;
    for (const torch::Tensor& g : like) {
      pulled.push_back(torch::full_like(g.detach(), std::nanf("")));
      spans.emplace_back(pulled.back().data_ptr<float>(), pulled.back().numel());
    }
    EXPECT_OK((*client)->Pull(spans));
    return pulled;
  }
};

// Why a 2-worker sync run equals one process with batch 64:
// * Data: BatchLoader shards like PyTorch's DistributedSampler (worker/dataset.h). Both the
//   workers and the reference use the same per-epoch permutation (seed 7); batch t of worker r
//   is { perm[(t*32 + j)*2 + r] : j < 32 }, so the union of the two workers' batch t is
//   perm[64t, 64t+64): exactly batch t of the single process with batch size 64, world 1.
// * Initial weights: CreateModel(mlp, seed 7) seeds LibTorch's RNG, so the workers (whose
//   InitJob sets the shards' values) and the reference start from identical parameters.
// * Gradients: each worker's loss is the mean cross-entropy over its 32 samples; a sync shard
//   waits for both workers' pushes of step t and averages them in rank order, (g0 + g1) / 2,
//   which is the gradient of the mean over all 64 samples (only the float summation order
//   differs). Every worker pulls after its push, and a sync push is acknowledged only once
//   the step is applied, so step t+1's gradients are computed at exactly the parameters of
//   step t, as in the single process.
// * Update: the shards' "sgd" (no momentum, no weight decay, constant schedule) is
//   p -= lr * g, the same as torch::optim::SGD (server/optimizer_test.cc checks the two
//   against each other).
// So after 50 steps the parameters agree up to accumulated float rounding (~1e-7 relative).
// With accumulation_steps 2 (#14) each worker runs 2 micro-batches of 16 per step: loader
// batches 2t and 2t+1 of 16, whose union over both workers is again perm[64t, 64t+64), and
// the loop's accumulated gradient is the mean over the worker's 32 samples, so the same
// reference holds. k1 also sets lr_scaling (linear, base batch 32) with half the lr: the
// shards' lr is then exactly the reference's.
// k2_overlap runs k2 with overlap: 1 and placement "ordered" (JobSpec.overlap: each shard's
// part leaves as soon as backward produced it) and 1 MiB chunks: fc1.weight alone on shard 0,
// the other tensors on shard 1. The pushes and the averages are the same, so is the result.
// k2_priority runs the same with overlap: 2: each step returns before its answers and the
// next forward waits layer by layer (fc1 needs both shards, fc2 and fc3 shard 1 only); the
// values each layer computes on are the same, so is the result.
struct SyncEquivalence {
  int accumulation = 1;
  int overlap = 0;  // JobSpec.overlap.
};
class SyncEquivalenceTest : public ConsistencyTest,
                            public ::testing::WithParamInterface<SyncEquivalence> {};

TEST_P(SyncEquivalenceTest, SyncMatchesSingleProcessSgd) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  constexpr int64_t kSteps = 50;
  const int accumulation = GetParam().accumulation;
  const bool overlap = GetParam().overlap > 0;
  const int kBatch = 32 / accumulation;  // Per micro-batch; 32 per worker per step.
  constexpr uint64_t kSeed = 7;
  constexpr double kLr = 0.05;
  constexpr double kTolerance = 1e-5;
  const std::string job =
      absl::StrCat("e2e-sync-equivalence-k", accumulation, overlap ? "-overlap" : "",
                   overlap ? absl::StrCat(GetParam().overlap) : "");

  ASSERT_NO_FATAL_FAILURE(StartServers(kShards));
  std::vector<std::unique_ptr<Subprocess>> workers;
  for (int r = 0; r < kWorkers; ++r) {
    workers.push_back(StartWorker(
        absl::StrCat("worker", r),
        {ServersFlag(), absl::StrCat("--rank=", r), absl::StrCat("--num_workers=", kWorkers),
         "--name=" + job, "--mode=sync", "--optimizer=sgd",
         // k1 also runs lr_scaling: linear with base batch 32 doubles lr / 2 for the global
         // batch of 64, so the shards must apply exactly kLr.
         absl::StrCat("--lr=", accumulation == 1 ? kLr / 2 : kLr),
         accumulation == 1 ? "--lr_scaling=linear" : "--lr_scaling=none", "--lr_base_batch_size=32",
         "--lr_schedule=constant", absl::StrCat("--batch_size=", kBatch),
         absl::StrCat("--steps=", kSteps), absl::StrCat("--accumulation_steps=", accumulation),
         "--model=mlp", "--dataset=mnist", absl::StrCat("--seed=", kSeed), "--evaluate=false",
         "--log_every=10", "--data_dir=" + DataDir(),
         absl::StrCat("--overlap=", GetParam().overlap),
         overlap ? "--placement=ordered" : "--placement=greedy",
         overlap ? "--chunk_bytes=1048576" : "--chunk_bytes=0"}));
    ASSERT_NE(workers.back(), nullptr);
  }
  const std::vector<int> codes = WaitAll({workers[0].get(), workers[1].get()}, absl::Minutes(3));
  for (int r = 0; r < kWorkers; ++r) {
    ASSERT_EQ(codes[r], 0) << "worker " << r;
    const std::string done = DoneLine(ReadFile(workers[r]->log_path()));
    ASSERT_FALSE(done.empty()) << "worker " << r;
    EXPECT_EQ(ToInt(LogField(done, "steps")), kSteps) << done;
    EXPECT_EQ(ToInt(LogField(done, "samples")), kSteps * 32) << done;
    if (accumulation == 1) {
      const std::vector<std::string> start =
          LinesWith(ReadFile(workers[r]->log_path()), "event=train_start");
      ASSERT_EQ(start.size(), 1u);
      EXPECT_EQ(LogField(start[0], "lr_scaling"), "linear");
      EXPECT_EQ(LogField(start[0], "lr"), "0.05");
      EXPECT_EQ(LogField(start[0], "lr_base"), "0.025");
    }
    EXPECT_EQ(ToInt(LogField(done, "first_step")), 0) << done;
    if (overlap) {
      const std::string log = ReadFile(workers[r]->log_path());
      const std::vector<std::string> start = LinesWith(log, "event=train_start");
      ASSERT_EQ(start.size(), 1u);
      EXPECT_EQ(LogField(start[0], "overlap"), absl::StrCat(GetParam().overlap));
      if (GetParam().overlap == 2) EXPECT_EQ(LogField(start[0], "forward_gate"), "layers");
      EXPECT_EQ(LogField(start[0], "placement"), "ordered");
      // The timeline: what share of the shards' parts left during backward (how much depends
      // on scheduling: both shards hold only parameters, so it may be all of them).
      const std::vector<std::string> progress = LinesWith(log, "event=progress");
      ASSERT_FALSE(progress.empty());
      const double early = std::stod(LogField(progress.back(), "early_shards").value_or("-1"));
      EXPECT_GE(early, 0.0);
      EXPECT_LE(early, 1.0);
    }
  }

  // Accounting on each shard: one update per step, both workers' pushes in each, no staleness.
  for (int s = 0; s < kShards; ++s) {
    SCOPED_TRACE(absl::StrCat("shard ", s));
    ASSERT_OK_AND_ASSIGN(JobInfoResponse info, GetJobInfo(addresses_[s], job));
    EXPECT_EQ(info.consistency(), "sync");
    EXPECT_EQ(info.updates_applied(), kSteps);
    EXPECT_EQ(info.pushes_applied(), kWorkers * kSteps);
    EXPECT_EQ(info.duplicates_dropped(), 0);
    ASSERT_EQ(info.workers_size(), kWorkers);
    for (int w = 0; w < kWorkers; ++w) {
      EXPECT_EQ(info.workers(w).last_step(), kSteps - 1) << "worker " << w;
      EXPECT_EQ(info.workers(w).pushes_applied(), kSteps) << "worker " << w;
      EXPECT_TRUE(info.workers(w).finished()) << "worker " << w;
    }
    // Each update touches every chunk the shard owns once.
    std::vector<int64_t> numels;
    for (const TensorSpec& t : info.tensors()) {
      int64_t n = 1;
      for (int64_t d : t.shape()) n *= d;
      numels.push_back(n);
    }
    ASSERT_OK_AND_ASSIGN(Partition partition, Partition::Create(numels, info.chunk_elems(), kShards,
                                                                overlap ? ChunkPlacement::kOrdered
                                                                        : ChunkPlacement::kGreedy));
    if (overlap) {
      // Ordered with 1 MiB chunks: fc1.weight alone on shard 0, everything else on shard 1.
      EXPECT_EQ(partition.shard_chunks(0), (std::vector<int64_t>{0}));
    }
    const int64_t owned_chunks = static_cast<int64_t>(partition.shard_chunks(s).size());
    EXPECT_GT(owned_chunks, 0);
    int64_t total = 0;
    for (int64_t n : info.staleness_histogram()) total += n;
    EXPECT_EQ(total, kSteps * owned_chunks);
    ASSERT_GE(info.staleness_histogram_size(), 1);
    EXPECT_EQ(info.staleness_histogram(0), total)
        << "sync has no staleness: [" << absl::StrJoin(info.staleness_histogram(), ",") << "]";
  }

  // The reference: one process, batch 64 = 2 x 32, plain SGD with torch::optim.
  torch::set_num_threads(1);
  ModelSpec model_spec;
  model_spec.set_name("mlp");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(model_spec, kSeed));
  std::vector<torch::Tensor> params = model->Parameters();
  const std::vector<std::string> names = model->ParameterNames();
  std::vector<torch::Tensor> initial;
  for (const torch::Tensor& p : params) initial.push_back(p.detach().clone());

  // The shards' final values, pulled with the real client (the job exists: no InitJob), in
  // the layout the workers registered.
  JobLayout layout = ShardLayout(job, names, params);
  if (overlap) {
    layout.chunk_elems = 262144;
    layout.placement = PLACEMENT_ORDERED;
  }
  {
    ASSERT_OK_AND_ASSIGN(JobInfoResponse info, GetJobInfo(addresses_[0], job));
    EXPECT_EQ(info.chunk_elems(), layout.chunk_elems);
    ASSERT_EQ(info.tensors_size(), static_cast<int>(layout.tensors.size()));
    for (int t = 0; t < info.tensors_size(); ++t) {
      EXPECT_EQ(info.tensors(t).DebugString(), layout.tensors[t].DebugString()) << "tensor " << t;
    }
  }
  const std::vector<torch::Tensor> pulled = PullFromShards(job, names, params, layout);
  ASSERT_EQ(pulled.size(), params.size());

  ASSERT_OK_AND_ASSIGN(JobData data, LoadDataset("mnist", DataDir() + "/mnist"));
  BatchLoader::Options lo;
  lo.rank = 0;
  lo.world_size = 1;
  lo.batch_size = kWorkers * 32;
  lo.max_steps = kSteps;
  lo.seed = kSeed;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<BatchLoader> loader,
                       BatchLoader::Create(data.train.get(), lo));
  torch::optim::SGD sgd(params, torch::optim::SGDOptions(kLr));
  for (int64_t t = 0; t < kSteps; ++t) {
    std::optional<Batch> batch = loader->Next();
    ASSERT_TRUE(batch.has_value()) << "step " << t;
    ASSERT_EQ(batch->size, kWorkers * 32);
    torch::Tensor x = torch::from_blob(batch->x.data(), {batch->size, 1, 28, 28}, torch::kFloat);
    torch::Tensor y = torch::from_blob(batch->y.data(), {batch->size}, torch::kLong);
    sgd.zero_grad();
    ASSERT_OK_AND_ASSIGN(torch::Tensor loss, CrossEntropyLoss(model.get(), x, y));
    loss.backward();
    sgd.step();
  }
  EXPECT_FALSE(loader->Next().has_value());

  double max_rel = 0;
  std::string worst;
  for (size_t i = 0; i < params.size(); ++i) {
    SCOPED_TRACE(names[i]);
    const torch::Tensor ref = params[i].detach().to(torch::kDouble);
    const torch::Tensor got = pulled[i].to(torch::kDouble);
    ASSERT_TRUE(torch::isfinite(got).all().item<bool>()) << "pull left NaNs";
    const double ref_norm = ref.norm().item<double>();
    ASSERT_GT(ref_norm, 0);
    const double rel = (got - ref).norm().item<double>() / ref_norm;
    // Not vacuous: training moved every tensor far more than the tolerance.
    const double moved = (ref - initial[i].to(torch::kDouble)).norm().item<double>() / ref_norm;
    EXPECT_GT(moved, 100 * kTolerance);
    EXPECT_LE(rel, kTolerance) << "||shards - reference|| / ||reference||";
    std::cout << absl::StrFormat("%-12s rel. error %.3e (moved %.3e)\n", names[i], rel, moved);
    if (rel >= max_rel) {
      max_rel = rel;
      worst = names[i];
    }
  }
  std::cout << "sync vs single-process SGD: max relative error " << max_rel << " (" << worst
            << ")\n";
  RecordProperty("max_relative_error", absl::StrFormat("%.3e", max_rel));
  ASSERT_NO_FATAL_FAILURE(StopServers());
}

INSTANTIATE_TEST_SUITE_P(Accumulation, SyncEquivalenceTest,
                         ::testing::Values(SyncEquivalence{1, 0}, SyncEquivalence{2, 0},
                                           SyncEquivalence{2, 1}, SyncEquivalence{2, 2}),
                         [](const ::testing::TestParamInfo<SyncEquivalence>& info) {
                           const int overlap = info.param.overlap;
                           return absl::StrCat("k", info.param.accumulation,
                                               overlap == 1   ? "_overlap"
                                               : overlap == 2 ? "_priority"
                                                              : "");
                         });

// mode diloco (#14): 2 workers x 4 rounds of H = 5 inner SGD steps (lr 0.05, batch 32), outer
// Nesterov SGD (lr 0.7, momentum 0.9) on 2 shards, against a reference written here: each
// worker's local run from the round's global model on its own batches (BatchLoader rank r of
// 2), the mean pseudo-gradient (global - local) as the gradient of the global parameters, and
// torch::optim::SGD with nesterov as the outer step. The shards' final values must agree to
// 1e-5, and every worker must push once per round (4 pushes, not 20).
TEST_F(ConsistencyTest, DilocoMatchesLocalSgdWithANesterovOuterStep) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  constexpr int kH = 5, kRounds = 4, kBatch = 32;
  constexpr uint64_t kSeed = 7;
  constexpr double kTolerance = 1e-5;
  const std::string job = "e2e-diloco";
  ASSERT_NO_FATAL_FAILURE(StartServers(kShards));
  const std::string spec = WriteYaml("diloco", absl::StrCat(R"(
name: e2e-diloco
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: sgd, lr: 0.05, lr_schedule: constant}
batch_size: 32
steps: )",
                                                            kH * kRounds, R"(
mode: diloco
num_workers: 2
num_shards: 2
seed: 7
log_every: 5
diloco: {inner_steps: 5, outer_optimizer: nesterov, outer_lr: 0.7, outer_momentum: 0.9}
)"));
  std::vector<std::unique_ptr<Subprocess>> workers;
  for (int r = 0; r < kWorkers; ++r) {
    workers.push_back(StartWorker(absl::StrCat("worker", r),
                                  {ServersFlag(), absl::StrCat("--rank=", r), "--job=" + spec,
                                   "--evaluate=false", "--data_dir=" + DataDir()}));
    ASSERT_NE(workers.back(), nullptr);
  }
  const std::vector<int> codes = WaitAll({workers[0].get(), workers[1].get()}, absl::Minutes(3));
  for (int r = 0; r < kWorkers; ++r) {
    ASSERT_EQ(codes[r], 0) << "worker " << r;
    const std::string log = ReadFile(workers[r]->log_path());
    const std::string done = DoneLine(log);
    EXPECT_EQ(ToInt(LogField(done, "steps")), kH * kRounds) << done;
    const std::vector<std::string> start = LinesWith(log, "event=train_start");
    ASSERT_EQ(start.size(), 1u);
    EXPECT_EQ(LogField(start[0], "inner_steps"), "5");
    EXPECT_EQ(LogField(start[0], "outer_optimizer"), "nesterov");
  }
  for (int s = 0; s < kShards; ++s) {
    ASSERT_OK_AND_ASSIGN(JobInfoResponse info, GetJobInfo(addresses_[s], job));
    EXPECT_EQ(info.consistency(), "sync");
    EXPECT_EQ(info.updates_applied(), kRounds);
    EXPECT_EQ(info.pushes_applied(), kWorkers * kRounds);
  }

  torch::set_num_threads(1);
  ModelSpec model_spec;
  model_spec.set_name("mlp");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(model_spec, kSeed));
  std::vector<torch::Tensor> local = model->Parameters();
  const std::vector<std::string> names = model->ParameterNames();
  std::vector<torch::Tensor> global;
  for (const torch::Tensor& p : local) global.push_back(p.detach().clone().requires_grad_(true));
  torch::optim::SGD outer(global, torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
  ASSERT_OK_AND_ASSIGN(JobData data, LoadDataset("mnist", DataDir() + "/mnist"));
  std::vector<std::unique_ptr<BatchLoader>> loaders;
  for (int r = 0; r < kWorkers; ++r) {
    BatchLoader::Options lo;
    lo.rank = r;
    lo.world_size = kWorkers;
    lo.batch_size = kBatch;
    lo.max_steps = kH * kRounds;
    lo.seed = kSeed;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<BatchLoader> l, BatchLoader::Create(data.train.get(), lo));
    loaders.push_back(std::move(l));
  }
  for (int round = 0; round < kRounds; ++round) {
    std::vector<torch::Tensor> mean_pseudo;
    for (const torch::Tensor& g : global) mean_pseudo.push_back(torch::zeros_like(g.detach()));
    for (int r = 0; r < kWorkers; ++r) {
      {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < local.size(); ++i) local[i].copy_(global[i].detach());
      }
      for (int h = 0; h < kH; ++h) {
        std::optional<Batch> batch = loaders[r]->Next();
        ASSERT_TRUE(batch.has_value());
        torch::Tensor x = torch::from_blob(batch->x.data(), {kBatch, 1, 28, 28}, torch::kFloat);
        torch::Tensor y = torch::from_blob(batch->y.data(), {kBatch}, torch::kLong);
        for (torch::Tensor& p : local) p.mutable_grad() = torch::Tensor();
        ASSERT_OK_AND_ASSIGN(torch::Tensor loss, CrossEntropyLoss(model.get(), x, y));
        loss.backward();
        torch::NoGradGuard no_grad;
        for (torch::Tensor& p : local) p.sub_(0.05 * p.grad());
      }
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < local.size(); ++i) {
        mean_pseudo[i].add_((global[i].detach() - local[i].detach()) / kWorkers);
      }
    }
    outer.zero_grad();
    for (size_t i = 0; i < global.size(); ++i) global[i].mutable_grad() = mean_pseudo[i];
    outer.step();
  }

  // The shards' final values.
  const std::vector<torch::Tensor> pulled = PullFromShards(job, names, global);
  ASSERT_EQ(pulled.size(), global.size());
  double max_rel = 0;
  for (size_t i = 0; i < global.size(); ++i) {
    const torch::Tensor ref = global[i].detach().to(torch::kDouble);
    const double rel =
        (pulled[i].to(torch::kDouble) - ref).norm().item<double>() / ref.norm().item<double>();
    EXPECT_LE(rel, kTolerance) << names[i];
    max_rel = std::max(max_rel, rel);
  }
  std::cout << "diloco vs local-SGD + Nesterov reference: max relative error " << max_rel << "\n";
  ASSERT_NO_FATAL_FAILURE(StopServers());
}

// Sync guardrails (#14) through the shards' two-phase apply (server/sync_commits.h): 2 workers
// x 2 micro-batches of 16 on 2 shards, clip_grad_norm 0.5 and dynamic loss scaling (2^10,
// growing every 10 good steps), against one process with batch 64 written here with
// torch::nn::utils::clip_grad_norm_ and torch::optim::SGD (momentum 0.9). Fault injection
// leaves a NaN in rank 1's gradient at steps 3 and 17 and in rank 0's at step 30, as an fp16
// overflow would: every worker must skip exactly those steps (the shards answer the non-finite
// flag, every worker commits skip), and the scales must stay identical. The reference skips the
// same steps (data consumed, no optimizer step, no momentum) and clips the others by the norm
// of the whole averaged gradient, which no single shard holds. Power-of-two scaling is exact,
// so the shards' final values must agree to 1e-5, and differ from the unclipped reference.
TEST_F(ConsistencyTest, SyncGlobalClippingAndLossScalingMatchOneProcess) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  constexpr int64_t kSteps = 50;
  constexpr uint64_t kSeed = 7;
  constexpr double kTolerance = 1e-5;
  const std::string job = "e2e-sync-guard";
  ASSERT_NO_FATAL_FAILURE(StartServers(kShards));
  const std::string spec = WriteYaml("sync-guard", absl::StrCat(R"(
name: e2e-sync-guard
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: sgd, lr: 0.05, momentum: 0.9, lr_schedule: constant}
batch_size: 16
accumulation_steps: 2
clip_grad_norm: 0.5
loss_scale: {mode: dynamic, init_scale: 1024, growth_interval: 10}
steps: )",
                                                                kSteps, R"(
mode: sync
num_workers: 2
num_shards: 2
seed: 7
log_every: 10
)"));
  std::vector<std::unique_ptr<Subprocess>> workers;
  const char* kFaults[kWorkers] = {"--fault_nonfinite_steps=30", "--fault_nonfinite_steps=3,17"};
  for (int r = 0; r < kWorkers; ++r) {
    workers.push_back(StartWorker(absl::StrCat("worker", r),
                                  {ServersFlag(), absl::StrCat("--rank=", r), "--job=" + spec,
                                   "--evaluate=false", "--data_dir=" + DataDir(), kFaults[r]}));
    ASSERT_NE(workers.back(), nullptr);
  }
  const std::vector<int> codes = WaitAll({workers[0].get(), workers[1].get()}, absl::Minutes(3));
  std::vector<std::vector<int64_t>> skipped(kWorkers);
  std::vector<std::string> last_scale(kWorkers);
  double clipped_sum = 0;
  for (int r = 0; r < kWorkers; ++r) {
    ASSERT_EQ(codes[r], 0) << "worker " << r;
    const std::string log = ReadFile(workers[r]->log_path());
    const std::string done = DoneLine(log);
    EXPECT_EQ(ToInt(LogField(done, "steps")), kSteps) << done;
    for (const std::string& line : LinesWith(log, "event=step_skipped")) {
      skipped[r].push_back(ToInt(LogField(line, "step")));
    }
    EXPECT_EQ(ToInt(LogField(done, "skipped_steps")), static_cast<int64_t>(skipped[r].size()));
    for (const std::string& line : LinesWith(log, "event=progress")) {
      clipped_sum += ToDouble(LogField(line, "clipped"));
      last_scale[r] = LogField(line, "loss_scale").value_or("");
    }
    const std::vector<std::string> start = LinesWith(log, "event=train_start");
    ASSERT_EQ(start.size(), 1u);
    EXPECT_EQ(LogField(start[0], "commit_steps"), "1");
  }
  EXPECT_EQ(skipped[0], (std::vector<int64_t>{3, 17, 30}));
  EXPECT_EQ(skipped[1], skipped[0]) << "every worker must skip the same steps";
  // Steps 0-49: 1024, 512 after 3, 1024 after 13, 512 after 17, 1024 after 27, 512 after 30,
  // 1024 after 40 (steps 41-49 are only 9 good ones).
  EXPECT_EQ(last_scale[0], "1024");
  EXPECT_EQ(last_scale[1], last_scale[0]);
  EXPECT_GT(clipped_sum, 0) << "the bound must bite for the test to mean anything";
  for (int s = 0; s < kShards; ++s) {
    ASSERT_OK_AND_ASSIGN(JobInfoResponse info, GetJobInfo(addresses_[s], job));
    EXPECT_EQ(info.steps_committed(), kSteps) << "shard " << s;
    EXPECT_EQ(info.steps_skipped(), static_cast<int64_t>(skipped[0].size())) << "shard " << s;
    EXPECT_EQ(info.pushes_applied(), kWorkers * kSteps) << "shard " << s;
    EXPECT_EQ(info.workers(1).last_step(), kSteps - 1) << "shard " << s;
  }

  ClippedReferenceOptions ro;
  ro.mnist_dir = DataDir() + "/mnist";
  ro.seed = kSeed;
  ro.batch_size = kWorkers * 32;
  ro.steps = kSteps;
  ro.skip_steps = skipped[0];
  ASSERT_OK_AND_ASSIGN(const ClippedReference ref, TrainClippedMlpReference(ro));
  const std::vector<torch::Tensor> got = PullFromShards(job, ref.names, ref.clipped);
  ASSERT_EQ(got.size(), ref.clipped.size());
  const double err = MaxRelError(got, ref.clipped);
  const double err_free = MaxRelError(got, ref.unclipped);
  std::cout << absl::StrFormat(
      "sync clip 0.5 + loss scaling (%d skipped steps): max rel. error vs clipped batch-64 "
      "reference %.3e, vs unclipped %.3e\n",
      skipped[0].size(), err, err_free);
  EXPECT_LE(err, kTolerance);
  EXPECT_GT(err_free, 100 * kTolerance) << "the comparison could not tell clipping from none";
  ASSERT_NO_FATAL_FAILURE(StopServers());
}

// One ssp run: rank 1 sleeps `delay_ms` before every step, rank 0 runs free.
struct SspResult {
  std::vector<JobInfoResponse> infos;
};

class SspTest : public ConsistencyTest {
 protected:
  void RunSsp(const std::string& job, int bound, int64_t steps, int delay_ms, SspResult* out) {
    std::vector<std::unique_ptr<Subprocess>> workers;
    for (int r = 0; r < kWorkers; ++r) {
      std::vector<std::string> args = {ServersFlag(),
                                       absl::StrCat("--rank=", r),
                                       absl::StrCat("--num_workers=", kWorkers),
                                       "--name=" + job,
                                       absl::StrCat("--mode=ssp:", bound),
                                       "--optimizer=adam",
                                       "--lr=0.001",
                                       absl::StrCat("--steps=", steps),
                                       "--evaluate=false",
                                       "--log_every=10",
                                       "--data_dir=" + DataDir()};
      if (r == 1) args.push_back(absl::StrCat("--step_delay_ms=", delay_ms));
      workers.push_back(StartWorker(absl::StrCat(job, "-worker", r), args));
      ASSERT_NE(workers.back(), nullptr);
    }
    const std::vector<int> codes = WaitAll({workers[0].get(), workers[1].get()}, absl::Minutes(3));
    std::vector<double> wall(kWorkers);
    for (int r = 0; r < kWorkers; ++r) {
      ASSERT_EQ(codes[r], 0) << "worker " << r;
      const std::string done = DoneLine(ReadFile(workers[r]->log_path()));
      ASSERT_FALSE(done.empty()) << "worker " << r;
      EXPECT_EQ(ToInt(LogField(done, "steps")), steps) << done;
      wall[r] = ToDouble(LogField(done, "wall_s"));
    }
    for (int s = 0; s < kShards; ++s) {
      ASSERT_OK_AND_ASSIGN(JobInfoResponse info, GetJobInfo(addresses_[s], job));
      std::cout << job << " shard " << s << ": max_clock_lead " << info.max_clock_lead()
                << ", barrier_wait_s " << info.barrier_wait_s() << "; workers' wall_s " << wall[0]
                << ", " << wall[1] << "\n";
      out->infos.push_back(std::move(info));
    }
  }
};

TEST_F(SspTest, SspBoundsClockLead) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  constexpr int kDelayMs = 25;
  ASSERT_NO_FATAL_FAILURE(StartServers(kShards));
  struct Case {
    std::string job;
    int bound;
    int64_t steps;
  };
  for (const Case& c : {Case{"e2e-ssp2", 2, 60}, Case{"e2e-ssp0", 0, 30}}) {
    SCOPED_TRACE(c.job);
    SspResult result;
    ASSERT_NO_FATAL_FAILURE(RunSsp(c.job, c.bound, c.steps, kDelayMs, &result));
    for (int s = 0; s < kShards; ++s) {
      SCOPED_TRACE(absl::StrCat("shard ", s));
      const JobInfoResponse& info = result.infos[s];
      EXPECT_EQ(info.consistency(), absl::StrCat("ssp:", c.bound));
      // The fast worker ran ahead to the bound, and never beyond it.
      EXPECT_EQ(info.max_clock_lead(), c.bound);
      // ... so its pulls had to wait for the slow worker.
      EXPECT_GT(info.barrier_wait_s(), 0);
      // Pushes are applied on arrival: one update per push.
      EXPECT_EQ(info.pushes_applied(), kWorkers * c.steps);
      EXPECT_EQ(info.updates_applied(), kWorkers * c.steps);
      EXPECT_EQ(info.duplicates_dropped(), 0);
      ASSERT_EQ(info.workers_size(), kWorkers);
      for (int w = 0; w < kWorkers; ++w) {
        EXPECT_EQ(info.workers(w).pushes_applied(), c.steps) << "worker " << w;
        EXPECT_EQ(info.workers(w).last_step(), c.steps - 1) << "worker " << w;
        EXPECT_TRUE(info.workers(w).finished()) << "worker " << w;
      }
    }
  }
  ASSERT_NO_FATAL_FAILURE(StopServers());
}

}  // namespace
}  // namespace e2e
}  // namespace gradmesh
