// Durable shard state (ShardOptions.store): restore after restart, log replay, snapshots,
// and the InitJob options that go with it (durability, consistency, staleness damping).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "common/status_testing.h"
#include "common/test_dirs.h"
#include "gtest/gtest.h"
#include "server/chunks_file.h"
#include "server/shard.h"
#include "server/shard_store.h"

namespace gradmesh {
namespace {

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}
std::vector<float> Floats(const std::string& b) {
  std::vector<float> v(b.size() / sizeof(float));
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

// Layout: tensors a[10] and b[3x4], chunks of 4 elements, one shard (which owns all six
// chunks). Initial value of element i of tensor t is 100 * t + i + 0.25.
const std::vector<int64_t> kNumels = {10, 12};

const Partition& TestPartition() {
  static const Partition* p = new Partition(Partition::Create(kNumels, 4, 1).value());
  return *p;
}

struct JobOptions {
  std::string job = "j";
  std::string optimizer = "sgd";
  std::string durability = "every_update";
  int64_t snapshot_every_updates = 1000000;
  double snapshot_every_seconds = 0;
  std::string consistency = "async";
  int32_t num_workers = 2;
  bool damping = false;
  double barrier_timeout_s = 0;
  bool commit_steps = false;  // sync two-phase apply (server/sync_commits.h).
};

InitJobRequest MakeInit(const JobOptions& o) {
  InitJobRequest r;
  r.set_job(o.job);
  auto* a = r.add_tensors();
  a->set_name("a");
  a->add_shape(10);
  auto* b = r.add_tensors();
  b->set_name("b");
  b->add_shape(3);
  b->add_shape(4);
  r.set_chunk_elems(4);
  r.set_num_shards(1);
  r.set_shard_index(0);
  OptimizerSpec* opt = r.mutable_optimizer();
  opt->set_name(o.optimizer);
  if (o.optimizer == "sgd") {
    opt->set_lr(0.5);
  } else if (o.optimizer == "sgd_momentum") {
    opt->set_name("sgd");
    opt->set_lr(0.125);
    opt->set_momentum(0.875);
  } else {
    opt->set_lr(0.01);
    opt->set_weight_decay(0.1);
  }
  r.set_consistency(o.consistency);
  r.set_num_workers(o.num_workers);
  r.set_staleness_damping(o.damping);
  r.set_barrier_timeout_s(o.barrier_timeout_s);
  r.set_commit_steps(o.commit_steps);
  r.mutable_durability()->set_mode(o.durability);
  r.mutable_durability()->set_snapshot_every_updates(o.snapshot_every_updates);
  r.mutable_durability()->set_snapshot_every_seconds(o.snapshot_every_seconds);
  const Partition& p = TestPartition();
  for (int64_t idx : p.shard_chunks(0)) {
    const ChunkInfo& c = p.chunks()[idx];
    std::vector<float> v(c.numel);
    for (int64_t i = 0; i < c.numel; ++i) {
      v[i] = static_cast<float>(100 * c.tensor + c.offset + i) + 0.25f;
    }
    ChunkData* d = r.add_initial();
    d->set_tensor(c.tensor);
    d->set_chunk(c.chunk);
    d->set_dtype(FLOAT32);
    d->set_data(Bytes(v));
  }
  return r;
}

// A pulled chunk, compared bit for bit.
struct PulledChunk {
  int32_t tensor;
  int32_t chunk;
  int64_t version;
  std::string data;
  bool operator==(const PulledChunk& o) const {
    return tensor == o.tensor && chunk == o.chunk && version == o.version && data == o.data;
  }
};

std::ostream& operator<<(std::ostream& os, const PulledChunk& c) {
  os << "(" << c.tensor << "," << c.chunk << " v" << c.version << ":";
  for (float f : Floats(c.data)) os << " " << f;
  return os << ")";
}

std::vector<PulledChunk> PullAll(Shard* shard, const std::string& job = "j") {
  PullRequest req;
  req.set_job(job);
  PullResponse resp;
  EXPECT_OK(shard->Pull(req, &resp));
  std::vector<PulledChunk> out;
  for (const ChunkData& c : resp.chunks()) {
    out.push_back({c.tensor(), c.chunk(), c.version(), c.data()});
  }
  return out;
}

absl::StatusOr<JobInfoResponse> Info(Shard* shard, const std::string& job = "j") {
  JobInfoRequest q;
  q.set_job(job);
  return shard->GetJobInfo(q);
}

// The progress fields a restart must preserve.
void ExpectSameProgress(const JobInfoResponse& want, const JobInfoResponse& got) {
  EXPECT_EQ(got.pushes_applied(), want.pushes_applied());
  EXPECT_EQ(got.updates_applied(), want.updates_applied());
  EXPECT_EQ(got.owned_elements(), want.owned_elements());
  ASSERT_EQ(got.workers_size(), want.workers_size());
  for (int w = 0; w < want.workers_size(); ++w) {
    EXPECT_EQ(got.workers(w).last_step(), want.workers(w).last_step()) << "worker " << w;
    EXPECT_EQ(got.workers(w).pushes_applied(), want.workers(w).pushes_applied()) << "worker " << w;
    EXPECT_EQ(got.workers(w).finished(), want.workers(w).finished()) << "worker " << w;
  }
  EXPECT_EQ(
      std::vector<int64_t>(got.staleness_histogram().begin(), got.staleness_histogram().end()),
      std::vector<int64_t>(want.staleness_histogram().begin(), want.staleness_histogram().end()));
}

// Deterministic pseudo-random pushes: push i comes from worker i % 2 at step i / 2, covers a
// varying subset of the chunks with varied gradients, and claims a base version 0-2 updates
// behind the chunk's current one. `versions` tracks chunk versions (indexed like
// shard_chunks(0)) and is updated.
PushRequest GenPush(int i, std::vector<int64_t>* versions, const std::string& job = "j") {
  const Partition& p = TestPartition();
  PushRequest r;
  r.set_job(job);
  r.set_worker(i % 2);
  r.set_step(i / 2);
  r.set_request_id(static_cast<uint64_t>(5000 + 7 * i));
  const auto& owned = p.shard_chunks(0);
  for (size_t k = 0; k < owned.size(); ++k) {
    if ((static_cast<int>(k) + i) % 3 == 0 && i % 5 != 0) continue;  // Skip some chunks.
    const ChunkInfo& c = p.chunks()[owned[k]];
    std::vector<float> g(c.numel);
    for (int64_t e = 0; e < c.numel; ++e) {
      g[e] = static_cast<float>((i * 7 + static_cast<int>(k) * 3 + static_cast<int>(e)) % 11 - 5) *
             0.37f;
    }
    ChunkData* d = r.add_chunks();
    d->set_tensor(c.tensor);
    d->set_chunk(c.chunk);
    d->set_dtype(FLOAT32);
    d->set_version(std::max<int64_t>(0, (*versions)[k] - i % 3));
    d->set_data(Bytes(g));
    ++(*versions)[k];
  }
  return r;
}

class DurabilityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(dir_, testutil::MakeUniqueTestDir("durability"));
    Open();
  }

  // (Re)starts the shard on dir_.
  void Open() {
    ASSERT_EQ(shard_, nullptr);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShardStore> store, ShardStore::Open(dir_, {}));
    ShardOptions options;
    options.store = std::move(store);
    ASSERT_OK_AND_ASSIGN(shard_, Shard::Create(std::move(options)));
  }

  // Destroys the shard and its store (closing RocksDB) and opens them again.
  void Restart() {
    shard_.reset();
    Open();
  }

  static std::unique_ptr<Shard> MemoryShard() {
    auto s = Shard::Create(ShardOptions());
    EXPECT_TRUE(s.ok()) << s.status();
    return std::move(s).value();
  }

  // every_update: 37 pushes, restart, and the state is exactly as before, from the log alone.
  void RunEveryUpdateRestart(const JobOptions& opts);

  std::string dir_;
  std::unique_ptr<Shard> shard_;
};

