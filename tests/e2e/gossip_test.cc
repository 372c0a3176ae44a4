// End-to-end tests of mode "gossip": four gradmesh_worker processes on 127.0.0.1 training the
// MNIST MLP with no shards, each serving its GossipService on a --peers entry (see
// worker/gossip/gossip_mode.h and tests/e2e/e2e_harness.h).
//
// * ExponentialReachesAccuracyAndConsensusShrinks: SGP push-sum over the exponential graph,
//   adam (lr 0.003: four ranks of batch 64 train like one of batch 256) + cosine schedule, 3
//   epochs (2 reach ~0.972, 3 ~0.978; about 4 s per epoch for all four on 2 cores): every rank
//   waits for its three peers before its first step (gossip.start_wait_s; a rank started
//   seconds late on a busy machine left the others to train without it) and
//   runs all its steps and exits 0, rank 0 averages all four finals and reaches >= 0.97 test
//   accuracy, and the consensus distance in the progress lines
//   falls by a clear factor from its peak (the models drift apart while the learning rate is
//   high and are pulled together as it decays). The workers run with --job_token_file, so
//   every exchange carries the job token; a caller of rank 1's peer service without it is
//   UNAUTHENTICATED and one with another token PERMISSION_DENIED while the job runs.
// * KilledWorkerDoesNotStopTheOthers: pairwise averaging ("random"); rank 3 is SIGKILLed
//   mid-run. The other three notice (event=gossip_peer_down), keep training, finish, exit 0,
//   and rank 0 evaluates the average of the three live finals.
// * StoppedWorkerResumesFromItsCheckpoint: checkpoint.every_steps 50; rank 2 gets SIGTERM,
//   stops mixing, writes its checkpoint and exits 0; restarted, it resumes at that step
//   (event=resuming), finishes the remaining steps, and rank 0 averages all four finals, whose
//   push-sum weights still sum to 4 (no share was lost in the stop and restart).
// * PushSumCountsEveryLocalStepOnce: a constant-gradient model, one rank slowed: the average
//   is exactly the sum of every rank's steps, and integer and float counter buffers count
//   every forward; a causal-mask buffer of -inf is pinned (not mixed) and comes out intact.
// * AModelOverTheMessageLimitIsRefusedAtStart: a model whose exchange exceeds the peer
//   service's message limit fails every rank at start with FAILED_PRECONDITION.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "proto/gossip.grpc.pb.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/testing/subprocess.h"

namespace gradmesh {
namespace e2e {
namespace {

using testutil::LinesWith;
using testutil::LogField;
using testutil::Ptrs;
using testutil::ReadFile;

constexpr int kWorkers = 4;

class GossipE2eTest : public E2eHarness {
 protected:
  // Writes a job spec with `gossip_yaml` (the body of its gossip: mapping) and `more_yaml`,
  // and starts kWorkers gossip workers on free ports with it plus `extra` flags.
  void StartGossipWorkers(const std::string& job, const std::string& gossip_yaml,
                          const std::vector<std::string>& extra,
                          const std::string& more_yaml = "") {
    std::vector<std::string>& peers = peers_;
    for (int r = 0; r < kWorkers; ++r) {
      ASSERT_OK_AND_ASSIGN(int port, PickFreePort());
      peers.push_back(absl::StrCat("127.0.0.1:", port));
    }
    const std::string spec = dir_ + "/" + job + ".yaml";
    std::ofstream(spec) << "name: " << job << "\nmode: gossip\nmodel: {name: mlp}\n"
                        << "dataset: {name: mnist}\nnum_workers: " << kWorkers << "\ngossip: {"
                        << gossip_yaml << "}\n"
                        << more_yaml;
    for (int r = 0; r < kWorkers; ++r) {
      std::vector<std::string> args = {"--job=" + spec, "--peers=" + absl::StrJoin(peers, ","),
                                       absl::StrCat("--rank=", r), "--data_dir=" + DataDir(),
                                       "--checkpoint_dir=" + dir_ + "/ckpt"};
      args.insert(args.end(), extra.begin(), extra.end());
      args_.push_back(args);
      workers_.push_back(StartWorker(absl::StrCat(job, "-rank", r), args));
      ASSERT_NE(workers_.back(), nullptr);
    }
  }

  std::vector<Subprocess*> Procs() { return Ptrs(workers_); }

  std::string Log(int r) { return ReadFile(workers_[r]->log_path()); }

