#include "server/update_log.h"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status_testing.h"
#include "common/test_dirs.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

// A record with `grads` gradients of `n` floats (value v + i), worker 3's request.
struct TestRecord {
  TestRecord(int64_t seq, int grads, size_t n, float v) {
    full.set_seq(seq);
    for (int g = 0; g < grads; ++g) {
      ChunkData* c = full.add_grads();
      c->set_tensor(g);
      c->set_chunk(2 * g + 1);
      c->set_version(seq * 10 + g);
      std::vector<float> f(n);
      for (size_t i = 0; i < n; ++i) f[i] = v + static_cast<float>(g * 1000 + i);
      c->set_data(std::string(reinterpret_cast<const char*>(f.data()), n * sizeof(float)));
    }
    state::RequestRef* r = full.add_requests();
    r->set_worker(3);
    r->set_step(seq);
    r->set_request_id(900 + static_cast<uint64_t>(seq));
    full.set_lr_scale(0.5f);
    state::UpdateRecord meta = full;
    std::vector<absl::string_view> data;
    for (ChunkData& c : *meta.mutable_grads()) c.clear_data();
    for (const ChunkData& c : full.grads()) data.push_back(c.data());
    encoded = std::make_unique<EncodedRecord>(meta, data);
  }
  state::UpdateRecord full;  // What a reader must get back.
  std::unique_ptr<EncodedRecord> encoded;
};

std::vector<const EncodedRecord*> Ptrs(const std::vector<std::unique_ptr<TestRecord>>& rs) {
  std::vector<const EncodedRecord*> out;
  for (const auto& r : rs) out.push_back(r->encoded.get());
  return out;
}

std::vector<state::UpdateRecord> Read(const std::string& root) {
  std::vector<state::UpdateRecord> out;
  EXPECT_OK(UpdateLog::ReadSegments(root, "j", &out));
  return out;
}

std::vector<std::string> Files(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

void ExpectRecords(const std::vector<state::UpdateRecord>& got,
                   const std::vector<std::unique_ptr<TestRecord>>& want, size_t count) {
  ASSERT_EQ(got.size(), count);
  for (size_t i = 0; i < count; ++i) {
    // Byte for byte what protobuf itself writes for the whole record.
    EXPECT_EQ(got[i].SerializeAsString(), want[i]->full.SerializeAsString()) << "record " << i;
  }
}

TEST(StreamChecksumTest, DoesNotDependOnHowTheStreamIsCut) {
  std::string s(1000, '\0');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 7 + 3);
  StreamChecksum whole;
  whole.Update(s.data(), s.size());
  for (size_t cut : {1, 7, 31, 32, 33, 500, 999}) {
    StreamChecksum parts;
    parts.Update(s.data(), cut);
    parts.Update(s.data() + cut, 0);
    parts.Update(s.data() + cut, s.size() - cut);
    EXPECT_EQ(parts.Finish(), whole.Finish()) << cut;
  }
  std::string t = s;
  t[600] ^= 1;
  StreamChecksum other;
  other.Update(t.data(), t.size());
  EXPECT_NE(other.Finish(), whole.Finish());
  std::string longer = s + std::string(1, '\0');  // A trailing zero still counts.
  StreamChecksum z;
  z.Update(longer.data(), longer.size());
  EXPECT_NE(z.Finish(), whole.Finish());
}

TEST(UpdateLogTest, RecordsReadBackAsTheUpdateRecordsTheyEncode) {
  ASSERT_OK_AND_ASSIGN(const std::string root, testutil::MakeUniqueTestDir("update_log"));
  std::vector<std::unique_ptr<TestRecord>> rs;
  rs.push_back(std::make_unique<TestRecord>(1, 2, 5, 0.25f));
  rs.push_back(std::make_unique<TestRecord>(2, 0, 0, 1.0f));
  rs.push_back(std::make_unique<TestRecord>(3, 1, 40000, -3.0f));  // Multi-byte varints.
  rs.push_back(std::make_unique<TestRecord>(4, 3, 1, 7.0f));
  ASSERT_OK_AND_ASSIGN(auto log, UpdateLog::Open(root, "j", 1, /*fresh=*/true, /*fsync=*/true));
  const auto ptrs = Ptrs(rs);
  ASSERT_OK(log->Append(1, absl::MakeConstSpan(ptrs).subspan(0, 3)));
  ASSERT_OK(log->Append(4, absl::MakeConstSpan(ptrs).subspan(3)));
  ExpectRecords(Read(root), rs, 4);
  EXPECT_EQ(Files(root + "/j"), std::vector<std::string>{"0000000000000001.log"});
  std::vector<state::UpdateRecord> none;
  ASSERT_OK(UpdateLog::ReadSegments(root, "other", &none));
  EXPECT_TRUE(none.empty());
}