void DurabilityTest::RunEveryUpdateRestart(const JobOptions& opts) {
  std::unique_ptr<Shard> twin = MemoryShard();  // Never restarts.
  JobOptions twin_opts = opts;
  twin_opts.durability = "none";
  ASSERT_OK(twin->InitJob(MakeInit(twin_opts)));
  ASSERT_OK_AND_ASSIGN(InitJobResponse created, (shard_.get())->InitJob(MakeInit(opts)));
  EXPECT_TRUE(created.created());
  const auto initial = PullAll(shard_.get());

  constexpr int kPushes = 37;
  std::vector<int64_t> versions(TestPartition().shard_chunks(0).size(), 0);
  std::vector<PushRequest> pushes;
  for (int i = 0; i < kPushes; ++i) {
    pushes.push_back(GenPush(i, &versions));
    ASSERT_OK_AND_ASSIGN(PushResponse r, (shard_.get())->Push(pushes.back()));
    EXPECT_FALSE(r.duplicate());
    ASSERT_OK(twin->Push(pushes.back()));
  }
  const auto before = PullAll(shard_.get());
  ASSERT_EQ(before, PullAll(twin.get()));  // Durable and in-memory shards agree.
  ASSERT_NE(before, initial);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info_before, Info(shard_.get()));
  EXPECT_EQ(info_before.updates_applied(), kPushes);
  EXPECT_EQ(info_before.pushes_applied(), kPushes);
  EXPECT_EQ(info_before.workers(0).last_step(), 18);
  EXPECT_EQ(info_before.workers(1).last_step(), 17);
  EXPECT_EQ(info_before.snapshots(), 1);  // At creation only.
  EXPECT_EQ(info_before.snapshot_update(), 0);
  EXPECT_FALSE(info_before.restored());
  EXPECT_EQ(info_before.replayed_updates(), 0);

  Restart();
  Shard* shard = shard_.get();
  EXPECT_EQ(PullAll(shard), before);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info_after, Info(shard));
  EXPECT_TRUE(info_after.restored());
  EXPECT_EQ(info_after.replayed_updates(), kPushes);
  EXPECT_EQ(info_after.snapshot_update(), 0);
  EXPECT_EQ(info_after.snapshots(), 0);  // Counts this process's snapshots.
  EXPECT_EQ(info_after.consistency(), opts.consistency);
  ExpectSameProgress(info_before, info_after);

  // InitJob from a resuming worker finds the job and changes nothing.
  ASSERT_OK_AND_ASSIGN(InitJobResponse again, shard->InitJob(MakeInit(opts)));
  EXPECT_FALSE(again.created());
  EXPECT_EQ(PullAll(shard), before);

  // Retries of pushes applied before the restart are recognised (first and last).
  for (int i : {0, kPushes - 1}) {
    ASSERT_OK_AND_ASSIGN(PushResponse dup, shard->Push(pushes[i]));
    EXPECT_TRUE(dup.duplicate()) << "push " << i;
    EXPECT_EQ(dup.new_versions_size(), 0);
  }
  EXPECT_EQ(PullAll(shard), before);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info_dup, Info(shard));
  EXPECT_EQ(info_dup.duplicates_dropped(), 2);
  EXPECT_EQ(info_dup.updates_applied(), kPushes);

  // A new push works, and gives bit-identical results to the shard that never restarted
  // (this needs the optimizer slots and chunk versions to have been restored).
  PushRequest next = GenPush(kPushes, &versions);
  ASSERT_OK_AND_ASSIGN(PushResponse r, shard->Push(next));
  EXPECT_FALSE(r.duplicate());
  ASSERT_OK_AND_ASSIGN(PushResponse twin_r, twin->Push(next));
  EXPECT_EQ(std::vector<int64_t>(r.new_versions().begin(), r.new_versions().end()),
            std::vector<int64_t>(twin_r.new_versions().begin(), twin_r.new_versions().end()));
  const auto after = PullAll(shard);
  EXPECT_EQ(after, PullAll(twin.get()));
  EXPECT_NE(after, before);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info_next, Info(shard));
  EXPECT_EQ(info_next.updates_applied(), kPushes + 1);
  EXPECT_EQ(info_next.workers(0).last_step(), 18);
  EXPECT_EQ(info_next.workers(1).last_step(), 18);

  // And that push is itself durable.
  Restart();
  EXPECT_EQ(PullAll(shard_.get()), after);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info_final, Info(shard_.get()));
  EXPECT_EQ(info_final.replayed_updates(), kPushes + 1);
  EXPECT_EQ(info_final.updates_applied(), kPushes + 1);
}

TEST_F(DurabilityTest, EveryUpdateRestoresSgdExactly) { RunEveryUpdateRestart(JobOptions()); }

TEST_F(DurabilityTest, EveryUpdateRestoresMomentumAndDampingExactly) {
  JobOptions o;
  o.optimizer = "sgd_momentum";
  o.damping = true;  // Damping depends on restored versions and the logged base versions.
  RunEveryUpdateRestart(o);
}

TEST_F(DurabilityTest, EveryUpdateRestoresAdamSlotsExactly) {
  JobOptions o;
  o.optimizer = "adam";
  RunEveryUpdateRestart(o);
}

TEST_F(DurabilityTest, EveryUpdateSsp) {
  JobOptions o;
  o.consistency = "ssp:100";  // Clocks are restored too; the bound is never hit here.
  RunEveryUpdateRestart(o);
}

TEST_F(DurabilityTest, EveryUpdateReplaysOnlyAfterTheLastSnapshot) {
  JobOptions o;
  o.optimizer = "adam";  // Slots now come from the snapshot, not from replay.
  o.snapshot_every_updates = 10;
  ASSERT_OK(shard_->InitJob(MakeInit(o)));
  std::unique_ptr<Shard> twin = MemoryShard();
  JobOptions twin_opts = o;
  twin_opts.durability = "none";
  ASSERT_OK(twin->InitJob(MakeInit(twin_opts)));
  std::vector<int64_t> versions(TestPartition().shard_chunks(0).size(), 0);
  for (int i = 0; i < 25; ++i) {
    const PushRequest p = GenPush(i, &versions);
    ASSERT_OK(shard_->Push(p));
    ASSERT_OK(twin->Push(p));
  }
  const auto before = PullAll(shard_.get());
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info_before, Info(shard_.get()));
  EXPECT_EQ(info_before.snapshots(), 3);  // Creation, update 10, update 20.
  EXPECT_EQ(info_before.snapshot_update(), 20);
  EXPECT_GT(info_before.last_snapshot_bytes(), 22 * 4);

  Restart();
  EXPECT_EQ(PullAll(shard_.get()), before);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info, Info(shard_.get()));
  EXPECT_TRUE(info.restored());
  EXPECT_EQ(info.snapshot_update(), 20);
  EXPECT_EQ(info.replayed_updates(), 5);
  EXPECT_EQ(info.updates_applied(), 25);
  ExpectSameProgress(info_before, info);
  // Ids from both the snapshot (push 3) and the log (push 22) are recognised.
  std::vector<int64_t> scratch(versions.size(), 0);
  for (int i = 0; i <= 22; ++i) {
    PushRequest p = GenPush(i, &scratch);
    if (i != 3 && i != 22) continue;
    ASSERT_OK_AND_ASSIGN(PushResponse r, shard_->Push(p));
    EXPECT_TRUE(r.duplicate()) << "push " << i;
  }
  EXPECT_EQ(PullAll(shard_.get()), before);
  // Same Adam moments and step counts as the shard that never restarted.
  const PushRequest next = GenPush(25, &versions);
  ASSERT_OK(shard_->Push(next));
  ASSERT_OK(twin->Push(next));
  EXPECT_EQ(PullAll(shard_.get()), PullAll(twin.get()));
}

TEST_F(DurabilityTest, PeriodicLosesOnlyUpdatesAfterTheLastSnapshot) {
  JobOptions o;
  o.durability = "periodic";
  o.snapshot_every_updates = 10;
  o.optimizer = "sgd_momentum";  // Redoing the lost pushes needs the restored momentum.
  ASSERT_OK(shard_->InitJob(MakeInit(o)));
  std::vector<int64_t> versions(TestPartition().shard_chunks(0).size(), 0);
  std::vector<PushRequest> pushes;
  std::vector<PulledChunk> at20;
  JobInfoResponse info20;
  for (int i = 0; i < 25; ++i) {
    pushes.push_back(GenPush(i, &versions));
    ASSERT_OK(shard_->Push(pushes.back()));
    if (i == 19) {
      at20 = PullAll(shard_.get());
      ASSERT_OK_AND_ASSIGN(info20, Info(shard_.get()));
    }
  }
  const auto before = PullAll(shard_.get());
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info_before, Info(shard_.get()));
  EXPECT_EQ(info_before.snapshots(), 3);
  EXPECT_EQ(info_before.snapshot_update(), 20);
  EXPECT_EQ(info_before.updates_applied(), 25);
  EXPECT_EQ(info20.snapshot_update(), 20);
  EXPECT_NE(PullAll(shard_.get()), at20);

  Restart();
  EXPECT_EQ(PullAll(shard_.get()), at20);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info, Info(shard_.get()));
  EXPECT_TRUE(info.restored());
  EXPECT_EQ(info.replayed_updates(), 0);
  EXPECT_EQ(info.updates_applied(), 20);
  EXPECT_EQ(info.pushes_applied(), 20);
  EXPECT_EQ(info.snapshot_update(), 20);
  EXPECT_EQ(info.workers(0).last_step(), 9);
  EXPECT_EQ(info.workers(1).last_step(), 9);
  ExpectSameProgress(info20, info);

  // Push 20 (index 19) was in the snapshot: a retry is a duplicate.
  ASSERT_OK_AND_ASSIGN(PushResponse dup, shard_->Push(pushes[19]));
  EXPECT_TRUE(dup.duplicate());
  EXPECT_EQ(PullAll(shard_.get()), at20);
  // The lost pushes 21-25 are not remembered: resending them applies them, and reproduces the
  // state before the crash.
  for (int i = 20; i < 25; ++i) {
    ASSERT_OK_AND_ASSIGN(PushResponse r, shard_->Push(pushes[i]));
    EXPECT_FALSE(r.duplicate()) << "push " << i;
  }
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info_redo, Info(shard_.get()));
  EXPECT_EQ(info_redo.updates_applied(), 25);
  ExpectSameProgress(info_before, info_redo);
  EXPECT_EQ(PullAll(shard_.get()), before);
}