  std::vector<std::unique_ptr<Subprocess>> workers_;
  std::vector<std::vector<std::string>> args_;  // Each rank's flags, for restarts.
  std::vector<std::string> peers_;              // Each rank's peer-service address.
};

// (step, consensus) of a worker's progress lines that measured one.
std::vector<std::pair<int64_t, double>> Consensus(const std::string& log) {
  std::vector<std::pair<int64_t, double>> out;
  for (const std::string& line : LinesWith(log, "event=progress")) {
    const double c = ToDouble(LogField(line, "consensus"));
    if (c >= 0) out.emplace_back(ToInt(LogField(line, "step")), c);
  }
  return out;
}

TEST_F(GossipE2eTest, ExponentialReachesAccuracyAndConsensusShrinks) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  constexpr int kEpochs = 3;
  const absl::Time start = absl::Now();
  const std::string model_path = dir_ + "/gossip-model.pt";
  const std::string token = "e2e-gossip-job-token-5f3a9c";
  std::ofstream(dir_ + "/job.token") << token << "\n";
  ASSERT_NO_FATAL_FAILURE(StartGossipWorkers(
      "gossip-exp", "topology: exponential, every_steps: 1, timeout_s: 2",
      {absl::StrCat("--epochs=", kEpochs), "--lr=0.003", "--lr_schedule=cosine", "--log_every=20",
       "--output=" + model_path, "--job_token_file=" + dir_ + "/job.token"}));
  // While rank 1 trains, its peer service answers only holders of the job's token.
  ASSERT_TRUE(WaitForLog(
      workers_[1].get(), [](const std::string& log) { return LastProgressStep(log) >= 20; },
      absl::Minutes(3)));
  auto stub =
      GossipService::NewStub(grpc::CreateChannel(peers_[1], grpc::InsecureChannelCredentials()));
  auto get_state = [&](const std::string& presented) {
    GossipStateRequest req;
    req.set_job("gossip-exp");
    req.set_rank(1);
    GossipStateResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    if (!presented.empty()) ctx.AddMetadata("x-gradmesh-job-token", presented);
    return stub->GetState(&ctx, req, &resp).error_code();
  };
  EXPECT_EQ(get_state(""), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(get_state("another-jobs-token"), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(get_state(token), grpc::StatusCode::OK);
  const std::vector<int> codes = WaitAll(Procs(), absl::Minutes(6));
  const double wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  for (int r = 0; r < kWorkers; ++r) ASSERT_EQ(codes[r], 0) << "rank " << r;

  // 60000 / (64 * 4) = 234 steps per epoch.
  constexpr int64_t kSteps = 234 * kEpochs;
  for (int r = 0; r < kWorkers; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    const std::string done = DoneLine(Log(r));
    ASSERT_FALSE(done.empty());
    EXPECT_EQ(ToInt(LogField(done, "steps")), kSteps);
    EXPECT_EQ(LogField(done, "stopped_early"), "false");
    EXPECT_GT(ToInt(LogField(done, "bytes_pushed")), 0);
    // Each waited for its three peers before its first step, so all four train side by side.
    const std::vector<std::string> ready = LinesWith(Log(r), "event=gossip_peers_ready");
    ASSERT_EQ(ready.size(), 1u);
    EXPECT_EQ(LogField(ready[0], "until"), "all_answered");
    if (r > 0) {
      EXPECT_EQ(LinesWith(Log(r), "event=final_delivered").size(), 1u);
      // It stays until the root has gathered, so peers can settle their shares with it.
      const std::vector<std::string> linger = LinesWith(Log(r), "event=final_linger");
      ASSERT_EQ(linger.size(), 1u);
      EXPECT_EQ(LogField(linger[0], "until"), "gathered");
      EXPECT_EQ(LogField(done, "accuracy"), "-1.0000");
    }
  }
  const std::string log0 = Log(0);
  const std::vector<std::string> avg = LinesWith(log0, "event=final_average");
  ASSERT_EQ(avg.size(), 1u);
  EXPECT_EQ(LogField(avg[0], "ranks"), "0,1,2,3");
  // Every share is either delivered or taken back: the weights still sum to n.
  EXPECT_NEAR(ToDouble(LogField(avg[0], "weight_sum")), 4.0, 1e-3);
  const double accuracy = ToDouble(LogField(DoneLine(log0), "accuracy"));
  EXPECT_GE(accuracy, 0.97);
  EXPECT_FALSE(ReadFile(model_path).empty()) << "rank 0 saves the model to --output";

  // Consensus: models start identical (same seed), drift apart while the learning rate is
  // high, and are pulled together as it decays: the last value is far below the peak.
  const std::vector<std::pair<int64_t, double>> c = Consensus(log0);
  ASSERT_GE(c.size(), 20u);
  double peak = 0;
  int64_t peak_step = 0;
  for (const auto& [step, value] : c) {
    if (value > peak) peak = value, peak_step = step;
  }
  const double last = c.back().second;
  std::cout << "gossip exponential: " << kEpochs << " epochs, accuracy " << accuracy << ", wall "
            << wall_s << " s; consensus peak " << peak << " at step " << peak_step << ", last "
            << last << " at step " << c.back().first << ", finals "
            << LogField(avg[0], "consensus").value_or("?") << "\n";
  EXPECT_LT(peak_step, c.back().first);
  EXPECT_LT(last, peak / 4) << "consensus distance should shrink as the lr decays";
  RecordProperty("accuracy", absl::StrCat(accuracy));
}

// Push-sum counts every local step once, whatever weight the rank holds when it steps. A
// model whose gradient is 1 in each of its 1,000 elements (loss = sum(w)), plain SGD lr 0.001,
// 150 steps on each of the 4 ranks, one of them slowed (--step_delay_ms=4, so it steps while
// its shares are in flight and at other weights than 1): any exact mixing ends with the
// average w = -0.001 * 150 = -0.15 in every element, and the int64 and float counters the
// forward increments at 150. Before, a step counted w-fold (x moved by the step, the mass
// w x by w times it) and a share taken back counted the steps taken meanwhile again: runs
// ended anywhere from -0.10 to -0.32; the int64 counter also drifted by its rounding.
TEST_F(GossipE2eTest, PushSumCountsEveryLocalStepOnce) {
  const std::string make = dir_ + "/make_constant.py";
  std::ofstream(make) << R"PY(import sys, torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1000))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("fcount", torch.zeros(4))
        self.register_buffer("mask", torch.full((3, 3), float("-inf")).triu(1))
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        self.fcount += 1.0
        return x.sum(1) * 0 + self.w.sum() + torch.exp(self.mask).sum() * 0.0
    @torch.jit.export
    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.forward(x).mean()
d = sys.argv[1]
torch.jit.script(M()).save(d + "/constant.pt")
import os
os.makedirs(d + "/constant_data", exist_ok=True)
torch.save({"x": torch.randn(400, 4), "y": torch.zeros(400)}, d + "/constant_data/train.pt")
)PY";
  ASSERT_EQ(std::system(absl::StrCat("/usr/bin/python3 ", make, " ", dir_).c_str()), 0);
  std::vector<std::string> peers;
  for (int r = 0; r < kWorkers; ++r) {
    ASSERT_OK_AND_ASSIGN(int port, PickFreePort());
    peers.push_back(absl::StrCat("127.0.0.1:", port));
  }
  const std::string spec = dir_ + "/constant.yaml";
  std::ofstream(spec) << "name: gossip-constant\nmode: gossip\nmodel: {name: torchscript, path: "
                      << dir_ << "/constant.pt}\ndataset: {name: tensors, path: " << dir_
                      << "/constant_data}\nloss: module\nnum_workers: " << kWorkers
                      << "\nbatch_size: 4\nsteps: 150\nlog_every: 50\n"
                      << "optimizer: {name: sgd, lr: 0.001, lr_schedule: constant}\n"
                      << "gossip: {topology: exponential, every_steps: 1}\n";
  for (int r = 0; r < kWorkers; ++r) {
    std::vector<std::string> args = {"--job=" + spec, "--peers=" + absl::StrJoin(peers, ","),
                                     absl::StrCat("--rank=", r),
                                     "--output=" + dir_ + "/constant_out.pt"};
    if (r == 1) args.push_back("--step_delay_ms=4");
    workers_.push_back(StartWorker(absl::StrCat("gossip-constant-rank", r), args));
    ASSERT_NE(workers_.back(), nullptr);
  }
  const std::vector<int> codes = WaitAll(Procs(), absl::Minutes(4));
  for (int r = 0; r < kWorkers; ++r) ASSERT_EQ(codes[r], 0) << "rank " << r << "\n" << Log(r);
  EXPECT_EQ(LogField(LinesWith(Log(0), "event=final_average")[0], "ranks"), "0,1,2,3");
  const std::string check = dir_ + "/check_constant.py";
  const std::string result = dir_ + "/constant_result.txt";
  std::ofstream(check) << R"PY(import sys, torch
m = torch.jit.load(sys.argv[1])
w = m.w.detach()
open(sys.argv[2], "w").write("%.9f %.9f %d %.6f %.6f %d %d\n" % (
    float(w.min()), float(w.max()), int(m.count), float(m.fcount.min()), float(m.fcount.max()),
    int(torch.isneginf(m.mask).sum()), int(torch.isnan(m.mask).sum())))
)PY";
  ASSERT_EQ(
      std::system(
          absl::StrCat("/usr/bin/python3 ", check, " ", dir_, "/constant_out.pt ", result).c_str()),
      0);
  double w_min = 0, w_max = 0, f_min = 0, f_max = 0;
  int64_t count = 0, neg_inf = 0, nan = -1;
  std::ifstream(result) >> w_min >> w_max >> count >> f_min >> f_max >> neg_inf >> nan;
  // The causal mask of -inf (a buffer the forward reads) is pinned, not mixed: still 3 -inf.
  EXPECT_EQ(neg_inf, 3);
  EXPECT_EQ(nan, 0);
  for (int r = 0; r < kWorkers; ++r) {
    const std::vector<std::string> pinned = LinesWith(Log(r), "event=gossip_pinned");
    ASSERT_EQ(pinned.size(), 1u) << "rank " << r;
    EXPECT_EQ(LogField(pinned[0], "elements"), "3");
  }
  EXPECT_NEAR(w_min, -0.15, 1e-5);
  EXPECT_NEAR(w_max, -0.15, 1e-5);
  EXPECT_EQ(count, 150);
  EXPECT_NEAR(f_min, 150, 1e-3);
  EXPECT_NEAR(f_max, 150, 1e-3);
}

// Every gossip exchange carries the whole model in one message. One over the peer service's
// message limit (here 1 MiB against the MLP's 1,077,288 bytes) would fail every exchange and
// leave each rank training alone: the job is refused at start, saying what to change.
TEST_F(GossipE2eTest, AModelOverTheMessageLimitIsRefusedAtStart) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  ASSERT_NO_FATAL_FAILURE(
      StartGossipWorkers("gossip-big", "topology: exponential", {"--max_message_mb=1"}));
  for (int r = 0; r < kWorkers; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ASSERT_OK_AND_ASSIGN(const int code, workers_[r]->Wait(absl::Minutes(2)));
    EXPECT_NE(code, 0) << Log(r);
    const std::vector<std::string> failed = LinesWith(Log(r), "event=failed");
    ASSERT_EQ(failed.size(), 1u) << Log(r);
    EXPECT_NE(failed[0].find("FAILED_PRECONDITION: gossip: every exchange carries the whole "
                             "model, 1077288 bytes as float32, which exceeds the 1048576-byte "
                             "message limit"),
              std::string::npos)
        << failed[0];
    EXPECT_TRUE(LinesWith(Log(r), "event=progress").empty());
  }
}

TEST_F(GossipE2eTest, KilledWorkerDoesNotStopTheOthers) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  constexpr int64_t kSteps = 300;
  ASSERT_NO_FATAL_FAILURE(StartGossipWorkers("gossip-kill",
                                             "topology: random, every_steps: 2, timeout_s: 1",
                                             {absl::StrCat("--steps=", kSteps), "--log_every=20"}));
  // Kill rank 3 once it is well into training.
  ASSERT_TRUE(WaitForLog(
      workers_[3].get(), [](const std::string& log) { return LastProgressStep(log) >= 60; },
      absl::Minutes(3)));
  ASSERT_OK(workers_[3]->Signal(SIGKILL));
  ASSERT_OK_AND_ASSIGN(int killed, workers_[3]->Wait(absl::Seconds(10)));
  EXPECT_EQ(killed, -SIGKILL);
  EXPECT_LT(LastProgressStep(Log(3)), kSteps);

