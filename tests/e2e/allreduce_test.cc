// End-to-end tests of mode "allreduce": real gradmesh_worker processes on 127.0.0.1, ring
// all-reduce over their gRPC CollectiveService.
//   * 2 workers x batch 32 for 50 steps = one LibTorch process with batch 64 (to 1e-5), and
//     measurably not the run in which rank 1's gradient is dropped;
//   * SIGKILL of one worker: the other exits non-zero within timeout_s + a few seconds naming
//     the dead peer; SIGSTOP (a silent peer): DEADLINE_EXCEEDED after timeout_s;
//   * MNIST MLP, 2 workers, 1 epoch, with a job token (--job_token_file): accuracy >= 0.97;
//   * 2 workers x 2 micro-batches of 16, clip_grad_norm 0.5 = one process with batch 64
//     clipped by torch::nn::utils::clip_grad_norm_ (to 1e-5);
//   * checkpoints every 20 steps; a run stopped (SIGTERM) at step >= 40 resumes from the
//     common checkpoint and ends equal to an uninterrupted run, also when rank 1 comes back
//     without its checkpoint files (rank 0 sends it its newest).
#include <signal.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/e2e/torch_reference.h"
#include "tests/testing/subprocess.h"
#include "worker/core/dataset.h"
#include "worker/model.h"
#include "worker/nccl/nccl_communicator.h"

namespace gradmesh {
namespace e2e {
namespace {

using testutil::LogField;
using testutil::Ptrs;
using testutil::ReadFile;

class AllreduceTest : public E2eHarness {
 protected:
  // The checkpoint tests' phases. An uninterrupted run of `job` saving its model to `out`.
  void RunStraight(const std::string& job, const std::string& out) {
    auto w = StartRanks(job, Peers(2), 2,
                        {"--output=" + out, "--checkpoint_dir=" + dir_ + "/ck-straight"}, "s");
    ASSERT_EQ(WaitAll(Ptrs(w), absl::Minutes(3)), (std::vector<int>{0, 0}));
  }
  // A run of `job` on `peers` with checkpoints in <dir>/ck, stopped by SIGTERM to rank
  // `signalled` once past step 50 (both ranks stop after the same step); their done lines.
  void RunAndStop(const std::string& job, const std::string& peers, int signalled,
                  std::vector<std::string>* done) {
    auto w =
        StartRanks(job, peers, 2, {"--step_delay_ms=20", "--checkpoint_dir=" + dir_ + "/ck"}, "a");
    ASSERT_TRUE(WaitForLog(
        w[0].get(), [](const std::string& log) { return LastProgressStep(log) >= 50; },
        absl::Minutes(2)));
    ASSERT_OK(w[signalled]->Signal(SIGTERM));
    ASSERT_EQ(WaitAll(Ptrs(w), absl::Seconds(30)), (std::vector<int>{0, 0}));
    for (int r = 0; r < 2; ++r) done->push_back(DoneLine(ReadFile(w[r]->log_path())));
  }
  // The max relative difference of two saved MLPs' parameters.
  static double SavedMlpDifference(const std::string& a, const std::string& b) {
    ModelSpec spec;
    spec.set_name("mlp");
    absl::StatusOr<std::unique_ptr<Model>> m = CreateModel(spec, 1);
    EXPECT_OK(m.status());
    if (!m.ok()) return 1;
    return MaxRelError(LoadSaved(a, (*m)->ParameterNames()), LoadSaved(b, (*m)->ParameterNames()));
  }

  // Two distinct free ports as a --peers value.
  std::string Peers(int n) {
    std::vector<std::string> out;
    while (static_cast<int>(out.size()) < n) {
      absl::StatusOr<int> p = PickFreePort();
      EXPECT_OK(p.status());
      if (!p.ok()) return "";
      const std::string a = absl::StrCat("127.0.0.1:", *p);
      if (std::find(out.begin(), out.end(), a) == out.end()) out.push_back(a);
    }
    addresses_ = out;
    return absl::StrJoin(out, ",");
  }

