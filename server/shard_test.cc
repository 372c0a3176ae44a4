#include "server/shard.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/partitioner.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

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

// Job "j": tensors a[10] and b[3x4], chunks of 4 elements, 2 shards, plain SGD lr 0.5.
// Initial value of element i of tensor t is 100 * t + i.
InitJobRequest MakeInit(int32_t shard_index, int32_t num_workers = 2) {
  InitJobRequest r;
  r.set_job("j");
  auto* a = r.add_tensors();
  a->set_name("a");
  a->add_shape(10);
  auto* b = r.add_tensors();
  b->set_name("b");
  b->add_shape(3);
  b->add_shape(4);
  r.set_chunk_elems(4);
  r.set_num_shards(2);
  r.set_shard_index(shard_index);
  r.mutable_optimizer()->set_name("sgd");
  r.mutable_optimizer()->set_lr(0.5);
  r.set_num_workers(num_workers);
  auto p = Partition::Create({10, 12}, 4, 2).value();
  for (int64_t idx : p.shard_chunks(shard_index)) {
    const ChunkInfo& c = p.chunks()[idx];
    std::vector<float> v(c.numel);
    for (int64_t i = 0; i < c.numel; ++i) v[i] = static_cast<float>(100 * c.tensor + c.offset + i);
    ChunkData* d = r.add_initial();
    d->set_tensor(c.tensor);
    d->set_chunk(c.chunk);
    d->set_dtype(FLOAT32);
    d->set_data(Bytes(v));
  }
  return r;
}

class ShardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto shard = Shard::Create(ShardOptions());
    ASSERT_OK(shard);
    shard_ = std::move(shard).value();
    partition_ = std::make_unique<Partition>(Partition::Create({10, 12}, 4, 2).value());
    ASSERT_OK_AND_ASSIGN(InitJobResponse r, shard_->InitJob(MakeInit(0)));
    EXPECT_TRUE(r.created());
  }

  // A chunk owned by shard 0 and one owned by shard 1.
  ChunkInfo Owned() { return partition_->chunks()[partition_->shard_chunks(0)[0]]; }
  ChunkInfo NotOwned() { return partition_->chunks()[partition_->shard_chunks(1)[0]]; }

  // Steps default to the request id, so a worker's steps increase with its ids.
  PushRequest MakePush(const ChunkInfo& c, float value, uint64_t id, int32_t worker = 0,
                       int64_t step = -1) {
    PushRequest p;
    p.set_job("j");
    p.set_worker(worker);
    p.set_step(step >= 0 ? step : static_cast<int64_t>(id));
    p.set_request_id(id);
    ChunkData* d = p.add_chunks();
    d->set_tensor(c.tensor);
    d->set_chunk(c.chunk);
    d->set_dtype(FLOAT32);
    d->set_data(Bytes(std::vector<float>(c.numel, value)));
    return p;
  }

  std::vector<float> PullOne(const ChunkInfo& c, int64_t* version = nullptr) {
    PullRequest req;
    req.set_job("j");
    ChunkData* d = req.add_chunks();
    d->set_tensor(c.tensor);
    d->set_chunk(c.chunk);
    PullResponse resp;
    EXPECT_OK(shard_->Pull(req, &resp));
    EXPECT_EQ(resp.chunks_size(), 1);
    if (version != nullptr) *version = resp.chunks(0).version();
    return Floats(resp.chunks(0).data());
  }

  std::vector<std::vector<float>> PullAllOwned() {
    PullRequest req;
    req.set_job("j");
    PullResponse resp;
    EXPECT_OK(shard_->Pull(req, &resp));
    std::vector<std::vector<float>> out;
    for (const auto& c : resp.chunks()) out.push_back(Floats(c.data()));
    return out;
  }

  std::unique_ptr<Shard> shard_;
  std::unique_ptr<Partition> partition_;
};

TEST_F(ShardTest, PullReturnsInitialValuesOfOwnedChunks) {
  PullRequest req;
  req.set_job("j");
  PullResponse resp;
  ASSERT_OK(shard_->Pull(req, &resp));
  ASSERT_EQ(resp.chunks_size(), static_cast<int>(partition_->shard_chunks(0).size()));
  for (int i = 0; i < resp.chunks_size(); ++i) {
    const ChunkInfo& c = partition_->chunks()[partition_->shard_chunks(0)[i]];
    EXPECT_EQ(resp.chunks(i).tensor(), c.tensor);
    EXPECT_EQ(resp.chunks(i).chunk(), c.chunk);
    EXPECT_EQ(resp.chunks(i).version(), 0);
    std::vector<float> v = Floats(resp.chunks(i).data());
    ASSERT_EQ(static_cast<int64_t>(v.size()), c.numel);
    for (int64_t k = 0; k < c.numel; ++k) EXPECT_EQ(v[k], 100 * c.tensor + c.offset + k);
  }
}

TEST_F(ShardTest, PushAppliesSgdAndBumpsVersion) {
  const ChunkInfo c = Owned();
  ASSERT_OK_AND_ASSIGN(PushResponse r, shard_->Push(MakePush(c, 2.0f, 1)));
  EXPECT_FALSE(r.duplicate());
  ASSERT_EQ(r.new_versions_size(), 1);
  EXPECT_EQ(r.new_versions(0), 1);
  int64_t version = -1;
  std::vector<float> v = PullOne(c, &version);
  EXPECT_EQ(version, 1);
  for (int64_t k = 0; k < c.numel; ++k) EXPECT_EQ(v[k], 100 * c.tensor + c.offset + k - 1.0f);
}

