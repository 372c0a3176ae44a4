#include "server/shard_store.h"

#include <map>
#include <memory>
#include <string>

#include "common/status_testing.h"
#include "common/test_dirs.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

// A snapshot write of `chunks` (as the shard adds them: version, values, slots).
std::unique_ptr<SnapshotWrite> Chunks(const std::string& job,
                                      const std::map<int64_t, state::ChunkState>& chunks) {
  auto write = std::make_unique<SnapshotWrite>(job);
  for (const auto& [idx, c] : chunks) write->AddChunk(idx, c.version(), c.values(), c.slots());
  return write;
}

state::UpdateRecord Record(int64_t seq, float value) {
  state::UpdateRecord r;
  r.set_seq(seq);
  ChunkData* g = r.add_grads();
  g->set_tensor(0);
  g->set_data(std::string(reinterpret_cast<const char*>(&value), sizeof(value)));
  state::RequestRef* req = r.add_requests();
  req->set_worker(1);
  req->set_request_id(1000 + seq);
  return r;
}

TEST(ShardStoreTest, SnapshotAndLogSurviveReopen) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, testutil::MakeUniqueTestDir("store"));
  InitJobRequest layout;
  layout.set_job("j1");
  layout.set_num_workers(2);
  std::map<int64_t, state::ChunkState> chunks;
  chunks[0].set_version(0);
  chunks[0].set_values("abcd");
  chunks[3].set_version(0);
  chunks[3].set_values("efgh");
  state::JobSnapshot snap;
  snap.set_seq(0);
  {
    ASSERT_OK_AND_ASSIGN(auto store, ShardStore::Open(dir, {}));
    ASSERT_OK_AND_ASSIGN(int64_t bytes,
                         store->WriteSnapshot(Chunks("j1", chunks).get(), &layout, snap));
    EXPECT_GT(bytes, 8);
    for (int64_t seq = 1; seq <= 5; ++seq) ASSERT_OK(store->AppendUpdate("j1", Record(seq, seq)));
    // A later snapshot at seq 3 drops records 1-3 and keeps 4-5.
    snap.set_seq(3);
    chunks[0].set_version(3);
    ASSERT_OK(store->WriteSnapshot(Chunks("j1", chunks).get(), nullptr, snap));
  }
  ASSERT_OK_AND_ASSIGN(auto store, ShardStore::Open(dir, {}));
  ASSERT_OK_AND_ASSIGN(auto jobs, store->LoadAll());
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].layout.job(), "j1");
  EXPECT_EQ(jobs[0].layout.num_workers(), 2);
  EXPECT_EQ(jobs[0].snapshot.seq(), 3);
  ASSERT_EQ(jobs[0].chunks.size(), 2u);
  EXPECT_EQ(jobs[0].chunks.at(0).version(), 3);
  EXPECT_EQ(jobs[0].chunks.at(3).values(), "efgh");
  ASSERT_EQ(jobs[0].log.size(), 2u);
  EXPECT_EQ(jobs[0].log[0].seq(), 4);
  EXPECT_EQ(jobs[0].log[1].seq(), 5);
  EXPECT_EQ(jobs[0].log[1].requests(0).request_id(), 1005u);
}

// The chunks a snapshot writes are read back as protobuf wrote them: every field, a zero
// version and empty arrays (which proto3 leaves out), versions and sizes past one byte.
TEST(ShardStoreTest, SnapshotChunksAreChunkStatesWhateverTheirFields) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, testutil::MakeUniqueTestDir("store"));
  std::map<int64_t, state::ChunkState> chunks;
  chunks[0].set_values("abcd");                        // version 0: left out
  chunks[1].set_version(300);                          // a two-byte varint, no arrays
  chunks[2].set_version(-1);                           // negative: ten bytes
  chunks[2].set_values(std::string(1 << 20, '\x7f'));  // a three-byte length
  chunks[2].set_slots(std::string(2 << 20, '\x01'));
  chunks[0x123456789].set_version(int64_t{1} << 40);  // a key past 32 bits
  chunks[0x123456789].set_slots("wxyz");              // slots without values
  ASSERT_OK_AND_ASSIGN(auto store, ShardStore::Open(dir, {}));
  InitJobRequest layout;
  layout.set_job("j");
  ASSERT_OK_AND_ASSIGN(int64_t bytes, store->WriteSnapshot(Chunks("j", chunks).get(), &layout,
                                                           state::JobSnapshot()));
  EXPECT_GT(bytes, 3 << 20);
  ASSERT_OK_AND_ASSIGN(auto jobs, store->LoadAll());
  ASSERT_EQ(jobs.size(), 1u);
  ASSERT_EQ(jobs[0].chunks.size(), chunks.size());
  for (const auto& [idx, c] : chunks) {
    SCOPED_TRACE(idx);
    const state::ChunkState& got = jobs[0].chunks.at(idx);
    EXPECT_EQ(got.version(), c.version());
    EXPECT_EQ(got.values(), c.values());
    EXPECT_EQ(got.slots(), c.slots());
    EXPECT_EQ(got.SerializeAsString(), c.SerializeAsString());
  }
}

TEST(ShardStoreTest, JobsAreSeparateAndOrderedNumerically) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, testutil::MakeUniqueTestDir("store"));
  ASSERT_OK_AND_ASSIGN(auto store, ShardStore::Open(dir, {}));
  for (const char* name : {"a", "a.b", "b"}) {
    InitJobRequest layout;
    layout.set_job(name);
    ASSERT_OK(store->WriteSnapshot(Chunks(name, {}).get(), &layout, state::JobSnapshot()));
  }
  // 300 records: keys must sort numerically (hex, fixed width), not as decimal strings.
  for (int64_t seq = 1; seq <= 300; ++seq) ASSERT_OK(store->AppendUpdate("a", Record(seq, 0)));
  ASSERT_OK(store->AppendUpdate("b", Record(1, 0)));
  ASSERT_OK_AND_ASSIGN(auto jobs, store->LoadAll());
  ASSERT_EQ(jobs.size(), 3u);
  ASSERT_EQ(jobs[0].layout.job(), "a");
  ASSERT_EQ(jobs[0].log.size(), 300u);
  for (int64_t i = 0; i < 300; ++i) EXPECT_EQ(jobs[0].log[i].seq(), i + 1);
  EXPECT_EQ(jobs[1].layout.job(), "a.b");
  EXPECT_EQ(jobs[1].log.size(), 0u);
  EXPECT_EQ(jobs[2].log.size(), 1u);
}

TEST(ShardStoreTest, SecondOpenOfALockedDirectoryFailsClearly) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, testutil::MakeUniqueTestDir("store"));
  ASSERT_OK_AND_ASSIGN(auto store, ShardStore::Open(dir, {}));
  EXPECT_STATUS_MSG(ShardStore::Open(dir, {}), absl::StatusCode::kInternal,
                    "cannot open shard state in " + dir);
}

}  // namespace
}  // namespace gradmesh
