#include "server/init_job_validation.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
const double kNaN = std::nan("");

// Job "j": tensors a[10] and b[3x4], chunks of 4 elements, 2 shards (this is shard 0), adam.
InitJobRequest Valid() {
  InitJobRequest r;
  r.set_job("j");
  TensorSpec* a = r.add_tensors();
  a->set_name("a");
  a->add_shape(10);
  TensorSpec* b = r.add_tensors();
  b->set_name("b");
  b->add_shape(3);
  b->add_shape(4);
  r.set_chunk_elems(4);
  r.set_num_shards(2);
  r.set_shard_index(0);
  r.mutable_optimizer()->set_name("adam");
  r.mutable_optimizer()->set_lr(0.001);
  r.set_num_workers(3);
  return r;
}

absl::Status Validate(const InitJobRequest& r, const ShardLimits& limits = ShardLimits()) {
  return ValidateInitJob(r, limits, OptimizerRegistry::WithBuiltins(),
                         ConsistencyRegistry::WithBuiltins());
}

// Valid() changed by `edit` fails with INVALID_ARGUMENT containing `msg`.
void ExpectInvalid(const std::function<void(InitJobRequest*)>& edit, const std::string& msg,
                   const ShardLimits& limits = ShardLimits()) {
  InitJobRequest r = Valid();
  edit(&r);
  EXPECT_STATUS_MSG(Validate(r, limits), absl::StatusCode::kInvalidArgument, msg);
}

TEST(ValidateInitJobTest, AcceptsAValidRequest) {
  EXPECT_OK(Validate(Valid()));
  InitJobRequest r = Valid();
  r.set_consistency("ssp:3");
  r.mutable_durability()->set_mode("every_update");
  r.set_barrier_timeout_s(kMaxBarrierTimeoutS);
  EXPECT_OK(Validate(r));
}

TEST(ValidateInitJobTest, JobName) {
  ExpectInvalid([](InitJobRequest* r) { r->set_job(""); }, "InitJob: job name is empty");
  ExpectInvalid([](InitJobRequest* r) { r->set_job(".."); }, "is not a valid name");
  ExpectInvalid([](InitJobRequest* r) { r->set_job(std::string(100000, 'x')); },
                "is not a valid name");
}

TEST(ValidateInitJobTest, CountsAgainstTheLimits) {
  ShardLimits l;
  l.max_tensors_per_job = 1;
  ExpectInvalid(
      [](InitJobRequest*) {},
      "InitJob: job j has 2 tensors; this shard accepts at most 1 (--max_tensors_per_job)", l);
  ExpectInvalid(
      [](InitJobRequest* r) { r->set_num_shards(1025); },
      "InitJob: job j num_shards 1025 exceeds this shard's limit 1024 (--max_num_shards)");
  ExpectInvalid([](InitJobRequest* r) { r->set_num_shards(10000000); }, "num_shards 10000000");
  ExpectInvalid(
      [](InitJobRequest* r) { r->set_num_workers(std::numeric_limits<int32_t>::max()); },
      "InitJob: job j num_workers 2147483647 exceeds this shard's limit 4096 (--max_num_workers)");
  ExpectInvalid([](InitJobRequest* r) { r->set_num_workers(0); }, "num_workers must be > 0");
  ExpectInvalid([](InitJobRequest* r) { r->set_num_workers(-5); }, "num_workers must be > 0");
  ExpectInvalid([](InitJobRequest* r) { r->set_num_shards(0); }, "shard_index 0 not in [0, 0)");
  ExpectInvalid([](InitJobRequest* r) { r->set_shard_index(2); }, "shard_index 2 not in [0, 2)");
  ExpectInvalid([](InitJobRequest* r) { r->set_shard_index(-1); }, "shard_index -1 not in [0, 2)");
  ExpectInvalid([](InitJobRequest* r) { r->mutable_tensors(0)->set_name(std::string(1025, 'n')); },
                "InitJob: job j tensors[0].name has 1025 bytes; at most 1024");
  ExpectInvalid(
      [](InitJobRequest* r) {
        for (int i = 0; i < 65; ++i) r->mutable_tensors(1)->add_shape(1);
      },
      "tensors[1] (b) has 67 dimensions; at most 64");
  l = ShardLimits();
  l.max_chunks_per_job = 2;
  ExpectInvalid(
      [](InitJobRequest* r) {
        for (int i = 0; i < 3; ++i) r->add_initial();
      },
      "carries 3 initial chunks; a job has at most 2 chunks (--max_chunks_per_job)", l);
}