TEST_F(ShardTest, RetriedPushIsAppliedOnce) {
  const ChunkInfo c = Owned();
  ASSERT_OK(shard_->Push(MakePush(c, 2.0f, 77)));
  ASSERT_OK_AND_ASSIGN(PushResponse again, shard_->Push(MakePush(c, 2.0f, 77)));
  EXPECT_TRUE(again.duplicate());
  // Same id from another worker is a different request.
  ASSERT_OK_AND_ASSIGN(PushResponse other, shard_->Push(MakePush(c, 2.0f, 77, 1)));
  EXPECT_FALSE(other.duplicate());
  int64_t version = -1;
  std::vector<float> v = PullOne(c, &version);
  EXPECT_EQ(version, 2);
  EXPECT_EQ(v[0], 100 * c.tensor + c.offset - 2.0f);
  ASSERT_OK_AND_ASSIGN(JobInfoResponse info, shard_->GetJobInfo([] {
    JobInfoRequest r;
    r.set_job("j");
    return r;
  }()));
  EXPECT_EQ(info.pushes_applied(), 2);
  EXPECT_EQ(info.duplicates_dropped(), 1);
  EXPECT_EQ(info.workers(0).pushes_applied(), 1);
  EXPECT_EQ(info.workers(1).pushes_applied(), 1);
}

TEST_F(ShardTest, FusedPushAnswersWithTheValuesAfterItsUpdate) {
  const ChunkInfo c = Owned();
  PushRequest p = MakePush(c, 2.0f, 5);
  p.mutable_pull()->set_job("j");
  ASSERT_OK_AND_ASSIGN(PushResponse r, shard_->Push(p));
  EXPECT_FALSE(r.duplicate());
  ASSERT_TRUE(r.has_pulled());
  // Exactly what a Pull of every owned chunk answers after the push.
  const auto after = PullAllOwned();
  ASSERT_EQ(r.pulled().chunks_size(), static_cast<int>(after.size()));
  for (int i = 0; i < r.pulled().chunks_size(); ++i) {
    EXPECT_EQ(Floats(r.pulled().chunks(i).data()), after[i]) << "chunk " << i;
  }
  EXPECT_EQ(r.pulled().chunks(0).version(), 1);
  EXPECT_EQ(after[0][0], 100 * c.tensor + c.offset - 1.0f);  // lr 0.5 x 2.
  // A retry is acknowledged as a duplicate and still answers with the values.
  ASSERT_OK_AND_ASSIGN(PushResponse again, shard_->Push(p));
  EXPECT_TRUE(again.duplicate());
  ASSERT_EQ(again.pulled().chunks_size(), static_cast<int>(after.size()));
  EXPECT_EQ(Floats(again.pulled().chunks(0).data()), after[0]);
  // The pull's own choices hold: one named chunk, narrowed to bf16.
  PushRequest q = MakePush(c, 0.0f, 6);
  q.mutable_pull()->set_job("j");
  q.mutable_pull()->set_codec("bf16");
  ChunkData* want = q.mutable_pull()->add_chunks();
  want->set_tensor(c.tensor);
  want->set_chunk(c.chunk);
  ASSERT_OK_AND_ASSIGN(PushResponse narrow, shard_->Push(q));
  ASSERT_EQ(narrow.pulled().chunks_size(), 1);
  EXPECT_EQ(narrow.pulled().chunks(0).codec(), "bf16");
}

TEST_F(ShardTest, FusedPushWithABadPullIsRefusedWholeAndChangesNothing) {
  const auto before = PullAllOwned();
  const ChunkInfo c = Owned();
  auto fused = [&](const std::function<void(PullRequest*)>& edit) {
    PushRequest p = MakePush(c, 1.0f, 9);
    p.mutable_pull()->set_job("j");
    edit(p.mutable_pull());
    return shard_->Push(p);
  };
  EXPECT_STATUS_MSG(fused([](PullRequest* r) { r->set_worker(1); }),
                    absl::StatusCode::kInvalidArgument, "its pull names job j worker 1");
  EXPECT_STATUS_MSG(fused([](PullRequest* r) { r->set_job("other"); }),
                    absl::StatusCode::kInvalidArgument, "its pull names job other");
  EXPECT_STATUS_MSG(fused([](PullRequest* r) { r->mutable_commit()->set_step(9); }),
                    absl::StatusCode::kInvalidArgument, "its pull commits a step");
  EXPECT_STATUS_MSG(fused([](PullRequest* r) { r->set_codec("topk:0.1"); }),
                    absl::StatusCode::kInvalidArgument, "codec");
  const ChunkInfo other = NotOwned();
  EXPECT_STATUS_MSG(fused([&](PullRequest* r) {
                      ChunkData* d = r->add_chunks();
                      d->set_tensor(other.tensor);
                      d->set_chunk(other.chunk);
                    }),
                    absl::StatusCode::kFailedPrecondition, "belongs to shard 1, not shard 0");
  EXPECT_EQ(PullAllOwned(), before);
  // A commit_steps job's push only prepares its step: it cannot carry a pull.
  InitJobRequest commits = MakeInit(0, 1);
  commits.set_job("jc");
  commits.set_consistency("sync");
  commits.set_commit_steps(true);
  ASSERT_OK(shard_->InitJob(commits));
  PushRequest pc = MakePush(c, 1.0f, 3);
  pc.set_job("jc");
  pc.mutable_pull()->set_job("jc");
  EXPECT_STATUS_MSG(shard_->Push(pc), absl::StatusCode::kFailedPrecondition,
                    "commits its steps (commit_steps)");
  pc.clear_pull();  // The same push alone is the job's first push of step 3 (not a duplicate).
  ASSERT_OK_AND_ASSIGN(PushResponse prepared, shard_->Push(pc));
  EXPECT_FALSE(prepared.duplicate());
  EXPECT_TRUE(prepared.has_prepared());
  // Nothing was recorded either: the same request id is then applied, not a duplicate.
  ASSERT_OK_AND_ASSIGN(PushResponse r, fused([](PullRequest*) {}));
  EXPECT_FALSE(r.duplicate());
}