// Writes records seq 1-3 of equal size (`rs`) as job j's log under `root`, in one segment,
// <root>/j/0000000000000001.log.
void WriteThreeRecords(const std::string& root, std::vector<std::unique_ptr<TestRecord>>* rs) {
  for (int64_t seq = 1; seq <= 3; ++seq) rs->push_back(std::make_unique<TestRecord>(seq, 2, 8, 1));
  ASSERT_OK_AND_ASSIGN(auto log, UpdateLog::Open(root, "j", 1, true, false));
  ASSERT_OK(log->Append(1, Ptrs(*rs)));
}

TEST(UpdateLogTest, AReaderStopsAtATornOrGarbledTail) {
  ASSERT_OK_AND_ASSIGN(const std::string root, testutil::MakeUniqueTestDir("update_log"));
  std::vector<std::unique_ptr<TestRecord>> rs;
  ASSERT_NO_FATAL_FAILURE(WriteThreeRecords(root, &rs));
  const std::string path = root + "/j/0000000000000001.log";
  const auto size = std::filesystem::file_size(path);
  // Every cut inside the last record leaves the first two.
  for (uintmax_t cut : {size - 1, size - 40, size - 70}) {
    std::filesystem::resize_file(path, cut);
    ExpectRecords(Read(root), rs, 2);
  }
  // A flipped byte in the last whole record (before the torn one) ends the segment there:
  // nothing valid follows it.
  std::filesystem::resize_file(path, size - 1);
  const uintmax_t third = size - 1 - (size - 1) / 3;
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    // The third record's frame header starts two thirds in (three records of equal size).
    ASSERT_EQ(bytes.substr(third, 4), std::string("LMG1"));
    f.seekp(static_cast<std::streamoff>(third - 10));
    f.put(static_cast<char>(bytes[third - 10] ^ 0x10));
  }
  std::filesystem::resize_file(path, third);  // The third record gone (never written).
  ExpectRecords(Read(root), rs, 1);
}

// A damaged record with a valid later record after it is not a torn tail: the writer finished
// it (and acknowledged it) before writing the next. Reading on would drop it and replay the
// rest over the gap; reading no further would drop the rest. DataLoss, naming where.
TEST(UpdateLogTest, ADamagedRecordBeforeValidOnesIsDataLoss) {
  ASSERT_OK_AND_ASSIGN(const std::string root, testutil::MakeUniqueTestDir("update_log"));
  std::vector<std::unique_ptr<TestRecord>> rs;
  ASSERT_NO_FATAL_FAILURE(WriteThreeRecords(root, &rs));
  const std::string path = root + "/j/0000000000000001.log";
  const uintmax_t size = std::filesystem::file_size(path);
  const uintmax_t second = size / 3;
  std::string original;
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    original.assign((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    ASSERT_EQ(original.substr(second, 4), std::string("LMG1"));
    f.seekp(static_cast<std::streamoff>(second + 40));  // In the second record's payload.
    f.put(static_cast<char>(original[second + 40] ^ 0x10));
  }
  std::vector<state::UpdateRecord> out;
  EXPECT_STATUS_MSG(UpdateLog::ReadSegments(root, "j", &out), absl::StatusCode::kDataLoss,
                    absl::StrCat("update log ", path, ": the record at byte ", second,
                                 " (seq 2) is damaged, and a whole record follows it (seq 3 at "
                                 "byte ",
                                 2 * size / 3,
                                 "): the log is corrupt, not torn by a crash; updates it "
                                 "acknowledged would be lost (to accept that loss, truncate the "
                                 "file to ",
                                 second, " bytes)"));
  // The third record cut short too (a crash tore it): nothing whole follows the damage, so
  // the segment ends before it, as at a torn tail.
  std::filesystem::resize_file(path, size - 5);
  out.clear();
  ASSERT_OK(UpdateLog::ReadSegments(root, "j", &out));
  EXPECT_EQ(out.size(), 1u);
  // A frame whose header names a later seq than the one due: records are missing.
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.write(original.data(), static_cast<std::streamsize>(original.size()));
  }
  std::filesystem::resize_file(path, second);
  {
    std::ofstream f(path, std::ios::app | std::ios::binary);
    f.write(original.data() + 2 * size / 3, static_cast<std::streamsize>(size / 3));
  }
  out.clear();
  EXPECT_STATUS_MSG(UpdateLog::ReadSegments(root, "j", &out), absl::StatusCode::kDataLoss,
                    absl::StrCat("update log ", path, ": the record at byte ", second,
                                 " has seq 3 where seq 2 belongs: records are missing"));
}