TEST(ValidateInitJobTest, TensorShapes) {
  ExpectInvalid([](InitJobRequest* r) { r->clear_tensors(); }, "InitJob: job j has no tensors");
  ExpectInvalid([](InitJobRequest* r) { r->mutable_tensors(1)->set_name("a"); }, "repeated name");
  ExpectInvalid([](InitJobRequest* r) { r->mutable_tensors(1)->set_name(""); },
                "empty or repeated");
  ExpectInvalid([](InitJobRequest* r) { r->mutable_tensors(1)->set_shape(0, -3); },
                "InitJob: job j tensor b has a negative dimension");
  // adam, shape [2^38]: over the per-tensor limit (2^34).
  ExpectInvalid([](InitJobRequest* r) { r->mutable_tensors(0)->set_shape(0, int64_t{1} << 38); },
                "InitJob: job j tensors[0] (a) has more than 17179869184 elements "
                "(--max_elements_per_tensor)");
  // A product that overflows int64 is caught before it is formed.
  ExpectInvalid(
      [](InitJobRequest* r) {
        r->mutable_tensors(0)->set_shape(0, int64_t{1} << 32);
        r->mutable_tensors(0)->add_shape(int64_t{1} << 32);
        r->mutable_tensors(0)->add_shape(int64_t{1} << 32);
      },
      "has more than");
  ExpectInvalid(
      [](InitJobRequest* r) {
        r->mutable_tensors(0)->set_shape(0, std::numeric_limits<int64_t>::max());
      },
      "has more than");
  // A zero dimension is an empty tensor (no chunks), whatever follows it.
  InitJobRequest r = Valid();
  r.mutable_tensors(0)->set_shape(0, 0);
  r.mutable_tensors(0)->add_shape(std::numeric_limits<int64_t>::max());
  EXPECT_OK(Validate(r));
}

TEST(ValidateInitJobTest, ChunksPerJob) {
  ExpectInvalid([](InitJobRequest* r) { r->set_chunk_elems(0); },
                "InitJob: job j chunk_elems must be > 0 and at most 268435456 (1 GiB of float32), "
                "got 0");
  ExpectInvalid([](InitJobRequest* r) { r->set_chunk_elems((int64_t{1} << 28) + 1); },
                "chunk_elems must be > 0 and at most 268435456");
  ExpectInvalid([](InitJobRequest* r) { r->set_chunk_elems(-4); }, "chunk_elems must be > 0");
  // 2^34 elements in chunks of 1: 2^34 chunks.
  ExpectInvalid(
      [](InitJobRequest* r) {
        r->mutable_tensors(0)->set_shape(0, int64_t{1} << 34);
        r->set_chunk_elems(1);
      },
      "InitJob: job j needs more than 262144 chunks of chunk_elems 1 (--max_chunks_per_job); "
      "raise chunk_elems");
  ShardLimits l;
  l.max_chunks_per_job = 6;  // a: 3 chunks, b: 3 chunks.
  InitJobRequest r = Valid();
  EXPECT_OK(Validate(r, l));
  l.max_chunks_per_job = 5;
  EXPECT_STATUS_MSG(Validate(r, l), absl::StatusCode::kInvalidArgument, "more than 5 chunks");
}

