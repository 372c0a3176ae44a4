#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "server/shard_durability.h"

namespace gradmesh {
namespace {

std::string TempDir() {
  std::string tmpl = ::testing::TempDir() + "/durability.XXXXXX";
  char* d = mkdtemp(tmpl.data());
  EXPECT_NE(d, nullptr);
  return tmpl;
}

// Job "j": one tensor a[8] in two chunks of 4 on one shard, SGD lr 0.5, two workers.
InitJobRequest Layout(const std::string& mode, int64_t every_updates) {
  InitJobRequest r;
  r.set_job("j");
  auto* a = r.add_tensors();
  a->set_name("a");
  a->add_shape(8);
  r.set_chunk_elems(4);
  r.set_num_shards(1);
  r.set_shard_index(0);
  r.mutable_optimizer()->set_name("sgd");
  r.mutable_optimizer()->set_lr(0.5);
  r.set_num_workers(2);
  r.mutable_durability()->set_mode(mode);
  r.mutable_durability()->set_snapshot_every_updates(every_updates);
  return NormalizedLayout(r);
}

// One job's parts over a store, wired as Shard wires them.
struct Parts {
  Parts(const InitJobRequest& layout, ShardStore* store)
      : job(JobState::Create(layout, OptimizerRegistry::WithBuiltins(),
                             ConsistencyRegistry::WithBuiltins(), store != nullptr)
                .value()),
        ledger("j", 2, 16, 4),
        durability(job.get(), &ledger, store, nullptr) {}

  absl::Status Apply(const ChunkUpdate& u, bool replay) {
    return durability.Apply(u, replay,
                            [this, &u] { ledger.RecordUpdate(job->ApplyToChunks(u), u.requests); });
  }
  // Applies gradient `g` to every element of both chunks as worker w's push `step`.
  absl::Status Push(float g, int32_t w, int64_t step) {
    std::vector<float> grad(4, g);
    ChunkUpdate u;
    u.chunks = {0, 1};
    u.numels = {4, 4};
    u.grads = {grad.data(), grad.data()};
    u.base_versions = {step, step};
    u.requests = {{w, step, static_cast<uint64_t>(100 + step)}};
    return Apply(u, /*replay=*/false);
  }
  void SetValues(float v) {
    for (const auto& [idx, chunk] : job->chunks()) {
      absl::MutexLock lock(&chunk->mu);
      chunk->values.assign(4, v + idx);
    }
  }
  std::vector<float> Values() {
    std::vector<float> out;
    for (int64_t idx : job->owned_indices()) {
      Chunk* c = job->chunk(idx);
      absl::MutexLock lock(&c->mu);
      out.insert(out.end(), c->values.begin(), c->values.end());
    }
    return out;
  }

  std::unique_ptr<JobState> job;
  RequestLedger ledger;
  ShardDurability durability;
};

class ShardDurabilityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDir();
    store_ = ShardStore::Open(dir_, {}).value();
  }
  ShardStore::StoredJob Load() {
    auto all = store_->LoadAll();
    EXPECT_OK(all);
    EXPECT_EQ(all->size(), 1u);
    return all->empty() ? ShardStore::StoredJob{} : (*all)[0];
  }

  std::string dir_;
  std::unique_ptr<ShardStore> store_;
};

TEST_F(ShardDurabilityTest, EveryUpdateLogsEachUpdateBeforeApplyingIt) {
  Parts p(Layout("every_update", 1000), store_.get());
  p.SetValues(1.0f);
  ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/true));  // Layout and initial values.
  ASSERT_OK(p.Push(2.0f, 0, 0));
  ASSERT_OK(p.Push(4.0f, 1, 1));
  const ShardStore::StoredJob s = Load();
  EXPECT_EQ(s.snapshot.seq(), 0);
  ASSERT_EQ(s.log.size(), 2u);
  const state::UpdateRecord& r = s.log[1];
  EXPECT_EQ(r.seq(), 2);
  ASSERT_EQ(r.grads_size(), 2);
  EXPECT_EQ(r.grads(1).tensor(), 0);
  EXPECT_EQ(r.grads(1).chunk(), 1);
  EXPECT_EQ(r.grads(1).version(), 1);
  std::vector<float> g(4);
  ASSERT_EQ(r.grads(1).data().size(), 16u);
  std::memcpy(g.data(), r.grads(1).data().data(), 16);
  EXPECT_EQ(g, std::vector<float>(4, 4.0f));
  ASSERT_EQ(r.requests_size(), 1);
  EXPECT_EQ(r.requests(0).worker(), 1);
  EXPECT_EQ(r.requests(0).step(), 1);
  EXPECT_EQ(r.requests(0).request_id(), 101u);
  EXPECT_EQ(r.lr_scale(), 0.0f);  // 1 is not written.
  EXPECT_EQ(p.ledger.updates_applied(), 2);
  // 1 - 0.5 * 2 - 0.5 * 4 and 2 - 0.5 * 2 - 0.5 * 4.
  EXPECT_EQ(p.Values(), (std::vector<float>{-2, -2, -2, -2, -1, -1, -1, -1}));
}

