#include "worker/core/loss_scaler.h"

#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

LossScaleSpec Dynamic(double init, int64_t interval) {
  LossScaleSpec s;
  s.set_mode("dynamic");
  s.set_init_scale(init);
  s.set_growth_factor(2);
  s.set_backoff_factor(0.5);
  s.set_growth_interval(interval);
  return s;
}

TEST(LossScalerTest, OffUnlessDynamic) {
  LossScaler off{LossScaleSpec()};
  EXPECT_FALSE(off.enabled());
  EXPECT_EQ(off.scale(), 1.0f);
  EXPECT_EQ(off.Update(true), 1.0f);
  EXPECT_EQ(off.skipped_steps(), 0);
}

// GradScaler's schedule: back off on every skipped step, grow after growth_interval good
// steps in a row (a skip restarts the count).
TEST(LossScalerTest, BacksOffOnOverflowAndGrowsAfterTheInterval) {
  LossScaler s(Dynamic(1024, 3));
  EXPECT_TRUE(s.enabled());
  EXPECT_EQ(s.scale(), 1024.0f);
  EXPECT_EQ(s.Update(false), 1024.0f);
  EXPECT_EQ(s.Update(false), 1024.0f);
  EXPECT_EQ(s.Update(false), 2048.0f);  // 3 in a row.
  EXPECT_EQ(s.Update(false), 2048.0f);
  EXPECT_EQ(s.Update(true), 1024.0f);  // Overflow: halve, and the count restarts.
  EXPECT_EQ(s.Update(false), 1024.0f);
  EXPECT_EQ(s.Update(false), 1024.0f);
  EXPECT_EQ(s.Update(false), 2048.0f);
  EXPECT_EQ(s.skipped_steps(), 1);
}

TEST(LossScalerTest, NeverGrowsToInfinityNorShrinksToZero) {
  LossScaler big(Dynamic(FLT_MAX, 1));
  EXPECT_EQ(big.Update(false), FLT_MAX);
  LossScaler tiny(Dynamic(FLT_MIN, 1000));
  EXPECT_EQ(tiny.Update(true), FLT_MIN);
  EXPECT_GT(tiny.scale(), 0.0f);
}

TEST(LossScalerTest, UnscaleDividesExactlyAndFindsNonFiniteValues) {
  LossScaler s(Dynamic(65536, 2000));
  std::vector<float> a = {65536.0f, -3.0f * 65536.0f, 0.5f}, b = {1.0f};
  std::vector<absl::Span<float>> grads = {absl::MakeSpan(a), absl::MakeSpan(b)};
  EXPECT_TRUE(s.Unscale(grads));
  EXPECT_EQ(a, (std::vector<float>{1.0f, -3.0f, 0.5f / 65536.0f}));
  EXPECT_EQ(b[0], 1.0f / 65536.0f);
  std::vector<float> c = {1.0f, std::numeric_limits<float>::infinity()};
  std::vector<float> d = {std::nanf("")};
  EXPECT_FALSE(s.Unscale({absl::MakeSpan(c)}));
  EXPECT_FALSE(s.Unscale({absl::MakeSpan(d)}));
}

}  // namespace
}  // namespace gradmesh