TEST(ValidateInitJobTest, LearningRateMustBeAFiniteNormalFloat32) {
  for (double lr : {0.0, -0.1, kNaN, kInf, -kInf, 1e39, 1e-50, 1e-39}) {
    SCOPED_TRACE(lr);
    ExpectInvalid([lr](InitJobRequest* r) { r->mutable_optimizer()->set_lr(lr); },
                  "InitJob: job j optimizer.lr ");
  }
  InitJobRequest r = Valid();
  r.mutable_optimizer()->set_lr(1e38);  // Finite as float32.
  EXPECT_OK(Validate(r));
  r.mutable_optimizer()->set_lr(1e39);
  EXPECT_EQ(Validate(r), absl::InvalidArgumentError(
                             "InitJob: job j optimizer.lr 1e+39 is not a finite float32 > 0 "
                             "(normal, >= 1.2e-38)"));
}

TEST(ValidateInitJobTest, EveryHyperParameterFiniteAndInRangeAsFloat32) {
  struct Case {
    const char* field;
    std::function<void(OptimizerSpec*, double)> set;
    std::vector<double> bad;
  };
  const std::vector<Case> cases = {
      {"momentum",
       [](OptimizerSpec* s, double v) { s->set_momentum(v); },
       {kNaN, kInf, -0.1, 1.0, 1 - 1e-12}},  // 1 - 1e-12 rounds to 1.0f.
      {"dampening", [](OptimizerSpec* s, double v) { s->set_dampening(v); }, {kNaN, -1, 1.5}},
      {"weight_decay",
       [](OptimizerSpec* s, double v) { s->set_weight_decay(v); },
       {kNaN, -kInf, -1e-3, 1e9, 1e300}},
      {"beta1", [](OptimizerSpec* s, double v) { s->set_beta1(v); }, {kNaN, 1.0, -0.5}},
      {"beta2", [](OptimizerSpec* s, double v) { s->set_beta2(v); }, {kNaN, 1 - 1e-10, 2}},
      {"eps", [](OptimizerSpec* s, double v) { s->set_eps(v); }, {kNaN, -1e-8, 1, 1e-50, 1e-40}},
      {"min_lr_fraction",
       [](OptimizerSpec* s, double v) { s->set_min_lr_fraction(v); },
       {kNaN, -0.1, 1.01}},
  };
  for (const Case& c : cases) {
    for (double v : c.bad) {
      SCOPED_TRACE(absl::StrCat(c.field, " = ", v));
      // Checked whichever optimizer the job uses (sgd ignores beta1, but NaN is still refused).
      for (const char* name : {"sgd", "adam"}) {
        ExpectInvalid(
            [&c, v, name](InitJobRequest* r) {
              r->mutable_optimizer()->set_name(name);
              c.set(r->mutable_optimizer(), v);
            },
            absl::StrCat("InitJob: job j optimizer.", c.field, " "));
      }
    }
  }
  ExpectInvalid([](InitJobRequest* r) { r->mutable_optimizer()->set_decay_updates(-1); },
                "InitJob: job j optimizer.decay_updates -1 must be >= 0");
  ExpectInvalid([](InitJobRequest* r) { r->mutable_optimizer()->set_warmup_updates(-1); },
                "InitJob: job j optimizer.warmup_updates -1 must be >= 0");
}

TEST(ValidateInitJobTest, OptimizerNameAndConsistency) {
  ExpectInvalid([](InitJobRequest* r) { r->mutable_optimizer()->set_name("rmsprop"); },
                "unknown optimizer \"rmsprop\" (known: adam, adamw, sgd)");
  ExpectInvalid([](InitJobRequest* r) { r->mutable_optimizer()->set_name(""); },
                "unknown optimizer");
  ExpectInvalid([](InitJobRequest* r) { r->mutable_optimizer()->set_lr_schedule("step"); },
                "unknown optimizer.lr_schedule \"step\"");
  ExpectInvalid([](InitJobRequest* r) { r->mutable_optimizer()->set_lr_schedule("cosine"); },
                "optimizer.decay_updates must be > 0 for the cosine schedule");
  ExpectInvalid(
      [](InitJobRequest* r) {
        r->mutable_optimizer()->set_name("sgd");
        r->mutable_optimizer()->set_nesterov(true);
      },
      "optimizer.nesterov needs momentum > 0");
  ExpectInvalid([](InitJobRequest* r) { r->set_consistency("eventually"); },
                "unknown consistency mode \"eventually\"");
  ExpectInvalid([](InitJobRequest* r) { r->set_consistency("ssp:-1"); },
                "ssp needs a staleness bound >= 0");
  ExpectInvalid([](InitJobRequest* r) { r->set_consistency("ssp:99999999999999999999"); },
                "ssp needs a staleness bound >= 0");
  ExpectInvalid([](InitJobRequest* r) { r->set_consistency("sync:2"); }, "takes no parameter");
  ExpectInvalid(
      [](InitJobRequest* r) {
        r->set_consistency("sync");
        r->set_staleness_damping(true);
      },
      "InitJob: job j staleness_damping applies to async mode only (mode is sync)");
  ExpectInvalid([](InitJobRequest* r) { r->set_placement(static_cast<Placement>(7)); },
                "InitJob: job j placement 7 is unknown; known: 0 (PLACEMENT_GREEDY), 1 "
                "(PLACEMENT_ORDERED)");
}

