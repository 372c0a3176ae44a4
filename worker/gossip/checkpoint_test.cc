// Tests of gossip checkpoint files: exact round trip, missing file, corruption, truncation,
// the .prev fallback, other kinds, and files of the old (pre-common/checkpoint) format.
#include "worker/gossip/checkpoint.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

#include "common/checkpoint.h"
#include "common/safe_path.h"
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
  const std::string path = RankCheckpointPath(TempDir() + "/ckpt_rt", "job-1", 2).value();
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

// The old writer's byte layout (before common/checkpoint), kept here to test legacy reads.
std::string LegacyGossipBytes(const GossipCheckpoint& c) {
  std::string data = "GMGOSCK1";
  auto put = [&data](const auto& v) { data.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put(c.rank);
  put(c.num_workers);
  put(static_cast<int64_t>(c.values.size()));
  put(c.num_slots);
  put(c.step);
  put(c.weight);
  data.append(reinterpret_cast<const char*>(c.values.data()), c.values.size() * sizeof(float));
  data.append(reinterpret_cast<const char*>(c.slots.data()), c.slots.size() * sizeof(float));
  ckpt::Crc32 crc;
  crc.Update(data.data(), data.size());
  put(crc.value());
  return data;
}

TEST(CheckpointTest, FallsBackToThePreviousFile) {
  const std::string path = TempDir() + "/ckpt_prev/rank-0.ckpt";
  GossipCheckpoint first = Sample();
  first.step = 100;
  ASSERT_OK(WriteGossipCheckpoint(path, first));
  ASSERT_OK(WriteGossipCheckpoint(path, Sample()));
  std::string main = ReadAll(path);
  main[main.size() - 6] ^= 1;  // In the slots.
  WriteAll(path, main);
  ckpt::CheckpointSource source;
  ASSERT_OK_AND_ASSIGN(GossipCheckpoint c, ReadGossipCheckpoint(path, &source));
  EXPECT_EQ(c.step, 100);
  EXPECT_EQ(c.slots, Sample().slots);
  EXPECT_TRUE(source.from_prev);
  EXPECT_EQ(source.path, path + ".prev");
  EXPECT_NE(source.main_error.find("checksum mismatch"), std::string::npos);
  // Both bad: DATA_LOSS naming both files.
  WriteAll(path + ".prev", ReadAll(path + ".prev").substr(0, 30));
  EXPECT_STATUS_MSG(ReadGossipCheckpoint(path), absl::StatusCode::kDataLoss, path + ": ");
  EXPECT_STATUS_MSG(ReadGossipCheckpoint(path), absl::StatusCode::kDataLoss,
                    path + ".prev: truncated");
  // Inconsistent input is refused before anything is written.
  GossipCheckpoint odd = Sample();
  odd.slots.pop_back();
  EXPECT_STATUS_MSG(WriteGossipCheckpoint(path, odd), absl::StatusCode::kInvalidArgument,
                    "5 slot values for 2 slots of 3 values");
}

TEST(CheckpointTest, ReadsTheOldFormatAndRefusesOtherKinds) {
  const std::string path = TempDir() + "/ckpt_legacy/rank-2.ckpt";
  std::filesystem::create_directories(TempDir() + "/ckpt_legacy");
  const std::string legacy = LegacyGossipBytes(Sample());
  WriteAll(path, legacy);
  ckpt::CheckpointSource source;
  ASSERT_OK_AND_ASSIGN(GossipCheckpoint c, ReadGossipCheckpoint(path, &source));
  EXPECT_EQ(source.format, "legacy gossip checkpoint (GMGOSCK1)");
  EXPECT_EQ(c.rank, 2);
  EXPECT_EQ(c.num_workers, 4);
  EXPECT_EQ(c.step, 123);
  EXPECT_EQ(c.weight, 0.3125);
  EXPECT_EQ(c.values, Sample().values);
  EXPECT_EQ(c.num_slots, 2);
  EXPECT_EQ(c.slots, Sample().slots);
  EXPECT_EQ(c.buffer_values, 0);  // Old files hold parameters only.
  // A corrupt old file is DATA_LOSS naming the file and the format.
  std::string flipped = legacy;
  flipped[40] ^= 1;
  WriteAll(path, flipped);
  EXPECT_STATUS_MSG(ReadGossipCheckpoint(path), absl::StatusCode::kDataLoss,
                    path + " (legacy gossip format GMGOSCK1): CRC mismatch");
  // The first new write keeps the (valid) old file as .prev.
  WriteAll(path, legacy);
  GossipCheckpoint later = Sample();
  later.step = 300;
  ASSERT_OK(WriteGossipCheckpoint(path, later));
  EXPECT_EQ(ReadAll(path + ".prev"), legacy);
  ASSERT_OK_AND_ASSIGN(c, ReadGossipCheckpoint(path));
  EXPECT_EQ(c.step, 300);

  // Allreduce checkpoints, old and new, are refused by name.
  const std::string other = TempDir() + "/ckpt_legacy/other.ckpt";
  WriteAll(other, std::string("GMARCKP1") + std::string(20, '\0'));
  EXPECT_STATUS_MSG(ReadGossipCheckpoint(other), absl::StatusCode::kFailedPrecondition,
                    other + " is a legacy allreduce checkpoint (GMARCKP1), expected kind 'gossip'");
  const std::vector<float> v = {1};
  ASSERT_OK(
      ckpt::WriteCheckpointFile(other, "allreduce", {}, {ckpt::ArrayRef::Of<float>("a0", v)}));
  EXPECT_STATUS_MSG(ReadGossipCheckpoint(other), absl::StatusCode::kFailedPrecondition,
                    "is of kind 'allreduce', expected 'gossip'");
}

TEST(CheckpointTest, BuffersRoundTripWithoutSlots) {
  const std::string path = TempDir() + "/ckpt_buffers/rank-2.ckpt";
  GossipCheckpoint in = Sample();                 // Parameters 1.5, -2.25, 3e-8 with 2 slots each.
  in.values.insert(in.values.end(), {0.75f, 4});  // A running mean, num_batches_tracked.
  in.buffer_values = 2;
  ASSERT_OK(WriteGossipCheckpoint(path, in));
  ASSERT_OK_AND_ASSIGN(GossipCheckpoint c, ReadGossipCheckpoint(path));
  EXPECT_EQ(c.values, (std::vector<float>{1.5f, -2.25f, 3e-8f, 0.75f, 4}));
  EXPECT_EQ(c.buffer_values, 2);
  EXPECT_EQ(c.num_slots, 2);
  EXPECT_EQ(c.slots, Sample().slots);
  // Slots for the buffers too, or more buffers than values, are refused at the write.
  GossipCheckpoint bad = in;
  bad.slots.insert(bad.slots.end(), {7, 8, 9, 10});
  EXPECT_STATUS_MSG(WriteGossipCheckpoint(path, bad), absl::StatusCode::kInvalidArgument,
                    "10 slot values for 2 slots of 5 values of which 2 are buffers");
  bad = in;
  bad.buffer_values = 6;
  EXPECT_STATUS(WriteGossipCheckpoint(path, bad), absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointTest, FilesWithoutBufferValuesHaveNoBuffers) {
  // The common-format file as written before buffers were part of the model.
  const std::string path = TempDir() + "/ckpt_v1/rank-0.ckpt";
  ckpt::Metadata m;
  m.SetInt("rank", 0);
  m.SetInt("num_workers", 2);
  m.SetInt("num_slots", 1);
  m.SetInt("step", 8);
  m.SetDouble("weight", 0.5);
  const std::vector<float> values = {1, 2}, slots = {3, 4};
  ASSERT_OK(ckpt::WriteCheckpointFile(
      path, "gossip", m,
      {ckpt::ArrayRef::Of<float>("values", values), ckpt::ArrayRef::Of<float>("slots", slots)}));
  ASSERT_OK_AND_ASSIGN(GossipCheckpoint c, ReadGossipCheckpoint(path));
  EXPECT_EQ(c.buffer_values, 0);
  EXPECT_EQ(c.values, values);
  EXPECT_EQ(c.slots, slots);
  // A buffer_values that leaves the slots without their parameters is DATA_LOSS.
  m.SetInt("buffer_values", 1);
  ASSERT_OK(ckpt::WriteCheckpointFile(
      path, "gossip", m,
      {ckpt::ArrayRef::Of<float>("values", values), ckpt::ArrayRef::Of<float>("slots", slots)}));
  EXPECT_STATUS_MSG(ReadGossipCheckpoint(path), absl::StatusCode::kDataLoss,
                    "2 values of which 1 of buffers, 1 slots of 2 floats");
}

TEST(CheckpointTest, ANonFinitePushSumWeightIsDataLoss) {
  // A replica restored with an infinite or NaN weight would make its values, and its peers',
  // inf/NaN. A large finite one is what a replica may hold (it sums what it absorbs).
  const std::string path = TempDir() + "/ckpt_weight/rank-0.ckpt";
  const std::vector<float> values = {1, 2}, slots = {3, 4};
  for (double weight : {std::numeric_limits<double>::infinity(), -1.0, 0.0,
                        std::numeric_limits<double>::quiet_NaN(), 8.5}) {
    ckpt::Metadata m;
    m.SetInt("rank", 0);
    m.SetInt("num_workers", 2);
    m.SetInt("num_slots", 1);
    m.SetInt("step", 8);
    m.SetDouble("weight", weight);
    ASSERT_OK(ckpt::WriteCheckpointFile(
        path, "gossip", m,
        {ckpt::ArrayRef::Of<float>("values", values), ckpt::ArrayRef::Of<float>("slots", slots)}));
    if (weight == 8.5) {  // More than one message may carry for 2 workers (4x), still fine.
      EXPECT_OK(ReadGossipCheckpoint(path).status());
    } else {
      EXPECT_STATUS_MSG(ReadGossipCheckpoint(path), absl::StatusCode::kDataLoss,
                        "invalid header values")
          << weight;
    }
  }
}

// Fuzzer findings (tests/fuzz/corpus/checkpoint_fuzz/known-*): a header whose sizes wrap
// around when multiplied (numel = 2^62 with 3 slots: 2^62 * 4 * 4 bytes = 0 mod 2^64) used to
// pass the size check and throw std::length_error out of the reader; and an empty legacy file
// (numel = 0) passed a null pointer to memcpy. Both are now answered by status.
TEST(CheckpointTest, LegacyHeaderSizesCannotWrapAround) {
  const std::string path = TempDir() + "/ckpt_hostile/rank-0.ckpt";
  std::filesystem::create_directories(TempDir() + "/ckpt_hostile");
  GossipCheckpoint c = Sample();
  c.values.clear();
  c.slots.clear();
  std::string bytes = LegacyGossipBytes(c);  // numel 0, 2 slots, no values
  WriteAll(path, bytes);
  ASSERT_OK_AND_ASSIGN(GossipCheckpoint empty, ReadGossipCheckpoint(path));
  EXPECT_TRUE(empty.values.empty());
  EXPECT_TRUE(empty.slots.empty());
  // numel at offset 16, num_slots at 24; the CRC is recomputed so only the sizes are wrong.
  const int64_t numel = int64_t{1} << 62;
  const int32_t slots = 3;
  bytes.resize(bytes.size() - sizeof(uint32_t));
  std::memcpy(&bytes[16], &numel, sizeof(numel));
  std::memcpy(&bytes[24], &slots, sizeof(slots));
  ckpt::Crc32 crc;
  crc.Update(bytes.data(), bytes.size());
  const uint32_t sum = crc.value();
  bytes.append(reinterpret_cast<const char*>(&sum), sizeof(sum));
  WriteAll(path, bytes);
  EXPECT_STATUS_MSG(ReadGossipCheckpoint(path), absl::StatusCode::kDataLoss,
                    "0 bytes of values and slots, expected 4611686018427387904 x 4 floats");
}

}  // namespace
}  // namespace gradmesh
