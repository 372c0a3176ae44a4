#include "server/chunks_file.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_testing.h"
#include "common/test_dirs.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

// Writes `chunks` to `path` and returns the reference a snapshot keeps.
state::ChunksFileRef Write(const std::string& path,
                           const std::map<int64_t, state::ChunkState>& chunks) {
  auto w = ChunksFileWriter::Open(path, /*fsync=*/true);
  EXPECT_OK(w);
  for (const auto& [idx, c] : chunks) (*w)->Add(idx, c.version(), c.values(), c.slots());
  auto ref = (*w)->Finish();
  EXPECT_OK(ref);
  return *ref;
}

std::map<int64_t, state::ChunkState> Chunks() {
  std::map<int64_t, state::ChunkState> chunks;
  chunks[0].set_version(7);
  chunks[0].set_values(std::string(4096, 'a'));
  chunks[0].set_slots(std::string(8192, 'b'));
  chunks[5].set_version(-3);                // Any version, kept as is.
  chunks[5].set_values("wxyz");             // No slots (SGD, a buffer).
  chunks[int64_t{1} << 40].set_version(0);  // Empty: kept too.
  return chunks;
}

void ExpectSame(const std::map<int64_t, state::ChunkState>& got,
                const std::map<int64_t, state::ChunkState>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [idx, c] : want) {
    SCOPED_TRACE(idx);
    ASSERT_EQ(got.count(idx), 1u);
    EXPECT_EQ(got.at(idx).version(), c.version());
    EXPECT_EQ(got.at(idx).values(), c.values());
    EXPECT_EQ(got.at(idx).slots(), c.slots());
  }
}

TEST(ChunksFileTest, ReadsBackWhatWasWrittenIntoANewDirectory) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, testutil::MakeUniqueTestDir("chunks"));
  const std::string path = ChunksFilePath(dir + "/updates/job", 1);
  const state::ChunksFileRef ref = Write(path, Chunks());
  EXPECT_EQ(ref.chunks(), 3);
  EXPECT_EQ(ref.bytes(), static_cast<int64_t>(std::filesystem::file_size(path)));
  ASSERT_OK_AND_ASSIGN(auto got, ReadChunksFile(path, ref));
  ExpectSame(got, Chunks());
}

TEST(ChunksFileTest, WritingOverALargerFileCutsItAtTheNewEnd) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, testutil::MakeUniqueTestDir("chunks"));
  const std::string path = ChunksFilePath(dir, 0);
  std::map<int64_t, state::ChunkState> big;
  big[1].set_values(std::string(1 << 20, 'z'));
  Write(path, big);
  const state::ChunksFileRef ref = Write(path, Chunks());
  EXPECT_EQ(static_cast<int64_t>(std::filesystem::file_size(path)), ref.bytes());
  ASSERT_OK_AND_ASSIGN(auto got, ReadChunksFile(path, ref));
  ExpectSame(got, Chunks());
}

// Damage after the snapshot was written is DataLoss naming the file, never other values.
TEST(ChunksFileTest, ADamagedMissingOrOtherFileIsDataLossNamingIt) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, testutil::MakeUniqueTestDir("chunks"));
  const std::string path = ChunksFilePath(dir, 0);
  const state::ChunksFileRef ref = Write(path, Chunks());
  auto expect_loss = [&](const state::ChunksFileRef& r, const std::string& what) {
    SCOPED_TRACE(what);
    auto got = ReadChunksFile(path, r);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(got.status().message().find(path), std::string::npos) << got.status();
    EXPECT_NE(got.status().message().find(what), std::string::npos) << got.status();
  };
  state::ChunksFileRef other = ref;
  other.set_chunks(2);
  expect_loss(other, "holds 3 chunks, not 2");
  other = ref;
  other.set_checksum(ref.checksum() + 1);
  expect_loss(other, "checksum does not match");
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('!');
  }
  expect_loss(ref, "checksum does not match");
  ASSERT_EQ(truncate(path.c_str(), ref.bytes() - 1), 0);
  expect_loss(ref, absl::StrCat("holds ", ref.bytes() - 1, " bytes, not ", ref.bytes()));
  // Grown to a terabyte (sparse): refused from its size, before anything is allocated for it.
  ASSERT_EQ(truncate(path.c_str(), int64_t{1} << 40), 0);
  expect_loss(ref, absl::StrCat("holds ", int64_t{1} << 40, " bytes, not ", ref.bytes()));
  std::filesystem::remove(path);
  expect_loss(ref, "is missing");
}

TEST(ChunksFileTest, AFileThatCannotBeCreatedIsAnErrorNamingIt) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, testutil::MakeUniqueTestDir("chunks"));
  const std::string blocker = dir + "/file";
  std::ofstream(blocker) << "x";
  auto w = ChunksFileWriter::Open(ChunksFilePath(blocker + "/sub", 0), false);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find(blocker), std::string::npos) << w.status();
}

}  // namespace
}  // namespace gradmesh
