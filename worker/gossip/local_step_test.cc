// Tests of the gossip local step (local_step.h) together with the replica's mixing: buffers
// are averaged in an exchange like parameters, and the local step adds their deltas instead
// of running the optimizer on them. Every value is exact in float32.
#include "worker/gossip/local_step.h"

#include <memory>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "worker/gossip/replica.h"

namespace gradmesh {
namespace {

std::unique_ptr<Optimizer> SgdMomentum() {
  OptimizerSpec s;
  s.set_name("sgd");
  s.set_lr(0.5);
  s.set_momentum(0.5);  // One slot per parameter element.
  return OptimizerRegistry::WithBuiltins().Create(s).value();
}

std::string Raw(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST(LocalStepTest, BuffersAreAveragedInAnExchangeAndGetTheirDeltaNotTheOptimizer) {
  // Model: parameter elements [0, 2), buffer elements [2, 4) (e.g. a running mean).
  GossipReplica::Options o;
  o.job = "j";
  o.rank = 1;
  o.num_workers = 2;
  o.total_steps = 10;
  GossipReplica replica(o, {1, 2, 10, 20});
  ExchangeHeader h;
  h.job = "j";
  h.from = 0;
  h.to = 1;
  h.kind = ExchangeKind::kAverage;
  h.numel = 4;
  ASSERT_OK_AND_ASSIGN(ExchangeReply reply,
                       replica.Handle(h, Raw({3, 6, 30, 40}), absl::InfiniteFuture()));
  // Pairwise averaging: parameters and buffers alike.
  EXPECT_EQ(replica.Snapshot().values, (std::vector<float>{2, 4, 20, 30}));
  EXPECT_EQ(reply.payload, Raw({1, 2, 10, 20}));  // The replica's values before.

  // Local step: gradient (2, -4), buffer deltas (0.5, -1). SGD lr 0.5, first update: the
  // momentum slot is the gradient, parameters -= 0.5 * gradient. The slot array has room for
  // the parameters only; the sentinel after it must stay.
  std::unique_ptr<Optimizer> sgd = SgdMomentum();
  ASSERT_EQ(sgd->num_slots(), 1);
  std::vector<float> slot = {0, 0, 99};
  float* slots[] = {slot.data()};
  const std::vector<float> grad = {2, -4, 0.5f, -1};
  replica.Update([&](absl::Span<float> x) { ApplyLocalStep(*sgd, 1, 1.0f, grad, 2, slots, x); });
  EXPECT_EQ(replica.Snapshot().values, (std::vector<float>{1, 6, 20.5f, 29}));
  EXPECT_EQ(slot, (std::vector<float>{2, -4, 99}));
}

TEST(LocalStepTest, WithoutBuffersItIsTheOptimizerStep) {
  std::unique_ptr<Optimizer> sgd = SgdMomentum();
  std::vector<float> x = {1, 1, 1}, slot = {0.5f, 0, 1};
  float* slots[] = {slot.data()};
  // Update 2: buf = 0.5 * buf + g; x -= 0.5 * buf; g = (1, 2, -2).
  ApplyLocalStep(*sgd, 2, 1.0f, std::vector<float>{1, 2, -2}, 3, slots, absl::MakeSpan(x));
  EXPECT_EQ(slot, (std::vector<float>{1.25f, 2, -1.5f}));
  EXPECT_EQ(x, (std::vector<float>{0.375f, 0, 1.75f}));
}

}  // namespace
}  // namespace gradmesh