TEST_F(ShardTest, BadPushesAreRejectedAndChangeNothing) {
  const auto before = PullAllOwned();
  const ChunkInfo c = Owned();

  PushRequest p = MakePush(c, 1.0f, 1);
  p.set_job("nope");
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kNotFound, "job nope");

  p = MakePush(c, 1.0f, 2);
  p.mutable_chunks(0)->set_tensor(7);
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kNotFound, "tensor 7");

  p = MakePush(c, 1.0f, 3);
  p.mutable_chunks(0)->set_chunk(99);
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kNotFound, "chunk 99 does not exist");

  p = MakePush(c, 1.0f, 4);
  p.mutable_chunks(0)->mutable_data()->resize(c.numel * 4 - 4);
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kInvalidArgument,
                    "float32 values (" + std::to_string(c.numel * 4) + " bytes), got " +
                        std::to_string(c.numel * 4 - 4) + " bytes");

  p = MakePush(c, 1.0f, 5);
  p.mutable_chunks(0)->set_dtype(FLOAT16);
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kInvalidArgument, "dtype FLOAT16");

  p = MakePush(c, 1.0f, 6);
  p.set_worker(2);
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kInvalidArgument, "worker 2 not in [0, 2)");

  // A valid chunk followed by a NaN chunk: nothing at all may be applied.
  p = MakePush(c, 1.0f, 7);
  const ChunkInfo c2 = partition_->chunks()[partition_->shard_chunks(0)[1]];
  ChunkData* d = p.add_chunks();
  d->set_tensor(c2.tensor);
  d->set_chunk(c2.chunk);
  std::vector<float> nan(c2.numel, 1.0f);
  nan[c2.numel - 1] = std::numeric_limits<float>::quiet_NaN();
  d->set_data(Bytes(nan));
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kInvalidArgument,
                    "element " + std::to_string(c2.numel - 1) + " is not finite");
  std::vector<float> inf(c.numel, 1.0f);
  inf[0] = std::numeric_limits<float>::infinity();
  p = MakePush(c, 1.0f, 8);
  p.mutable_chunks(0)->set_data(Bytes(inf));
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kInvalidArgument, "element 0 is not finite");

  p = MakePush(NotOwned(), 1.0f, 9);
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kFailedPrecondition,
                    "belongs to shard 1, not shard 0");

  p = MakePush(c, 1.0f, 10);
  *p.add_chunks() = p.chunks(0);
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kInvalidArgument, "appears twice");

  p = MakePush(c, 1.0f, 11);
  p.mutable_chunks(0)->set_version(std::numeric_limits<int64_t>::min());
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kInvalidArgument,
                    "base version -9223372036854775808 is negative");
  p = MakePush(c, 1.0f, 12, 0, /*step=*/0);
  p.set_step(-3);
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kInvalidArgument, "step -3 out of range");
  p.set_step(std::numeric_limits<int64_t>::max());
  EXPECT_STATUS_MSG(shard_->Push(p), absl::StatusCode::kInvalidArgument, "out of range");

  EXPECT_EQ(PullAllOwned(), before);
  ASSERT_OK_AND_ASSIGN(JobInfoResponse info, shard_->GetJobInfo([] {
    JobInfoRequest r;
    r.set_job("j");
    return r;
  }()));
  EXPECT_EQ(info.pushes_applied(), 0);
  // A rejected request id is not remembered: a corrected retry is applied.
  ASSERT_OK_AND_ASSIGN(PushResponse ok, shard_->Push(MakePush(c, 1.0f, 7)));
  EXPECT_FALSE(ok.duplicate());
}

TEST_F(ShardTest, InitJobIsIdempotentAndRejectsConflicts) {
  ASSERT_OK_AND_ASSIGN(InitJobResponse again, shard_->InitJob(MakeInit(0)));
  EXPECT_FALSE(again.created());
  InitJobRequest other = MakeInit(0, /*num_workers=*/3);
  EXPECT_STATUS_MSG(shard_->InitJob(other), absl::StatusCode::kFailedPrecondition,
                    "already exists on this shard with a different layout");
}

TEST_F(ShardTest, InitJobValidatesInput) {
  InitJobRequest r = MakeInit(1);
  r.set_job("k");
  r.mutable_optimizer()->set_name("rmsprop");
  EXPECT_STATUS_MSG(shard_->InitJob(r), absl::StatusCode::kInvalidArgument,
                    "unknown optimizer \"rmsprop\" (known: adam, adamw, sgd)");
  r = MakeInit(1);
  r.set_job("k");
  r.set_consistency("eventually");
  EXPECT_STATUS_MSG(shard_->InitJob(r), absl::StatusCode::kInvalidArgument,
                    "unknown consistency mode \"eventually\" (known: async, ssp, sync");
  r = MakeInit(1);
  r.set_job("k");
  r.mutable_initial()->RemoveLast();
  EXPECT_STATUS_MSG(shard_->InitJob(r), absl::StatusCode::kInvalidArgument,
                    "but the request carries initial values for");
  r = MakeInit(1);
  r.set_job("k");
  r.set_shard_index(2);
  EXPECT_STATUS_MSG(shard_->InitJob(r), absl::StatusCode::kInvalidArgument,
                    "shard_index 2 not in [0, 2)");
  r = MakeInit(1);
  r.set_job("k");
  r.mutable_tensors(1)->set_name("a");
  EXPECT_STATUS_MSG(shard_->InitJob(r), absl::StatusCode::kInvalidArgument, "repeated name");
  // None of the failures created the job.
  JobInfoRequest q;
  q.set_job("k");
  EXPECT_STATUS(shard_->GetJobInfo(q), absl::StatusCode::kNotFound);
}

