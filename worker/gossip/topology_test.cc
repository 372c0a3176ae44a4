// Tests of the gossip topologies: exact peer sequences of the exponential graph, the random
// topology's determinism, uniformity and respect of availability, and the registry.
#include "worker/gossip/topology.h"

#include <map>
#include <set>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

const auto kAll = [](int32_t) { return true; };

TEST(TopologyTest, RegistryKnowsBothAndListsThemForUnknownNames) {
  TopologyRegistry r = TopologyRegistry::WithBuiltins();
  EXPECT_EQ(r.names(), (std::vector<std::string>{"exponential", "random"}));
  ASSERT_OK_AND_ASSIGN(auto exp, r.Create("exponential", 1));
  EXPECT_EQ(exp->name(), "exponential");
  EXPECT_EQ(exp->mixing(), MixingKind::kPushSum);
  ASSERT_OK_AND_ASSIGN(auto rnd, r.Create("random", 1));
  EXPECT_EQ(rnd->name(), "random");
  EXPECT_EQ(rnd->mixing(), MixingKind::kPairwiseAverage);
  EXPECT_STATUS_MSG(r.Create("ring", 1), absl::StatusCode::kInvalidArgument,
                    "unknown gossip topology \"ring\" (known: exponential, random)");
}

TEST(TopologyTest, ExponentialPeriodIsCeilLog2) {
  EXPECT_EQ(ExponentialPeriod(1), 1);
  EXPECT_EQ(ExponentialPeriod(2), 1);
  EXPECT_EQ(ExponentialPeriod(3), 2);
  EXPECT_EQ(ExponentialPeriod(4), 2);
  EXPECT_EQ(ExponentialPeriod(5), 3);
  EXPECT_EQ(ExponentialPeriod(8), 3);
  EXPECT_EQ(ExponentialPeriod(9), 4);
}

TEST(TopologyTest, ExponentialPeersFollowPowersOfTwo) {
  ASSERT_OK_AND_ASSIGN(auto t, TopologyRegistry::WithBuiltins().Create("exponential", 1));
  // n = 4: distances 1, 2, 1, 2, ...
  const std::vector<int32_t> rank1 = {2, 3, 2, 3};
  for (int64_t round = 0; round < 4; ++round) {
    EXPECT_EQ(t->Peer(1, 4, round, kAll), rank1[round]) << round;
    EXPECT_EQ(t->Peer(3, 4, round, kAll), round % 2 == 0 ? 0 : 1) << round;
  }
  // n = 5: distances 1, 2, 4.
  EXPECT_EQ(t->Peer(4, 5, 0, kAll), 0);
  EXPECT_EQ(t->Peer(4, 5, 1, kAll), 1);
  EXPECT_EQ(t->Peer(4, 5, 2, kAll), 3);
  EXPECT_EQ(t->Peer(4, 5, 3, kAll), 0);
  // Every round's graph is a permutation: each rank receives exactly once.
  for (int32_t n : {2, 3, 4, 5, 8}) {
    for (int64_t round = 0; round < 6; ++round) {
      std::set<int32_t> targets;
      for (int32_t r = 0; r < n; ++r) {
        std::optional<int32_t> p = t->Peer(r, n, round, kAll);
        ASSERT_TRUE(p.has_value());
        EXPECT_NE(*p, r);
        targets.insert(*p);
      }
      EXPECT_EQ(static_cast<int32_t>(targets.size()), n) << "n=" << n << " round=" << round;
    }
  }
  EXPECT_EQ(t->Peer(0, 1, 0, kAll), std::nullopt);
}

TEST(TopologyTest, ExponentialSkipsTheRoundWhenItsPeerIsUnavailable) {
  ASSERT_OK_AND_ASSIGN(auto t, TopologyRegistry::WithBuiltins().Create("exponential", 1));
  auto not3 = [](int32_t p) { return p != 3; };
  EXPECT_EQ(t->Peer(2, 4, 0, not3), std::nullopt);  // 2 -> 3 is down: keep the mass.
  EXPECT_EQ(t->Peer(2, 4, 1, not3), 0);
}