TEST_F(ShardDurabilityTest, SnapshotsAreTakenByCountAndDropTheLog) {
  Parts p(Layout("every_update", 3), store_.get());
  p.SetValues(0.0f);
  ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/true));
  EXPECT_EQ(p.durability.stats().snapshots, 1);
  for (int step = 0; step < 2; ++step) {
    ASSERT_OK(p.Push(1.0f, 0, step));
    ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/false));
  }
  EXPECT_EQ(p.durability.stats().snapshots, 1);  // 2 updates < 3.
  ASSERT_OK(p.Push(1.0f, 0, 2));
  ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/false));
  const ShardDurability::Stats st = p.durability.stats();
  EXPECT_EQ(st.snapshots, 2);
  EXPECT_EQ(st.snapshot_update, 3);
  EXPECT_GT(st.last_snapshot_bytes, 0);
  EXPECT_FALSE(st.restored);
  const ShardStore::StoredJob s = Load();
  EXPECT_EQ(s.snapshot.seq(), 3);
  EXPECT_TRUE(s.log.empty());
  ASSERT_EQ(s.snapshot.workers_size(), 2);
  EXPECT_EQ(s.snapshot.workers(0).last_step(), 2);
  EXPECT_EQ(s.snapshot.workers(0).recent_ids_size(), 3);
  ASSERT_EQ(s.chunks.size(), 2u);
  EXPECT_EQ(s.chunks.at(1).version(), 3);
}

TEST_F(ShardDurabilityTest, RestoreLoadsTheSnapshotAndReplaysTheLogExactly) {
  std::vector<float> want;
  {
    Parts p(Layout("every_update", 2), store_.get());
    p.SetValues(3.0f);
    ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/true));
    for (int step = 0; step < 5; ++step) {
      ASSERT_OK(p.Push(0.125f * (step + 1), step % 2, step));
      ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/false));
    }
    want = p.Values();
  }
  const ShardStore::StoredJob s = Load();
  EXPECT_EQ(s.snapshot.seq(), 4);
  ASSERT_EQ(s.log.size(), 1u);
  Parts r(s.layout, store_.get());
  ASSERT_OK(
      r.durability.Restore(s, [&r](const ChunkUpdate& u) { return r.Apply(u, /*replay=*/true); }));
  EXPECT_EQ(r.Values(), want);
  const ShardDurability::Stats st = r.durability.stats();
  EXPECT_TRUE(st.restored);
  EXPECT_EQ(st.replayed, 1);
  EXPECT_EQ(st.snapshot_update, 4);
  EXPECT_EQ(r.ledger.updates_applied(), 5);
  const RequestLedger::Stats ls = r.ledger.stats();
  EXPECT_EQ(ls.workers[0].last_step, 4);
  EXPECT_EQ(ls.workers[1].last_step, 3);
  EXPECT_EQ(ls.pushes_applied, 5);
  // Replay logs nothing new: the store still holds one record.
  EXPECT_EQ(Load().log.size(), 1u);
}

TEST_F(ShardDurabilityTest, RestoreRefusesMissingChunksAndForeignLogRecords) {
  Parts p(Layout("periodic", 1000), store_.get());
  p.SetValues(0.0f);
  ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/true));
  ShardStore::StoredJob s = Load();

  ShardStore::StoredJob missing = s;
  missing.chunks.erase(1);
  Parts a(s.layout, store_.get());
  EXPECT_EQ(a.durability.Restore(missing, [](const ChunkUpdate&) { return absl::OkStatus(); }),
            absl::DataLossError(absl::StrCat("restoring job j from ", dir_,
                                             ": chunk 1 is missing or has the wrong size")));

  ShardStore::StoredJob foreign = s;
  state::UpdateRecord rec;
  rec.set_seq(1);
  ChunkData* g = rec.add_grads();
  g->set_tensor(0);
  g->set_chunk(2);  // a[8] has chunks 0 and 1 only.
  g->set_data(std::string(16, '\0'));
  foreign.log.push_back(rec);
  Parts b(s.layout, store_.get());
  int replayed = 0;
  EXPECT_EQ(b.durability.Restore(foreign,
                                 [&replayed](const ChunkUpdate&) {
                                   ++replayed;
                                   return absl::OkStatus();
                                 }),
            absl::DataLossError("restoring job j: log record 1 names a chunk this shard does not "
                                "own or has the wrong size"));
  EXPECT_EQ(replayed, 0);
}

TEST_F(ShardDurabilityTest, PeriodicDoesNotLogAndNoneDoesNothing) {
  Parts p(Layout("periodic", 1000), store_.get());
  p.SetValues(0.0f);
  ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/true));
  ASSERT_OK(p.Push(1.0f, 0, 0));
  EXPECT_TRUE(Load().log.empty());

  Parts none(Layout("none", 1000), nullptr);
  none.SetValues(0.0f);
  ASSERT_OK(none.Push(1.0f, 0, 0));
  ASSERT_OK(none.durability.MaybeSnapshot(/*force=*/true));
  EXPECT_EQ(none.durability.stats().snapshots, 0);
  EXPECT_EQ(none.ledger.updates_applied(), 1);
}

}  // namespace
}  // namespace gradmesh
