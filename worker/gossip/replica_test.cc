// Tests of GossipReplica: the exact arithmetic of one push-sum and one pairwise exchange,
// codec compensation, validation (every error leaves the replica unchanged), the final round
// and the consensus estimate. Multi-rank conservation and convergence are in gossiper_test.
#include "worker/gossip/replica.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "worker/gossip/value_codec.h"

namespace gradmesh {
namespace {

GossipReplica::Options Opts(int32_t rank, int32_t n = 4) {
  GossipReplica::Options o;
  o.job = "j";
  o.rank = rank;
  o.num_workers = n;
  o.total_steps = 100;
  return o;
}

std::string Raw(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

ExchangeHeader Header(int32_t from, int32_t to, ExchangeKind kind, int64_t numel, double weight = 0,
                      std::string codec = "") {
  ExchangeHeader h;
  h.job = "j";
  h.from = from;
  h.to = to;
  h.kind = kind;
  h.weight = weight;
  h.numel = numel;
  h.codec = std::move(codec);
  return h;
}

std::vector<float> Values(const GossipReplica& r) { return r.Snapshot().values; }

TEST(ReplicaTest, PushSumReceiveIsTheWeightedAverageAndAddsTheWeight) {
  GossipReplica r(Opts(1), {1, 2}, 1.0);
  ASSERT_OK_AND_ASSIGN(ExchangeReply reply, r.Handle(Header(0, 1, ExchangeKind::kPushSum, 2, 0.5),
                                                     Raw({4, 8}), absl::InfiniteFuture()));
  // (1 * [1, 2] + 0.5 * [4, 8]) / 1.5 = [2, 4].
  EXPECT_EQ(Values(r), (std::vector<float>{2.0f, 4.0f}));
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 1.5);
  EXPECT_TRUE(reply.payload.empty());
}

TEST(ReplicaTest, APushSumShareSentAgainWithItsIdIsAbsorbedOnce) {
  GossipReplica r(Opts(1), {1, 2}, 1.0);
  ExchangeHeader h = Header(0, 1, ExchangeKind::kPushSum, 2, 0.5);
  h.exchange_id = 77;
  ASSERT_OK_AND_ASSIGN(ExchangeReply first, r.Handle(h, Raw({4, 8}), absl::InfiniteFuture()));
  EXPECT_FALSE(first.duplicate);
  // The reply was lost; the sender asks again: nothing changes.
  ASSERT_OK_AND_ASSIGN(ExchangeReply again, r.Handle(h, Raw({4, 8}), absl::InfiniteFuture()));
  EXPECT_TRUE(again.duplicate);
  EXPECT_EQ(Values(r), (std::vector<float>{2.0f, 4.0f}));
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 1.5);
  // The same id from another sender, and the next id from this one, are new shares.
  ExchangeHeader other = h;
  other.from = 2;
  ASSERT_OK_AND_ASSIGN(ExchangeReply o, r.Handle(other, Raw({2, 4}), absl::InfiniteFuture()));
  EXPECT_FALSE(o.duplicate);
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 2.0);
  h.exchange_id = 78;
  ASSERT_OK_AND_ASSIGN(ExchangeReply next, r.Handle(h, Raw({2, 4}), absl::InfiniteFuture()));
  EXPECT_FALSE(next.duplicate);
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 2.5);
  // A stale first copy of 77 that arrives after 78: a duplicate too (same incarnation).
  h.exchange_id = 77;
  ASSERT_OK_AND_ASSIGN(ExchangeReply stale, r.Handle(h, Raw({2, 4}), absl::InfiniteFuture()));
  EXPECT_TRUE(stale.duplicate);
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 2.5);
  // A restarted sender (another incarnation) starts its sequence again: new shares.
  h.exchange_id = (uint64_t{5} << 32) | 1;
  ASSERT_OK_AND_ASSIGN(ExchangeReply fresh, r.Handle(h, Raw({2, 4}), absl::InfiniteFuture()));
  EXPECT_FALSE(fresh.duplicate);
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 3.0);
  h.exchange_id = 78;  // The old incarnation's 78 again: no longer remembered, absorbed.

  ASSERT_OK(r.Handle(h, Raw({2, 4}), absl::InfiniteFuture()).status());
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 3.5);
  // Once finished, a resend of a share absorbed before is still "delivered" (the sender
  // must not take it back), while a new share is refused.
  r.Finish();
  ASSERT_OK_AND_ASSIGN(ExchangeReply late, r.Handle(h, Raw({2, 4}), absl::InfiniteFuture()));
  EXPECT_TRUE(late.duplicate);
  h.exchange_id = 79;
  EXPECT_STATUS(r.Handle(h, Raw({2, 4}), absl::InfiniteFuture()).status(),
                absl::StatusCode::kFailedPrecondition);
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 3.5);
  // Id 0 means "no check": the same share twice is absorbed twice.
  GossipReplica plain(Opts(1), {1, 2}, 1.0);
  ExchangeHeader h0 = Header(0, 1, ExchangeKind::kPushSum, 2, 0.5);
  ASSERT_OK(plain.Handle(h0, Raw({4, 8}), absl::InfiniteFuture()).status());
  ASSERT_OK(plain.Handle(h0, Raw({4, 8}), absl::InfiniteFuture()).status());
  EXPECT_DOUBLE_EQ(plain.Snapshot().weight, 2.0);
}

