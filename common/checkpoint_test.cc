// Tests of the shared checkpoint format (checkpoint.h): round trips of every dtype and
// metadata type, .prev rotation and fallback, corruption, truncation, kinds, legacy formats,
// and the 64-bit-clean checksum helper.
#include "common/checkpoint.h"

#include <zlib.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace ckpt {
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

bool Exists(const std::string& path) { return std::filesystem::exists(path); }

struct Sample {
  std::vector<float> f32 = {1.5f, -0.0f, std::numeric_limits<float>::infinity(), 3e-38f};
  std::vector<double> f64 = {0.1, -1e300, 2.5};
  std::vector<int64_t> i64 = {std::numeric_limits<int64_t>::min(), -1, 0,
                              std::numeric_limits<int64_t>::max()};
  std::vector<uint8_t> u8 = {0, 1, 127, 128, 255};
  std::vector<int32_t> i32 = {-7, 1 << 30};
  std::vector<float> empty;
  Metadata meta;

  explicit Sample(int64_t step) {
    meta.SetInt("step", step);
    meta.SetInt("rank", -3);
    meta.SetDouble("weight", 0.3125);
    meta.SetString("note", std::string("a\0b\xff", 4));
    meta.SetString("empty", "");
  }
  std::vector<ArrayRef> Arrays() const {
    return {ArrayRef::Of<float>("f32", f32),   ArrayRef::Of<double>("f64", f64),
            ArrayRef::Of<int64_t>("i64", i64), ArrayRef::Of<uint8_t>("u8", u8),
            ArrayRef::Of<int32_t>("i32", i32), ArrayRef::Of<float>("empty", empty)};
  }
  absl::Status Write(const std::string& path, const WriteOptions& o = {}) const {
    return WriteCheckpointFile(path, "test", meta, Arrays(), o);
  }
};

ReadOptions Kind(const std::string& kind) {
  ReadOptions o;
  o.kind = kind;
  return o;
}

TEST(Crc32Test, KnownValueAndAnySplitEqualsOnePass) {
  Crc32 check;
  check.Update("123456789", 9);
  EXPECT_EQ(check.value(), 0xCBF43926u);  // The standard CRC-32 check value.

  // A few MiB of pseudo-random bytes, summed in one pass and in odd-sized pieces.
  std::string data(5 * (1 << 20) + 13, '\0');
  std::mt19937_64 rng(7);
  for (char& c : data) c = static_cast<char>(rng());
  Crc32 whole;
  whole.Update(data.data(), data.size());
  const size_t pieces[] = {1, 3, 4093, 65537, 1 << 20, 999983, 7};
  Crc32 split;
  size_t at = 0;
  for (size_t i = 0; at < data.size(); ++i) {
    const size_t n = std::min(pieces[i % 7], data.size() - at);
    split.Update(data.data() + at, n);
    split.Update(data.data() + at + n, 0);  // Empty updates change nothing.
    at += n;
  }
  EXPECT_EQ(split.value(), whole.value());
  // And both equal zlib's own 32-bit-length crc32 over chunks below 4 GiB.
  uLong ref = crc32(0L, Z_NULL, 0);
  ref = crc32(ref, reinterpret_cast<const Bytef*>(data.data()), static_cast<uInt>(data.size()));
  EXPECT_EQ(whole.value(), static_cast<uint32_t>(ref));
  // The length type is 64-bit: sizes past 4 GiB are not truncated by construction.
  static_assert(sizeof(z_size_t) >= sizeof(size_t) && sizeof(size_t) >= 8,
                "crc32_z must take 64-bit lengths");
}