TEST(UpdateLogTest, RotateDeletesTheSegmentsASnapshotCovers) {
  ASSERT_OK_AND_ASSIGN(const std::string root, testutil::MakeUniqueTestDir("update_log"));
  std::vector<std::unique_ptr<TestRecord>> rs;
  for (int64_t seq = 1; seq <= 6; ++seq) rs.push_back(std::make_unique<TestRecord>(seq, 1, 4, 2));
  const auto p = Ptrs(rs);
  ASSERT_OK_AND_ASSIGN(auto log, UpdateLog::Open(root, "j", 1, true, false));
  ASSERT_OK(log->Append(1, absl::MakeConstSpan(p).subspan(0, 3)));
  ASSERT_OK(log->Rotate(2));  // Record 3 is not covered: the segment stays.
  ASSERT_OK(log->Append(4, absl::MakeConstSpan(p).subspan(3, 2)));
  EXPECT_EQ(Files(root + "/j"),
            (std::vector<std::string>{"0000000000000001.log", "0000000000000004.log"}));
  ExpectRecords(Read(root), rs, 5);
  ASSERT_OK(log->Rotate(5));  // Both are covered, and kept as spares.
  EXPECT_EQ(Files(root + "/j"), (std::vector<std::string>{"spare.0", "spare.1"}));
  EXPECT_TRUE(Read(root).empty());
  // Segment 6 is written over segment 4's file: the reader stops at 4's records after it.
  ASSERT_OK(log->Append(6, absl::MakeConstSpan(p).subspan(5)));
  EXPECT_EQ(Files(root + "/j"), (std::vector<std::string>{"0000000000000006.log", "spare.0"}));
  const std::vector<state::UpdateRecord> got = Read(root);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].SerializeAsString(), rs[5]->full.SerializeAsString());
  ASSERT_OK(UpdateLog::Remove(root, "j"));
  EXPECT_FALSE(std::filesystem::exists(root + "/j"));
}

TEST(UpdateLogTest, OpenKeepsReplayedSegmentsAndDropsTheRest) {
  ASSERT_OK_AND_ASSIGN(const std::string root, testutil::MakeUniqueTestDir("update_log"));
  std::vector<std::unique_ptr<TestRecord>> rs;
  for (int64_t seq = 1; seq <= 4; ++seq) rs.push_back(std::make_unique<TestRecord>(seq, 1, 4, 3));
  const auto p = Ptrs(rs);
  {
    ASSERT_OK_AND_ASSIGN(auto log, UpdateLog::Open(root, "j", 1, true, false));
    ASSERT_OK(log->Append(1, absl::MakeConstSpan(p).subspan(0, 2)));
    ASSERT_OK(log->Rotate(0));
    ASSERT_OK(log->Append(3, absl::MakeConstSpan(p).subspan(2, 1)));
  }
  // Restored at seq 2 (say record 3 was torn): segment 3 goes, segment 1 stays until a
  // snapshot covers seq 2, and the log continues at 3.
  {
    ASSERT_OK_AND_ASSIGN(auto log, UpdateLog::Open(root, "j", 3, false, false));
    EXPECT_EQ(Files(root + "/j"), std::vector<std::string>{"0000000000000001.log"});
    ASSERT_OK(log->Append(3, absl::MakeConstSpan(p).subspan(2, 2)));
    ExpectRecords(Read(root), rs, 4);
    ASSERT_OK(log->Rotate(2));
    EXPECT_EQ(Files(root + "/j"), (std::vector<std::string>{"0000000000000003.log", "spare.0"}));
  }
  // A new job of the same name starts from nothing (the spare could hold its first seqs).
  ASSERT_OK_AND_ASSIGN(auto log, UpdateLog::Open(root, "j", 1, true, false));
  EXPECT_TRUE(Files(root + "/j").empty());
  ASSERT_OK(log->Append(1, absl::MakeConstSpan(p).subspan(0, 1)));
  ExpectRecords(Read(root), rs, 1);
}

TEST(UpdateLogTest, AFailedWriteLeavesNothingOfItsBatch) {
  ASSERT_OK_AND_ASSIGN(const std::string root, testutil::MakeUniqueTestDir("update_log"));
  std::vector<std::unique_ptr<TestRecord>> rs;
  rs.push_back(std::make_unique<TestRecord>(1, 1, 16, 4));
  rs.push_back(std::make_unique<TestRecord>(2, 2, 50000, 5));  // ~400 KB.
  rs.push_back(std::make_unique<TestRecord>(2, 1, 16, 6));
  const auto p = Ptrs(rs);
  ASSERT_OK_AND_ASSIGN(auto log, UpdateLog::Open(root, "j", 1, true, false));
  ASSERT_OK(log->Append(1, absl::MakeConstSpan(p).subspan(0, 1)));
  const auto size = std::filesystem::file_size(root + "/j/0000000000000001.log");
  // Files may not grow past 64 KiB: the big record is cut short by the kernel.
  signal(SIGXFSZ, SIG_IGN);
  rlimit old;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = 64 << 10;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const absl::Status st = log->Append(2, absl::MakeConstSpan(p).subspan(1, 1));
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "0000000000000001.log")) << st;
  EXPECT_EQ(std::filesystem::file_size(root + "/j/0000000000000001.log"), size);
  // The seq is taken by the next record; readers never see the failed one.
  ASSERT_OK(log->Append(2, absl::MakeConstSpan(p).subspan(2, 1)));
  const std::vector<state::UpdateRecord> got = Read(root);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[1].SerializeAsString(), rs[2]->full.SerializeAsString());
}

}  // namespace
}  // namespace gradmesh