TEST(ReplicaTest, PushSumSenderHalvesTheWeightAndTakesItBackWhenNotDelivered) {
  GossipReplica r(Opts(0), {3, 5}, 0.75);
  std::vector<float> sent;
  ASSERT_OK_AND_ASSIGN(double w, r.BeginPushSum(&sent));
  EXPECT_DOUBLE_EQ(w, 0.375);
  EXPECT_EQ(sent, (std::vector<float>{3.0f, 5.0f}));
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 0.375);
  EXPECT_EQ(Values(r), (std::vector<float>{3.0f, 5.0f}));  // The de-biased model is unchanged.
  r.EndPushSum(/*delivered=*/false, w, sent);
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 0.75);
  ASSERT_OK_AND_ASSIGN(w, r.BeginPushSum(&sent));
  r.EndPushSum(/*delivered=*/true, w, sent);
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 0.375);
  // Below the floor nothing is sent.
  ASSERT_OK_AND_ASSIGN(w, r.BeginPushSum(&sent, /*min_weight=*/0.5));
  EXPECT_EQ(w, 0.0);
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 0.375);
}

// A local step moves the push-sum mass w x by the whole step whatever w is: x by step / w.
// Two ranks, one holding 0.25 of the weight and one 1.75 (a share absorbed), each take the
// step -1 on every element: the final average sum w x / sum w moves by exactly -1, as if
// both had stepped at weight 1.
TEST(ReplicaTest, ALocalStepMovesTheMassByTheWholeStep) {
  GossipReplica low(Opts(0, 2), {2, 4}, 0.25);
  GossipReplica high(Opts(1, 2), {2, 4}, 1.75);
  auto step = [](absl::Span<float> x) {
    for (float& v : x) v -= 1.0f;
  };
  low.ApplyStep(step);
  high.ApplyStep(step);
  EXPECT_EQ(Values(low), (std::vector<float>{-2.0f, 0.0f}));  // 2 - 1 / 0.25.
  const double mean0 = (0.25 * Values(low)[0] + 1.75 * Values(high)[0]) / 2.0;
  const double mean1 = (0.25 * Values(low)[1] + 1.75 * Values(high)[1]) / 2.0;
  EXPECT_NEAR(mean0, 2.0 - 1.0, 1e-6);
  EXPECT_NEAR(mean1, 4.0 - 1.0, 1e-6);
  GossipReplica one(Opts(0, 2), {2, 4}, 1.0);
  one.ApplyStep(step);
  EXPECT_EQ(Values(one), (std::vector<float>{1.0f, 3.0f}));  // Weight 1: the plain step.
}

