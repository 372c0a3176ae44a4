// Tests of the allreduce checkpoint files and the resume-step agreement (checkpoint.h).
#include "worker/allreduce/checkpoint.h"

#include <cstdio>
#include <fstream>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

std::string TempDir() {
  const char* d = std::getenv("TEST_TMPDIR");
  return d != nullptr ? d : "/tmp";
}

TEST(CheckpointTest, RoundTripKeepsThePreviousOne) {
  const std::string path = CheckpointPath(TempDir() + "/ck1", "job-a", 3);
  EXPECT_EQ(path, TempDir() + "/ck1/job-a/rank-3.ckpt");
  std::vector<float> a = {1.5f, -2.0f, 3.25f}, b = {}, c = {7.0f};
  ASSERT_OK(WriteCheckpoint(path, 10, {a, b, c}));
  a[0] = 9.0f;
  ASSERT_OK(WriteCheckpoint(path, 20, {a, b, c}));
  ASSERT_OK_AND_ASSIGN(RankCheckpoint ck, ReadCheckpoint(path));
  EXPECT_EQ(ck.step, 20);
  ASSERT_EQ(ck.arrays.size(), 3u);
  EXPECT_EQ(ck.arrays[0], (std::vector<float>{9.0f, -2.0f, 3.25f}));
  EXPECT_TRUE(ck.arrays[1].empty());
  EXPECT_EQ(ck.arrays[2], (std::vector<float>{7.0f}));
  std::vector<RankCheckpoint> both = ReadAvailableCheckpoints(path);
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(both[0].step, 20);
  EXPECT_EQ(both[1].step, 10);
  EXPECT_EQ(both[1].arrays[0][0], 1.5f);
}

TEST(CheckpointTest, MissingIsNotFoundAndCorruptIsDataLoss) {
  const std::string path = CheckpointPath(TempDir() + "/ck2", "j", 0);
  EXPECT_STATUS(ReadCheckpoint(path).status(), absl::StatusCode::kNotFound);
  std::vector<float> a(100, 1.0f);
  ASSERT_OK(WriteCheckpoint(path, 5, {a}));
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    f.put('\x7f');
  }
  EXPECT_STATUS_MSG(ReadCheckpoint(path).status(), absl::StatusCode::kDataLoss,
                    "checksum mismatch");
  ASSERT_EQ(std::remove(path.c_str()), 0);
  std::ofstream(path) << "GMARCKP1";
  EXPECT_STATUS_MSG(ReadCheckpoint(path).status(), absl::StatusCode::kDataLoss, "truncated");
  EXPECT_TRUE(ReadAvailableCheckpoints(path).empty());
}

TEST(ResumeStepTest, NewestCommonStepOrAClearError) {
  ASSERT_OK_AND_ASSIGN(int64_t none, ResumeStep({{}, {}, {}}));
  EXPECT_EQ(none, 0);
  ASSERT_OK_AND_ASSIGN(int64_t same, ResumeStep({{200, 100}, {200, 100}}));
  EXPECT_EQ(same, 200);
  // Rank 1 died between its step-300 and rank 0's: both still have 200.
  ASSERT_OK_AND_ASSIGN(int64_t older, ResumeStep({{300, 200}, {200, 100}}));
  EXPECT_EQ(older, 200);
  EXPECT_STATUS_MSG(ResumeStep({{300, 200}, {}}).status(),
                    absl::StatusCode::kFailedPrecondition,
                    "no checkpoint step in common (rank 0: [300,200]; rank 1: [])");
}

}  // namespace
}  // namespace gradmesh