  std::vector<std::unique_ptr<Subprocess>> StartRanks(const std::string& job_file,
                                                      const std::string& peers, int n,
                                                      std::vector<std::string> extra = {},
                                                      const std::string& tag = "w") {
    std::vector<std::unique_ptr<Subprocess>> out;
    for (int r = 0; r < n; ++r) {
      std::vector<std::string> args = {"--job=" + job_file, "--peers=" + peers,
                                       absl::StrCat("--rank=", r), "--data_dir=" + DataDir(),
                                       "--checkpoint_dir=" + dir_ + "/ckpt"};
      args.insert(args.end(), extra.begin(), extra.end());
      out.push_back(StartWorker(absl::StrCat(tag, r), args));
    }
    return out;
  }

  std::vector<std::string> addresses_;
};

constexpr char kEquivalenceJob[] = R"(
name: e2e-allreduce-eq
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: sgd, lr: 0.05, momentum: 0.9}
batch_size: 32
steps: 50
mode: allreduce
num_workers: 2
seed: 7
log_every: 10
)";

// Why 2 x 32 equals 1 x 64: BatchLoader shards like DistributedSampler, so the union of the
// two ranks' batch t is batch t of one process with batch 64 (see consistency_test.cc); each
// rank's loss is the mean over its 32 samples, and the all-reduce average (g0 + g1) / 2 is the
// gradient of the mean over 64 (up to float summation order); both ranks apply the same SGD
// momentum update (common/optimizer.h follows torch::optim::SGD) from identical seeded
// parameters. The buckets (256 KiB) split the MLP's 1 MiB of gradients into several
// all-reduces overlapping backward.
TEST_F(AllreduceTest, TwoWorkersEqualOneProcessWithTwiceTheBatch) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  constexpr int64_t kSteps = 50;
  constexpr double kTolerance = 1e-5;
  // Both ring transports: plain TCP links (the default) and the gRPC streams.
  const std::vector<std::string> transports = {"tcp", "grpc"};
  std::vector<std::string> outputs;
  for (const std::string& transport : transports) {
    const std::string output = absl::StrCat(dir_, "/model-", transport, ".pt");
    outputs.push_back(output);
    auto workers = StartRanks(
        WriteYaml(absl::StrCat("eq-", transport),
                  absl::StrCat(kEquivalenceJob,
                               "allreduce: {bucket_bytes: 262144, transport: ", transport, "}\n")),
        Peers(2), 2, {"--output=" + output});
    std::vector<int> codes = WaitAll(Ptrs(workers), absl::Minutes(3));
    ASSERT_EQ(codes, (std::vector<int>{0, 0})) << transport;
    for (int r = 0; r < 2; ++r) {
      const std::string log = ReadFile(workers[r]->log_path());
      const std::string done = DoneLine(log);
      EXPECT_EQ(ToInt(LogField(done, "steps")), kSteps) << done;
      EXPECT_EQ(ToInt(LogField(done, "samples")), kSteps * 32) << done;
      EXPECT_EQ(LogField(done, "stopped_early"), "false");
      // Each rank sends 2 (n-1)/n of the gradients per step (plus a few handshake bytes).
      EXPECT_GE(ToInt(LogField(done, "bytes_pushed")), kSteps * 269322 * 4);
      EXPECT_LT(ToInt(LogField(done, "bytes_pushed")), kSteps * 269322 * 4 + 4096);
      EXPECT_NE(log.find(absl::StrCat("transport=", transport)), std::string::npos) << log;
    }
    EXPECT_GT(ToDouble(LogField(DoneLine(ReadFile(workers[0]->log_path())), "accuracy")), 0.5);
  }

