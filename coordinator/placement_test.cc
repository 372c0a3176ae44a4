// Tests of the built-in placement strategies (coordinator/placement.h).
#include "coordinator/placement.h"

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

using Names = std::vector<std::string>;

PlacementInput Input(const std::string& mode, int workers, int shards) {
  PlacementInput in;
  in.spec.set_mode(mode);
  in.spec.set_num_workers(workers);
  in.spec.set_num_shards(shards);
  return in;
}

absl::StatusOr<JobPlacement> Place(const std::string& strategy, const PlacementInput& in) {
  auto s = PlacementRegistry::WithBuiltins().Create(strategy);
  if (!s.ok()) return s.status();
  return (*s)->Place(in);
}

TEST(PlacementTest, DefaultsByMode) {
  JobSpec spec;
  for (const char* mode : {"async", "sync", "ssp:2", "gossip"}) {
    spec.set_mode(mode);
    EXPECT_EQ(DefaultPlacementFor(spec), "spread") << mode;
  }
  spec.set_mode("allreduce");
  EXPECT_EQ(DefaultPlacementFor(spec), "pack");
}

TEST(PlacementTest, UnknownStrategyListsKnownOnes) {
  EXPECT_STATUS_MSG(PlacementRegistry::WithBuiltins().Create("random"),
                    absl::StatusCode::kInvalidArgument,
                    "unknown placement strategy \"random\" (known: pack, spread)");
}

TEST(PlacementTest, SpreadPutsShardsOnLeastLoadedServersAndSpreadsRanks) {
  PlacementInput in = Input("async", 4, 2);
  in.servers = {{"s0", "h", 2, 1}, {"s1", "h", 2, 0}, {"s2", "h", 1, 0}};
  in.workers = {{"w0", "a", 4, 0}, {"w1", "b", 2, 0}, {"w2", "c", 2, 2}};
  ASSERT_OK_AND_ASSIGN(JobPlacement p, Place("spread", in));
  // s1 and s2 are empty (s1 has more free slots); s0 is half full.
  EXPECT_EQ(p.shard_nodes, (Names{"s1", "s2"}));
  // w2 is full. w0 (4 slots) and w1 (2 slots) alternate by fraction used:
  // w0 0/4 vs w1 0/2 -> w0 (more free); then w1 (0/2 < 1/4? no: 0 < 1/4) ...
  EXPECT_EQ(p.worker_nodes, (Names{"w0", "w1", "w0", "w0"}));
}

TEST(PlacementTest, PsModeMayPutTwoRanksOfOneJobOnANode) {
  PlacementInput in = Input("sync", 2, 1);
  in.servers = {{"s0", "", 1, 0}};
  in.workers = {{"w0", "", 2, 0}};
  ASSERT_OK_AND_ASSIGN(JobPlacement p, Place("spread", in));
  EXPECT_EQ(p.worker_nodes, (Names{"w0", "w0"}));
}

TEST(PlacementTest, RefusesTooFewWorkerSlotsListingTheOffer) {
  PlacementInput in = Input("async", 3, 1);
  in.servers = {{"s0", "", 1, 0}};
  in.workers = {{"w1", "", 1, 0}, {"w0", "", 2, 1}};
  EXPECT_STATUS_MSG(Place("spread", in), absl::StatusCode::kFailedPrecondition,
                    "job needs 3 workers but the alive worker nodes offer 2 slots (w0: 1, w1: 1); "
                    "start more gradmesh_worker --coordinator=... daemons or lower num_workers");
}

TEST(PlacementTest, RefusesTooFewServers) {
  PlacementInput in = Input("async", 1, 3);
  in.servers = {{"s0", "", 1, 0}, {"s1", "", 1, 1}, {"s2", "", 4, 0}};
  in.workers = {{"w0", "", 1, 0}};
  EXPECT_STATUS_MSG(Place("spread", in), absl::StatusCode::kFailedPrecondition,
                    "job needs 3 shards on distinct server nodes but only 2 alive server nodes "
                    "have a free slot (s0: 1, s1: 0, s2: 4); start more gradmesh_server "
                    "--coordinator=... daemons or lower num_shards");
  in.servers.clear();
  EXPECT_STATUS_MSG(Place("pack", in), absl::StatusCode::kFailedPrecondition,
                    "but only 0 alive server nodes have a free slot (none alive)");
}

TEST(PlacementTest, PeerModesPlaceNoShardsAndOneRankPerNode) {
  PlacementInput in = Input("gossip", 2, 5);
  in.workers = {{"w0", "", 4, 0}, {"w1", "", 4, 3}};
  ASSERT_OK_AND_ASSIGN(JobPlacement p, Place("spread", in));
  EXPECT_TRUE(p.shard_nodes.empty());
  EXPECT_EQ(p.worker_nodes, (Names{"w0", "w1"}));
  in.spec.set_num_workers(3);
  EXPECT_STATUS_MSG(Place("spread", in), absl::StatusCode::kFailedPrecondition,
                    "job needs 3 workers on distinct worker nodes (mode gossip: a node's peer "
                    "address serves one rank per job) but only 2 alive worker nodes have a free "
                    "slot (w0: 4, w1: 1)");
}

TEST(PlacementTest, PackFillsTheFewestHosts) {
  PlacementInput in = Input("allreduce", 3, 0);
  in.workers = {{"a0", "hostA", 1, 0},
                {"b0", "hostB", 1, 0},
                {"b1", "hostB", 1, 0},
                {"b2", "hostB", 1, 0},
                {"c0", "hostC", 1, 1}};
  ASSERT_OK_AND_ASSIGN(JobPlacement p, Place("pack", in));
  EXPECT_EQ(p.worker_nodes, (Names{"b0", "b1", "b2"}));
  in.spec.set_num_workers(4);
  ASSERT_OK_AND_ASSIGN(p, Place("pack", in));
  EXPECT_EQ(p.worker_nodes, (Names{"b0", "b1", "b2", "a0"}));
  // Spread, for contrast, takes least-loaded nodes by name regardless of host.
  ASSERT_OK_AND_ASSIGN(p, Place("spread", in));
  EXPECT_EQ(p.worker_nodes, (Names{"a0", "b0", "b1", "b2"}));
}

TEST(PlacementTest, PackInPsModeFillsNodesToTheirSlots) {
  PlacementInput in = Input("async", 3, 1);
  in.servers = {{"s0", "", 1, 0}};
  in.workers = {{"w0", "h1", 2, 0}, {"w1", "h2", 4, 0}};
  ASSERT_OK_AND_ASSIGN(JobPlacement p, Place("pack", in));
  EXPECT_EQ(p.worker_nodes, (Names{"w1", "w1", "w1"}));
}

TEST(PlacementTest, ReplacementIsLeastLoadedIgnoringSlots) {
  EXPECT_EQ(PickReplacement({}), std::nullopt);
  EXPECT_EQ(PickReplacement({{"w0", "", 1, 3}, {"w1", "", 1, 1}, {"w2", "", 2, 4}}),
            std::optional<std::string>("w1"));
}

}  // namespace
}  // namespace gradmesh