TEST_F(DurabilityTest, SyncPeriodicSnapshotsAtStepBoundaries) {
  JobOptions o;
  o.durability = "periodic";
  o.snapshot_every_updates = 3;
  o.snapshot_every_seconds = 1e-6;  // Time-based snapshots are off in sync mode.
  o.consistency = "sync";
  o.barrier_timeout_s = 10;
  ASSERT_OK(shard_->InitJob(MakeInit(o)));
  const Partition& p = TestPartition();
  // Worker w pushes (w + 1) * (s + 1) to every element at step s; the average is
  // 1.5 * (s + 1), and SGD lr 0.5 subtracts 0.75 * (s + 1), exactly.
  auto push = [&](int32_t w, int64_t s) {
    PushRequest r;
    r.set_job("j");
    r.set_worker(w);
    r.set_step(s);
    r.set_request_id(static_cast<uint64_t>(100 * w + s + 1));
    for (int64_t idx : p.shard_chunks(0)) {
      const ChunkInfo& c = p.chunks()[idx];
      ChunkData* d = r.add_chunks();
      d->set_tensor(c.tensor);
      d->set_chunk(c.chunk);
      d->set_version(s);
      d->set_data(Bytes(std::vector<float>(c.numel, static_cast<float>((w + 1) * (s + 1)))));
    }
    return r;
  };
  auto expect_values = [&](Shard* shard, int64_t steps) {
    float sub = 0;
    for (int64_t s = 0; s < steps; ++s) sub += 0.75f * static_cast<float>(s + 1);
    for (const PulledChunk& c : PullAll(shard)) {
      EXPECT_EQ(c.version, steps);
      const ChunkInfo& info = p.chunks()[p.Find(c.tensor, c.chunk)];
      const std::vector<float> v = Floats(c.data);
      for (int64_t e = 0; e < info.numel; ++e) {
        EXPECT_EQ(v[e], static_cast<float>(100 * c.tensor + info.offset + e) + 0.25f - sub)
            << "tensor " << c.tensor << " chunk " << c.chunk << " element " << e;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int32_t w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      for (int64_t s = 0; s < 7; ++s) {
        auto r = shard_->Push(push(w, s));
        EXPECT_TRUE(r.ok()) << r.status();
      }
    });
  }
  for (auto& t : threads) t.join();
  expect_values(shard_.get(), 7);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info_before, Info(shard_.get()));
  EXPECT_EQ(info_before.updates_applied(), 7);
  EXPECT_EQ(info_before.pushes_applied(), 14);
  EXPECT_EQ(info_before.snapshots(), 3);  // Creation, step 3, step 6.
  EXPECT_EQ(info_before.snapshot_update(), 6);
  EXPECT_GT(info_before.barrier_wait_s(), 0.0);

  Restart();
  expect_values(shard_.get(), 6);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info, Info(shard_.get()));
  EXPECT_TRUE(info.restored());
  EXPECT_EQ(info.consistency(), "sync");
  EXPECT_EQ(info.updates_applied(), 6);
  EXPECT_EQ(info.snapshot_update(), 6);
  EXPECT_EQ(info.replayed_updates(), 0);
  EXPECT_EQ(info.pushes_applied(), 12);
  for (int w = 0; w < 2; ++w) {
    EXPECT_EQ(info.workers(w).last_step(), 5);
    EXPECT_EQ(info.workers(w).pushes_applied(), 6);
  }
  // The workers redo the lost step 6 and the barrier works after the restart.
  std::thread w1([&] { EXPECT_OK(shard_->Push(push(1, 6))); });
  auto r0 = shard_->Push(push(0, 6));
  w1.join();
  ASSERT_OK(r0);
  EXPECT_FALSE(r0->duplicate());
  expect_values(shard_.get(), 7);
}

TEST_F(DurabilityTest, SspClocksSurviveRestart) {
  JobOptions o;
  o.consistency = "ssp:1";
  o.barrier_timeout_s = 0.2;
  ASSERT_OK(shard_->InitJob(MakeInit(o)));
  std::vector<int64_t> versions(6, 0);
  // Worker 0 pushes steps 0 and 1, worker 1 nothing: a pull of worker 0 is at lead 2 > 1.
  for (int i : {0, 2}) ASSERT_OK(shard_->Push(GenPush(i, &versions)));
  PullRequest pull0;
  pull0.set_job("j");
  pull0.set_worker(0);
  PullRequest pull1 = pull0;
  pull1.set_worker(1);
  PullResponse resp;
  EXPECT_STATUS_MSG(shard_->Pull(pull0, &resp), absl::StatusCode::kFailedPrecondition,
                    "ssp:1 pull of worker 0 at clock 2 waited 200ms for workers [1] to catch up");
  Restart();
  // The restored clocks still hold worker 0 back, and worker 1 can pull.
  EXPECT_OK(shard_->Pull(pull1, &resp));
  EXPECT_STATUS_MSG(shard_->Pull(pull0, &resp), absl::StatusCode::kFailedPrecondition,
                    "ssp:1 pull of worker 0 at clock 2 waited 200ms for workers [1] to catch up");
  ASSERT_OK(shard_->Push(GenPush(1, &versions)));  // Worker 1, step 0.
  resp.Clear();
  EXPECT_OK(shard_->Pull(pull0, &resp));
  EXPECT_EQ(resp.chunks_size(), 6);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info, Info(shard_.get()));
  EXPECT_EQ(info.max_clock_lead(), 1);
}

TEST_F(DurabilityTest, SyncBarrierTimeoutOnShardForgetsTheRequest) {
  JobOptions o;
  o.durability = "every_update";
  o.consistency = "sync";
  o.barrier_timeout_s = 0.2;
  ASSERT_OK(shard_->InitJob(MakeInit(o)));
  const auto initial = PullAll(shard_.get());
  std::vector<int64_t> versions(TestPartition().shard_chunks(0).size(), 0);
  PushRequest p = GenPush(0, &versions);  // Worker 0, step 0.
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kFailedPrecondition,
                    "workers [1] did not push; nothing was applied");
  EXPECT_EQ(PullAll(shard_.get()), initial);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info, Info(shard_.get()));
  EXPECT_EQ(info.updates_applied(), 0);
  EXPECT_EQ(info.workers(0).last_step(), -1);
  EXPECT_GE(info.barrier_wait_s(), 0.2);
  // Nothing was logged either.
  Restart();
  EXPECT_EQ(PullAll(shard_.get()), initial);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse restored, Info(shard_.get()));
  EXPECT_EQ(restored.replayed_updates(), 0);
  EXPECT_EQ(restored.updates_applied(), 0);
  // The failed request id was forgotten: the same request, retried when worker 1 shows up,
  // is applied (not a duplicate, not "in progress").
  PushRequest p1 = p;
  p1.set_worker(1);
  p1.set_request_id(p.request_id() + 1);
  std::thread w1([&] { EXPECT_OK(shard_->Push(p1)); });
  auto r = shard_->Push(p);
  w1.join();
  ASSERT_OK(r);
  EXPECT_FALSE(r->duplicate());
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info_retry, Info(shard_.get()));
  EXPECT_EQ(info_retry.updates_applied(), 1);
  EXPECT_EQ(info_retry.pushes_applied(), 2);
}