// A share that was not delivered comes back as a share: the local steps taken while it was
// out (scaled by 1 / w) are not counted twice. Mass before: 1 * [3]; a step of -1 at weight
// 0.5 (-2 on x); the half returns: (0.5 * 1 + 0.5 * 3) / 1 = 2, mass 3 - 1.
TEST(ReplicaTest, AShareTakenBackKeepsTheStepsTakenMeanwhileOnce) {
  GossipReplica r(Opts(0), {3}, 1.0);
  std::vector<float> sent;
  ASSERT_OK_AND_ASSIGN(double w, r.BeginPushSum(&sent));
  r.ApplyStep([](absl::Span<float> x) { x[0] -= 1.0f; });
  EXPECT_EQ(Values(r), (std::vector<float>{1.0f}));
  r.EndPushSum(/*delivered=*/false, w, sent);
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 1.0);
  EXPECT_EQ(Values(r), (std::vector<float>{2.0f}));
}

TEST(ReplicaTest, PairwiseAverageBothSidesEndAtTheMeanAndKeepLocalProgress) {
  GossipReplica caller(Opts(0), {3, 5});
  GossipReplica callee(Opts(2), {1, 3});
  std::vector<float> sent(2);
  caller.Read(absl::MakeSpan(sent));
  ASSERT_OK_AND_ASSIGN(ExchangeReply reply, callee.Handle(Header(0, 2, ExchangeKind::kAverage, 2),
                                                          Raw(sent), absl::InfiniteFuture()));
  EXPECT_EQ(Values(callee), (std::vector<float>{2.0f, 4.0f}));
  ASSERT_EQ(reply.numel, 2);
  ASSERT_EQ(reply.payload, Raw({1, 3}));  // The callee's values before averaging.
  // A local step on the caller while the exchange was in flight is kept.
  caller.Update([](absl::Span<float> x) { x[0] += 0.5f; });
  caller.ApplyAverageReply(sent, {1, 3});
  EXPECT_EQ(Values(caller), (std::vector<float>{2.5f, 4.0f}));
}

TEST(ReplicaTest, LossyCodecRoundingIsCompensatedSoPairwiseConservesTheSum) {
  ASSERT_OK_AND_ASSIGN(ValueCodec fp16, ValueCodec::Create("fp16"));
  const std::vector<float> a0 = {0.1f, 1.0f / 3, -2.7182817f};
  const std::vector<float> b0 = {0.7f, -1.0f / 7, 3.1415927f};
  GossipReplica caller(Opts(0), a0);
  GossipReplica callee(Opts(1), b0);
  std::string payload;
  ASSERT_OK(fp16.Encode(a0, &payload));
  std::vector<float> arrives(3);
  ASSERT_OK(fp16.Decode(payload, absl::MakeSpan(arrives)));
  ASSERT_NE(arrives, a0);  // fp16 does round these.
  ASSERT_OK_AND_ASSIGN(ExchangeReply reply,
                       callee.Handle(Header(0, 1, ExchangeKind::kAverage, 3, 0, "fp16"), payload,
                                     absl::InfiniteFuture()));
  EXPECT_EQ(reply.codec, "fp16");
  std::vector<float> peer(3);
  ASSERT_OK(fp16.Decode(reply.payload, absl::MakeSpan(peer)));
  caller.ApplyAverageReply(arrives, peer);
  const std::vector<float> a = Values(caller), b = Values(callee);
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(a[i] + b[i], a0[i] + b0[i], 1e-6) << i;
    EXPECT_NEAR(a[i], (a0[i] + b0[i]) / 2, 2e-3) << i;  // fp16 precision.
  }
}