TEST(ValidateInitJobTest, OrderedPlacement) {
  InitJobRequest r = Valid();
  r.set_placement(PLACEMENT_ORDERED);
  EXPECT_OK(Validate(r));
  // a[10] = [4,4,2], b[12] = [4,4,4]; middles 2, 6, 9, 12, 16, 20 of 22 (boundary 11): shard
  // 0 holds a's three chunks, shard 1 b's.
  ASSERT_OK_AND_ASSIGN(Partition p, LayoutPartition(r));
  EXPECT_EQ(p.shard_chunks(0), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(p.shard_chunks(1), (std::vector<int64_t>{3, 4, 5}));
  r.set_placement(PLACEMENT_GREEDY);
  ASSERT_OK_AND_ASSIGN(Partition g, LayoutPartition(r));
  EXPECT_NE(g.shard_chunks(0), p.shard_chunks(0));
}

TEST(ValidateInitJobTest, TimeoutsAndDurability) {
  for (double t : {-1.0, kNaN, kInf, kMaxBarrierTimeoutS + 1}) {
    SCOPED_TRACE(t);
    ExpectInvalid([t](InitJobRequest* r) { r->set_barrier_timeout_s(t); },
                  "InitJob: job j barrier_timeout_s must be >= 0 and at most 604800, got ");
  }
  ExpectInvalid(
      [](InitJobRequest* r) { r->mutable_durability()->set_snapshot_every_updates(-1); },
      "InitJob: job j snapshot intervals must be >= 0: durability.snapshot_every_updates is -1");
  for (double t : {-1.0, kNaN, kInf}) {
    ExpectInvalid(
        [t](InitJobRequest* r) { r->mutable_durability()->set_snapshot_every_seconds(t); },
        "durability.snapshot_every_seconds must be in [0, 1e9], got ");
  }
  ExpectInvalid([](InitJobRequest* r) { r->mutable_durability()->set_mode("sometimes"); },
                "unknown durability mode \"sometimes\"");
}

// Valid() with initial values for shard 0's chunks.
InitJobRequest WithInitial(const Partition& p) {
  InitJobRequest r = Valid();
  for (int64_t idx : p.shard_chunks(0)) {
    const ChunkInfo& c = p.chunks()[idx];
    std::vector<float> v(c.numel, 1.5f);
    ChunkData* d = r.add_initial();
    d->set_tensor(c.tensor);
    d->set_chunk(c.chunk);
    d->set_data(std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)));
  }
  return r;
}