  // The reference, and the same run with rank 1's gradients dropped.
  torch::set_num_threads(1);
  ModelSpec spec;
  spec.set_name("mlp");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> ref, CreateModel(spec, 7));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> dropped, CreateModel(spec, 7));
  const std::vector<std::string> names = ref->ParameterNames();
  std::vector<torch::Tensor> initial;
  for (const auto& p : ref->Parameters()) initial.push_back(p.detach().clone());
  ASSERT_OK_AND_ASSIGN(JobData data, LoadDataset("mnist", DataDir() + "/mnist"));
  BatchLoader::Options lo;
  lo.world_size = 1;
  lo.batch_size = 64;
  lo.max_steps = kSteps;
  lo.seed = 7;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<BatchLoader> loader,
                       BatchLoader::Create(data.train.get(), lo));
  torch::optim::SGD sgd(ref->Parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD sgd_dropped(dropped->Parameters(),
                                torch::optim::SGDOptions(0.05).momentum(0.9));
  const torch::Tensor rank0 = torch::arange(0, 64, 2);  // Rank 0's samples of the 64.
  for (int64_t t = 0; t < kSteps; ++t) {
    std::optional<Batch> batch = loader->Next();
    ASSERT_TRUE(batch.has_value());
    torch::Tensor x = torch::from_blob(batch->x.data(), {64, 1, 28, 28}, torch::kFloat);
    torch::Tensor y = torch::from_blob(batch->y.data(), {64}, torch::kLong);
    sgd.zero_grad();
    ASSERT_OK_AND_ASSIGN(torch::Tensor loss, CrossEntropyLoss(ref.get(), x, y));
    loss.backward();
    sgd.step();
    // Dropped: the average sees rank 0's gradient and zeros, (g0 + 0) / 2.
    sgd_dropped.zero_grad();
    ASSERT_OK_AND_ASSIGN(torch::Tensor l0, CrossEntropyLoss(dropped.get(), x.index_select(0, rank0),
                                                            y.index_select(0, rank0)));
    (l0 * 0.5).backward();
    sgd_dropped.step();
  }
  std::vector<torch::Tensor> want, want_dropped;
  for (const auto& p : ref->Parameters()) want.push_back(p.detach());
  for (const auto& p : dropped->Parameters()) want_dropped.push_back(p.detach());
  for (size_t i = 0; i < names.size(); ++i) {
    const double moved =
        (want[i] - initial[i]).norm().item<double>() / want[i].norm().item<double>();
    EXPECT_GT(moved, 100 * kTolerance) << names[i] << ": training must move every tensor";
  }
  for (size_t t = 0; t < transports.size(); ++t) {
    std::vector<torch::Tensor> got = LoadSaved(outputs[t], names);
    ASSERT_EQ(got.size(), names.size());
    const double err = MaxRelError(got, want);
    const double err_dropped = MaxRelError(got, want_dropped);
    std::cout << absl::StrFormat(
        "transport %s: max rel. error vs batch-64 reference %.3e, vs dropped rank 1 %.3e\n",
        transports[t], err, err_dropped);
    EXPECT_LE(err, kTolerance) << transports[t];
    EXPECT_GT(err_dropped, 100 * kTolerance) << "the comparison could not tell a dropped gradient";
  }
}

constexpr char kGuardrailJob[] = R"(
name: e2e-allreduce-guard
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: sgd, lr: 0.05, momentum: 0.9}
batch_size: 16
accumulation_steps: 2
clip_grad_norm: 0.5
loss_scale: {mode: dynamic, init_scale: 1024, growth_interval: 10}
steps: 50
mode: allreduce
num_workers: 2
seed: 7
log_every: 10
allreduce: {bucket_bytes: 262144}
)";

