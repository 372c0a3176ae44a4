// End-to-end: a modelled 100 Mbit/s link (--link_mbit=100, each worker paces its tensor traffic
// per direction) makes the dense job communication-bound; DGC-style compression (topk:0.01+fp16
// pushes with momentum correction, sgd on the shards so updates stay sparse, "changes" pulls)
// must lift throughput accordingly. 2 shards, 2 async workers, MNIST MLP, 150 steps each:
//
//   run          flags                                                   asserted
//   dense        --optimizer=sgd --lr=0.05                               the baseline
//   compressed   + --push_codec=topk:0.01+fp16 --ef_momentum=0.9         samples/s >= 5x dense
//                  --pull_codec=changes                                  push B/step >= 100x less
//                                                                        pull B/step >= 10x less
//
// samples/s is the sum of both workers' event=done lines; bytes per step are per worker (each
// worker's done line, both checked). Measured by hand: 378 vs 9,819 samples/s per worker (26x).
// The test prints a table and records the numbers as test properties. About 40 s.
#include <cstdint>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "proto/gradmesh.pb.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/testing/subprocess.h"

namespace gradmesh {
namespace e2e {
namespace {

using testutil::LogField;
using testutil::ReadFile;

constexpr int kShards = 2;
constexpr int kWorkers = 2;
constexpr int64_t kSteps = 150;
constexpr int64_t kMlpParams = 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10;

struct WorkerResult {
  int64_t steps = -1;
  double samples_per_s = -1;
  int64_t bytes_pushed = -1, raw_bytes_pushed = -1;
  int64_t bytes_pulled = -1, raw_bytes_pulled = -1;
  double comm_s = -1;
  double push_per_step() const { return static_cast<double>(bytes_pushed) / steps; }
  double pull_per_step() const { return static_cast<double>(bytes_pulled) / steps; }
};

struct LinkRun {
  std::string label;
  std::vector<std::string> flags;
  WorkerResult w[kWorkers];
  double samples_per_s = 0;  // both workers
  double accuracy = -1;
  double wall_s = -1;
};

class LinkE2eTest : public E2eHarness {
 protected:
  void Train(const std::string& job, LinkRun* run) {
    const absl::Time start = absl::Now();
    std::vector<std::unique_ptr<Subprocess>> workers;
    for (int r = 0; r < kWorkers; ++r) {
      std::vector<std::string> args = {ServersFlag(),
                                       absl::StrCat("--rank=", r),
                                       absl::StrCat("--num_workers=", kWorkers),
                                       absl::StrCat("--steps=", kSteps),
                                       "--model=mlp",
                                       "--dataset=mnist",
                                       "--mode=async",
                                       "--optimizer=sgd",
                                       "--lr=0.05",
                                       "--seed=1",
                                       "--name=" + job,
                                       "--data_dir=" + DataDir(),
                                       "--log_every=0",
                                       "--link_mbit=100"};
      args.insert(args.end(), run->flags.begin(), run->flags.end());
      workers.push_back(StartWorker(absl::StrCat(job, "-worker", r), args));
      ASSERT_NE(workers.back(), nullptr);
    }
    const std::vector<int> codes = WaitAll({workers[0].get(), workers[1].get()}, absl::Seconds(75));
    for (int r = 0; r < kWorkers; ++r) ASSERT_EQ(codes[r], 0) << run->label << " worker " << r;
    run->wall_s = absl::ToDoubleSeconds(absl::Now() - start);
    for (int r = 0; r < kWorkers; ++r) {
      const std::string done = DoneLine(ReadFile(workers[r]->log_path()));
      ASSERT_FALSE(done.empty()) << run->label << " worker " << r;
      WorkerResult& w = run->w[r];
      w.steps = ToInt(LogField(done, "steps"));
      w.samples_per_s = ToDouble(LogField(done, "samples_per_s"));
      w.bytes_pushed = ToInt(LogField(done, "bytes_pushed"));
      w.raw_bytes_pushed = ToInt(LogField(done, "raw_bytes_pushed"));
      w.bytes_pulled = ToInt(LogField(done, "bytes_pulled"));
      w.raw_bytes_pulled = ToInt(LogField(done, "raw_bytes_pulled"));
      w.comm_s = ToDouble(LogField(done, "comm_s"));
      EXPECT_EQ(w.steps, kSteps) << done;
      ASSERT_GT(w.samples_per_s, 0) << done;
      ASSERT_GT(w.bytes_pushed, 0) << done;
      ASSERT_GT(w.bytes_pulled, 0) << done;
      EXPECT_EQ(w.raw_bytes_pushed, kSteps * 4 * kMlpParams) << done;
      EXPECT_EQ(w.raw_bytes_pulled % (4 * kMlpParams), 0) << done;
      run->samples_per_s += w.samples_per_s;
      if (r == 0) run->accuracy = ToDouble(LogField(done, "accuracy"));
    }
    for (int s = 0; s < kShards; ++s) {
      ASSERT_OK_AND_ASSIGN(JobInfoResponse info, GetJobInfo(addresses_[s], job));
      EXPECT_EQ(info.pushes_applied(), kWorkers * kSteps) << run->label << " shard " << s;
    }
  }
};

TEST_F(LinkE2eTest, DgcWithChangesPullsBeatsDenseOnA100MbitLink) {
  if (!HaveMnist()) GTEST_SKIP() << "MNIST files not found under " << DataDir() << "/mnist";
  ASSERT_NO_FATAL_FAILURE(StartServers(kShards));
  LinkRun dense{"dense", {}};
  LinkRun dgc{"topk:0.01+fp16/changes",
              {"--push_codec=topk:0.01+fp16", "--ef_momentum=0.9", "--pull_codec=changes"}};
  ASSERT_NO_FATAL_FAILURE(Train("link-dense", &dense));
  ASSERT_NO_FATAL_FAILURE(Train("link-dgc", &dgc));

  std::cout << absl::StrFormat("%-24s %6s %10s %10s %12s %12s %8s %8s %7s\n", "run", "rank",
                               "samples/s", "comm_s", "push_B/step", "pull_B/step", "accuracy",
                               "wall_s", "");
  for (const LinkRun* run : {&dense, &dgc}) {
    for (int r = 0; r < kWorkers; ++r) {
      const WorkerResult& w = run->w[r];
      std::cout << absl::StrFormat("%-24s %6d %10.1f %10.2f %12.0f %12.0f %8.4f %8.1f\n",
                                   run->label, r, w.samples_per_s, w.comm_s, w.push_per_step(),
                                   w.pull_per_step(), run->accuracy, run->wall_s);
    }
  }
  const double speedup = dgc.samples_per_s / dense.samples_per_s;
  double push_ratio[kWorkers], pull_ratio[kWorkers];
  for (int r = 0; r < kWorkers; ++r) {
    push_ratio[r] = dense.w[r].push_per_step() / dgc.w[r].push_per_step();
    pull_ratio[r] = dense.w[r].pull_per_step() / dgc.w[r].pull_per_step();
  }
  std::cout << absl::StrFormat(
                   "samples/s (both workers): dense %.1f, compressed %.1f, speedup %.1fx\n"
                   "push ratio rank0 %.1fx rank1 %.1fx; pull ratio rank0 %.1fx rank1 %.1fx\n",
                   dense.samples_per_s, dgc.samples_per_s, speedup, push_ratio[0], push_ratio[1],
                   pull_ratio[0], pull_ratio[1])
            << std::flush;
  RecordProperty("samples_per_s_dense", absl::StrFormat("%.1f", dense.samples_per_s));
  RecordProperty("samples_per_s_compressed", absl::StrFormat("%.1f", dgc.samples_per_s));
  RecordProperty("speedup", absl::StrFormat("%.1f", speedup));
  for (int r = 0; r < kWorkers; ++r) {
    RecordProperty(absl::StrCat("push_ratio_rank", r), absl::StrFormat("%.1f", push_ratio[r]));
    RecordProperty(absl::StrCat("pull_ratio_rank", r), absl::StrFormat("%.1f", pull_ratio[r]));
  }
  RecordProperty("accuracy_dense", absl::StrFormat("%.4f", dense.accuracy));
  RecordProperty("accuracy_compressed", absl::StrFormat("%.4f", dgc.accuracy));

  // Dense: every byte as float32.
  for (int r = 0; r < kWorkers; ++r) {
    EXPECT_EQ(dense.w[r].bytes_pushed, dense.w[r].raw_bytes_pushed) << r;
    EXPECT_EQ(dense.w[r].bytes_pulled, dense.w[r].raw_bytes_pulled) << r;
  }
  EXPECT_GE(speedup, 5.0) << dense.samples_per_s << " vs " << dgc.samples_per_s;
  for (int r = 0; r < kWorkers; ++r) {
    EXPECT_GE(push_ratio[r], 100.0) << "rank " << r;
    EXPECT_GE(pull_ratio[r], 10.0) << "rank " << r;
  }
  ASSERT_NO_FATAL_FAILURE(StopServers());
}

}  // namespace
}  // namespace e2e
}  // namespace gradmesh