TEST(CheckpointFileTest, RoundTripsEveryDtypeAndMetadataType) {
  const std::string path = TempDir() + "/common_rt/sub/dir/a.ckpt";
  const Sample s(42);
  ASSERT_OK(s.Write(path));
  ASSERT_OK_AND_ASSIGN(Checkpoint c, ReadCheckpointFile(path, Kind("test")));
  EXPECT_EQ(c.header.kind, "test");
  EXPECT_EQ(c.header.source.path, path);
  EXPECT_FALSE(c.header.source.from_prev);
  EXPECT_EQ(c.header.source.format, "gmckpt/1");
  EXPECT_TRUE(c.header.metadata == s.meta);
  EXPECT_EQ(*c.header.metadata.GetInt("step"), 42);
  EXPECT_EQ(*c.header.metadata.GetDouble("weight"), 0.3125);
  EXPECT_EQ(*c.header.metadata.GetString("note"), std::string("a\0b\xff", 4));
  EXPECT_STATUS_MSG(c.header.metadata.GetInt("weight"), absl::StatusCode::kInvalidArgument,
                    "'weight' is not an int64");
  EXPECT_STATUS_MSG(c.header.metadata.GetInt("nope"), absl::StatusCode::kInvalidArgument,
                    "'nope' is missing");
  ASSERT_EQ(c.header.arrays.size(), 6u);
  EXPECT_EQ(c.header.arrays[1].name, "f64");
  EXPECT_EQ(c.header.arrays[1].dtype, DType::kFloat64);
  EXPECT_EQ(c.header.arrays[1].count, 3);
  EXPECT_EQ(*c.Take<float>("f32"), s.f32);
  EXPECT_EQ(*c.Take<double>("f64"), s.f64);
  EXPECT_EQ(*c.Take<int64_t>("i64"), s.i64);
  EXPECT_EQ(*c.Take<uint8_t>("u8"), s.u8);
  EXPECT_EQ(*c.Take<int32_t>("i32"), s.i32);
  EXPECT_TRUE(c.Take<float>("empty")->empty());
  EXPECT_STATUS_MSG(c.Take<float>("i64"), absl::StatusCode::kInvalidArgument,
                    "no float32 array 'i64' (it is int64)");
  EXPECT_STATUS_MSG(c.Take<float>("zzz"), absl::StatusCode::kInvalidArgument, path);

  // Header only: the same description without the values, and without reading them.
  ReadOptions fast = Kind("test");
  fast.verify_payload = false;
  ASSERT_OK_AND_ASSIGN(CheckpointHeader h, ReadCheckpointHeader(path, fast));
  EXPECT_TRUE(h.metadata == s.meta);
  ASSERT_EQ(h.arrays.size(), 6u);
  EXPECT_EQ(h.arrays[3].name, "u8");
  EXPECT_EQ(h.arrays[3].count, 5);
  EXPECT_FALSE(Exists(PrevPath(path)));
}

TEST(CheckpointFileTest, KeepsThePreviousFileAndNoTemporaries) {
  const std::string dir = TempDir() + "/common_prev";
  const std::string path = dir + "/a.ckpt";
  ASSERT_OK(Sample(1).Write(path));
  ASSERT_OK(Sample(2).Write(path));
  ASSERT_OK(Sample(3).Write(path));
  EXPECT_EQ(*ReadCheckpointHeader(path)->metadata.GetInt("step"), 3);
  ReadOptions single;
  single.fallback_to_prev = false;
  EXPECT_EQ(*ReadCheckpointHeader(PrevPath(path), single)->metadata.GetInt("step"), 2);
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    ++files;
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
  }
  EXPECT_EQ(files, 2);
}

TEST(CheckpointFileTest, FallsBackToPrevOnACorruptOrTruncatedMainFile) {
  const std::string path = TempDir() + "/common_fb/a.ckpt";
  ASSERT_OK(Sample(10).Write(path));
  ASSERT_OK(Sample(20).Write(path));
  const std::string good = ReadAll(path);

  // A flipped byte in the payload: the full read and the verifying header read fall back.
  std::string flipped = good;
  flipped[flipped.size() - 10] ^= 0x20;
  WriteAll(path, flipped);
  ASSERT_OK_AND_ASSIGN(Checkpoint c, ReadCheckpointFile(path));
  EXPECT_TRUE(c.header.source.from_prev);
  EXPECT_EQ(c.header.source.path, PrevPath(path));
  EXPECT_NE(c.header.source.main_error.find("payload checksum mismatch"), std::string::npos)
      << c.header.source.main_error;
  EXPECT_EQ(*c.header.metadata.GetInt("step"), 10);
  EXPECT_EQ(*c.Take<double>("f64"), Sample(10).f64);
  ASSERT_OK_AND_ASSIGN(CheckpointHeader h, ReadCheckpointHeader(path));
  EXPECT_TRUE(h.source.from_prev);
  // Without the fallback the corruption is reported.
  ReadOptions single;
  single.fallback_to_prev = false;
  EXPECT_STATUS_MSG(ReadCheckpointFile(path, single), absl::StatusCode::kDataLoss,
                    "checkpoint " + path + ": payload checksum mismatch");

  // A flipped byte in the header.
  flipped = good;
  flipped[30] ^= 1;
  WriteAll(path, flipped);
  ASSERT_OK_AND_ASSIGN(c, ReadCheckpointFile(path));
  EXPECT_TRUE(c.header.source.from_prev);
  EXPECT_NE(c.header.source.main_error.find("header checksum mismatch"), std::string::npos);

  // Truncated, at several places.
  for (size_t keep : {size_t{0}, size_t{5}, size_t{15}, size_t{40}, good.size() - 1}) {
    WriteAll(path, good.substr(0, keep));
    ASSERT_OK_AND_ASSIGN(c, ReadCheckpointFile(path));
    EXPECT_TRUE(c.header.source.from_prev) << keep;
    EXPECT_EQ(*c.header.metadata.GetInt("step"), 10);
  }
  WriteAll(path, good.substr(0, good.size() - 1));
  EXPECT_STATUS_MSG(ReadCheckpointFile(path, single), absl::StatusCode::kDataLoss, "truncated");
  WriteAll(path, good + "x");
  EXPECT_STATUS_MSG(ReadCheckpointFile(path, single), absl::StatusCode::kDataLoss,
                    "1 trailing bytes");

  // Missing main file.
  ASSERT_EQ(std::remove(path.c_str()), 0);
  ASSERT_OK_AND_ASSIGN(c, ReadCheckpointFile(path));
  EXPECT_TRUE(c.header.source.from_prev);
  EXPECT_NE(c.header.source.main_error.find("does not exist"), std::string::npos);
}