TEST_F(ShardTest, StalenessIsRecorded) {
  const ChunkInfo c = Owned();
  // Three pushes all computed from version 0: staleness 0, 1, 2.
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_OK(shard_->Push(MakePush(c, 0.1f, id)));
  JobInfoRequest q;
  q.set_job("j");
  ASSERT_OK_AND_ASSIGN(JobInfoResponse info, shard_->GetJobInfo(q));
  ASSERT_EQ(info.staleness_histogram_size(), 16);
  EXPECT_EQ(info.staleness_histogram(0), 1);
  EXPECT_EQ(info.staleness_histogram(1), 1);
  EXPECT_EQ(info.staleness_histogram(2), 1);
  EXPECT_EQ(info.workers(0).last_step(), 3);
}

TEST_F(ShardTest, ConcurrentPushersAllApplied) {
  const ChunkInfo c = Owned();
  // One thread per worker (a worker's steps increase), two chunks' worth of contention.
  constexpr int kThreads = 2, kPushes = 500;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPushes; ++i) {
        EXPECT_OK(shard_->Push(MakePush(c, 0.25f, t * 100000 + i, t)));
      }
    });
  }
  for (auto& th : threads) th.join();
  int64_t version = -1;
  std::vector<float> v = PullOne(c, &version);
  EXPECT_EQ(version, kThreads * kPushes);
  // Each push subtracts 0.5 * 0.25 = 0.125 exactly (representable), 1000 times.
  EXPECT_EQ(v[0], 100 * c.tensor + c.offset - 125.0f);
}

TEST_F(ShardTest, PushOfAnAlreadyAppliedStepIsADuplicate) {
  const ChunkInfo c = Owned();
  ASSERT_OK(shard_->Push(MakePush(c, 1.0f, /*id=*/10, /*worker=*/0, /*step=*/5)));
  // A different request id for step 5 or an earlier step (a resumed worker re-pushing): not
  // applied again.
  for (int64_t step : {5, 3}) {
    ASSERT_OK_AND_ASSIGN(PushResponse r, shard_->Push(MakePush(c, 1.0f, 20 + step, 0, step)));
    EXPECT_TRUE(r.duplicate()) << "step " << step;
  }
  // The other worker's step 5 and this worker's step 6 are new.
  ASSERT_OK_AND_ASSIGN(PushResponse other, shard_->Push(MakePush(c, 1.0f, 30, 1, 5)));
  EXPECT_FALSE(other.duplicate());
  ASSERT_OK_AND_ASSIGN(PushResponse next, shard_->Push(MakePush(c, 1.0f, 31, 0, 6)));
  EXPECT_FALSE(next.duplicate());
  int64_t version = -1;
  std::vector<float> v = PullOne(c, &version);
  EXPECT_EQ(version, 3);
  EXPECT_EQ(v[0], 100 * c.tensor + c.offset - 1.5f);
  JobInfoRequest q;
  q.set_job("j");
  ASSERT_OK_AND_ASSIGN(JobInfoResponse info, shard_->GetJobInfo(q));
  EXPECT_EQ(info.duplicates_dropped(), 2);
  EXPECT_EQ(info.pushes_applied(), 3);
}

// A restarted worker re-pushing a step (new request id) while its previous incarnation's push
// of that step is still being applied: ABORTED until that one is done, then a duplicate.
TEST(ShardInProgressTest, SecondPushOfAStepInProgressIsAborted) {
  ShardOptions options;
  absl::Notification entered, release;
  // A consistency policy that holds the first push until released.
  options.consistency.Register(
      "gate",
      [&](const ConsistencyConfig&,
          const std::string&) -> absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> {
        class Gate final : public ConsistencyPolicy {
         public:
          Gate(absl::Notification* e, absl::Notification* r) : entered_(e), release_(r) {}
          std::string mode() const override { return "gate"; }
          void StartPush(const ChunkUpdate& push, ApplyFn apply, WaitDone done,
                         WaitCancel*) override {
            if (!entered_->HasBeenNotified()) {
              entered_->Notify();
              release_->WaitForNotification();
            }
            done(apply(push));
          }
          void StartPull(int32_t, WaitDone done, WaitCancel*) override { done(absl::OkStatus()); }
          void OnFinish(int32_t) override {}
          void Restore(const std::vector<int64_t>&, const std::vector<bool>&) override {}
          ConsistencyStats stats() const override { return {}; }

         private:
          absl::Notification* entered_;
          absl::Notification* release_;
        };
        return std::unique_ptr<ConsistencyPolicy>(new Gate(&entered, &release));
      });
  ASSERT_OK_AND_ASSIGN(auto shard, Shard::Create(options));
  InitJobRequest init = MakeInit(0);
  init.set_consistency("gate");
  ASSERT_OK(shard->InitJob(init));
  const ChunkInfo c = Partition::Create({10, 12}, 4, 2).value().chunks()[0];
  auto push = [&](uint64_t id) {
    PushRequest p;
    p.set_job("j");
    p.set_worker(0);
    p.set_step(4);
    p.set_request_id(id);
    ChunkData* d = p.add_chunks();
    d->set_tensor(c.tensor);
    d->set_chunk(c.chunk);
    d->set_data(Bytes(std::vector<float>(c.numel, 1.0f)));
    return p;
  };
  absl::StatusOr<PushResponse> first;
  std::thread t([&] { first = shard->Push(push(1)); });
  entered.WaitForNotification();
  EXPECT_STATUS_MSG(shard->Push(push(2)), absl::StatusCode::kAborted,
                    "worker 0 step 4 is already being applied");
  release.Notify();
  t.join();
  ASSERT_OK(first);
  EXPECT_FALSE(first->duplicate());
  ASSERT_OK_AND_ASSIGN(PushResponse again, shard->Push(push(2)));
  EXPECT_TRUE(again.duplicate());
}

