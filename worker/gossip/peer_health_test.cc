// Tests of PeerHealth: the exact backoff schedule, reset on success, finished peers.
#include "worker/gossip/peer_health.h"

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(PeerHealthTest, BackoffDoublesUpToMaxAndResetsOnSuccess) {
  PeerHealth h(3, absl::Milliseconds(250), absl::Seconds(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_TRUE(h.Available(1, t0));
  EXPECT_TRUE(h.OnFailure(1, t0));  // First failure: it just went down.
  EXPECT_EQ(h.retry_at(1), t0 + absl::Milliseconds(250));
  EXPECT_FALSE(h.Available(1, t0 + absl::Milliseconds(249)));
  EXPECT_TRUE(h.Available(1, t0 + absl::Milliseconds(250)));
  EXPECT_TRUE(h.Available(2, t0));  // Others are unaffected.

  const absl::Time t1 = t0 + absl::Seconds(1);
  EXPECT_FALSE(h.OnFailure(1, t1));
  EXPECT_EQ(h.retry_at(1), t1 + absl::Milliseconds(500));
  EXPECT_FALSE(h.OnFailure(1, t1));
  EXPECT_EQ(h.retry_at(1), t1 + absl::Seconds(1));
  EXPECT_FALSE(h.OnFailure(1, t1));
  EXPECT_EQ(h.retry_at(1), t1 + absl::Seconds(1));  // Capped.
  EXPECT_EQ(h.consecutive_failures(1), 4);

  EXPECT_TRUE(h.OnSuccess(1));   // It is back.
  EXPECT_FALSE(h.OnSuccess(1));  // Was not down.
  EXPECT_TRUE(h.Available(1, t1));
  EXPECT_TRUE(h.OnFailure(1, t1));
  EXPECT_EQ(h.retry_at(1), t1 + absl::Milliseconds(250));  // Starts over.
}

TEST(PeerHealthTest, NotYetRunningFailuresRetrySoonWithoutGrowingTheBackoff) {
  PeerHealth h(2, absl::Milliseconds(250), absl::Seconds(4));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_TRUE(h.OnFailure(1, t0, /*grow=*/false));
  EXPECT_FALSE(h.OnFailure(1, t0, /*grow=*/false));
  EXPECT_FALSE(h.OnFailure(1, t0, /*grow=*/false));
  EXPECT_EQ(h.retry_at(1), t0 + absl::Milliseconds(250));
  EXPECT_EQ(h.consecutive_failures(1), 3);
  h.OnFailure(1, t0);  // A growing failure starts at `initial`, then doubles.
  EXPECT_EQ(h.retry_at(1), t0 + absl::Milliseconds(250));
  h.OnFailure(1, t0);
  EXPECT_EQ(h.retry_at(1), t0 + absl::Milliseconds(500));
}

TEST(PeerHealthTest, FinishedPeersAreNeverAvailableAgain) {
  PeerHealth h(2, absl::Milliseconds(250), absl::Seconds(4));
  h.OnFinished(0);
  EXPECT_TRUE(h.finished(0));
  EXPECT_FALSE(h.Available(0, absl::InfiniteFuture()));
  EXPECT_TRUE(h.Available(1, absl::FromUnixSeconds(0)));
}

}  // namespace
}  // namespace gradmesh