TEST(ReplicaTest, InvalidRequestsAreRejectedWithTheirCodeAndChangeNothing) {
  GossipReplica r(Opts(1), {1, 2}, 1.0);
  const absl::Time never = absl::InfiniteFuture();
  const std::string ok = Raw({4, 8});
  ExchangeHeader h = Header(0, 1, ExchangeKind::kPushSum, 2, 0.5);
  ExchangeHeader bad = h;
  bad.numel = 3;
  EXPECT_STATUS_MSG(r.Handle(bad, Raw({1, 2, 3}), never), absl::StatusCode::kInvalidArgument,
                    "3 parameters sent, this replica has 2");
  bad = h;
  bad.from = 1;
  EXPECT_STATUS_MSG(r.Handle(bad, ok, never), absl::StatusCode::kInvalidArgument, "sender rank");
  bad.from = 4;
  EXPECT_STATUS(r.Handle(bad, ok, never), absl::StatusCode::kInvalidArgument);
  bad = h;
  bad.job = "other";
  EXPECT_STATUS(r.Handle(bad, ok, never), absl::StatusCode::kInvalidArgument);
  // 4 workers: weights sum to about 4, and more than 16 is refused (1.7e308 would overflow the
  // replica's weight, and a final's weighted sum, to inf).
  for (double w : {0.0, -1.0, 16.001, 1.7e308, std::numeric_limits<double>::infinity(),
                   std::numeric_limits<double>::quiet_NaN()}) {
    bad = h;
    bad.weight = w;
    EXPECT_STATUS_MSG(r.Handle(bad, ok, never), absl::StatusCode::kInvalidArgument,
                      "push-sum weight")
        << w;
  }
  bad = h;
  bad.codec = "topk:0.1";
  EXPECT_STATUS_MSG(r.Handle(bad, ok, never), absl::StatusCode::kInvalidArgument,
                    "gossip codec \"topk:0.1\"");
  EXPECT_STATUS_MSG(r.Handle(h, ok.substr(0, 7), never), absl::StatusCode::kInvalidArgument,
                    "7 bytes of float32 data for 2 elements");
  EXPECT_STATUS_MSG(r.Handle(h, Raw({1, std::nanf("")}), never), absl::StatusCode::kInvalidArgument,
                    "element 1 is not finite");
  bad = h;
  bad.codec = "fp16";
  EXPECT_STATUS(r.Handle(bad, ok, never), absl::StatusCode::kInvalidArgument);  // Not fp16.
  EXPECT_STATUS_MSG(r.Handle(h, ok, absl::Now() - absl::Seconds(1)),
                    absl::StatusCode::kDeadlineExceeded, "deadline passed");
  EXPECT_STATUS_MSG(r.Handle(Header(0, 1, ExchangeKind::kFinal, 2, 1.0), ok, never),
                    absl::StatusCode::kFailedPrecondition, "finals go to rank 0");
  EXPECT_EQ(Values(r), (std::vector<float>{1.0f, 2.0f}));
  EXPECT_DOUBLE_EQ(r.Snapshot().weight, 1.0);
  EXPECT_EQ(r.TakeConsensus().count, 0);
}