TEST_F(ShardTest, FinishMarksWorker) {
  FinishRequest f;
  f.set_job("j");
  f.set_worker(1);
  f.set_step(9);
  ASSERT_OK(shard_->Finish(f));
  f.set_worker(5);
  EXPECT_STATUS(shard_->Finish(f), absl::StatusCode::kInvalidArgument);
  JobInfoRequest q;
  q.set_job("j");
  ASSERT_OK_AND_ASSIGN(JobInfoResponse info, shard_->GetJobInfo(q));
  EXPECT_FALSE(info.workers(0).finished());
  EXPECT_TRUE(info.workers(1).finished());
}

// ---------------------------------------------------------------------------------------------
// Elastic sync: SetSyncGroup.

class SyncGroupShardTest : public ShardTest {
 protected:
  void SetUp() override {
    ShardTest::SetUp();
    InitJobRequest init = MakeInit(0, /*num_workers=*/3);
    init.set_job("s");
    init.set_consistency("sync");
    init.set_barrier_timeout_s(10);
    ASSERT_OK(shard_->InitJob(init));
  }

  PushRequest SyncPush(int32_t worker, int64_t step, float value) {
    PushRequest p = MakePush(Owned(), value, 100 * worker + step + 1, worker, step);
    p.set_job("s");
    return p;
  }

  std::vector<float> PullSync(int64_t* version) {
    PullRequest req;
    req.set_job("s");
    ChunkData* d = req.add_chunks();
    d->set_tensor(Owned().tensor);
    d->set_chunk(Owned().chunk);
    PullResponse resp;
    EXPECT_OK(shard_->Pull(req, &resp));
    EXPECT_EQ(resp.chunks_size(), 1);
    *version = resp.chunks(0).version();
    return Floats(resp.chunks(0).data());
  }

  JobInfoResponse SyncInfo() {
    JobInfoRequest q;
    q.set_job("s");
    auto info = shard_->GetJobInfo(q);
    EXPECT_OK(info);
    return info.ok() ? *info : JobInfoResponse();
  }

  static std::vector<int32_t> Active(const JobInfoResponse& info) {
    return {info.active_workers().begin(), info.active_workers().end()};
  }
};

