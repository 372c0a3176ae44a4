// Tests of the allreduce checkpoint files and the resume-step agreement (checkpoint.h),
// including files of the old (pre-common/checkpoint) format.
#include "worker/allreduce/checkpoint.h"

#include <cstdio>
#include <fstream>
#include <iterator>
#include <utility>

#include "common/checkpoint.h"
#include "common/safe_path.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

std::string TempDir() {
  const char* d = std::getenv("TEST_TMPDIR");
  return d != nullptr ? d : "/tmp";
}

TEST(CheckpointTest, RoundTripKeepsThePreviousOne) {
  const std::string path = RankCheckpointPath(TempDir() + "/ck1", "job-a", 3).value();
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
  const std::string path = RankCheckpointPath(TempDir() + "/ck2", "j", 0).value();
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

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteAll(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
}

// The old writer's byte layout (before common/checkpoint), kept here to test legacy reads.
std::string LegacyBytes(int64_t step, const std::vector<std::vector<float>>& arrays) {
  std::string d = "GMARCKP1";
  auto put = [&d](const auto& v) { d.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put(static_cast<uint64_t>(step));
  put(static_cast<uint32_t>(arrays.size()));
  for (const auto& a : arrays) {
    put(static_cast<uint64_t>(a.size()));
    d.append(reinterpret_cast<const char*>(a.data()), a.size() * sizeof(float));
  }
  ckpt::Crc32 crc;
  crc.Update(d.data(), d.size());
  put(crc.value());
  return d;
}

TEST(CheckpointTest, ReadsOldFilesAndKeepsThemAsPrev) {
  const std::string path = RankCheckpointPath(TempDir() + "/ck3", "old", 1).value();
  ASSERT_OK(WriteCheckpoint(path, 1, {}));  // Creates the directory.
  WriteAll(path + ".prev", LegacyBytes(100, {{1.0f, 2.0f}, {}}));
  WriteAll(path, LegacyBytes(200, {{3.0f, 4.0f}, {}}));
  ASSERT_OK_AND_ASSIGN(RankCheckpoint ck, ReadCheckpoint(path));
  EXPECT_EQ(ck.step, 200);
  ASSERT_EQ(ck.arrays.size(), 2u);
  EXPECT_EQ(ck.arrays[0], (std::vector<float>{3.0f, 4.0f}));
  EXPECT_TRUE(ck.arrays[1].empty());
  std::vector<RankCheckpoint> both = ReadAvailableCheckpoints(path);
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(both[1].step, 100);

  // A new write keeps the valid old file as .prev: steps 300 and 200 remain.
  const std::string old_main = ReadAll(path);
  std::vector<float> p = {5.0f, 6.0f};
  ASSERT_OK(WriteCheckpoint(path, 300, {p, {}}));
  EXPECT_EQ(ReadAll(path + ".prev"), old_main);
  both = ReadAvailableCheckpoints(path);
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(both[0].step, 300);
  EXPECT_EQ(both[1].step, 200);
  EXPECT_EQ(both[1].arrays[0], (std::vector<float>{3.0f, 4.0f}));

  // A corrupt old file is DATA_LOSS naming the file and the format.
  std::string bad = old_main;
  bad[21] ^= 1;
  WriteAll(path + ".prev", bad);
  EXPECT_STATUS_MSG(ReadCheckpoint(path + ".prev").status(), absl::StatusCode::kDataLoss,
                    " (legacy allreduce format GMARCKP1) is unusable: checksum mismatch");
  EXPECT_EQ(ReadAvailableCheckpoints(path).size(), 1u);
}

TEST(CheckpointTest, ListsStepsWithoutKeepingArraysAndSkipsBadFiles) {
  const std::string path = RankCheckpointPath(TempDir() + "/ck4", "j", 0).value();
  EXPECT_TRUE(ListAvailableCheckpoints(path).empty());
  std::vector<float> a(1000, 1.0f), b = {2.0f};
  ASSERT_OK(WriteCheckpoint(path, 10, {a, b}));
  ASSERT_OK(WriteCheckpoint(path, 20, {a, b}));
  std::vector<RankCheckpointInfo> infos = ListAvailableCheckpoints(path);
  ASSERT_EQ(infos.size(), 2u);
  EXPECT_EQ(infos[0].path, path);
  EXPECT_EQ(infos[0].step, 20);
  EXPECT_EQ(infos[0].array_sizes, (std::vector<int64_t>{1000, 1}));
  EXPECT_EQ(infos[1].path, path + ".prev");
  EXPECT_EQ(infos[1].step, 10);
  // A payload corruption is found by the streamed checksum: only .prev is listed.
  std::string main = ReadAll(path);
  main[main.size() - 100] ^= 8;
  WriteAll(path, main);
  infos = ListAvailableCheckpoints(path);
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_EQ(infos[0].step, 10);
  EXPECT_EQ(ReadAvailableCheckpoints(path).size(), 1u);
}

TEST(CheckpointTest, RefusesGossipCheckpoints) {
  const std::string path = RankCheckpointPath(TempDir() + "/ck5", "j", 0).value();
  std::vector<float> v = {1.0f};
  ASSERT_OK(WriteCheckpoint(path, 1, {v}));
  ASSERT_OK(ckpt::WriteCheckpointFile(path, "gossip", {}, {ckpt::ArrayRef::Of<float>("v", v)}));
  EXPECT_STATUS_MSG(ReadCheckpoint(path).status(), absl::StatusCode::kFailedPrecondition,
                    path + " is of kind 'gossip', expected 'allreduce'");
  WriteAll(path, std::string("GMGOSCK1") + std::string(40, '\0'));
  EXPECT_STATUS_MSG(ReadCheckpoint(path).status(), absl::StatusCode::kFailedPrecondition,
                    path + " is a legacy gossip checkpoint (GMGOSCK1), expected kind 'allreduce'");
  // Non-float32 arrays are not this mode's.
  const std::vector<int64_t> n = {1};
  ASSERT_OK(
      ckpt::WriteCheckpointFile(path, "allreduce", {}, {ckpt::ArrayRef::Of<int64_t>("a0", n)}));
  EXPECT_STATUS(ReadCheckpoint(path).status(), absl::StatusCode::kDataLoss);  // No step.
  ckpt::Metadata m;
  m.SetInt("step", 4);
  ASSERT_OK(
      ckpt::WriteCheckpointFile(path, "allreduce", m, {ckpt::ArrayRef::Of<int64_t>("a0", n)}));
  EXPECT_STATUS_MSG(ReadCheckpoint(path).status(), absl::StatusCode::kFailedPrecondition,
                    "array 'a0' is int64; allreduce checkpoints hold float32");
}

TEST(PlanResumeTest, NewestCommonStepOrTheNewestOneSent) {
  auto plan = [](const std::vector<std::vector<int64_t>>& steps) {
    const ResumePlan p = PlanResume(steps);
    return std::make_pair(p.step, p.source);
  };
  EXPECT_EQ(plan({{}, {}, {}}), std::make_pair(int64_t{0}, -1));
  EXPECT_EQ(plan({{200, 100}, {200, 100}}), std::make_pair(int64_t{200}, -1));
  // Rank 1 died between its step-300 and rank 0's: both still have 200.
  EXPECT_EQ(plan({{300, 200}, {200, 100}}), std::make_pair(int64_t{200}, -1));
  // Rank 1 moved to a node without its files: rank 0 sends it step 300.
  EXPECT_EQ(plan({{300, 200}, {}}), std::make_pair(int64_t{300}, 0));
  // Nothing in common: the newest step anywhere, from the lowest rank holding it.
  EXPECT_EQ(plan({{100}, {300, 200}, {300}}), std::make_pair(int64_t{300}, 1));
  EXPECT_EQ(plan({{}, {}, {400}}), std::make_pair(int64_t{400}, 2));
}

}  // namespace
}  // namespace gradmesh