TEST_F(DurabilityTest, FailedSyncPushIdCanBeRetriedWithoutRestart) {
  JobOptions o;
  o.durability = "none";
  o.consistency = "sync";
  o.barrier_timeout_s = 0.1;
  ASSERT_OK(shard_->InitJob(MakeInit(o)));
  std::vector<int64_t> versions(TestPartition().shard_chunks(0).size(), 0);
  const PushRequest p = GenPush(0, &versions);  // Worker 0, step 0.
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kFailedPrecondition,
                    "workers [1] did not push");
  PushRequest p1 = p;  // Worker 1, step 0, same chunks.
  p1.set_worker(1);
  std::thread w1([&] { EXPECT_OK(shard_->Push(p1)); });
  auto r = shard_->Push(p);
  w1.join();
  ASSERT_OK(r);
  EXPECT_FALSE(r->duplicate());
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info, Info(shard_.get()));
  EXPECT_EQ(info.updates_applied(), 1);
  EXPECT_EQ(info.duplicates_dropped(), 0);
}

// A new submission that reuses the name of a job the shard still holds (the coordinator
// compacted the old one): another incarnation replaces it, memory and durable records too,
// so nothing of the old job survives a restart; the same incarnation, or none, is the same
// job as before.
TEST_F(DurabilityTest, AnotherIncarnationReplacesTheJobAndItsDurableState) {
  JobOptions o;
  ASSERT_OK_AND_ASSIGN(InitJobResponse first, shard_->InitJob(MakeInit(o), "aaaa"));
  EXPECT_TRUE(first.created());
  const auto initial = PullAll(shard_.get());
  std::vector<int64_t> versions(TestPartition().shard_chunks(0).size(), 0);
  for (int i = 0; i < 5; ++i) ASSERT_OK(shard_->Push(GenPush(i, &versions)));
  const auto trained = PullAll(shard_.get());
  ASSERT_NE(trained, initial);
  // The same submission again (a resuming worker), or a caller without a token: the same job.
  ASSERT_OK_AND_ASSIGN(InitJobResponse again, shard_->InitJob(MakeInit(o), "aaaa"));
  EXPECT_FALSE(again.created());
  ASSERT_OK_AND_ASSIGN(again, shard_->InitJob(MakeInit(o)));
  EXPECT_FALSE(again.created());
  EXPECT_EQ(PullAll(shard_.get()), trained);

  // Another incarnation: a new job from its own initial values, even with another layout.
  o.optimizer = "adam";
  o.durability = "every_update";
  ASSERT_OK_AND_ASSIGN(InitJobResponse replaced, shard_->InitJob(MakeInit(o), "bbbb"));
  EXPECT_TRUE(replaced.created());
  EXPECT_EQ(PullAll(shard_.get()), initial);
  ASSERT_OK_AND_ASSIGN(JobInfoResponse info, Info(shard_.get()));
  EXPECT_EQ(info.updates_applied(), 0);
  std::fill(versions.begin(), versions.end(), 0);
  ASSERT_OK(shard_->Push(GenPush(0, &versions)));
  const auto new_trained = PullAll(shard_.get());

  // Nothing of the old job is replayed into the new one after a restart.
  Restart();
  EXPECT_EQ(PullAll(shard_.get()), new_trained);
  ASSERT_OK_AND_ASSIGN(info, Info(shard_.get()));
  EXPECT_TRUE(info.restored());
  EXPECT_EQ(info.replayed_updates(), 1);
  EXPECT_EQ(info.optimizer().name(), "adam");
  ASSERT_OK_AND_ASSIGN(again, shard_->InitJob(MakeInit(o), "bbbb"));
  EXPECT_FALSE(again.created());
}

TEST_F(DurabilityTest, DurabilityNeedsAStore) {
  std::unique_ptr<Shard> memory = MemoryShard();
  for (const std::string mode : {"periodic", "every_update"}) {
    JobOptions o;
    o.durability = mode;
    EXPECT_STATUS_MSG(memory->InitJob(MakeInit(o)), absl::StatusCode::kFailedPrecondition,
                      "InitJob: job j asks for durability " + mode +
                          " but this shard has no data directory (start it with --data_dir)");
  }
  EXPECT_STATUS_MSG(Info(memory.get()), absl::StatusCode::kNotFound,
                    "job j is not known to this shard");
  // "none" (and unset) need no store.
  JobOptions o;
  o.durability = "none";
  ASSERT_OK(memory->InitJob(MakeInit(o)));
  o.job = "k";
  o.durability = "";
  ASSERT_OK(memory->InitJob(MakeInit(o)));
  FinishRequest f;
  f.set_job("k");
  for (int32_t w = 0; w < 2; ++w) {
    f.set_worker(w);
    ASSERT_OK(memory->Finish(f));
  }
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info, Info(memory.get(), "k"));
  EXPECT_EQ(info.snapshots(), 0);
}

TEST_F(DurabilityTest, FailedInitJobPersistsNothing) {
  JobOptions o;
  o.durability = "sometimes";
  EXPECT_STATUS_MSG(shard_->InitJob(MakeInit(o)), absl::StatusCode::kInvalidArgument,
                    "unknown durability mode \"sometimes\" (known: every_update, none, periodic)");
  o = JobOptions();
  o.job = "a/b";
  EXPECT_STATUS_MSG(shard_->InitJob(MakeInit(o)), absl::StatusCode::kInvalidArgument,
                    "InitJob: job \"a/b\" is not a valid name: 1-63 characters");
  o.job = "";
  EXPECT_STATUS_MSG(shard_->InitJob(MakeInit(o)), absl::StatusCode::kInvalidArgument,
                    "job name is empty");
  o = JobOptions();
  o.snapshot_every_updates = -1;
  EXPECT_STATUS_MSG(shard_->InitJob(MakeInit(o)), absl::StatusCode::kInvalidArgument,
                    "InitJob: job j snapshot intervals must be >= 0");
  o = JobOptions();
  o.barrier_timeout_s = -1;
  EXPECT_STATUS_MSG(shard_->InitJob(MakeInit(o)), absl::StatusCode::kInvalidArgument,
                    "InitJob: job j barrier_timeout_s must be >= 0");
  o = JobOptions();
  o.consistency = "ssp:-2";
  EXPECT_STATUS_MSG(shard_->InitJob(MakeInit(o)), absl::StatusCode::kInvalidArgument,
                    "InitJob: job j: consistency mode ssp needs a staleness bound >= 0, as in "
                    "\"ssp:3\"; got \"ssp:-2\"");
  // Fails after the job was built, while copying initial values.
  InitJobRequest r = MakeInit(JobOptions());
  r.mutable_initial()->RemoveLast();
  EXPECT_STATUS_MSG(shard_->InitJob(r), absl::StatusCode::kInvalidArgument,
                    "owns 6 chunks but the request carries initial values for 5");
  r = MakeInit(JobOptions());
  std::vector<float> nan(2, 0.0f);
  nan[1] = std::nanf("");
  for (ChunkData& c : *r.mutable_initial()) {
    if (c.tensor() == 0 && c.chunk() == 2) c.set_data(Bytes(nan));  // Elements 8 and 9 of a.
  }
  EXPECT_STATUS_MSG(shard_->InitJob(r), absl::StatusCode::kInvalidArgument,
                    "element 1 is not finite");

  Restart();
  for (const std::string job : {"j", "a/b", ""}) {
    EXPECT_STATUS_MSG(Info(shard_.get(), job), absl::StatusCode::kNotFound,
                      "its data dir " + dir_ + " holds no state for it");
  }
  PushRequest p;
  p.set_job("j");
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kNotFound, dir_);
  shard_.reset();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShardStore> store, ShardStore::Open(dir_, {}));
  ASSERT_OK_AND_ASSIGN(auto jobs, store->LoadAll());
  EXPECT_TRUE(jobs.empty());
}

TEST_F(DurabilityTest, DurableJobsAreIndependent) {
  // Two jobs whose names share a prefix, with different modes; only the durable ones return.
  JobOptions a;
  a.job = "j";
  JobOptions b;
  b.job = "j-x";
  b.durability = "periodic";
  b.snapshot_every_updates = 2;
  JobOptions c;
  c.job = "mem";
  c.durability = "none";
  for (const auto* o : {&a, &b, &c}) ASSERT_OK(shard_->InitJob(MakeInit(*o)));
  std::vector<int64_t> va(6, 0), vb(6, 0), vc(6, 0);
  for (int i = 0; i < 5; ++i) {
    ASSERT_OK(shard_->Push(GenPush(i, &va, "j")));
    ASSERT_OK(shard_->Push(GenPush(i + 10, &vb, "j-x")));
    ASSERT_OK(shard_->Push(GenPush(i + 20, &vc, "mem")));
  }
  const auto ja = PullAll(shard_.get(), "j");
  Restart();
  EXPECT_EQ(PullAll(shard_.get(), "j"), ja);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse ia, Info(shard_.get(), "j"));
  EXPECT_EQ(ia.updates_applied(), 5);
  EXPECT_EQ(ia.replayed_updates(), 5);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse ib, Info(shard_.get(), "j-x"));
  EXPECT_EQ(ib.updates_applied(), 4);
  EXPECT_EQ(ib.replayed_updates(), 0);
  EXPECT_STATUS(Info(shard_.get(), "mem"), absl::StatusCode::kNotFound);
}

