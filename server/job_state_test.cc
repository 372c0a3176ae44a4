#include "server/job_state.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

// Job "j": tensors a[10] and b[3x4], chunks of 4 elements, 2 shards, SGD lr 0.5.
InitJobRequest Layout(int32_t shard_index = 0, const std::string& mode = "async") {
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
  r.set_num_workers(3);
  r.set_consistency(mode);
  return NormalizedLayout(r);
}

absl::StatusOr<std::unique_ptr<JobState>> Make(const InitJobRequest& layout,
                                               bool have_store = false) {
  return JobState::Create(layout, OptimizerRegistry::WithBuiltins(),
                          ConsistencyRegistry::WithBuiltins(), have_store);
}

TEST(JobStateLayoutTest, ValidateLayoutNamesTheProblem) {
  InitJobRequest r = Layout();
  EXPECT_OK(ValidateLayout(r));
  InitJobRequest bad = r;
  bad.set_job("");
  EXPECT_EQ(ValidateLayout(bad), absl::InvalidArgumentError("InitJob: job name is empty"));
  bad = r;
  bad.set_job("a/b");
  EXPECT_EQ(ValidateLayout(bad),
            absl::InvalidArgumentError(
                "InitJob: job \"a/b\" is not a valid name: 1-63 characters: lowercase letters a-z, "
                "digits 0-9 and '-', starting and ending with a letter or digit (no dots, '_', "
                "'/', uppercase or non-ASCII)"));
  bad = r;
  bad.mutable_tensors(1)->set_name("a");
  EXPECT_EQ(
      ValidateLayout(bad),
      absl::InvalidArgumentError("InitJob: job j tensor 1 has an empty or repeated name \"a\""));
  bad = r;
  bad.mutable_tensors(1)->set_shape(0, -3);
  EXPECT_EQ(ValidateLayout(bad),
            absl::InvalidArgumentError("InitJob: job j tensor b has a negative dimension"));
  bad = r;
  bad.set_shard_index(2);
  EXPECT_EQ(ValidateLayout(bad),
            absl::InvalidArgumentError("InitJob: job j shard_index 2 not in [0, 2)"));
  bad = r;
  bad.set_num_workers(0);
  EXPECT_EQ(ValidateLayout(bad),
            absl::InvalidArgumentError("InitJob: job j num_workers must be > 0"));
  bad = r;
  bad.mutable_durability()->set_mode("sometimes");
  EXPECT_EQ(ValidateLayout(bad),
            absl::InvalidArgumentError(
                "unknown durability mode \"sometimes\" (known: every_update, none, periodic)"));
}

// InitJob's job name follows the name rule (common/job_name.h): the name becomes RocksDB key
// parts and log values.
TEST(JobStateLayoutTest, JobNamesFollowTheNameRule) {
  for (const std::string& name :
       std::vector<std::string>{"..", ".", "/", "a/../../b", std::string(64, 'j'),
                                std::string(300, 'j'), "Job", "my_job", "my.job", "-job", "job-",
                                "j\xc3\xb6"
                                "b",
                                "\xef\xbd\x8a\xef\xbd\x8f", std::string("j\0b", 3)}) {
    InitJobRequest r = Layout();
    r.set_job(name);
    EXPECT_STATUS_MSG(ValidateLayout(r), absl::StatusCode::kInvalidArgument, "is not a valid name")
        << name;
  }
  InitJobRequest r = Layout();
  r.set_job(std::string(63, 'j'));
  EXPECT_OK(ValidateLayout(r));
}

TEST(JobStateLayoutTest, NormalizedLayoutFillsDefaultsAndDropsInitialValues) {
  InitJobRequest r;
  r.set_job("j");
  r.add_initial()->set_tensor(1);
  const InitJobRequest n = NormalizedLayout(r);
  EXPECT_EQ(n.initial_size(), 0);
  EXPECT_EQ(n.consistency(), "async");
  EXPECT_EQ(n.barrier_timeout_s(), 120);
  EXPECT_EQ(n.durability().mode(), "none");
  EXPECT_EQ(n.durability().snapshot_every_updates(), 1000);
  ASSERT_OK_AND_ASSIGN(Durability d, ParseDurability(n.durability()));
  EXPECT_EQ(d, Durability::kNone);
}