TEST(ReplicaTest, AFinishedReplicaRefusesMixingButTheRootKeepsTakingFinals) {
  GossipReplica r(Opts(0), {1, 2}, 1.0, /*step=*/7);
  const ReplicaSnapshot mine = r.Finish();
  EXPECT_EQ(mine.values, (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(mine.step, 7);
  EXPECT_TRUE(r.State().finished);
  const absl::Time never = absl::InfiniteFuture();
  EXPECT_STATUS_MSG(r.Handle(Header(1, 0, ExchangeKind::kPushSum, 2, 0.5), Raw({4, 8}), never),
                    absl::StatusCode::kFailedPrecondition, "has finished its steps");
  EXPECT_STATUS(r.Handle(Header(1, 0, ExchangeKind::kAverage, 2), Raw({4, 8}), never),
                absl::StatusCode::kFailedPrecondition);
  std::vector<float> v;
  EXPECT_STATUS(r.BeginPushSum(&v), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Values(r), (std::vector<float>{1.0f, 2.0f}));

  ExchangeHeader f = Header(2, 0, ExchangeKind::kFinal, 2, 2.0);
  f.step = 9;
  ASSERT_OK_AND_ASSIGN(ExchangeReply first, r.Handle(f, Raw({4, 5}), never));
  EXPECT_FALSE(first.duplicate);
  ASSERT_OK_AND_ASSIGN(ExchangeReply again, r.Handle(f, Raw({40, 50}), never));
  EXPECT_TRUE(again.duplicate);
  const auto finals = r.Finals();
  ASSERT_EQ(finals.size(), 2u);
  EXPECT_EQ(finals.at(0).values, (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(finals.at(2).values, (std::vector<float>{4.0f, 5.0f}));  // The first one counts.
  EXPECT_EQ(finals.at(2).step, 9);
  EXPECT_DOUBLE_EQ(finals.at(2).weight, 2.0);
}

TEST(ReplicaTest, AStoppedReplicaRefusesWithAbortedAndRecordsNoFinal) {
  GossipReplica r(Opts(0), {1, 2}, 0.5, /*step=*/4);
  const ReplicaSnapshot s = r.Stop();
  EXPECT_EQ(s.values, (std::vector<float>{1, 2}));
  EXPECT_EQ(s.weight, 0.5);
  EXPECT_EQ(s.step, 4);
  EXPECT_FALSE(r.State().finished);
  EXPECT_STATUS_MSG(
      r.Handle(Header(1, 0, ExchangeKind::kPushSum, 2, 0.5), Raw({4, 8}), absl::InfiniteFuture()),
      absl::StatusCode::kAborted, "is stopping");
  EXPECT_EQ(r.Snapshot().weight, 0.5);
  EXPECT_TRUE(r.Finals().empty());
}

TEST(ReplicaTest, AverageFinalsIsWeightedAndReportsTheExactConsensus) {
  std::map<int32_t, ReplicaSnapshot> finals;
  finals[0] = ReplicaSnapshot{{0, 0}, 1.0, 10};
  finals[3] = ReplicaSnapshot{{3, 3}, 2.0, 10};
  FinalAverage avg = AverageFinals(finals);
  EXPECT_EQ(avg.values, (std::vector<float>{2.0f, 2.0f}));
  EXPECT_DOUBLE_EQ(avg.weight_sum, 3.0);
  EXPECT_EQ(avg.ranks, (std::vector<int32_t>{0, 3}));
  // sqrt(((2^2 + 2^2) + (1 + 1)) / 2).
  EXPECT_DOUBLE_EQ(avg.consensus, std::sqrt(5.0));
  EXPECT_TRUE(AverageFinals({}).values.empty());
}

TEST(ReplicaTest, ConsensusEstimateUsesTheRecordedDistances) {
  GossipReplica r(Opts(1), {1, 3});
  ASSERT_OK(r.Handle(Header(0, 1, ExchangeKind::kAverage, 2), Raw({3, 5}), absl::InfiniteFuture())
                .status());
  ConsensusSample s = r.TakeConsensus();
  EXPECT_DOUBLE_EQ(s.sum_sq, 8.0);  // ||[1,3] - [3,5]||^2
  EXPECT_EQ(s.count, 1);
  EXPECT_EQ(r.TakeConsensus().count, 0);  // Reset.
  // n = 4: sqrt(3/8 * 8).
  EXPECT_DOUBLE_EQ(EstimateConsensus(s, 4), std::sqrt(3.0));
  EXPECT_DOUBLE_EQ(EstimateConsensus(ConsensusSample{}, 4), -1);
  EXPECT_DOUBLE_EQ(EstimateConsensus(s, 1), 0);
}

}  // namespace
}  // namespace gradmesh