  std::vector<Subprocess*> live = {workers_[0].get(), workers_[1].get(), workers_[2].get()};
  const std::vector<int> codes = WaitAll(live, absl::Minutes(4));
  int noticed = 0;
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ASSERT_EQ(codes[r], 0);
    const std::string log = Log(r);
    const std::string done = DoneLine(log);
    ASSERT_FALSE(done.empty());
    EXPECT_EQ(ToInt(LogField(done, "steps")), kSteps);
    for (const std::string& line : LinesWith(log, "event=gossip_peer_down")) {
      noticed += LogField(line, "peer") == "3" ? 1 : 0;
    }
  }
  EXPECT_GE(noticed, 1) << "some rank should have found rank 3 down";
  const std::string log0 = Log(0);
  const std::vector<std::string> avg = LinesWith(log0, "event=final_average");
  ASSERT_EQ(avg.size(), 1u);
  EXPECT_EQ(LogField(avg[0], "ranks"), "0,1,2");
  EXPECT_EQ(LinesWith(log0, "event=final_peer_given_up").size(), 1u);
  const double accuracy = ToDouble(LogField(DoneLine(log0), "accuracy"));
  std::cout << "gossip with rank 3 killed: accuracy " << accuracy << "\n";
  EXPECT_GE(accuracy, 0.9);
}