TEST(JobStateTest, OwnsItsPartitionChunks) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<JobState> job, Make(Layout(0)));
  const Partition& p = job->partition();
  EXPECT_EQ(job->owned_indices(), p.shard_chunks(0));
  EXPECT_EQ(job->chunks().size(), p.shard_chunks(0).size());
  EXPECT_EQ(job->owned_elements(), p.shard_elements(0));
  EXPECT_EQ(job->owned_elements() + p.shard_elements(1), 22);
  EXPECT_EQ(job->durability(), Durability::kNone);
  EXPECT_FALSE(job->sync_mode());
  EXPECT_EQ(job->policy().mode(), "async");
  for (int64_t idx : job->owned_indices()) {
    Chunk* c = job->chunk(idx);
    absl::MutexLock lock(&c->mu);
    EXPECT_EQ(c->version, 0);
    EXPECT_TRUE(c->values.empty());
    EXPECT_TRUE(c->slots.empty());  // Plain SGD has no slots.
  }
}

TEST(JobStateTest, CreateErrors) {
  InitJobRequest l = Layout();
  l.mutable_optimizer()->set_name("lion");
  absl::StatusOr<std::unique_ptr<JobState>> job = Make(l);
  EXPECT_STATUS_MSG(job, absl::StatusCode::kInvalidArgument, "InitJob: job j");
  EXPECT_STATUS_MSG(job, absl::StatusCode::kInvalidArgument, "lion");

  l = Layout(0, "sync");
  l.set_staleness_damping(true);
  EXPECT_EQ(Make(l).status(),
            absl::InvalidArgumentError("InitJob: job j asks for staleness_damping, which applies "
                                       "to async mode only (mode is sync)"));

  l = Layout();
  l.mutable_durability()->set_mode("periodic");
  EXPECT_EQ(Make(l).status(), absl::FailedPreconditionError(
                                  "InitJob: job j asks for durability periodic but this shard "
                                  "has no data directory (start it with --data_dir)"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<JobState> durable, Make(l, /*have_store=*/true));
  EXPECT_EQ(durable->durability(), Durability::kPeriodic);
}

TEST(JobStateTest, NamesWorkersAndOwnership) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<JobState> job, Make(Layout(0)));
  EXPECT_EQ(job->ChunkName(1, 2), "job j tensor 1 (b) chunk 2");
  EXPECT_EQ(job->ChunkName(5, 0), "job j tensor 5 (#5) chunk 0");
  EXPECT_OK(job->CheckWorker("Push", 2));
  EXPECT_EQ(job->CheckWorker("Pull", 3),
            absl::InvalidArgumentError("Pull: job j worker 3 not in [0, 3)"));
  EXPECT_EQ(job->CheckWorker("Finish", -1),
            absl::InvalidArgumentError("Finish: job j worker -1 not in [0, 3)"));

  const Partition& p = job->partition();
  const ChunkInfo& mine = p.chunks()[p.shard_chunks(0)[0]];
  ASSERT_OK_AND_ASSIGN(auto owned, job->OwnedChunk("Push", mine.tensor, mine.chunk));
  EXPECT_EQ(owned.first, p.shard_chunks(0)[0]);
  EXPECT_EQ(owned.second, job->chunk(owned.first));
  const ChunkInfo& theirs = p.chunks()[p.shard_chunks(1)[0]];
  EXPECT_EQ(job->OwnedChunk("Push", theirs.tensor, theirs.chunk).status(),
            absl::FailedPreconditionError(
                absl::StrCat("Push: ", job->ChunkName(theirs.tensor, theirs.chunk),
                             " belongs to shard 1, not shard 0")));
  EXPECT_EQ(job->OwnedChunk("Pull", 0, 3).status(),
            absl::NotFoundError("Pull: job j tensor 0 (a) chunk 3 does not exist"));
}