TEST(CheckInitialValuesTest, ExactlyTheOwnedChunksEachOnceAllFinite) {
  ASSERT_OK_AND_ASSIGN(const Partition p, LayoutPartition(Valid()));
  const InitJobRequest good = WithInitial(p);
  ASSERT_EQ(good.initial_size(), 3);
  EXPECT_OK(CheckInitialValues(good, p));

  InitJobRequest r = good;
  r.mutable_initial()->RemoveLast();
  EXPECT_EQ(CheckInitialValues(r, p),
            absl::InvalidArgumentError("InitJob: job j shard 0 owns 3 chunks but the request "
                                       "carries initial values for 2"));
  r = good;
  r.mutable_initial(1)->set_chunk(99);
  EXPECT_EQ(CheckInitialValues(r, p),
            absl::InvalidArgumentError(absl::StrCat("InitJob: job j tensor ", r.initial(1).tensor(),
                                                    " (", r.initial(1).tensor() == 0 ? "a" : "b",
                                                    ") chunk 99 does not exist")));
  r = good;
  const ChunkInfo& other = p.chunks()[p.shard_chunks(1)[0]];
  r.mutable_initial(0)->set_tensor(other.tensor);
  r.mutable_initial(0)->set_chunk(other.chunk);
  EXPECT_STATUS_MSG(CheckInitialValues(r, p), absl::StatusCode::kInvalidArgument,
                    "is not owned by shard 0");
  r = good;
  *r.mutable_initial(1) = r.initial(0);
  EXPECT_STATUS_MSG(CheckInitialValues(r, p), absl::StatusCode::kInvalidArgument, "appears twice");
  r = good;
  r.mutable_initial(2)->mutable_data()->append("xxxx");
  EXPECT_STATUS_MSG(CheckInitialValues(r, p), absl::StatusCode::kInvalidArgument, "float32 values");
  r = good;
  const float nan = std::nanf("");
  std::memcpy(&(*r.mutable_initial(0)->mutable_data())[4], &nan, sizeof(float));
  EXPECT_STATUS_MSG(CheckInitialValues(r, p), absl::StatusCode::kInvalidArgument,
                    "element 1 is not finite");
  r = good;
  r.mutable_initial(0)->set_dtype(FLOAT16);
  EXPECT_STATUS_MSG(CheckInitialValues(r, p), absl::StatusCode::kInvalidArgument, "FLOAT16");

  // A buffer may start with infinities (a causal mask of -inf), never NaN; a parameter may not.
  const float inf = std::numeric_limits<float>::infinity();
  const float minus_inf = -inf;
  r = good;
  std::memcpy(&(*r.mutable_initial(0)->mutable_data())[4], &minus_inf, sizeof(float));
  const int32_t t = r.initial(0).tensor();
  EXPECT_STATUS_MSG(CheckInitialValues(r, p), absl::StatusCode::kInvalidArgument,
                    "element 1 is not finite (-inf)");
  r.mutable_tensors(t)->set_buffer(true);
  EXPECT_OK(CheckInitialValues(r, p));
  std::memcpy(&(*r.mutable_initial(0)->mutable_data())[0], &inf, sizeof(float));
  EXPECT_OK(CheckInitialValues(r, p));
  std::memcpy(&(*r.mutable_initial(0)->mutable_data())[8], &nan, sizeof(float));
  EXPECT_STATUS_MSG(CheckInitialValues(r, p), absl::StatusCode::kInvalidArgument,
                    "element 2 is not finite (nan)");
}

TEST(EstimateJobMemoryTest, CountsEveryPart) {
  InitJobRequest r = Valid();
  ASSERT_OK_AND_ASSIGN(const Partition p, LayoutPartition(r));
  const int64_t owned = p.shard_elements(0);
  ASSERT_EQ(owned, 12);
  JobMemory m = EstimateJobMemory(r, p, /*num_slots=*/2, /*dedupe_window=*/100);
  EXPECT_EQ(m.values, 48);
  EXPECT_EQ(m.slots, 96);
  EXPECT_EQ(m.barrier, 0);
  EXPECT_EQ(m.snapshot, 0);
  EXPECT_EQ(m.ledger, 3 * (100 * 48 + 256));
  EXPECT_GT(m.bookkeeping, 6 * 64);
  EXPECT_EQ(m.total(), m.values + m.slots + m.ledger + m.bookkeeping);
  r.set_consistency("sync");
  r.mutable_durability()->set_mode("periodic");
  m = EstimateJobMemory(r, p, 2, 100);
  EXPECT_EQ(m.barrier, 3 * 48);
  EXPECT_EQ(m.snapshot, 48 + 96);
  EXPECT_EQ(m.Describe("adam").substr(0, 57),
            "values 48 B, adam slots 96 B, sync barrier copies 144 B, ");
}

