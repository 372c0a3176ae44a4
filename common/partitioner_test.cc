#include "common/partitioner.h"

#include <algorithm>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

// Every element of every tensor is owned by exactly one chunk of exactly one shard, and the
// shards' loads differ by at most one chunk (greedy), or each is within one chunk of its 1/S
// of the model, in contiguous ranges whose shard never decreases along the model (ordered).
void CheckInvariants(const std::vector<int64_t>& numels, int64_t chunk, int32_t shards,
                     ChunkPlacement placement = ChunkPlacement::kGreedy) {
  ASSERT_OK_AND_ASSIGN(Partition p, Partition::Create(numels, chunk, shards, placement));
  std::vector<std::vector<int>> owner(numels.size());
  for (size_t t = 0; t < numels.size(); ++t) owner[t].assign(numels[t], 0);
  int64_t covered = 0;
  for (int32_t s = 0; s < shards; ++s) {
    int64_t load = 0;
    for (int64_t idx : p.shard_chunks(s)) {
      const ChunkInfo& c = p.chunks()[idx];
      EXPECT_EQ(c.shard, s);
      EXPECT_GT(c.numel, 0);
      EXPECT_LE(c.numel, chunk);
      for (int64_t i = c.offset; i < c.offset + c.numel; ++i) ++owner[c.tensor][i];
      load += c.numel;
      covered += c.numel;
    }
    EXPECT_EQ(load, p.shard_elements(s));
  }
  for (size_t t = 0; t < numels.size(); ++t) {
    for (int64_t i = 0; i < numels[t]; ++i)
      ASSERT_EQ(owner[t][i], 1) << "tensor " << t << " elem " << i;
  }
  int64_t total = 0;
  for (int64_t n : numels) total += n;
  EXPECT_EQ(covered, total);
  int64_t lo = p.shard_elements(0), hi = p.shard_elements(0);
  for (int32_t s = 1; s < shards; ++s) {
    lo = std::min(lo, p.shard_elements(s));
    hi = std::max(hi, p.shard_elements(s));
  }
  if (placement == ChunkPlacement::kGreedy) {
    EXPECT_LE(hi - lo, chunk) << "shards unbalanced by more than one chunk";
    return;
  }
  for (int32_t s = 0; s < shards; ++s) {
    EXPECT_LE(std::abs(p.shard_elements(s) * shards - total), chunk * shards)
        << "shard " << s << " holds " << p.shard_elements(s) << " of " << total;
  }
  for (size_t i = 1; i < p.chunks().size(); ++i) {
    EXPECT_GE(p.chunks()[i].shard, p.chunks()[i - 1].shard) << "chunk " << i;
  }
}

TEST(PartitionerTest, MlpLayoutOnTwoShards) {
  // MLP 784-256-256-10 weights and biases, 64 Ki-element chunks.
  CheckInvariants({200704, 256, 65536, 256, 2560, 10}, 65536, 2);
}

TEST(PartitionerTest, AutoChunkElemsBalancesSmallJobs) {
  const std::vector<int64_t> mlp = {200704, 256, 65536, 256, 2560, 10};  // 269,322 elements.
  // One shard: 1 MiB, as before auto existed.
  EXPECT_EQ(AutoChunkElems(mlp, 1), 262144);
  // 2 shards: ceil(269322 / 16) = 16833, rounded up to 17 x 1024.
  EXPECT_EQ(AutoChunkElems(mlp, 2), 17408);
  EXPECT_EQ(AutoChunkElems(mlp, 4), kMinAutoChunkElems);  // 8417 -> the 64 KiB floor.
  EXPECT_EQ(AutoChunkElems({10}, 2), kMinAutoChunkElems);
  EXPECT_EQ(AutoChunkElems({}, 3), kMinAutoChunkElems);
  EXPECT_EQ(AutoChunkElems({int64_t{100} << 20}, 4), kMaxAutoChunkElems);  // 400 MB: 1 MiB.
  // The MLP on 2 shards: 1 MiB chunks leave it 200,704 / 68,618; auto chunks balance it.
  ASSERT_OK_AND_ASSIGN(Partition fixed, Partition::Create(mlp, 262144, 2));
  EXPECT_EQ(fixed.shard_elements(0), 200704);
  EXPECT_EQ(fixed.shard_elements(1), 68618);
  ASSERT_OK_AND_ASSIGN(Partition balanced, Partition::Create(mlp, AutoChunkElems(mlp, 2), 2));
  EXPECT_EQ(balanced.shard_elements(0), 135168);
  EXPECT_EQ(balanced.shard_elements(1), 134154);
  ASSERT_OK_AND_ASSIGN(Partition four, Partition::Create(mlp, AutoChunkElems(mlp, 4), 4));
  EXPECT_EQ(four.shard_elements(0), 69632);
  EXPECT_EQ(four.shard_elements(3), 65792);
  CheckInvariants(mlp, AutoChunkElems(mlp, 3), 3);
}

// The invariants on 50 random layouts (up to 8 tensors, chunk sizes, up to 5 shards).
void CheckRandomLayouts(uint32_t seed, ChunkPlacement placement) {
  std::mt19937 rng(seed);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> numels(1 + rng() % 8);
    for (auto& n : numels) n = rng() % 5000;
    CheckInvariants(numels, 1 + rng() % 700, 1 + rng() % 5, placement);
  }
}

TEST(PartitionerTest, RandomLayouts) { CheckRandomLayouts(7, ChunkPlacement::kGreedy); }

