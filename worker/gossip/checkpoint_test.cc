// Tests of gossip checkpoint files: exact round trip, missing file, corruption, truncation.
#include "worker/gossip/checkpoint.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

std::string TempDir() {
  const char* t = std::getenv("TEST_TMPDIR");
  return t != nullptr ? t : "/tmp";
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteAll(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
}

GossipCheckpoint Sample() {
  GossipCheckpoint c;
  c.rank = 2;
  c.num_workers = 4;
  c.step = 123;
  c.weight = 0.3125;
  c.values = {1.5f, -2.25f, 3e-8f};
  c.num_slots = 2;
  c.slots = {1, 2, 3, 4, 5, 6};
  return c;
}

TEST(CheckpointTest, RoundTripsExactlyAndCreatesTheDirectory) {
  const std::string path = GossipCheckpointPath(TempDir() + "/ckpt_rt", "job-1", 2);
  EXPECT_EQ(path, TempDir() + "/ckpt_rt/job-1/rank-2.ckpt");
  ASSERT_OK(WriteGossipCheckpoint(path, Sample()));
  ASSERT_OK_AND_ASSIGN(GossipCheckpoint c, ReadGossipCheckpoint(path));
  EXPECT_EQ(c.rank, 2);
  EXPECT_EQ(c.num_workers, 4);
  EXPECT_EQ(c.step, 123);
  EXPECT_EQ(c.weight, 0.3125);
  EXPECT_EQ(c.values, Sample().values);
  EXPECT_EQ(c.num_slots, 2);
  EXPECT_EQ(c.slots, Sample().slots);
  // Overwriting replaces it (and leaves no temporary file behind).
  GossipCheckpoint later = Sample();
  later.step = 200;
  ASSERT_OK(WriteGossipCheckpoint(path, later));
  ASSERT_OK_AND_ASSIGN(c, ReadGossipCheckpoint(path));
  EXPECT_EQ(c.step, 200);
  EXPECT_TRUE(ReadAll(path + ".tmp").empty());
}

TEST(CheckpointTest, MissingCorruptAndTruncatedFiles) {
  const std::string path = TempDir() + "/ckpt_bad/rank-0.ckpt";
  EXPECT_STATUS(ReadGossipCheckpoint(path), absl::StatusCode::kNotFound);
  ASSERT_OK(WriteGossipCheckpoint(path, Sample()));
  const std::string good = ReadAll(path);
  std::string flipped = good;
  flipped[40] ^= 1;
  WriteAll(path, flipped);
  EXPECT_STATUS_MSG(ReadGossipCheckpoint(path), absl::StatusCode::kDataLoss, "CRC mismatch");
  WriteAll(path, good.substr(0, good.size() - 9));
  EXPECT_STATUS(ReadGossipCheckpoint(path), absl::StatusCode::kDataLoss);
  WriteAll(path, "hello");
  EXPECT_STATUS_MSG(ReadGossipCheckpoint(path), absl::StatusCode::kDataLoss, "bad magic");
}

}  // namespace
}  // namespace gradmesh