// Accumulation and clipping (#14): 2 workers x 2 micro-batches of 16, clipped to a global
// norm of 0.5, equal one process with batch 64 clipped by torch::nn::utils::clip_grad_norm_
// (LibTorch's own implementation) to 1e-5 after 50 steps. The micro-batches of a step are
// loader batches 2s and 2s+1 of 16, whose union over both ranks is batch s of 64; each
// micro-batch's loss is divided by 2, so the accumulated gradient is the rank's mean over 32,
// the all-reduce averages the two ranks, and the allreduce mode clips that average (the
// global norm) before its optimizer. The run must also differ from the unclipped reference.
// With dynamic loss scaling on (scale 2^10, doubling every 10 good steps: exact in float32)
// the gradients travel scaled and the allreduce mode unscales the averaged one, so the result
// is the same; no step overflows, and the scale ends at 2^15 on both ranks.
TEST_F(AllreduceTest, AccumulationAndGlobalClippingEqualOneProcessWithTheWholeBatch) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  constexpr int64_t kSteps = 50;
  constexpr double kTolerance = 1e-5;
  const std::string output = dir_ + "/model-guard.pt";
  auto workers = StartRanks(WriteYaml("guard", kGuardrailJob), Peers(2), 2, {"--output=" + output});
  std::vector<int> codes = WaitAll(Ptrs(workers), absl::Minutes(3));
  ASSERT_EQ(codes, (std::vector<int>{0, 0}));
  double clipped_sum = 0;
  int progress_lines = 0;
  for (int r = 0; r < 2; ++r) {
    const std::string log = ReadFile(workers[r]->log_path());
    const std::string done = DoneLine(log);
    EXPECT_EQ(ToInt(LogField(done, "steps")), kSteps) << done;
    EXPECT_EQ(ToInt(LogField(done, "samples")), kSteps * 32) << done;
    // One all-reduce of the gradients per step, not per micro-batch.
    EXPECT_LT(ToInt(LogField(done, "bytes_pushed")), kSteps * 269322 * 4 + 4096);
    EXPECT_EQ(ToInt(LogField(done, "skipped_steps")), 0) << done;
    std::string last_progress;
    for (const std::string& line : std::vector<std::string>(absl::StrSplit(log, "\n"))) {
      if (line.find("event=progress") == std::string::npos) continue;
      last_progress = line;
      clipped_sum += ToDouble(LogField(line, "clipped"));
      ++progress_lines;
    }
    EXPECT_EQ(LogField(last_progress, "loss_scale"), "32768") << last_progress;
  }
  EXPECT_GT(progress_lines, 0);
  EXPECT_GT(clipped_sum, 0) << "the bound must bite for the test to mean anything";

  ClippedReferenceOptions ro;
  ro.mnist_dir = DataDir() + "/mnist";
  ro.steps = kSteps;
  ASSERT_OK_AND_ASSIGN(const ClippedReference ref, TrainClippedMlpReference(ro));
  const std::vector<std::string>& names = ref.names;
  const std::vector<torch::Tensor>& want = ref.clipped;
  const std::vector<torch::Tensor>& want_free = ref.unclipped;
  std::vector<torch::Tensor> got = LoadSaved(output, names);
  ASSERT_EQ(got.size(), names.size());
  const double err = MaxRelError(got, want);
  const double err_free = MaxRelError(got, want_free);
  std::cout << absl::StrFormat(
      "accumulation 2 x 16 + clip 0.5: max rel. error vs clipped batch-64 reference %.3e, vs "
      "unclipped %.3e\n",
      err, err_free);
  EXPECT_LE(err, kTolerance);
  EXPECT_GT(err_free, 100 * kTolerance) << "the comparison could not tell clipping from none";
}

constexpr char kLongJob[] = R"(
name: e2e-allreduce-fail
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: sgd, lr: 0.05}
batch_size: 16
steps: 100000
mode: allreduce
num_workers: 2
seed: 3
log_every: 20
allreduce: {timeout_s: 5}
)";

TEST_F(AllreduceTest, KilledPeerFailsTheOtherFastNamingIt) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  auto workers = StartRanks(WriteYaml("kill", kLongJob), Peers(2), 2);
  ASSERT_TRUE(WaitForLog(
      workers[1].get(), [](const std::string& log) { return LastProgressStep(log) >= 40; },
      absl::Minutes(2)));
  ASSERT_OK(workers[0]->Signal(SIGKILL));
  const absl::Time killed = absl::Now();
  ASSERT_OK_AND_ASSIGN(int code, workers[1]->Wait(absl::Seconds(5 + 5)));
  const absl::Duration took = absl::Now() - killed;
  EXPECT_EQ(code, 1);
  const std::string log = ReadFile(workers[1]->log_path());
  EXPECT_NE(log.find("event=failed"), std::string::npos) << log;
  // The error names the dead peer by rank and address.
  EXPECT_NE(log.find(absl::StrCat("rank 0 (", addresses_[0], ")")), std::string::npos) << log;
  EXPECT_NE(log.find("UNAVAILABLE"), std::string::npos) << log;
  std::cout << "survivor exited " << absl::FormatDuration(took) << " after the kill\n";
}

