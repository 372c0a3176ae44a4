#include "common/spin_wait.h"

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(AdaptiveSpinTest, SpinsWhileWaitsAreShorterThanHalfTheBudget) {
  AdaptiveSpin spin(absl::Microseconds(200));
  EXPECT_EQ(spin.SpinFor(), absl::Microseconds(200));  // First wait: nothing known yet.
  spin.Record(absl::Microseconds(380));
  EXPECT_EQ(spin.mean(), absl::Microseconds(95));  // 0 + (380 - 0) / 4.
  EXPECT_EQ(spin.SpinFor(), absl::Microseconds(200));
  spin.Record(absl::Microseconds(115));
  EXPECT_EQ(spin.mean(), absl::Microseconds(100));  // 95 + (115 - 95) / 4: half the budget.
  EXPECT_EQ(spin.SpinFor(), absl::ZeroDuration());
}

TEST(AdaptiveSpinTest, SlowWaitsStopTheSpinningAndFastOnesStartItAgain) {
  AdaptiveSpin spin(absl::Microseconds(200));
  // A slow operation (5 ms counts as 4 budgets, 800 µs) takes the mean to the budget: the
  // next waits block at once.
  spin.Record(absl::Milliseconds(5));
  EXPECT_EQ(spin.mean(), absl::Microseconds(200));
  EXPECT_EQ(spin.SpinFor(), absl::ZeroDuration());
  spin.Record(absl::Milliseconds(5));
  spin.Record(absl::Milliseconds(5));
  EXPECT_EQ(spin.mean(), absl::Nanoseconds(462500));  // 200 -> 350 -> 462.5 µs.
  // Fast operations (60 µs, unspun) bring it under half the budget after nine waits:
  // 361.9, 286.4, 229.8, 187.4, 155.5, 131.6, 113.7, 100.3, 90.2 µs.
  int fast = 0;
  while (spin.SpinFor() == absl::ZeroDuration() && fast < 100) {
    spin.Record(absl::Microseconds(60));
    ++fast;
  }
  EXPECT_EQ(fast, 9);
  EXPECT_EQ(spin.mean(), absl::Nanoseconds(90223));
  EXPECT_EQ(spin.SpinFor(), absl::Microseconds(200));
}

TEST(AdaptiveSpinTest, AZeroBudgetNeverSpins) {
  AdaptiveSpin spin(absl::ZeroDuration());
  EXPECT_EQ(spin.SpinFor(), absl::ZeroDuration());
  spin.Record(absl::Microseconds(1));
  EXPECT_EQ(spin.SpinFor(), absl::ZeroDuration());
  AdaptiveSpin negative(absl::Microseconds(-5));
  EXPECT_EQ(negative.SpinFor(), absl::ZeroDuration());
}

TEST(AdaptiveSpinTest, AnEndlessBudgetIsOneSecond) {
  AdaptiveSpin spin(absl::InfiniteDuration());
  EXPECT_EQ(spin.SpinFor(), absl::Seconds(1));
  spin.Record(absl::InfiniteDuration());  // Counts as 4 budgets: no overflow.
  EXPECT_EQ(spin.mean(), absl::Seconds(1));
  EXPECT_EQ(spin.SpinFor(), absl::ZeroDuration());
}

}  // namespace
}  // namespace gradmesh