// The RocksDB write-ahead logs (<dir>/*.log) of a closed store.
std::vector<std::string> RocksLogs(const std::string& dir) {
  std::vector<std::string> logs;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() == ".log") logs.push_back(e.path().string());
  }
  return logs;
}

// RocksDB's write-ahead log damaged in its middle: the store does not open (RocksDB's default
// recovery stopped at the damage silently, and the job written after it was forgotten).
// Removed: the store opens without the job, and the shard says its update log is orphaned.
TEST_F(DurabilityTest, ADamagedStoreLogFailsAndALostOneLeavesAnOrphanedUpdateLogNamed) {
  ASSERT_OK(shard_->InitJob(MakeInit(JobOptions())));  // "j", every_update.
  std::vector<int64_t> versions(6, 0);
  for (int i = 0; i < 5; ++i) ASSERT_OK(shard_->Push(GenPush(i, &versions)));
  shard_.reset();
  std::vector<std::string> logs = RocksLogs(dir_);
  ASSERT_FALSE(logs.empty());
  const std::string wal = logs.back();
  const uintmax_t size = std::filesystem::file_size(wal);
  ASSERT_GT(size, 150u);
  std::string original;
  {
    std::fstream f(wal, std::ios::in | std::ios::out | std::ios::binary);
    original.assign((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    f.seekp(static_cast<std::streamoff>(size / 3));
    const std::string garbage(16, '\x5a');
    f.write(garbage.data(), static_cast<std::streamsize>(garbage.size()));
  }
  absl::StatusOr<std::unique_ptr<ShardStore>> damaged = ShardStore::Open(dir_, {});
  EXPECT_EQ(damaged.status().code(), absl::StatusCode::kInternal) << damaged.status();
  EXPECT_TRUE(absl::StrContains(damaged.status().message(), "cannot open shard state in " + dir_))
      << damaged.status();
  damaged = absl::UnknownError("closed");

  for (const std::string& l : RocksLogs(dir_)) std::filesystem::remove(l);
  // A job whose creation did not finish: its first snapshot's chunk file, never named.
  std::filesystem::create_directories(dir_ + "/updates/k");
  std::ofstream(dir_ + "/updates/k/chunks.0") << "half";
  std::FILE* out = std::tmpfile();
  Logger logger({}, out);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShardStore> store, ShardStore::Open(dir_, {}));
  ShardOptions options;
  options.store = std::move(store);
  options.logger = &logger;
  ASSERT_OK_AND_ASSIGN(shard_, Shard::Create(std::move(options)));
  EXPECT_STATUS(Info(shard_.get()), absl::StatusCode::kNotFound);
  std::fflush(out);
  std::rewind(out);
  std::string lines;
  for (int c; (c = std::fgetc(out)) != EOF;) lines.push_back(static_cast<char>(c));
  std::fclose(out);
  EXPECT_TRUE(
      absl::StrContains(lines, "event=orphaned_update_log job=j path=" + dir_ + "/updates/j"))
      << lines;
  EXPECT_FALSE(absl::StrContains(lines, "job=k")) << lines;
}

TEST_F(DurabilityTest, StalenessDampingScalesByOneOverOnePlusStaleness) {
  for (const bool damping : {true, false}) {
    SCOPED_TRACE(damping ? "damping" : "no damping");
    JobOptions o;
    o.job = damping ? "damped" : "plain";
    o.durability = "none";
    o.damping = damping;
    InitJobRequest init = MakeInit(o);
    init.mutable_optimizer()->set_lr(1.0);
    ASSERT_OK(shard_->InitJob(init));
    const ChunkInfo& c = TestPartition().chunks()[TestPartition().shard_chunks(0)[1]];
    auto push = [&](uint64_t id, float g, int64_t base) {
      PushRequest r;
      r.set_job(o.job);
      r.set_worker(static_cast<int32_t>(id % 2));
      r.set_step(static_cast<int64_t>(id));  // Increasing per worker.
      r.set_request_id(id);
      ChunkData* d = r.add_chunks();
      d->set_tensor(c.tensor);
      d->set_chunk(c.chunk);
      d->set_version(base);
      d->set_data(Bytes(std::vector<float>(c.numel, g)));
      return r;
    };
    auto value0 = [&] {
      for (const PulledChunk& p : PullAll(shard_.get(), o.job)) {
        if (p.tensor == c.tensor && p.chunk == c.chunk) return Floats(p.data)[0];
      }
      ADD_FAILURE() << "chunk not pulled";
      return 0.0f;
    };
    const float v0 = static_cast<float>(100 * c.tensor + c.offset) + 0.25f;
    ASSERT_EQ(value0(), v0);
    ASSERT_OK(shard_->Push(push(1, 2.0f, 0)));  // Staleness 0: full step.
    EXPECT_EQ(value0(), v0 - 2.0f);
    ASSERT_OK(shard_->Push(push(2, 2.0f, 0)));  // Staleness 1: half step when damped.
    EXPECT_EQ(value0(), damping ? v0 - 3.0f : v0 - 4.0f);
    ASSERT_OK(shard_->Push(push(3, 4.0f, 2)));  // Current again: full step.
    EXPECT_EQ(value0(), damping ? v0 - 7.0f : v0 - 8.0f);
    ASSERT_OK(shard_->Push(push(4, 4.0f, 0)));  // Staleness 3: a quarter when damped.
    EXPECT_EQ(value0(), damping ? v0 - 8.0f : v0 - 12.0f);
    ASSERT_OK_AND_ASSIGN(const JobInfoResponse info, Info(shard_.get(), o.job));
    EXPECT_EQ(info.staleness_histogram(0), 2);
    EXPECT_EQ(info.staleness_histogram(1), 1);
    EXPECT_EQ(info.staleness_histogram(3), 1);
  }
}

TEST_F(DurabilityTest, PeriodicSnapshotByTime) {
  JobOptions o;
  o.durability = "periodic";
  o.snapshot_every_seconds = 0.005;
  ASSERT_OK(shard_->InitJob(MakeInit(o)));
  std::vector<int64_t> versions(6, 0);
  absl::SleepFor(absl::Milliseconds(10));
  ASSERT_OK(shard_->Push(GenPush(0, &versions)));
  ASSERT_OK_AND_ASSIGN(JobInfoResponse info, Info(shard_.get()));
  EXPECT_EQ(info.snapshots(), 2);
  EXPECT_EQ(info.snapshot_update(), 1);
  const auto state = PullAll(shard_.get());
  Restart();
  EXPECT_EQ(PullAll(shard_.get()), state);
  ASSERT_OK_AND_ASSIGN(info, Info(shard_.get()));
  EXPECT_EQ(info.updates_applied(), 1);
}

// A Finish whose snapshot fails is not acknowledged, nor is its repeat, and the retry once the
// disk works records it (once): a shard that then restarts knows the worker finished (it would
// otherwise wait for a worker that is gone).
TEST_F(DurabilityTest, AFinishThatCannotBeRecordedFailsAndItsRetryRecordsIt) {
  JobOptions o;
  o.durability = "periodic";
  ASSERT_OK(shard_->InitJob(MakeInit(o)));
  std::vector<int64_t> versions(6, 0);
  ASSERT_OK(shard_->Push(GenPush(0, &versions)));
  // Both snapshot slots made directories (which not even root can open as files): the next
  // snapshot cannot be written, whichever slot it takes.
  const std::string job_dir = absl::StrCat(dir_, "/updates/j");
  std::vector<std::string> blocked;
  for (int slot = 0; slot < 2; ++slot) {
    const std::string path = ChunksFilePath(job_dir, slot);
    if (std::filesystem::exists(path)) continue;  // The slot the stored snapshot names.
    ASSERT_TRUE(std::filesystem::create_directories(path)) << path;
    blocked.push_back(path);
  }
  ASSERT_EQ(blocked.size(), 1u);
  FinishRequest f;
  f.set_job("j");
  f.set_worker(1);
  f.set_step(0);
  EXPECT_FALSE(shard_->Finish(f).ok());
  EXPECT_FALSE(shard_->Finish(f).ok());  // A repeat is not acknowledged either.
  std::filesystem::remove_all(blocked[0]);
  ASSERT_OK_AND_ASSIGN(JobInfoResponse info, Info(shard_.get()));
  const int64_t snapshots = info.snapshots();
  ASSERT_OK(shard_->Finish(f));  // The retry records it...
  ASSERT_OK_AND_ASSIGN(info, Info(shard_.get()));
  EXPECT_EQ(info.snapshots(), snapshots + 1);
  ASSERT_OK(shard_->Finish(f));  // ... once.
  ASSERT_OK_AND_ASSIGN(info, Info(shard_.get()));
  EXPECT_EQ(info.snapshots(), snapshots + 1);
  Restart();
  ASSERT_OK_AND_ASSIGN(info, Info(shard_.get()));
  EXPECT_TRUE(info.workers(1).finished());
  EXPECT_FALSE(info.workers(0).finished());
}

// Each worker's first Finish is made durable (a snapshot), so a restarted shard knows who is
// done; the last one's snapshot holds the final state.
TEST_F(DurabilityTest, EachFinishForcesASnapshot) {
  JobOptions o;
  o.durability = "periodic";  // With a snapshot every 10^6 updates: only the forced ones.
  ASSERT_OK(shard_->InitJob(MakeInit(o)));
  std::vector<int64_t> versions(6, 0);
  for (int i = 0; i < 3; ++i) ASSERT_OK(shard_->Push(GenPush(i, &versions)));
  const auto final_state = PullAll(shard_.get());
  ASSERT_OK_AND_ASSIGN(JobInfoResponse info, Info(shard_.get()));
  EXPECT_EQ(info.snapshots(), 1);
  EXPECT_EQ(info.snapshot_update(), 0);

  FinishRequest f;
  f.set_job("j");
  f.set_worker(1);
  f.set_step(1);
  ASSERT_OK(shard_->Finish(f));
  ASSERT_OK_AND_ASSIGN(info, Info(shard_.get()));
  EXPECT_EQ(info.snapshots(), 2);  // Worker 1's Finish is durable before it returns.
  {
    // A crash now: the restarted shard knows worker 1 finished and worker 0 did not.
    Restart();
    ASSERT_OK_AND_ASSIGN(JobInfoResponse r, Info(shard_.get()));
    EXPECT_TRUE(r.workers(1).finished());
    EXPECT_FALSE(r.workers(0).finished());
    EXPECT_EQ(PullAll(shard_.get()), final_state);
  }
  f.set_worker(0);
  f.set_step(1);
  ASSERT_OK(shard_->Finish(f));
  ASSERT_OK_AND_ASSIGN(info, Info(shard_.get()));
  EXPECT_EQ(info.snapshots(), 1);  // Counted since the restart.
  EXPECT_EQ(info.snapshot_update(), 3);
  EXPECT_EQ(info.snapshot_update(), info.updates_applied());
  EXPECT_GT(info.last_snapshot_bytes(), 0);
  EXPECT_GE(info.last_snapshot_s(), 0.0);
  // A repeated Finish does not snapshot again.
  ASSERT_OK(shard_->Finish(f));
  ASSERT_OK_AND_ASSIGN(info, Info(shard_.get()));
  EXPECT_EQ(info.snapshots(), 1);

  Restart();
  EXPECT_EQ(PullAll(shard_.get()), final_state);
  ASSERT_OK_AND_ASSIGN(info, Info(shard_.get()));
  EXPECT_EQ(info.updates_applied(), 3);
  EXPECT_EQ(info.replayed_updates(), 0);
  EXPECT_TRUE(info.workers(0).finished());
  EXPECT_TRUE(info.workers(1).finished());
  EXPECT_EQ(info.workers(0).last_step(), 1);
  EXPECT_EQ(info.workers(1).last_step(), 0);
}

// Elastic sync: updates applied with a barrier group's lr_scale are logged with it, so log
// replay after a restart reproduces them bit for bit.
TEST_F(DurabilityTest, SyncGroupLrScaleReplaysExactly) {
  JobOptions o;
  o.consistency = "sync";
  o.num_workers = 3;
  o.optimizer = "adam";  // Moments and bias correction make every update count.
  o.barrier_timeout_s = 10;
  const Partition& p = TestPartition();
  // Worker w's gradient at step s: varied, exactly representable or not.
  auto push = [&](int32_t w, int64_t s) {
    PushRequest r;
    r.set_job("j");
    r.set_worker(w);
    r.set_step(s);
    r.set_request_id(static_cast<uint64_t>(1000 * w + s + 1));
    for (int64_t idx : p.shard_chunks(0)) {
      const ChunkInfo& c = p.chunks()[idx];
      std::vector<float> g(c.numel);
      for (int64_t e = 0; e < c.numel; ++e) {
        g[e] = static_cast<float>((7 * w + 3 * s + e) % 13 - 6) * 0.31f + 0.01f * w;
      }
      ChunkData* d = r.add_chunks();
      d->set_tensor(c.tensor);
      d->set_chunk(c.chunk);
      d->set_version(s);
      d->set_data(Bytes(g));
    }
    return r;
  };
  // One step of `workers` (the last one pushes on this thread).
  auto step = [&](Shard* shard, const std::vector<int32_t>& workers, int64_t s) {
    std::vector<std::thread> threads;
    for (size_t i = 0; i + 1 < workers.size(); ++i) {
      threads.emplace_back([&, w = workers[i]] { EXPECT_OK(shard->Push(push(w, s))); });
    }
    EXPECT_OK(shard->Push(push(workers.back(), s)));
    for (auto& t : threads) t.join();
  };
  const double kScale = 2.0 / 3.0;  // Not exact in float: replay must use the same value.
  // The same job on a memory shard, and on one that keeps factor 1 (to show it matters).
  JobOptions memory_opts = o;
  memory_opts.durability = "none";
  std::unique_ptr<Shard> twin = MemoryShard();
  std::unique_ptr<Shard> unscaled = MemoryShard();
  ASSERT_OK(twin->InitJob(MakeInit(memory_opts)));
  ASSERT_OK(unscaled->InitJob(MakeInit(memory_opts)));
  ASSERT_OK(shard_->InitJob(MakeInit(o)));

  // Step 0 with everyone at factor 1, then worker 1 is lost: steps 1-5 with 0 and 2.
  for (Shard* s : {shard_.get(), twin.get(), unscaled.get()}) step(s, {0, 1, 2}, 0);
  ASSERT_OK(shard_->SetSyncGroup("j", {0, 2}, kScale));
  ASSERT_OK(twin->SetSyncGroup("j", {0, 2}, kScale));
  ASSERT_OK(unscaled->SetSyncGroup("j", {0, 2}, 1.0));
  for (int64_t s = 1; s <= 5; ++s) {
    for (Shard* sh : {shard_.get(), twin.get(), unscaled.get()}) step(sh, {2, 0}, s);
  }
  const auto before = PullAll(shard_.get());
  EXPECT_EQ(before, PullAll(twin.get()));
  EXPECT_NE(before, PullAll(unscaled.get()));
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info_before, Info(shard_.get()));
  EXPECT_EQ(info_before.updates_applied(), 6);
  EXPECT_EQ(info_before.pushes_applied(), 13);
  EXPECT_EQ(info_before.lr_scale(), static_cast<float>(kScale));
  EXPECT_EQ(info_before.snapshot_update(), 0);

  Restart();
  EXPECT_EQ(PullAll(shard_.get()), before);  // Bit for bit, from the log alone.
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info, Info(shard_.get()));
  EXPECT_TRUE(info.restored());
  EXPECT_EQ(info.replayed_updates(), 6);
  ExpectSameProgress(info_before, info);
  // The group is not persisted: all ranks at factor 1 until the coordinator re-sends it.
  EXPECT_EQ(std::vector<int32_t>(info.active_workers().begin(), info.active_workers().end()),
            (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(info.lr_scale(), 1.0);
  ASSERT_OK(shard_->SetSyncGroup("j", {0, 2}, kScale));
  step(shard_.get(), {0, 2}, 6);
  step(twin.get(), {0, 2}, 6);
  const auto after = PullAll(shard_.get());
  EXPECT_EQ(after, PullAll(twin.get()));
  EXPECT_NE(after, before);
}

// A buffer tensor (b as an int64 buffer beside parameter a, adam): its values are the initial
// ones plus every pushed delta exactly, it has no slots in the snapshot, and a restart restores
// it from the snapshot and the log.
TEST_F(DurabilityTest, BufferValuesSurviveRestartFromSnapshotAndLog) {
  JobOptions o;
  o.optimizer = "adam";
  o.snapshot_every_updates = 4;
  const auto with_buffer = [](InitJobRequest r) {
    r.mutable_tensors(1)->set_buffer(true);
    r.mutable_tensors(1)->set_dtype(INT64);
    return r;
  };
  ASSERT_OK(shard_->InitJob(with_buffer(MakeInit(o))));
  std::unique_ptr<Shard> twin = MemoryShard();
  JobOptions twin_opts = o;
  twin_opts.durability = "none";
  ASSERT_OK(twin->InitJob(with_buffer(MakeInit(twin_opts))));
  // The same job with b a parameter, on the same durable shard: its snapshots carry b's slots.
  JobOptions plain_opts = o;
  plain_opts.job = "plain";
  ASSERT_OK(shard_->InitJob(MakeInit(plain_opts)));
  // b's expected values: initial (100 + i + 0.25) plus the deltas, added in push order.
  std::vector<float> b(12);
  for (int i = 0; i < 12; ++i) b[i] = static_cast<float>(100 + i) + 0.25f;
  const Partition& part = TestPartition();
  std::vector<int64_t> versions(part.shard_chunks(0).size(), 0);
  for (int i = 0; i < 10; ++i) {
    const PushRequest p = GenPush(i, &versions);
    for (const ChunkData& c : p.chunks()) {
      if (c.tensor() != 1) continue;
      const std::vector<float> g = Floats(c.data());
      for (size_t e = 0; e < g.size(); ++e) b[4 * c.chunk() + e] += g[e];
    }
    ASSERT_OK(shard_->Push(p));
    ASSERT_OK(twin->Push(p));
    std::vector<int64_t> scratch = versions;
    ASSERT_OK(shard_->Push(GenPush(i, &scratch, "plain")));
  }
  const auto before = PullAll(shard_.get());
  ASSERT_EQ(before, PullAll(twin.get()));
  std::vector<float> got_b(12);
  for (const PulledChunk& c : before) {
    if (c.tensor != 1) continue;
    const std::vector<float> v = Floats(c.data);
    std::copy(v.begin(), v.end(), got_b.begin() + 4 * c.chunk);
  }
  EXPECT_EQ(got_b, b);
  ASSERT_NE(b[0], 100.25f);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info_before, Info(shard_.get()));
  EXPECT_EQ(info_before.snapshot_update(), 8);
  // Snapshot: a (10 values, 20 adam slots) and b (12 values, no slots): at least b's 24
  // slot floats smaller than the plain job's at the same update.
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse plain_info, Info(shard_.get(), "plain"));
  EXPECT_EQ(plain_info.snapshot_update(), 8);
  EXPECT_GT(info_before.last_snapshot_bytes(), (10 + 20 + 12) * 4);
  EXPECT_GE(plain_info.last_snapshot_bytes() - info_before.last_snapshot_bytes(), 24 * 4);

  Restart();
  EXPECT_EQ(PullAll(shard_.get()), before);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info, Info(shard_.get()));
  EXPECT_TRUE(info.restored());
  EXPECT_EQ(info.replayed_updates(), 2);
  ASSERT_EQ(info.tensors_size(), 2);
  EXPECT_TRUE(info.tensors(1).buffer());
  EXPECT_EQ(info.tensors(1).dtype(), INT64);
  // The resumed worker's InitJob (same layout) finds the job; and the next push agrees.
  ASSERT_OK_AND_ASSIGN(InitJobResponse again, shard_->InitJob(with_buffer(MakeInit(o))));
  EXPECT_FALSE(again.created());
  const PushRequest next = GenPush(10, &versions);
  ASSERT_OK(shard_->Push(next));
  ASSERT_OK(twin->Push(next));
  EXPECT_EQ(PullAll(shard_.get()), PullAll(twin.get()));
}

}  // namespace
}  // namespace gradmesh