TEST_F(AllreduceTest, SilentPeerTimesOutNamingIt) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  auto workers = StartRanks(WriteYaml("stop", kLongJob), Peers(2), 2);
  ASSERT_TRUE(WaitForLog(
      workers[0].get(), [](const std::string& log) { return LastProgressStep(log) >= 40; },
      absl::Minutes(2)));
  ASSERT_OK(workers[1]->Signal(SIGSTOP));  // Alive, connected, silent.
  const absl::Time stopped = absl::Now();
  ASSERT_OK_AND_ASSIGN(int code, workers[0]->Wait(absl::Seconds(5 + 5)));
  const absl::Duration took = absl::Now() - stopped;
  EXPECT_EQ(code, 1);
  EXPECT_GE(took, absl::Seconds(4.5));
  const std::string log = ReadFile(workers[0]->log_path());
  EXPECT_NE(log.find("DEADLINE_EXCEEDED"), std::string::npos) << log;
  EXPECT_NE(log.find(absl::StrCat("rank 1 (", addresses_[1], ")")), std::string::npos) << log;
  ASSERT_OK(workers[1]->Signal(SIGKILL));
}

constexpr char kAccuracyJob[] = R"(
name: e2e-allreduce-mnist
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: sgd, lr: 0.05, momentum: 0.9, nesterov: true, lr_schedule: cosine}
batch_size: 32
epochs: 1
mode: allreduce
num_workers: 2
seed: 1
log_every: 200
)";

// With --job_token_file (standalone): every ring stream carries the job token, so the run
// only succeeds if both ranks' peer services accept each other's streams.
TEST_F(AllreduceTest, MnistMlpOneEpochReaches97Percent) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  std::ofstream(dir_ + "/job.token") << "e2e-allreduce-token-81c2\n";
  auto workers = StartRanks(WriteYaml("acc", kAccuracyJob), Peers(2), 2,
                            {"--job_token_file=" + dir_ + "/job.token"});
  ASSERT_EQ(WaitAll(Ptrs(workers), absl::Minutes(5)), (std::vector<int>{0, 0}));
  const std::string done = DoneLine(ReadFile(workers[0]->log_path()));
  const double accuracy = ToDouble(LogField(done, "accuracy"));
  std::cout << "allreduce MNIST MLP 1 epoch: accuracy " << accuracy << ", "
            << LogField(done, "samples_per_s").value_or("?") << " samples/s per worker\n";
  EXPECT_EQ(ToInt(LogField(done, "steps")), 60000 / 64);
  EXPECT_GE(accuracy, 0.97) << done;
  // Backend "auto" (the default): NCCL needs a CUDA build and a GPU per rank, else the ring.
  const std::string log = ReadFile(workers[0]->log_path());
  const bool nccl = log.find("backend=nccl") != std::string::npos;
  EXPECT_TRUE(nccl || log.find("backend=ring") != std::string::npos) << log;
}

// Backend "nccl" in a worker built without --config=cuda: every rank refuses before training,
// naming the build flag.
TEST_F(AllreduceTest, NcclBackendWithoutCudaBuildFailsNamingTheFlag) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  if (NcclBuiltIn()) GTEST_SKIP() << "built with --config=cuda";  // Same build as the worker.
  std::string yaml = kAccuracyJob;
  yaml += "allreduce: {backend: nccl}\n";
  auto workers = StartRanks(WriteYaml("nccl", yaml), Peers(2), 2);
  for (const auto& w : workers) {
    ASSERT_OK_AND_ASSIGN(int code, w->Wait(absl::Minutes(1)));
    EXPECT_EQ(code, 1);
    const std::string l = ReadFile(w->log_path());
    EXPECT_NE(l.find("allreduce.backend nccl needs a worker built with --config=cuda"),
              std::string::npos)
        << l;
    EXPECT_EQ(l.find("event=train_start"), std::string::npos) << l;
  }
}

constexpr char kCheckpointJob[] = R"(
name: e2e-allreduce-ckpt
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: adam, lr: 0.001}
batch_size: 32
steps: 120
mode: allreduce
num_workers: 2
seed: 5
log_every: 10
checkpoint: {every_steps: 20}
)";