TEST_F(SyncGroupShardTest, ShrinkCompletesTheWaitingStepWithScaledLearningRate) {
  const ChunkInfo c = Owned();
  JobInfoResponse info = SyncInfo();
  EXPECT_EQ(Active(info), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(info.lr_scale(), 1.0);
  // Workers 0 and 2 push step 0 and wait for worker 1, which is gone.
  absl::StatusOr<PushResponse> r0, r2;
  std::thread t0([&] { r0 = shard_->Push(SyncPush(0, 0, 1.5f)); });
  std::thread t2([&] { r2 = shard_->Push(SyncPush(2, 0, 4.25f)); });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(SyncInfo().updates_applied(), 0);
  ASSERT_OK(shard_->SetSyncGroup("s", {2, 0}, 0.75));
  t0.join();
  t2.join();
  ASSERT_OK(r0);
  ASSERT_OK(r2);
  ASSERT_EQ(r0->new_versions_size(), 1);
  EXPECT_EQ(r0->new_versions(0), 1);
  // SGD: p - (lr * lr_scale) * mean(g) = p - (0.5 * 0.75) * ((1.5 + 4.25) / 2) = p - 1.078125.
  const auto expect_values = [&](float subtracted, int64_t want_version) {
    int64_t version = -1;
    const std::vector<float> v = PullSync(&version);
    EXPECT_EQ(version, want_version);
    ASSERT_EQ(static_cast<int64_t>(v.size()), c.numel);
    for (int64_t e = 0; e < c.numel; ++e) {
      EXPECT_EQ(v[e], static_cast<float>(100 * c.tensor + c.offset + e) - subtracted)
          << "element " << e;
    }
  };
  const float avg = (1.5f + 4.25f) * 0.5f;
  ASSERT_EQ((0.5f * 0.75f) * avg, 1.078125f);  // The optimizer's math, exact in float.
  expect_values(1.078125f, 1);
  info = SyncInfo();
  EXPECT_EQ(Active(info), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(info.lr_scale(), 0.75);
  EXPECT_EQ(info.updates_applied(), 1);
  EXPECT_EQ(info.pushes_applied(), 2);
  EXPECT_EQ(info.workers(1).last_step(), -1);
  EXPECT_EQ(info.workers(2).last_step(), 0);

  // The removed worker is refused, changes nothing, and may retry later (id forgotten).
  EXPECT_STATUS_MSG(shard_->Push(SyncPush(1, 1, 100.0f)), absl::StatusCode::kFailedPrecondition,
                    "worker 1 is not in the sync group of job s (active: [0, 2])");
  expect_values(1.078125f, 1);
  EXPECT_EQ(SyncInfo().pushes_applied(), 2);

  // The next step needs only 0 and 2, still at factor 0.75: p -= 0.375 * 2 = 0.75.
  std::thread n0([&] { EXPECT_OK(shard_->Push(SyncPush(0, 1, 1.0f))); });
  EXPECT_OK(shard_->Push(SyncPush(2, 1, 3.0f)));
  n0.join();
  expect_values(1.078125f + 0.75f, 2);

  // Growing back (empty = all ranks, factor 1): step 2 waits for worker 1 too.
  ASSERT_OK(shard_->SetSyncGroup("s", {}, 1.0));
  info = SyncInfo();
  EXPECT_EQ(Active(info), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(info.lr_scale(), 1.0);
  absl::StatusOr<PushResponse> s0, s2;
  std::thread g0([&] { s0 = shard_->Push(SyncPush(0, 2, 1.0f)); });
  std::thread g2([&] { s2 = shard_->Push(SyncPush(2, 2, 2.0f)); });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(SyncInfo().updates_applied(), 2);
  ASSERT_OK(shard_->Push(SyncPush(1, 2, 6.0f)));  // Rank order (1 + 6) + 2 = 9, / 3 = 3.
  g0.join();
  g2.join();
  ASSERT_OK(s0);
  ASSERT_OK(s2);
  ASSERT_EQ(((1.0f + 6.0f) + 2.0f) * (1.0f / 3.0f), 3.0f);
  expect_values(1.078125f + 0.75f + 1.5f, 3);  // p -= 0.5 * 3.
  EXPECT_EQ(SyncInfo().pushes_applied(), 7);
}

TEST_F(SyncGroupShardTest, BadArgumentsAreRejectedWithExactCodesAndChangeNothing) {
  ASSERT_OK(shard_->SetSyncGroup("s", {0, 1}, 0.5));
  EXPECT_STATUS_MSG(shard_->SetSyncGroup("nope", {0}, 1.0), absl::StatusCode::kNotFound,
                    "job nope is not known to this shard");
  EXPECT_STATUS_MSG(shard_->SetSyncGroup("j", {0}, 0.5), absl::StatusCode::kFailedPrecondition,
                    "SetSyncGroup: job j has consistency mode async; only sync jobs have a "
                    "barrier group");
  // Also for a bad group: the mode is checked first.
  EXPECT_STATUS(shard_->SetSyncGroup("j", {7}, 2.0), absl::StatusCode::kFailedPrecondition);
  EXPECT_STATUS_MSG(shard_->SetSyncGroup("s", {0, 3}, 1.0), absl::StatusCode::kInvalidArgument,
                    "SetSyncGroup: sync group of job s: rank 3 not in [0, 3)");
  EXPECT_STATUS_MSG(shard_->SetSyncGroup("s", {-1, 0}, 1.0), absl::StatusCode::kInvalidArgument,
                    "SetSyncGroup: sync group of job s: rank -1 not in [0, 3)");
  EXPECT_STATUS_MSG(shard_->SetSyncGroup("s", {1, 1}, 1.0), absl::StatusCode::kInvalidArgument,
                    "SetSyncGroup: sync group of job s: rank 1 appears twice");
  EXPECT_STATUS_MSG(shard_->SetSyncGroup("s", {2, 0, 2}, 0.5), absl::StatusCode::kInvalidArgument,
                    "SetSyncGroup: sync group of job s: rank 2 appears twice");
  for (double scale : {0.0, -0.25, 1.0000001, 2.0, std::numeric_limits<double>::infinity(),
                       std::numeric_limits<double>::quiet_NaN()}) {
    EXPECT_STATUS_MSG(shard_->SetSyncGroup("s", {0, 1, 2}, scale),
                      absl::StatusCode::kInvalidArgument, "not in (0, 1]")
        << scale;
  }
  EXPECT_STATUS_MSG(shard_->SetSyncGroup("s", {0, 1, 2}, 1.5), absl::StatusCode::kInvalidArgument,
                    "SetSyncGroup: job s: lr_scale 1.5 not in (0, 1]");
  EXPECT_STATUS_MSG(shard_->SetSyncGroup("s", {0, 1, 2}, 1.0000001),
                    absl::StatusCode::kInvalidArgument,
                    "SetSyncGroup: job s: lr_scale 1.0000001 not in (0, 1]");
  // A factor that rounds to 0 in float is refused by the policy.
  EXPECT_STATUS_MSG(shard_->SetSyncGroup("s", {0, 1, 2}, 1e-60), absl::StatusCode::kInvalidArgument,
                    "SetSyncGroup: sync group of job s: lr_scale 0 not in (0, 1]");
  // Still {0, 1} at 0.5: worker 2 is refused, and 0 and 1 complete a step at half the lr.
  JobInfoResponse info = SyncInfo();
  EXPECT_EQ(Active(info), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(info.lr_scale(), 0.5);
  EXPECT_STATUS_MSG(shard_->Push(SyncPush(2, 0, 1.0f)), absl::StatusCode::kFailedPrecondition,
                    "worker 2 is not in the sync group of job s (active: [0, 1])");
  std::thread t1([&] { EXPECT_OK(shard_->Push(SyncPush(1, 0, 3.0f))); });
  ASSERT_OK(shard_->Push(SyncPush(0, 0, 1.0f)));
  t1.join();
  int64_t version = -1;
  const std::vector<float> v = PullSync(&version);
  EXPECT_EQ(version, 1);
  const ChunkInfo c = Owned();
  EXPECT_EQ(v[0], static_cast<float>(100 * c.tensor + c.offset) - 0.5f);  // 0.25 * 2.
  // Idempotent: the same group again (in any order) changes nothing.
  ASSERT_OK(shard_->SetSyncGroup("s", {1, 0}, 0.5));
  info = SyncInfo();
  EXPECT_EQ(Active(info), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(info.lr_scale(), 0.5);
  // Async jobs report no group.
  JobInfoRequest q;
  q.set_job("j");
  ASSERT_OK_AND_ASSIGN(JobInfoResponse async_info, shard_->GetJobInfo(q));
  EXPECT_EQ(async_info.active_workers_size(), 0);
  EXPECT_EQ(async_info.lr_scale(), 1.0);
}

// ---------------------------------------------------------------------------------------------
// Model buffers (TensorSpec.buffer): pushed deltas are added as they are, no optimizer.

// Job `job`: parameter w[6] (chunks 0-3, 4-5), buffers rm[4] (float32, one chunk) and nbt[]
// (an int64 scalar, one element), chunks of 4 elements, one shard, adam lr 0.5.
// Initial values: w[i] = i, rm[i] = 10 + i, nbt = 3.
InitJobRequest BufferInit(const std::string& job, const std::string& mode, int32_t workers) {
  InitJobRequest r;
  r.set_job(job);
  TensorSpec* w = r.add_tensors();
  w->set_name("w");
  w->add_shape(6);
  TensorSpec* rm = r.add_tensors();
  rm->set_name("rm");
  rm->add_shape(4);
  rm->set_buffer(true);
  rm->set_dtype(FLOAT32);
  TensorSpec* nbt = r.add_tensors();
  nbt->set_name("nbt");
  nbt->set_buffer(true);
  nbt->set_dtype(INT64);
  r.set_chunk_elems(4);
  r.set_num_shards(1);
  r.set_shard_index(0);
  r.mutable_optimizer()->set_name("adam");
  r.mutable_optimizer()->set_lr(0.5);
  r.set_num_workers(workers);
  r.set_consistency(mode);
  r.set_barrier_timeout_s(10);
  const std::vector<std::vector<float>> init = {{0, 1, 2, 3}, {4, 5}, {10, 11, 12, 13}, {3}};
  const std::vector<std::pair<int, int>> ids = {{0, 0}, {0, 1}, {1, 0}, {2, 0}};
  for (size_t i = 0; i < init.size(); ++i) {
    ChunkData* d = r.add_initial();
    d->set_tensor(ids[i].first);
    d->set_chunk(ids[i].second);
    d->set_dtype(FLOAT32);
    d->set_data(Bytes(init[i]));
  }
  return r;
}

// One push of `job`: w chunk 0 gets gradient `g`, rm gets `rm_delta`, nbt gets 1.
PushRequest BufferPush(const std::string& job, int32_t worker, int64_t step,
                       const std::vector<float>& g, const std::vector<float>& rm_delta) {
  PushRequest p;
  p.set_job(job);
  p.set_worker(worker);
  p.set_step(step);
  p.set_request_id(static_cast<uint64_t>(1000 * worker + step + 1));
  const std::vector<std::pair<int, std::vector<float>>> chunks = {
      {0, g}, {1, rm_delta}, {2, {1.0f}}};
  for (const auto& [tensor, data] : chunks) {
    ChunkData* d = p.add_chunks();
    d->set_tensor(tensor);
    d->set_chunk(0);
    d->set_dtype(FLOAT32);
    d->set_data(Bytes(data));
  }
  return p;
}

// Every chunk of `job` (w0, w1, rm, nbt) with its version; `codec` as PullRequest.codec.
std::vector<std::pair<std::vector<float>, int64_t>> PullBuffersJob(Shard* shard,
                                                                   const std::string& job,
                                                                   const std::string& codec = "") {
  PullRequest req;
  req.set_job(job);
  req.set_codec(codec);
  PullResponse resp;
  EXPECT_OK(shard->Pull(req, &resp));
  std::vector<std::pair<std::vector<float>, int64_t>> out;
  for (const ChunkData& c : resp.chunks()) {
    EXPECT_EQ(c.codec(), codec.empty() || c.tensor() > 0 ? "" : codec)
        << "tensor " << c.tensor() << " chunk " << c.chunk();
    out.emplace_back(c.codec().empty() ? Floats(c.data()) : std::vector<float>(), c.version());
  }
  return out;
}

// What adam (lr 0.5) makes of w chunk 0 = {0, 1, 2, 3} with the given gradients, in order,
// computed by the same optimizer code the shard runs.
std::vector<float> AdamReference(const std::vector<std::vector<float>>& grads) {
  OptimizerSpec spec;
  spec.set_name("adam");
  spec.set_lr(0.5);
  std::unique_ptr<Optimizer> adam = OptimizerRegistry::WithBuiltins().Create(spec).value();
  std::vector<float> p = {0, 1, 2, 3}, m(4, 0.0f), v(4, 0.0f);
  float* slots[] = {m.data(), v.data()};
  for (size_t i = 0; i < grads.size(); ++i) {
    adam->Apply(static_cast<int64_t>(i) + 1, LrScheduleFactor(spec, static_cast<int64_t>(i)),
                grads[i].data(), p.data(), slots, 4);
  }
  return p;
}

TEST_F(ShardTest, AsyncPushAddsBufferDeltasExactlyBesideAdamParameters) {
  ASSERT_OK(shard_->InitJob(BufferInit("bn", "async", 2)));
  const std::vector<float> g1 = {0.5f, -1.0f, 2.0f, 0.25f}, g2 = {-3.0f, 1.0f, 0.0f, 8.0f};
  ASSERT_OK_AND_ASSIGN(PushResponse r1,
                       shard_->Push(BufferPush("bn", 0, 0, g1, {0.5f, -0.25f, 1.0f, 0.125f})));
  EXPECT_EQ(std::vector<int64_t>(r1.new_versions().begin(), r1.new_versions().end()),
            (std::vector<int64_t>{1, 1, 1}));
  ASSERT_OK(shard_->Push(BufferPush("bn", 1, 0, g2, {-2.0f, 0.75f, 0.0f, 4.0f})));
  const auto got = PullBuffersJob(shard_.get(), "bn");
  ASSERT_EQ(got.size(), 4u);
  const std::vector<float> w = AdamReference({g1, g2});
  ASSERT_NE(w, (std::vector<float>{0, 1, 2, 3}));
  EXPECT_EQ(got[0].first, w);
  EXPECT_EQ(got[0].second, 2);
  EXPECT_EQ(got[1].first, (std::vector<float>{4, 5}));  // Not pushed: untouched.
  EXPECT_EQ(got[1].second, 0);
  // Each push applied alone: value += delta, exactly.
  EXPECT_EQ(got[2].first, (std::vector<float>{8.5f, 11.5f, 13.0f, 17.125f}));
  EXPECT_EQ(got[2].second, 2);
  EXPECT_EQ(got[3].first, (std::vector<float>{5.0f}));  // 3 + 1 + 1.
  EXPECT_EQ(got[3].second, 2);

  // A narrowed pull still sends the buffers dense (and exact); the parameters narrowed.
  const auto narrow = PullBuffersJob(shard_.get(), "bn", "bf16");
  ASSERT_EQ(narrow.size(), 4u);
  EXPECT_EQ(narrow[2].first, (std::vector<float>{8.5f, 11.5f, 13.0f, 17.125f}));
  EXPECT_EQ(narrow[3].first, (std::vector<float>{5.0f}));

  // The layout keeps the buffer flags and dtypes (FLOAT32 normalised to unset).
  JobInfoRequest q;
  q.set_job("bn");
  ASSERT_OK_AND_ASSIGN(JobInfoResponse info, shard_->GetJobInfo(q));
  ASSERT_EQ(info.tensors_size(), 3);
  EXPECT_FALSE(info.tensors(0).buffer());
  EXPECT_TRUE(info.tensors(1).buffer());
  EXPECT_EQ(info.tensors(1).dtype(), DTYPE_UNSPECIFIED);
  EXPECT_TRUE(info.tensors(2).buffer());
  EXPECT_EQ(info.tensors(2).dtype(), INT64);
  EXPECT_EQ(info.tensors(2).shape_size(), 0);
  // Same layout with the dtype spelled FLOAT32 or not: the job is found, not a conflict.
  InitJobRequest again = BufferInit("bn", "async", 2);
  again.mutable_tensors(1)->clear_dtype();
  ASSERT_OK_AND_ASSIGN(InitJobResponse found, shard_->InitJob(again));
  EXPECT_FALSE(found.created());
  // A different buffer flag is another layout.
  again.mutable_tensors(1)->set_buffer(false);
  EXPECT_STATUS_MSG(shard_->InitJob(again), absl::StatusCode::kFailedPrecondition,
                    "already exists on this shard with a different layout");
}

TEST_F(ShardTest, SyncBufferGetsTheMeanDeltaOfTheStepWithoutTheGroupFactor) {
  ASSERT_OK(shard_->InitJob(BufferInit("sbn", "sync", 2)));
  // The group factor scales the parameters' learning rate, never a buffer's delta.
  ASSERT_OK(shard_->SetSyncGroup("sbn", {0, 1}, 0.5));
  const std::vector<float> g0 = {1.0f, 2.0f, -4.0f, 0.5f}, g1 = {3.0f, -2.0f, 0.0f, 1.5f};
  absl::StatusOr<PushResponse> r0;
  std::thread t0([&] {
    r0 = shard_->Push(BufferPush("sbn", 0, 0, g0, {0.5f, 1.0f, -3.0f, 0.25f}));
  });
  ASSERT_OK(shard_->Push(BufferPush("sbn", 1, 0, g1, {1.5f, -1.0f, 2.0f, 0.75f})));
  t0.join();
  ASSERT_OK(r0);
  const auto got = PullBuffersJob(shard_.get(), "sbn");
  ASSERT_EQ(got.size(), 4u);
  // One update from the mean gradient {2, 0, -2, 1} at half the rate.
  OptimizerSpec spec;
  spec.set_name("adam");
  spec.set_lr(0.5);
  std::unique_ptr<Optimizer> adam = OptimizerRegistry::WithBuiltins().Create(spec).value();
  std::vector<float> w = {0, 1, 2, 3}, m(4, 0.0f), v(4, 0.0f);
  float* slots[] = {m.data(), v.data()};
  const std::vector<float> mean = {2.0f, 0.0f, -2.0f, 1.0f};
  adam->Apply(1, 0.5f * LrScheduleFactor(spec, 0), mean.data(), w.data(), slots, 4);
  EXPECT_EQ(got[0].first, w);
  EXPECT_EQ(got[0].second, 1);
  // rm = {10, 11, 12, 13} + mean delta {1, 0, -0.5, 0.5}; nbt = 3 + mean(1, 1).
  EXPECT_EQ(got[2].first, (std::vector<float>{11.0f, 11.0f, 11.5f, 13.5f}));
  EXPECT_EQ(got[2].second, 1);
  EXPECT_EQ(got[3].first, (std::vector<float>{4.0f}));
  EXPECT_EQ(got[3].second, 1);
}

TEST_F(ShardTest, InitJobChecksTensorDTypes) {
  InitJobRequest r = BufferInit("dt", "async", 1);
  r.mutable_tensors(0)->set_dtype(INT64);
  EXPECT_STATUS_MSG(shard_->InitJob(r), absl::StatusCode::kInvalidArgument,
                    "InitJob: job dt tensors[0] (w) is a parameter of dtype INT64; parameters "
                    "must be floating-point");
  r = BufferInit("dt", "async", 1);
  r.mutable_tensors(2)->set_dtype(static_cast<DType>(77));
  EXPECT_STATUS_MSG(shard_->InitJob(r), absl::StatusCode::kInvalidArgument,
                    "InitJob: job dt tensors[2] (nbt) has unknown dtype 77");
  JobInfoRequest q;
  q.set_job("dt");
  EXPECT_EQ(shard_->GetJobInfo(q).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace gradmesh