TEST(JobStateTest, ApplyToChunksRunsTheOptimizerAndReportsStaleness) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<JobState> job, Make(Layout(0)));
  const std::vector<int64_t>& owned = job->owned_indices();
  ASSERT_GE(owned.size(), 2u);
  for (int64_t idx : owned) {
    Chunk* c = job->chunk(idx);
    absl::MutexLock lock(&c->mu);
    c->values.assign(c->info.numel, 10.0f);
  }
  const int64_t n0 = job->chunk(owned[0])->info.numel;
  const int64_t n1 = job->chunk(owned[1])->info.numel;
  std::vector<float> g0(n0, 2.0f), g1(n1, -4.0f);
  ChunkUpdate u;
  u.chunks = {owned[0], owned[1]};
  u.numels = {n0, n1};
  u.grads = {g0.data(), g1.data()};
  u.base_versions = {0, 0};
  EXPECT_EQ(job->ApplyToChunks(u), (std::vector<int64_t>{0, 0}));
  u.base_versions = {0, 1};
  u.lr_scale = 0.5f;
  EXPECT_EQ(job->ApplyToChunks(u), (std::vector<int64_t>{1, 0}));
  Chunk* c0 = job->chunk(owned[0]);
  Chunk* c1 = job->chunk(owned[1]);
  absl::MutexLock l0(&c0->mu);
  absl::MutexLock l1(&c1->mu);
  EXPECT_EQ(c0->version, 2);
  EXPECT_EQ(c1->version, 2);
  // 10 - 0.5 * 2 - 0.25 * 2 and 10 + 0.5 * 4 + 0.25 * 4.
  EXPECT_EQ(c0->values, std::vector<float>(n0, 8.5f));
  EXPECT_EQ(c1->values, std::vector<float>(n1, 13.0f));
}

TEST(JobStateTest, StalenessDampingDividesTheRate) {
  InitJobRequest l = Layout(0);
  l.set_staleness_damping(true);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<JobState> job, Make(l));
  const int64_t idx = job->owned_indices()[0];
  Chunk* c = job->chunk(idx);
  const int64_t n = c->info.numel;
  {
    absl::MutexLock lock(&c->mu);
    c->values.assign(n, 0.0f);
    c->version = 3;
  }
  std::vector<float> g(n, 1.0f);
  ChunkUpdate u;
  u.chunks = {idx};
  u.numels = {n};
  u.grads = {g.data()};
  u.base_versions = {0};
  EXPECT_EQ(job->ApplyToChunks(u), (std::vector<int64_t>{3}));
  absl::MutexLock lock(&c->mu);
  EXPECT_EQ(c->values, std::vector<float>(n, -0.125f));  // -0.5 / (1 + 3).
}