TEST(CheckpointFileTest, BothFilesBadIsDataLossNamingBoth) {
  const std::string path = TempDir() + "/common_both/a.ckpt";
  EXPECT_STATUS_MSG(ReadCheckpointFile(path), absl::StatusCode::kNotFound,
                    "checkpoint " + path + " does not exist, nor does " + PrevPath(path));
  EXPECT_STATUS(ReadCheckpointHeader(path), absl::StatusCode::kNotFound);
  ASSERT_OK(Sample(1).Write(path));
  ASSERT_OK(Sample(2).Write(path));
  std::string main = ReadAll(path), prev = ReadAll(PrevPath(path));
  main[main.size() / 2] ^= 4;
  WriteAll(path, main);
  WriteAll(PrevPath(path), prev.substr(0, prev.size() / 2));
  const absl::Status st = ReadCheckpointFile(path).status();
  EXPECT_STATUS_MSG(st, absl::StatusCode::kDataLoss, "checkpoint " + path + ": ");
  EXPECT_STATUS_MSG(st, absl::StatusCode::kDataLoss, "checksum mismatch");
  EXPECT_STATUS_MSG(st, absl::StatusCode::kDataLoss, "checkpoint " + PrevPath(path) + ": ");
  EXPECT_STATUS_MSG(st, absl::StatusCode::kDataLoss, "truncated");
  EXPECT_STATUS(ReadCheckpointHeader(path), absl::StatusCode::kDataLoss);

  // A corrupt main file with no previous copy names the missing one.
  ASSERT_EQ(std::remove(PrevPath(path).c_str()), 0);
  EXPECT_STATUS_MSG(ReadCheckpointFile(path), absl::StatusCode::kDataLoss,
                    "; no previous copy " + PrevPath(path));
  // Missing main and corrupt previous copy.
  WriteAll(PrevPath(path), "garbage!garbage!");
  ASSERT_EQ(std::remove(path.c_str()), 0);
  EXPECT_STATUS_MSG(ReadCheckpointFile(path), absl::StatusCode::kDataLoss, "bad magic");
}

TEST(CheckpointFileTest, ACorruptMainFileIsNotRotatedOverAGoodPrev) {
  const std::string path = TempDir() + "/common_rot/a.ckpt";
  ASSERT_OK(Sample(1).Write(path));
  ASSERT_OK(Sample(2).Write(path));
  std::string main = ReadAll(path);
  main[main.size() - 3] ^= 1;
  WriteAll(path, main);
  ASSERT_OK(Sample(3).Write(path));
  ReadOptions single;
  single.fallback_to_prev = false;
  EXPECT_EQ(*ReadCheckpointHeader(path, single)->metadata.GetInt("step"), 3);
  EXPECT_EQ(*ReadCheckpointHeader(PrevPath(path), single)->metadata.GetInt("step"), 1);
}