namespace gradmesh {
namespace {

// commit_steps (two-phase sync): worker w's push of `step` over every chunk, gradient element e
// of chunk k = ((w + 1) * (k + 2) + e + step) % 7 - 3, times `scale`.
PushRequest CommitPush(int32_t worker, int64_t step, uint64_t id, float scale = 1) {
  const Partition& p = TestPartition();
  PushRequest r;
  r.set_job("j");
  r.set_worker(worker);
  r.set_step(step);
  r.set_request_id(id);
  const auto& owned = p.shard_chunks(0);
  for (size_t k = 0; k < owned.size(); ++k) {
    const ChunkInfo& c = p.chunks()[owned[k]];
    std::vector<float> g(c.numel);
    for (int64_t e = 0; e < c.numel; ++e) {
      g[e] =
          scale * static_cast<float>(((worker + 1) * (static_cast<int>(k) + 2) + e + step) % 7 - 3);
    }
    ChunkData* d = r.add_chunks();
    d->set_tensor(c.tensor);
    d->set_chunk(c.chunk);
    d->set_dtype(FLOAT32);
    d->set_data(Bytes(g));
  }
  return r;
}

// The squared norm of the average of workers 0 and 1's CommitPush of `step`.
double AverageSquaredNorm(int64_t step) {
  const PushRequest a = CommitPush(0, step, 1), b = CommitPush(1, step, 2);
  double sq = 0;
  for (int i = 0; i < a.chunks_size(); ++i) {
    const std::vector<float> x = Floats(a.chunks(i).data()), y = Floats(b.chunks(i).data());
    for (size_t e = 0; e < x.size(); ++e) {
      const float m = (x[e] + y[e]) * 0.5f;
      sq += static_cast<double>(m) * m;
    }
  }
  return sq;
}

// Both workers' pushes of one sync step, concurrently (the barrier needs both).
std::vector<absl::StatusOr<PushResponse>> PushBoth(Shard* shard, const PushRequest& a,
                                                   const PushRequest& b) {
  std::vector<absl::StatusOr<PushResponse>> out(2, absl::UnknownError("not run"));
  std::thread t([&] { out[1] = shard->Push(b); });
  out[0] = shard->Push(a);
  t.join();
  return out;
}

// A pull of worker `worker` that commits `step`.
absl::StatusOr<PullResponse> CommitPull(Shard* shard, int32_t worker, int64_t step, double coef,
                                        bool skip = false) {
  PullRequest req;
  req.set_job("j");
  req.set_worker(worker);
  req.mutable_commit()->set_step(step);
  req.mutable_commit()->set_clip_coef(coef);
  req.mutable_commit()->set_skip(skip);
  PullResponse resp;
  RETURN_IF_ERROR(shard->Pull(req, &resp));
  return resp;
}

std::vector<PulledChunk> Chunks(const PullResponse& resp) {
  std::vector<PulledChunk> out;
  for (const ChunkData& c : resp.chunks())
    out.push_back({c.tensor(), c.chunk(), c.version(), c.data()});
  return out;
}

JobOptions CommitJob() {
  JobOptions o;
  o.consistency = "sync";
  o.optimizer = "sgd_momentum";
  o.commit_steps = true;
  return o;
}

// The step is held until a commit applies it, scaled: the result equals plain sync fed the
// gradients times the coefficient (power-of-two coefficients: bit for bit). The second commit
// applies nothing; the log replays the committed (scaled) step exactly, and a commit of it
// after the restart finds it applied.
TEST_F(DurabilityTest, CommitStepsApplyTheHeldStepOnceScaledByTheCoefficient) {
  std::unique_ptr<Shard> twin = MemoryShard();
  JobOptions plain = CommitJob();
  plain.commit_steps = false;
  plain.durability = "none";
  ASSERT_OK(twin->InitJob(MakeInit(plain)));
  ASSERT_OK(shard_->InitJob(MakeInit(CommitJob())));
  const auto initial = PullAll(shard_.get());
  for (int64_t step = 0; step < 3; ++step) {
    const float coef = step == 1 ? 1.0f : 0.25f;
    auto r = PushBoth(shard_.get(), CommitPush(0, step, 10 + step), CommitPush(1, step, 20 + step));
    for (int w = 0; w < 2; ++w) {
      ASSERT_OK(r[w]);
      EXPECT_FALSE(r[w]->duplicate());
      ASSERT_TRUE(r[w]->has_prepared());
      EXPECT_DOUBLE_EQ(r[w]->prepared().grad_sq_norm(), AverageSquaredNorm(step)) << step;
      EXPECT_FALSE(r[w]->prepared().nonfinite());
    }
    // Held, not applied: a plain pull still sees the last step.
    if (step == 0) {
      EXPECT_EQ(PullAll(shard_.get()), initial);
    }
    // A retried push (any request id) of the held step is a duplicate with the same figures.
    ASSERT_OK_AND_ASSIGN(PushResponse again, shard_->Push(CommitPush(1, step, 99 + step)));
    EXPECT_TRUE(again.duplicate());
    EXPECT_DOUBLE_EQ(again.prepared().grad_sq_norm(), AverageSquaredNorm(step));
    auto t = PushBoth(twin.get(), CommitPush(0, step, 10 + step, coef),
                      CommitPush(1, step, 20 + step, coef));
    ASSERT_OK(t[0]);
    ASSERT_OK(t[1]);
    ASSERT_OK_AND_ASSIGN(PullResponse first, CommitPull(shard_.get(), 1, step, coef));
    ASSERT_OK_AND_ASSIGN(PullResponse second, CommitPull(shard_.get(), 0, step, coef));
    EXPECT_FALSE(first.commit_missing());
    EXPECT_EQ(Chunks(first), PullAll(twin.get())) << "step " << step;
    EXPECT_EQ(Chunks(second), Chunks(first));
    // A commit with another decision (figures seen after restarts) changes nothing: the step
    // stands as applied, and the pull answers its values.
    ASSERT_OK_AND_ASSIGN(PullResponse other, CommitPull(shard_.get(), 0, step, coef / 2));
    EXPECT_FALSE(other.commit_missing());
    EXPECT_EQ(Chunks(other), Chunks(first));
  }
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info, Info(shard_.get()));
  EXPECT_EQ(info.updates_applied(), 3);
  EXPECT_EQ(info.pushes_applied(), 6);
  EXPECT_EQ(info.steps_committed(), 3);
  EXPECT_EQ(info.steps_skipped(), 0);
  EXPECT_EQ(info.workers(1).last_step(), 2);
  const auto before = PullAll(shard_.get());
  Restart();
  EXPECT_EQ(PullAll(shard_.get()), before);
  ASSERT_OK_AND_ASSIGN(PullResponse late, CommitPull(shard_.get(), 0, 2, 0.25));
  EXPECT_FALSE(late.commit_missing());
  EXPECT_EQ(Chunks(late), before);
}

// A worker flags its step non-finite (zeros as values): the figures say so on every push, the
// skip applies nothing (values, versions, momentum) but counts the pushes and steps, also
// after a restart; the next step then trains as if the skipped one never happened.
TEST_F(DurabilityTest, CommitStepsSkipANonFiniteStepEverywhereAlike) {
  ASSERT_OK(shard_->InitJob(MakeInit(CommitJob())));
  const auto initial = PullAll(shard_.get());
  PushRequest bad = CommitPush(0, 0, 10, 0.0f);
  bad.set_nonfinite(true);
  auto r = PushBoth(shard_.get(), bad, CommitPush(1, 0, 20));
  for (int w = 0; w < 2; ++w) {
    ASSERT_OK(r[w]);
    EXPECT_TRUE(r[w]->prepared().nonfinite()) << w;
  }
  ASSERT_OK_AND_ASSIGN(PullResponse skipped, CommitPull(shard_.get(), 1, 0, 1, /*skip=*/true));
  EXPECT_EQ(Chunks(skipped), initial);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info, Info(shard_.get()));
  EXPECT_EQ(info.steps_skipped(), 1);
  EXPECT_EQ(info.pushes_applied(), 2);
  EXPECT_EQ(info.workers(0).last_step(), 0);
  Restart();
  EXPECT_EQ(PullAll(shard_.get()), initial);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse restored, Info(shard_.get()));
  EXPECT_EQ(restored.workers(0).last_step(), 0);
  // Step 1 from the initial values (and zero momentum) equals a fresh job's step 0 with the
  // same gradients: nothing of the skipped step leaked.
  std::unique_ptr<Shard> twin = MemoryShard();
  JobOptions plain = CommitJob();
  plain.commit_steps = false;
  plain.durability = "none";
  ASSERT_OK(twin->InitJob(MakeInit(plain)));
  PushRequest a = CommitPush(0, 1, 11), b = CommitPush(1, 1, 21);
  ASSERT_OK(PushBoth(shard_.get(), a, b)[0]);
  a.set_step(0);
  b.set_step(0);
  ASSERT_OK(PushBoth(twin.get(), a, b)[0]);
  ASSERT_OK_AND_ASSIGN(PullResponse next, CommitPull(shard_.get(), 0, 1, 1));
  std::vector<PulledChunk> want = PullAll(twin.get());
  EXPECT_EQ(Chunks(next), want);
}