// Stop (SIGTERM: every rank stops after the same step) past a checkpoint, restart: the ranks
// resume from their newest common checkpoint (with Adam's slots) and end exactly where an
// uninterrupted run ends.
TEST_F(AllreduceTest, ResumesFromCheckpointsToTheSameResult) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  const std::string job = WriteYaml("ckpt", kCheckpointJob);
  const std::string straight = dir_ + "/straight.pt", resumed = dir_ + "/resumed.pt";
  ASSERT_NO_FATAL_FAILURE(RunStraight(job, straight));
  const std::string peers = Peers(2);
  {
    std::vector<std::string> stopped;
    // One rank asks; both stop after the same step.
    ASSERT_NO_FATAL_FAILURE(RunAndStop(job, peers, /*signalled=*/1, &stopped));
    for (const std::string& done : stopped) {
      EXPECT_EQ(LogField(done, "stopped_early"), "true") << done;
    }
    EXPECT_EQ(ToInt(LogField(stopped[0], "steps")), ToInt(LogField(stopped[1], "steps")));
  }
  auto w =
      StartRanks(job, peers, 2, {"--output=" + resumed, "--checkpoint_dir=" + dir_ + "/ck"}, "b");
  ASSERT_EQ(WaitAll(Ptrs(w), absl::Minutes(3)), (std::vector<int>{0, 0}));
  const std::string log0 = ReadFile(w[0]->log_path());
  const std::string done = DoneLine(log0);
  const int64_t first = ToInt(LogField(done, "first_step"));
  EXPECT_GE(first, 40);
  EXPECT_EQ(first % 20, 0);
  EXPECT_EQ(ToInt(LogField(done, "steps")), 120 - first);
  EXPECT_NE(log0.find("event=resuming"), std::string::npos);
  const double err = SavedMlpDifference(resumed, straight);
  std::cout << "resumed at step " << first << ": max rel. difference " << err << "\n";
  EXPECT_EQ(err, 0) << "a resumed run must redo exactly the same steps";
}

// A rank that comes back without its checkpoint files (moved to another node, or its disk
// lost): no step is common, so rank 0 sends it its newest checkpoint, and the run still ends
// exactly where an uninterrupted one does.
TEST_F(AllreduceTest, ARankWithoutCheckpointsIsSentThem) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  const std::string job = WriteYaml("moved", kCheckpointJob);
  const std::string straight = dir_ + "/straight.pt", resumed = dir_ + "/resumed.pt";
  ASSERT_NO_FATAL_FAILURE(RunStraight(job, straight));
  const std::string peers = Peers(2);
  std::vector<std::string> stopped;
  ASSERT_NO_FATAL_FAILURE(RunAndStop(job, peers, /*signalled=*/0, &stopped));
  // Rank 1's files are gone (the job's name is e2e-allreduce-ckpt).
  int removed = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_ + "/ck/e2e-allreduce-ckpt")) {
    if (absl::StartsWith(e.path().filename().string(), "rank-1.")) {
      std::filesystem::remove(e.path());
      ++removed;
    }
  }
  ASSERT_GE(removed, 1);
  auto w =
      StartRanks(job, peers, 2, {"--output=" + resumed, "--checkpoint_dir=" + dir_ + "/ck"}, "b");
  ASSERT_EQ(WaitAll(Ptrs(w), absl::Minutes(3)), (std::vector<int>{0, 0}));
  const std::string log1 = ReadFile(w[1]->log_path());
  const std::vector<std::string> resuming = testutil::LinesWith(log1, "event=resuming");
  ASSERT_EQ(resuming.size(), 1u) << log1;
  EXPECT_EQ(LogField(resuming[0], "checkpoint_from_rank"), "0") << resuming[0];
  const int64_t first = ToInt(LogField(DoneLine(log1), "first_step"));
  EXPECT_GE(first, 40);
  EXPECT_EQ(first % 20, 0);
  const double err = SavedMlpDifference(resumed, straight);
  std::cout << "rank 1 sent step " << first << ": max rel. difference " << err << "\n";
  EXPECT_EQ(err, 0) << "the sent checkpoint must be rank 0's exactly (with Adam's slots)";
}

}  // namespace
}  // namespace e2e
}  // namespace gradmesh