TEST_F(GossipE2eTest, StoppedWorkerResumesFromItsCheckpoint) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  constexpr int64_t kSteps = 300;
  ASSERT_NO_FATAL_FAILURE(StartGossipWorkers("gossip-resume", "topology: exponential",
                                             {absl::StrCat("--steps=", kSteps), "--log_every=20"},
                                             "checkpoint: {every_steps: 50}\n"));
  ASSERT_TRUE(WaitForLog(
      workers_[2].get(), [](const std::string& log) { return LastProgressStep(log) >= 100; },
      absl::Minutes(3)));
  ASSERT_OK(workers_[2]->Signal(SIGTERM));
  ASSERT_OK_AND_ASSIGN(int stopped, workers_[2]->Wait(absl::Seconds(30)));
  ASSERT_EQ(stopped, 0);
  const std::string first = Log(2);
  const std::string first_done = DoneLine(first);
  ASSERT_EQ(LogField(first_done, "stopped_early"), "true") << first_done;
  const int64_t stop_step = ToInt(LogField(first_done, "steps"));
  ASSERT_GE(stop_step, 100);
  ASSERT_LT(stop_step, kSteps);
  const std::vector<std::string> ckpts = LinesWith(first, "event=checkpoint");
  ASSERT_FALSE(ckpts.empty());
  EXPECT_EQ(ToInt(LogField(ckpts.back(), "step")), stop_step);
  EXPECT_TRUE(LinesWith(first, "event=final_delivered").empty()) << "a stopped rank has no final";

  workers_[2] = StartWorker("gossip-resume-rank2-restarted", args_[2]);
  ASSERT_NE(workers_[2], nullptr);
  const std::vector<int> codes = WaitAll(Procs(), absl::Minutes(4));
  for (int r = 0; r < kWorkers; ++r) ASSERT_EQ(codes[r], 0) << "rank " << r;
  const std::string resumed = Log(2);
  const std::vector<std::string> resuming = LinesWith(resumed, "event=resuming");
  ASSERT_EQ(resuming.size(), 1u);
  EXPECT_EQ(ToInt(LogField(resuming[0], "step")), stop_step);
  // A resumed rank joins its running peers at once: no start rendezvous.
  EXPECT_TRUE(LinesWith(resumed, "event=gossip_peers_ready").empty());
  const std::string done = DoneLine(resumed);
  EXPECT_EQ(ToInt(LogField(done, "first_step")), stop_step);
  EXPECT_EQ(ToInt(LogField(done, "steps")), kSteps - stop_step);
  EXPECT_EQ(LinesWith(resumed, "event=final_delivered").size(), 1u);

  const std::vector<std::string> avg = LinesWith(Log(0), "event=final_average");
  ASSERT_EQ(avg.size(), 1u);
  EXPECT_EQ(LogField(avg[0], "ranks"), "0,1,2,3");
  EXPECT_NEAR(ToDouble(LogField(avg[0], "weight_sum")), 4.0, 1e-3);
  const double accuracy = ToDouble(LogField(DoneLine(Log(0)), "accuracy"));
  std::cout << "gossip with rank 2 stopped at step " << stop_step << " and resumed: accuracy "
            << accuracy << "\n";
  EXPECT_GE(accuracy, 0.9);
}

}  // namespace
}  // namespace e2e
}  // namespace gradmesh