// A restart between the phases loses the held step (nothing of it was applied or logged): the
// commit answers commit_missing with no chunks, the workers push the step again, and its
// commit then applies it.
TEST_F(DurabilityTest, CommitStepsRestartBetweenThePhasesAnswersCommitMissing) {
  ASSERT_OK(shard_->InitJob(MakeInit(CommitJob())));
  const auto initial = PullAll(shard_.get());
  ASSERT_OK(PushBoth(shard_.get(), CommitPush(0, 0, 10), CommitPush(1, 0, 20))[0]);
  Restart();
  ASSERT_OK_AND_ASSIGN(PullResponse missing, CommitPull(shard_.get(), 0, 0, 1));
  EXPECT_TRUE(missing.commit_missing());
  EXPECT_EQ(missing.chunks_size(), 0);
  EXPECT_EQ(PullAll(shard_.get()), initial);
  auto again = PushBoth(shard_.get(), CommitPush(0, 0, 11), CommitPush(1, 0, 21));
  ASSERT_OK(again[0]);
  EXPECT_FALSE(again[0]->duplicate());
  ASSERT_OK_AND_ASSIGN(PullResponse done, CommitPull(shard_.get(), 0, 0, 1));
  EXPECT_FALSE(done.commit_missing());
  EXPECT_NE(Chunks(done), initial);
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse info, Info(shard_.get()));
  EXPECT_EQ(info.updates_applied(), 1);
}

