#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_testing.h"
#include "common/test_dirs.h"
#include "gtest/gtest.h"
#include "server/shard_durability.h"

namespace gradmesh {
namespace {

// Job "j": one tensor a[8] in two chunks of 4 on one shard, SGD lr 0.5 (or Adam), two workers.
InitJobRequest Layout(const std::string& mode, int64_t every_updates, bool adam = false) {
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
  if (adam) {
    r.mutable_optimizer()->set_name("adam");
    r.mutable_optimizer()->set_lr(0.01);
  }
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

  // Every chunk's version, values and slots, bit for bit.
  std::string ChunkBytes() {
    std::string out;
    for (int64_t idx : job->owned_indices()) {
      Chunk* c = job->chunk(idx);
      absl::MutexLock lock(&c->mu);
      out += absl::StrCat("chunk ", idx, " v", c->version, ":");
      out.append(reinterpret_cast<const char*>(c->values.data()), c->values.size() * 4);
      out.append(reinterpret_cast<const char*>(c->slots.data()), c->slots.size() * 4);
    }
    return out;
  }
  std::string LedgerBytes() {
    state::JobSnapshot snap;
    ledger.SaveTo(&snap);
    return snap.SerializeAsString();
  }

  std::unique_ptr<JobState> job;
  RequestLedger ledger;
  ShardDurability durability;
};

// Thread t's push i: worker t % 2, a step and request id no other push has, a gradient that
// depends on (t, i, element), on chunk 0, chunk 1 or both.
absl::Status ThreadPush(Parts* p, int t, int i, bool replay = false) {
  std::vector<float> g0(4), g1(4);
  for (int e = 0; e < 4; ++e) {
    g0[e] = 0.01f * static_cast<float>((t * 31 + i * 7 + e) % 13 - 6);
    g1[e] = 0.02f * static_cast<float>((t * 17 + i * 5 + e) % 11 - 5);
  }
  ChunkUpdate u;
  const int which = (t + i) % 3;
  if (which != 1) {
    u.chunks.push_back(0);
    u.grads.push_back(g0.data());
  }
  if (which != 0) {
    u.chunks.push_back(1);
    u.grads.push_back(g1.data());
  }
  for (size_t k = 0; k < u.chunks.size(); ++k) {
    u.numels.push_back(4);
    u.base_versions.push_back(i);
  }
  u.requests = {{t % 2, int64_t{i} * 8 + t / 2, static_cast<uint64_t>(1000 * t + i)}};
  return p->Apply(u, replay);
}

class ShardDurabilityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(dir_, testutil::MakeUniqueTestDir("durability"));
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

// A snapshot costs several times more per byte than the log, so the log between two grows with
// the state: a large shard does not snapshot after every push.
TEST_F(ShardDurabilityTest, TheLogBetweenSnapshotsGrowsWithTheState) {
  EXPECT_EQ(LogBytesPerSnapshot(0), kLogBytesPerSnapshot);
  EXPECT_EQ(LogBytesPerSnapshot(kLogBytesPerSnapshot / kLogPerStateBytes), kLogBytesPerSnapshot);
  EXPECT_EQ(LogBytesPerSnapshot(int64_t{1} << 30), kLogPerStateBytes << 30);
  // a[8]: 8 values, and with Adam its two slots of 8.
  Parts sgd(Layout("every_update", 1000), store_.get());
  EXPECT_EQ(sgd.durability.stats().state_bytes, 8 * 4);
  Parts adam(Layout("every_update", 1000, /*adam=*/true), store_.get());
  EXPECT_EQ(adam.durability.stats().state_bytes, 3 * 8 * 4);
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

TEST_F(ShardDurabilityTest, ConcurrentEveryUpdatePushesRestoreExactly) {
  constexpr int kThreads = 8, kPushes = 60;
  // Snapshots (and log rotations) every 7 updates, taken by the pushing threads meanwhile.
  Parts p(Layout("every_update", 7, /*adam=*/true), store_.get());
  p.SetValues(1.0f);
  ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/true));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&p, t] {
      for (int i = 0; i < kPushes; ++i) {
        EXPECT_OK(ThreadPush(&p, t, i));
        EXPECT_OK(p.durability.MaybeSnapshot(/*force=*/false));
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(p.ledger.updates_applied(), kThreads * kPushes);
  const ShardDurability::Stats st = p.durability.stats();
  EXPECT_EQ(st.log_records, kThreads * kPushes);
  EXPECT_GE(st.log_writes, 1);
  EXPECT_LE(st.log_writes, st.log_records);
  EXPECT_GT(st.snapshots, 1);

  const ShardStore::StoredJob s = Load();
  EXPECT_EQ(s.snapshot.seq() + static_cast<int64_t>(s.log.size()), kThreads * kPushes);
  Parts r(s.layout, store_.get());
  ASSERT_OK(
      r.durability.Restore(s, [&r](const ChunkUpdate& u) { return r.Apply(u, /*replay=*/true); }));
  EXPECT_EQ(r.ChunkBytes(), p.ChunkBytes());    // Values, Adam slots and versions.
  EXPECT_EQ(r.LedgerBytes(), p.LedgerBytes());  // Progress, recent ids, counters.
  EXPECT_EQ(r.ledger.updates_applied(), kThreads * kPushes);
  // An id applied before the restart is still a duplicate after it.
  EXPECT_EQ(r.ledger.BeginPush(1, int64_t{kPushes - 1} * 8 + 3, 1000 * 7 + kPushes - 1).value(),
            RequestLedger::Admission::kDuplicate);
  // The restored job logs on after the replayed records (the live one, sharing the store,
  // applies the same update without logging it).
  ASSERT_OK(ThreadPush(&r, 0, kPushes));
  ASSERT_OK(ThreadPush(&p, 0, kPushes, /*replay=*/true));
  EXPECT_EQ(r.ChunkBytes(), p.ChunkBytes());
  const ShardStore::StoredJob again = Load();
  EXPECT_EQ(again.snapshot.seq() + static_cast<int64_t>(again.log.size()), kThreads * kPushes + 1);
}

TEST_F(ShardDurabilityTest, AFailedLogWriteAcknowledgesAndAppliesNothing) {
  Parts p(Layout("every_update", 1000), store_.get());
  p.SetValues(1.0f);
  ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/true));
  ASSERT_OK(p.Push(2.0f, 0, 0));
  const std::vector<float> before = p.Values();
  const std::string segment = dir_ + "/updates/j/0000000000000001.log";
  const auto size = std::filesystem::file_size(segment);
  // Files may grow by 10 bytes only: the next record is cut short and the write fails.
  signal(SIGXFSZ, SIG_IGN);
  rlimit old;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = size + 10;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const absl::Status st = p.Push(4.0f, 1, 1);
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_TRUE(absl::StartsWith(st.message(),
                               "Push: job j not applied: cannot write log segment " + segment))
      << st;
  EXPECT_EQ(p.Values(), before);
  EXPECT_EQ(p.ledger.updates_applied(), 1);
  EXPECT_EQ(std::filesystem::file_size(segment), size);
  // The next update takes seq 2, and a restore replays exactly the two applied ones.
  ASSERT_OK(p.Push(8.0f, 1, 2));
  const ShardStore::StoredJob s = Load();
  ASSERT_EQ(s.log.size(), 2u);
  EXPECT_EQ(s.log[1].seq(), 2);
  EXPECT_EQ(s.log[1].requests(0).step(), 2);
  Parts r(s.layout, store_.get());
  ASSERT_OK(
      r.durability.Restore(s, [&r](const ChunkUpdate& u) { return r.Apply(u, /*replay=*/true); }));
  EXPECT_EQ(r.ChunkBytes(), p.ChunkBytes());
  EXPECT_EQ(r.LedgerBytes(), p.LedgerBytes());
}