TEST(PartitionerTest, ExactPlacement) {
  // Chunks of 4: t0 = [4,4,2], t1 = [3]. Largest first: (0,0)->s0, (0,1)->s1, (1,0)->s0? No:
  // after (0,0) s0=4, (0,1) s1=4, then (1,0) size 3 -> s0 (tie, lowest), then (0,2) -> s1.
  ASSERT_OK_AND_ASSIGN(Partition p, Partition::Create({10, 3}, 4, 2));
  ASSERT_EQ(p.chunks().size(), 4u);
  EXPECT_EQ(p.num_chunks(0), 3);
  EXPECT_EQ(p.num_chunks(1), 1);
  EXPECT_EQ(p.chunks()[p.Find(0, 0)].shard, 0);
  EXPECT_EQ(p.chunks()[p.Find(0, 1)].shard, 1);
  EXPECT_EQ(p.chunks()[p.Find(1, 0)].shard, 0);
  EXPECT_EQ(p.chunks()[p.Find(0, 2)].shard, 1);
  EXPECT_EQ(p.chunks()[p.Find(0, 2)].offset, 8);
  EXPECT_EQ(p.chunks()[p.Find(0, 2)].numel, 2);
  EXPECT_EQ(p.shard_elements(0), 7);
  EXPECT_EQ(p.shard_elements(1), 6);
  EXPECT_EQ(p.Find(0, 3), -1);
  EXPECT_EQ(p.Find(2, 0), -1);
  EXPECT_EQ(p.Find(-1, 0), -1);
}

TEST(PartitionerTest, OrderedPlacementIsContiguousAndBalanced) {
  // Chunks of 4 over 13 elements: t0 = [4,4,2] at 0, 4, 8; t1 = [3] at 10. Middles 2, 6, 9,
  // 11.5 of 13 on 2 shards (boundary 6.5): s0, s0, s1, s1.
  ASSERT_OK_AND_ASSIGN(Partition p, Partition::Create({10, 3}, 4, 2, ChunkPlacement::kOrdered));
  EXPECT_EQ(p.chunks()[p.Find(0, 0)].shard, 0);
  EXPECT_EQ(p.chunks()[p.Find(0, 1)].shard, 0);
  EXPECT_EQ(p.chunks()[p.Find(0, 2)].shard, 1);
  EXPECT_EQ(p.chunks()[p.Find(1, 0)].shard, 1);
  EXPECT_EQ(p.shard_elements(0), 8);
  EXPECT_EQ(p.shard_elements(1), 5);
  EXPECT_EQ(p.shard_chunks(1), (std::vector<int64_t>{2, 3}));
  // The MLP with auto chunks on 2 shards: the last shard holds the end of fc1.weight and
  // every later tensor, the first only fc1.weight.
  const std::vector<int64_t> mlp = {200704, 256, 65536, 256, 2560, 10};
  ASSERT_OK_AND_ASSIGN(Partition m,
                       Partition::Create(mlp, AutoChunkElems(mlp, 2), 2, ChunkPlacement::kOrdered));
  for (int64_t idx : m.shard_chunks(0)) EXPECT_EQ(m.chunks()[idx].tensor, 0);
  EXPECT_EQ(m.chunks()[m.Find(5, 0)].shard, 1);
  EXPECT_EQ(m.shard_elements(0), 139264);  // 8 chunks of 17408.
  EXPECT_EQ(m.shard_elements(1), 130058);
  // A chunk larger than a shard's share leaves some shards empty, as greedy placement does.
  ASSERT_OK_AND_ASSIGN(Partition one, Partition::Create({10}, 16, 3, ChunkPlacement::kOrdered));
  EXPECT_EQ(one.chunks()[0].shard, 1);
  CheckInvariants(mlp, AutoChunkElems(mlp, 3), 3, ChunkPlacement::kOrdered);
  CheckRandomLayouts(11, ChunkPlacement::kOrdered);
}

TEST(PartitionerTest, DeterministicAcrossCalls) {
  ASSERT_OK_AND_ASSIGN(Partition a, Partition::Create({1000, 77, 5000, 1}, 128, 3));
  ASSERT_OK_AND_ASSIGN(Partition b, Partition::Create({1000, 77, 5000, 1}, 128, 3));
  ASSERT_EQ(a.chunks().size(), b.chunks().size());
  for (size_t i = 0; i < a.chunks().size(); ++i)
    EXPECT_EQ(a.chunks()[i].shard, b.chunks()[i].shard);
}

TEST(PartitionerTest, RejectsBadArguments) {
  EXPECT_STATUS_MSG(Partition::Create({10}, 0, 2), absl::StatusCode::kInvalidArgument,
                    "chunk_elems");
  EXPECT_STATUS_MSG(Partition::Create({10}, 4, 0), absl::StatusCode::kInvalidArgument,
                    "num_shards");
  EXPECT_STATUS_MSG(Partition::Create({-1}, 4, 1), absl::StatusCode::kInvalidArgument, "negative");
}

TEST(PartitionerTest, EmptyTensorHasNoChunks) {
  ASSERT_OK_AND_ASSIGN(Partition p, Partition::Create({0, 5}, 4, 2));
  EXPECT_EQ(p.num_chunks(0), 0);
  EXPECT_EQ(p.num_chunks(1), 2);
  EXPECT_EQ(p.Find(0, 0), -1);
}

}  // namespace
}  // namespace gradmesh