TEST(CheckpointFileTest, OtherKindsFormatsAndBadRequests) {
  const std::string path = TempDir() + "/common_kind/a.ckpt";
  ASSERT_OK(Sample(1).Write(path));
  ASSERT_OK(Sample(2).Write(path));
  EXPECT_STATUS_MSG(ReadCheckpointFile(path, Kind("gossip")), absl::StatusCode::kFailedPrecondition,
                    "checkpoint " + path + " is of kind 'test', expected 'gossip'");
  EXPECT_STATUS(ReadCheckpointHeader(path, Kind("gossip")), absl::StatusCode::kFailedPrecondition);

  // A newer format version is refused, not taken for corruption.
  std::string v2 = ReadAll(path);
  v2[8] = 2;
  WriteAll(path, v2);
  ReadOptions single;
  single.fallback_to_prev = false;
  EXPECT_STATUS_MSG(ReadCheckpointFile(path, single), absl::StatusCode::kFailedPrecondition,
                    "format version 2; this build reads version 1");

  // Legacy formats: parsed by the caller's parser, or refused by name.
  WriteAll(path, "OLDFMT01payload");
  ReadOptions legacy = Kind("test");
  legacy.fallback_to_prev = false;
  legacy.legacy.push_back(LegacyFormat{"OLDFMT01", "legacy test checkpoint (OLDFMT01)",
                                       [](const std::string&, const std::string& bytes) {
                                         Checkpoint c;
                                         c.header.kind = "test";
                                         c.header.metadata.SetInt("len", bytes.size());
                                         c.Add<uint8_t>("raw", {bytes.begin(), bytes.end()});
                                         return absl::StatusOr<Checkpoint>(std::move(c));
                                       }});
  legacy.legacy.push_back(LegacyFormat{"OTHER001", "legacy other checkpoint (OTHER001)", {}});
  ASSERT_OK_AND_ASSIGN(Checkpoint c, ReadCheckpointFile(path, legacy));
  EXPECT_EQ(c.header.source.format, "legacy test checkpoint (OLDFMT01)");
  EXPECT_EQ(*c.header.metadata.GetInt("len"), 15);
  EXPECT_EQ(c.Take<uint8_t>("raw")->size(), 15u);
  // Its header read parses it too.
  ASSERT_OK_AND_ASSIGN(CheckpointHeader h, ReadCheckpointHeader(path, legacy));
  EXPECT_EQ(h.arrays.size(), 1u);
  // A valid legacy main file counts for keep_prev.
  WriteOptions wo;
  wo.legacy = legacy.legacy;
  ASSERT_OK(Sample(9).Write(path, wo));
  EXPECT_EQ(ReadAll(PrevPath(path)), "OLDFMT01payload");

  WriteAll(path, "OTHER001payload");
  EXPECT_STATUS_MSG(
      ReadCheckpointFile(path, legacy), absl::StatusCode::kFailedPrecondition,
      "checkpoint " + path + " is a legacy other checkpoint (OTHER001), expected kind 'test'");
  WriteAll(path, "something else entirely");
  EXPECT_STATUS_MSG(ReadCheckpointFile(path, legacy), absl::StatusCode::kDataLoss,
                    "bad magic or too short (23 bytes starting \"somethin\")");

  // Bad write requests.
  const std::vector<float> v = {1};
  EXPECT_STATUS_MSG(WriteCheckpointFile(path, "", {}, {}), absl::StatusCode::kInvalidArgument,
                    "empty kind");
  EXPECT_STATUS_MSG(WriteCheckpointFile(path, "k", {},
                                        {ArrayRef::Of<float>("a", v), ArrayRef::Of<float>("a", v)}),
                    absl::StatusCode::kInvalidArgument, "two arrays named 'a'");
  EXPECT_STATUS_MSG(
      WriteCheckpointFile(path, "k", {}, {ArrayRef{"a", DType::kFloat32, nullptr, 3}}),
      absl::StatusCode::kInvalidArgument, "has count 3 and no data");
  Metadata bad;
  bad.SetInt("", 1);
  EXPECT_STATUS_MSG(WriteCheckpointFile(path, "k", bad, {}), absl::StatusCode::kInvalidArgument,
                    "empty metadata key");
}

TEST(CheckpointFileTest, IoErrorsAreInternalAndNameTheFile) {
  const std::string blocker = TempDir() + "/common_io_file";
  WriteAll(blocker, "x");
  const std::string path = blocker + "/a.ckpt";  // Its "directory" is a file.
  const std::vector<float> v = {1};
  EXPECT_STATUS_MSG(WriteCheckpointFile(path, "k", {}, {ArrayRef::Of<float>("a", v)}),
                    absl::StatusCode::kInternal, path);
}

}  // namespace
}  // namespace ckpt
}  // namespace gradmesh