TEST_F(ShardDurabilityTest, OldStoresWithTheLogInRocksDbStillRestore) {
  // A store written before the log files: records as RocksDB keys (ShardStore::AppendUpdate).
  std::vector<float> want;
  std::string want_ledger;
  {
    Parts p(Layout("periodic", 1000), store_.get());  // periodic: the live job logs nothing.
    p.SetValues(1.0f);
    ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/true));
    for (int step = 0; step < 3; ++step) {
      ASSERT_OK(p.Push(0.5f * (step + 1), step % 2, step));
      state::UpdateRecord rec;
      rec.set_seq(step + 1);
      for (int c = 0; c < 2; ++c) {
        ChunkData* g = rec.add_grads();
        g->set_tensor(0);
        g->set_chunk(c);
        g->set_version(step);
        std::vector<float> grad(4, 0.5f * (step + 1));
        g->set_data(std::string(reinterpret_cast<const char*>(grad.data()), 16));
      }
      state::RequestRef* req = rec.add_requests();
      req->set_worker(step % 2);
      req->set_step(step);
      req->set_request_id(100 + step);
      ASSERT_OK(store_->AppendUpdate("j", rec));
    }
    want = p.Values();
    want_ledger = p.LedgerBytes();
  }
  ShardStore::StoredJob s = Load();
  ASSERT_EQ(s.log.size(), 3u);
  s.layout.mutable_durability()->set_mode("every_update");
  Parts r(s.layout, store_.get());
  ASSERT_OK(
      r.durability.Restore(s, [&r](const ChunkUpdate& u) { return r.Apply(u, /*replay=*/true); }));
  EXPECT_EQ(r.Values(), want);
  EXPECT_EQ(r.LedgerBytes(), want_ledger);
  // New records go to the log files after the old ones, and both restore.
  ASSERT_OK(r.Push(1.0f, 1, 3));
  const ShardStore::StoredJob after = Load();
  ASSERT_EQ(after.log.size(), 4u);
  EXPECT_EQ(after.log[3].seq(), 4);
  EXPECT_EQ(after.log[3].requests(0).request_id(), 103u);
}