TEST(EstimateJobMemoryTest, SaturatesInsteadOfOverflowing) {
  // A large job within the default limits (one tensor of 2^34 elements in 64 chunks, 4096
  // workers, sync): the estimate is huge but never negative.
  InitJobRequest r = Valid();
  r.clear_tensors();
  TensorSpec* t = r.add_tensors();
  t->set_name("w");
  t->add_shape(int64_t{1} << 34);
  r.set_chunk_elems(int64_t{1} << 28);
  r.set_num_shards(1);
  r.set_num_workers(4096);
  r.set_consistency("sync");
  ASSERT_OK(Validate(r));
  ASSERT_OK_AND_ASSIGN(const Partition p, LayoutPartition(r));
  const JobMemory m = EstimateJobMemory(r, p, 2, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(m.ledger, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(m.total(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(m.barrier, (int64_t{1} << 36) * 4096);
  EXPECT_EQ(m.values, int64_t{1} << 36);
}

TEST(ValidateInitJobTest, TensorDTypes) {
  // Parameters: a floating type (trained as float32, written back in it). Buffers: any element
  // type torch.save writes.
  InitJobRequest r = Valid();
  for (DType d : {DTYPE_UNSPECIFIED, FLOAT32, FLOAT64, FLOAT16, BFLOAT16}) {
    r.mutable_tensors(0)->set_dtype(d);
    EXPECT_OK(Validate(r)) << DType_Name(d);
  }
  r.mutable_tensors(1)->set_buffer(true);
  for (DType d : {DTYPE_UNSPECIFIED, FLOAT32, FLOAT64, FLOAT16, BFLOAT16, INT64, INT32, INT16, INT8,
                  UINT8, BOOL}) {
    r.mutable_tensors(1)->set_dtype(d);
    EXPECT_OK(Validate(r)) << DType_Name(d);
  }
  for (DType d : {INT64, INT32, INT16, INT8, UINT8, BOOL}) {
    ExpectInvalid(
        [d](InitJobRequest* r) { r->mutable_tensors(1)->set_dtype(d); },
        absl::StrCat("InitJob: job j tensors[1] (b) is a parameter of dtype ", DType_Name(d),
                     "; parameters must be floating-point (FLOAT32, FLOAT64, FLOAT16, BFLOAT16; "
                     "only buffers may have other element types)"));
  }
  ExpectInvalid(
      [](InitJobRequest* r) {
        r->mutable_tensors(1)->set_buffer(true);
        r->mutable_tensors(1)->set_dtype(static_cast<DType>(11));
      },
      "InitJob: job j tensors[1] (b) has unknown dtype 11");
  ExpectInvalid([](InitJobRequest* r) { r->mutable_tensors(0)->set_dtype(static_cast<DType>(-1)); },
                "InitJob: job j tensors[0] (a) has unknown dtype -1");
}

TEST(EstimateJobMemoryTest, BufferElementsHaveNoSlots) {
  // Shard 0 owns a's chunks 0 and 2 (8 elements) and b's chunk 1 (4): b as a buffer has no
  // adam slots.
  InitJobRequest r = Valid();
  r.mutable_tensors(1)->set_buffer(true);
  ASSERT_OK_AND_ASSIGN(const Partition p, LayoutPartition(r));
  int64_t buffer_owned = 0;
  for (int64_t idx : p.shard_chunks(0)) {
    if (p.chunks()[idx].tensor == 1) buffer_owned += p.chunks()[idx].numel;
  }
  ASSERT_GT(buffer_owned, 0);
  const JobMemory m = EstimateJobMemory(r, p, /*num_slots=*/2, /*dedupe_window=*/100);
  EXPECT_EQ(m.values, 48);
  EXPECT_EQ(m.slots, 2 * 4 * (12 - buffer_owned));
}

}  // namespace
}  // namespace gradmesh