TEST_F(DurabilityTest, CommitStepsBadRequestsChangeNothing) {
  // commit_steps is for sync, and the shards clamp values only for it.
  JobOptions async_commit;
  async_commit.commit_steps = true;
  EXPECT_STATUS_MSG(shard_->InitJob(MakeInit(async_commit)), absl::StatusCode::kInvalidArgument,
                    "commit_steps applies to sync mode only");
  InitJobRequest value_only = MakeInit(JobOptions());
  value_only.set_clip_grad_value(1);
  EXPECT_STATUS_MSG(shard_->InitJob(value_only), absl::StatusCode::kInvalidArgument,
                    "clip_grad_value is applied by the shards only with commit_steps");
  // A plain job neither takes the flag nor a commit.
  ASSERT_OK(shard_->InitJob(MakeInit(JobOptions())));
  PushRequest flagged = CommitPush(0, 0, 1);
  flagged.set_nonfinite(true);
  EXPECT_STATUS_MSG(shard_->Push(flagged), absl::StatusCode::kInvalidArgument,
                    "does not commit its steps");
  EXPECT_STATUS_MSG(CommitPull(shard_.get(), 0, 0, 1), absl::StatusCode::kInvalidArgument,
                    "does not commit its steps");
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse plain, Info(shard_.get()));
  EXPECT_EQ(plain.updates_applied(), 0);
  // A coefficient outside (0, 1] applies nothing; the step stays held for a good commit.
  JobOptions o = CommitJob();
  o.job = "k";
  InitJobRequest k = MakeInit(o);
  k.set_job("k");
  ASSERT_OK(shard_->InitJob(k));
  PushRequest a = CommitPush(0, 0, 1), b = CommitPush(1, 0, 2);
  a.set_job("k");
  b.set_job("k");
  ASSERT_OK(PushBoth(shard_.get(), a, b)[0]);
  PullRequest pull;
  pull.set_job("k");
  pull.mutable_commit()->set_step(0);
  PullResponse resp;
  for (double bad : {0.0, 1.5, -0.5}) {
    pull.mutable_commit()->set_clip_coef(bad);
    EXPECT_STATUS_MSG(shard_->Pull(pull, &resp), absl::StatusCode::kInvalidArgument,
                      "is not in (0, 1]");
  }
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse held, Info(shard_.get(), "k"));
  EXPECT_EQ(held.updates_applied(), 0);
  pull.mutable_commit()->set_clip_coef(1);
  resp.Clear();
  ASSERT_OK(shard_->Pull(pull, &resp));
  EXPECT_FALSE(resp.commit_missing());
  ASSERT_OK_AND_ASSIGN(const JobInfoResponse applied, Info(shard_.get(), "k"));
  EXPECT_EQ(applied.updates_applied(), 1);
}

}  // namespace
}  // namespace gradmesh