// Snapshots write their chunks to chunks.0 and chunks.1 in turn, each over the file the stored
// snapshot does not name: a crash while one is written (here: that file garbled or cut) leaves
// the stored snapshot whole, and the restore exact.
TEST_F(ShardDurabilityTest, SnapshotsAlternateChunkFilesSoATornOneLosesNothing) {
  const std::string files = dir_ + "/updates/j/";
  std::vector<float> want;
  {
    Parts p(Layout("every_update", 2, /*adam=*/true), store_.get());
    p.SetValues(1.0f);
    ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/true));
    EXPECT_EQ(Load().snapshot.chunks_file().slot(), 0);
    for (int step = 0; step < 2; ++step) {
      ASSERT_OK(p.Push(0.25f, 0, step));
      ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/false));
    }
    EXPECT_EQ(p.durability.stats().snapshots, 2);
    const ShardStore::StoredJob s = Load();
    EXPECT_EQ(s.snapshot.chunks_file().slot(), 1);
    EXPECT_EQ(s.snapshot.chunks_file().chunks(), 2);
    EXPECT_EQ(s.snapshot.chunks_file().bytes(), 8 + 2 * (32 + 3 * 4 * 4));  // Adam: 2 slots.
    ASSERT_OK(p.Push(0.5f, 1, 0));  // Logged after the snapshot.
    want = p.Values();
  }
  // The next snapshot would write chunks.0: a crash in the middle of it.
  ASSERT_EQ(truncate((files + "chunks.0").c_str(), 20), 0);
  ShardStore::StoredJob s = Load();
  ASSERT_EQ(s.log.size(), 1u);
  Parts r(s.layout, store_.get());
  ASSERT_OK(
      r.durability.Restore(s, [&r](const ChunkUpdate& u) { return r.Apply(u, /*replay=*/true); }));
  EXPECT_EQ(r.Values(), want);
  // The restored job goes on with the other file, and the torn one is written whole.
  ASSERT_OK(r.durability.MaybeSnapshot(/*force=*/true));
  s = Load();
  EXPECT_EQ(s.snapshot.chunks_file().slot(), 0);
  EXPECT_TRUE(s.log.empty());
  Parts again(s.layout, store_.get());
  ASSERT_OK(again.durability.Restore(s, [](const ChunkUpdate&) { return absl::OkStatus(); }));
  EXPECT_EQ(again.Values(), want);
  EXPECT_EQ(again.ChunkBytes(), r.ChunkBytes());
}

// A store from before chunk files: chunk states as RocksDB keys. It restores, and its next
// snapshot moves them to a file and deletes the keys.
TEST_F(ShardDurabilityTest, OldStoresWithChunkKeysRestoreAndMoveToAFile) {
  Parts p(Layout("periodic", 1000), store_.get());
  p.SetValues(2.0f);
  {
    SnapshotWrite keys("j");
    std::vector<float> v0(4, 3.0f), v1(4, 4.0f);
    keys.AddChunk(0, 5, absl::string_view(reinterpret_cast<const char*>(v0.data()), 16), "");
    keys.AddChunk(1, 6, absl::string_view(reinterpret_cast<const char*>(v1.data()), 16), "");
    state::JobSnapshot snap;
    p.ledger.SaveTo(&snap);
    ASSERT_OK(store_->WriteSnapshot(&keys, &p.job->layout(), snap));
  }
  ShardStore::StoredJob s = Load();
  EXPECT_FALSE(s.snapshot.has_chunks_file());
  Parts r(s.layout, store_.get());
  ASSERT_OK(r.durability.Restore(s, [](const ChunkUpdate&) { return absl::OkStatus(); }));
  EXPECT_EQ(r.Values(), std::vector<float>({3, 3, 3, 3, 4, 4, 4, 4}));
  ASSERT_OK(r.durability.MaybeSnapshot(/*force=*/true));
  s = Load();
  EXPECT_EQ(s.snapshot.chunks_file().slot(), 0);
  EXPECT_EQ(s.chunks.at(1).version(), 6);
  // The keys are gone: with the reference cleared the snapshot has no chunks at all.
  ASSERT_OK(store_->WriteSnapshot(std::make_unique<SnapshotWrite>("j").get(), nullptr,
                                  state::JobSnapshot()));
  EXPECT_TRUE(Load().chunks.empty());
}

// A replaced job (Shard::DropStaleJob) must not write into the files its successor owns.
TEST_F(ShardDurabilityTest, AfterCloseNothingIsLoggedAppliedOrSnapshotted) {
  Parts p(Layout("every_update", 1), store_.get());
  p.SetValues(1.0f);
  ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/true));
  ASSERT_OK(p.Push(1.0f, 0, 0));
  const std::vector<float> before = p.Values();
  p.durability.Close();
  const absl::Status st = p.Push(1.0f, 0, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "job j not applied: the job was replaced")) << st;
  EXPECT_EQ(p.Values(), before);
  ASSERT_OK(p.durability.MaybeSnapshot(/*force=*/true));
  const ShardDurability::Stats stats = p.durability.stats();
  EXPECT_EQ(stats.snapshots, 1);  // The one before Close only.
  EXPECT_EQ(stats.log_records, 1);
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