TEST(JobStateTest, SyncGroup) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<JobState> async_job, Make(Layout(0)));
  EXPECT_EQ(async_job->SetSyncGroup({0}, 1.0, nullptr),
            absl::FailedPreconditionError("SetSyncGroup: job j has consistency mode async; only "
                                          "sync jobs have a barrier group"));
  EXPECT_EQ(async_job->CountedWorkers(), (std::vector<bool>{true, true, true}));
  EXPECT_TRUE(async_job->SyncGroup().first.empty());

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<JobState> job, Make(Layout(0, "sync")));
  EXPECT_TRUE(job->sync_mode());
  EXPECT_EQ(job->SyncGroup().first, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(job->SyncGroup().second, 1.0f);
  EXPECT_EQ(job->SetSyncGroup({0}, 0.0, nullptr),
            absl::InvalidArgumentError("SetSyncGroup: job j: lr_scale 0 not in (0, 1]"));
  EXPECT_STATUS_MSG(job->SetSyncGroup({0, 3}, 1.0, nullptr), absl::StatusCode::kInvalidArgument,
                    "SetSyncGroup");
  EXPECT_EQ(job->SyncGroup().first, (std::vector<int32_t>{0, 1, 2}));
  ASSERT_OK(job->SetSyncGroup({2, 0}, 0.5, nullptr));
  EXPECT_EQ(job->SyncGroup().first, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(job->SyncGroup().second, 0.5f);
  EXPECT_EQ(job->CountedWorkers(), (std::vector<bool>{true, false, true}));
  ASSERT_OK(job->SetSyncGroup({}, 1.0, nullptr));  // Empty: every rank.
  EXPECT_EQ(job->SyncGroup().first, (std::vector<int32_t>{0, 1, 2}));
}

TEST(JobStateLayoutTest, NormalizedLayoutSpellsFloat32AsUnsetAndKeepsBufferFlags) {
  InitJobRequest r = Layout();
  r.mutable_tensors(0)->set_dtype(FLOAT32);
  r.mutable_tensors(1)->set_buffer(true);
  r.mutable_tensors(1)->set_dtype(INT64);
  const InitJobRequest n = NormalizedLayout(r);
  EXPECT_EQ(n.tensors(0).dtype(), DTYPE_UNSPECIFIED);
  EXPECT_FALSE(n.tensors(0).buffer());
  EXPECT_EQ(n.tensors(1).dtype(), INT64);
  EXPECT_TRUE(n.tensors(1).buffer());
  r.mutable_tensors(1)->set_dtype(FLOAT32);
  EXPECT_EQ(NormalizedLayout(r).tensors(1).dtype(), DTYPE_UNSPECIFIED);
}

TEST(JobStateTest, BufferChunksTakePlainDeltasAndHaveNoSlots) {
  // Tensor b is a buffer; adam with a warmup schedule, lr_scale and damping would all change
  // a parameter's step, none of them a buffer's delta.
  InitJobRequest l = Layout(0);
  l.mutable_tensors(1)->set_buffer(true);
  l.mutable_optimizer()->set_name("adam");
  l.mutable_optimizer()->set_lr_schedule("cosine");
  l.mutable_optimizer()->set_warmup_updates(10);
  l.mutable_optimizer()->set_decay_updates(100);
  l.set_staleness_damping(true);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<JobState> job, Make(l));
  EXPECT_FALSE(job->is_buffer(0));
  EXPECT_TRUE(job->is_buffer(1));
  int64_t param_idx = -1, buffer_idx = -1;
  for (int64_t idx : job->owned_indices()) {
    Chunk* c = job->chunk(idx);
    absl::MutexLock lock(&c->mu);
    c->values.assign(c->info.numel, 10.0f);
    c->version = 3;
    if (c->info.tensor == 1) {
      EXPECT_TRUE(c->slots.empty()) << "chunk " << idx;
      buffer_idx = idx;
    } else {
      EXPECT_EQ(c->slots.size(), static_cast<size_t>(2 * c->info.numel)) << "chunk " << idx;
      param_idx = idx;
    }
  }
  ASSERT_GE(param_idx, 0);
  ASSERT_GE(buffer_idx, 0);
  const int64_t np = job->chunk(param_idx)->info.numel;
  const int64_t nb = job->chunk(buffer_idx)->info.numel;
  std::vector<float> gp(np, 1.0f), gb(nb);
  for (int64_t e = 0; e < nb; ++e) gb[e] = 0.375f * static_cast<float>(e) - 1.0f;
  ChunkUpdate u;
  u.chunks = {param_idx, buffer_idx};
  u.numels = {np, nb};
  u.grads = {gp.data(), gb.data()};
  u.base_versions = {1, 0};
  u.lr_scale = 0.25f;
  EXPECT_EQ(job->ApplyToChunks(u), (std::vector<int64_t>{2, 3}));
  Chunk* cb = job->chunk(buffer_idx);
  Chunk* cp = job->chunk(param_idx);
  absl::MutexLock lb(&cb->mu);
  absl::MutexLock lp(&cp->mu);
  EXPECT_EQ(cb->version, 4);
  EXPECT_EQ(cp->version, 4);
  for (int64_t e = 0; e < nb; ++e) EXPECT_EQ(cb->values[e], 10.0f + gb[e]) << "element " << e;
  EXPECT_NE(cp->values[0], 10.0f);  // The parameter did take an optimizer step.
  EXPECT_NE(cp->values[0], 9.0f);   // ... not a plain subtraction.
}

}  // namespace
}  // namespace gradmesh