TEST(TopologyTest, RandomIsDeterministicUniformAndOnlyPicksAvailablePeers) {
  ASSERT_OK_AND_ASSIGN(auto a, TopologyRegistry::WithBuiltins().Create("random", 7));
  ASSERT_OK_AND_ASSIGN(auto b, TopologyRegistry::WithBuiltins().Create("random", 7));
  ASSERT_OK_AND_ASSIGN(auto c, TopologyRegistry::WithBuiltins().Create("random", 8));
  std::map<int32_t, int> counts;
  int differs = 0;
  constexpr int kRounds = 3000;
  for (int64_t round = 0; round < kRounds; ++round) {
    std::optional<int32_t> p = a->Peer(1, 4, round, kAll);
    ASSERT_TRUE(p.has_value());
    EXPECT_NE(*p, 1);
    EXPECT_EQ(p, b->Peer(1, 4, round, kAll));
    differs += p != c->Peer(1, 4, round, kAll) ? 1 : 0;
    ++counts[*p];
  }
  EXPECT_GT(differs, kRounds / 3);  // Another seed, another sequence.
  ASSERT_EQ(counts.size(), 3u);
  for (const auto& [peer, count] : counts) {
    // 1000 expected; 6 standard deviations (~26) is far inside +-150.
    EXPECT_NEAR(count, kRounds / 3, 150) << "peer " << peer;
  }
  auto only2 = [](int32_t p) { return p == 2; };
  for (int64_t round = 0; round < 50; ++round) EXPECT_EQ(a->Peer(0, 4, round, only2), 2);
  EXPECT_EQ(a->Peer(0, 4, 0, [](int32_t) { return false; }), std::nullopt);
  EXPECT_EQ(a->Peer(0, 1, 0, kAll), std::nullopt);
}

// MaySend agrees with Peer: a rank's in-neighbours are exactly the ranks whose Peer() picks it
// in some round (the receiver refuses the others).
TEST(TopologyTest, InNeighboursAreTheRanksThatPickThisOne) {
  TopologyRegistry r = TopologyRegistry::WithBuiltins();
  ASSERT_OK_AND_ASSIGN(auto exp, r.Create("exponential", 1));
  EXPECT_EQ(InNeighbours(*exp, 1, 4), (std::vector<bool>{true, false, false, true}));
  EXPECT_EQ(InNeighbours(*exp, 0, 5), (std::vector<bool>{false, true, false, true, true}));
  EXPECT_EQ(InNeighbours(*exp, 0, 2), (std::vector<bool>{false, true}));
  EXPECT_EQ(InNeighbours(*exp, 0, 1), (std::vector<bool>{false}));
  for (int32_t n = 2; n <= 9; ++n) {
    for (int32_t to = 0; to < n; ++to) {
      std::set<int32_t> picks;
      for (int32_t from = 0; from < n; ++from) {
        for (int64_t round = 0; round < 2 * ExponentialPeriod(n); ++round) {
          auto p = exp->Peer(from, n, round, kAll);
          if (p.has_value() && *p == to) picks.insert(from);
        }
      }
      for (int32_t from = 0; from < n; ++from) {
        EXPECT_EQ(exp->MaySend(from, to, n), picks.count(from) > 0)
            << "n " << n << " from " << from << " to " << to;
      }
    }
  }
  ASSERT_OK_AND_ASSIGN(auto rnd, r.Create("random", 1));
  EXPECT_EQ(InNeighbours(*rnd, 2, 4), (std::vector<bool>{true, true, false, true}));
  EXPECT_FALSE(rnd->MaySend(-1, 0, 4));
  EXPECT_FALSE(rnd->MaySend(4, 0, 4));
}

}  // namespace
}  // namespace gradmesh
