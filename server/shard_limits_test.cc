#include "server/shard_limits.h"

#include <utility>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(ShardLimitsTest, DefaultsAreValidAndEveryFieldMustBePositive) {
  EXPECT_OK(ValidateShardLimits(ShardLimits()));
  ShardLimits l;
  l.max_num_workers = 0;
  EXPECT_EQ(ValidateShardLimits(l),
            absl::InvalidArgumentError("ShardLimits.max_num_workers must be > 0, got 0"));
  l = ShardLimits();
  l.max_memory_bytes = -1;
  EXPECT_EQ(ValidateShardLimits(l),
            absl::InvalidArgumentError("ShardLimits.max_memory_bytes must be > 0, got -1"));
  l = ShardLimits();
  l.max_waiting_pushes = 0;
  EXPECT_STATUS_MSG(ValidateShardLimits(l), absl::StatusCode::kInvalidArgument,
                    "max_waiting_pushes");
}

TEST(ShardLimitsTest, DefaultMemoryIsMostOfPhysicalMemory) {
  const int64_t d = DefaultMaxMemoryBytes();
  EXPECT_GT(d, int64_t{64} << 20);
  EXPECT_LT(d, int64_t{1} << 50);
}

TEST(ShardLimitsTest, FormatBytes) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(int64_t{12} << 20), "12.0 MiB");
  EXPECT_EQ(FormatBytes((int64_t{5} << 30) / 4), "1.2 GiB");
}

TEST(MemoryBudgetTest, ReservesWhatFitsAndNamesWhatIsLeft) {
  MemoryBudget b(int64_t{2} << 30);
  EXPECT_OK(b.Reserve((int64_t{4} << 30) / 5, "first"));
  EXPECT_EQ(b.Reserve(int64_t{4} << 30, "InitJob: job j", "values 4.0 GiB"),
            absl::ResourceExhaustedError("InitJob: job j needs 4.0 GiB (values 4.0 GiB); 1.2 GiB "
                                         "of the 2.0 GiB budget is left (--max_memory_bytes)"));
  EXPECT_EQ(b.Reserve(int64_t{4} << 30, "x"),
            absl::ResourceExhaustedError(
                "x needs 4.0 GiB; 1.2 GiB of the 2.0 GiB budget is left (--max_memory_bytes)"));
  EXPECT_EQ(b.used(), (int64_t{4} << 30) / 5);  // The refusal reserved nothing.
  EXPECT_TRUE(b.TryReserve(b.limit() - b.used()));
  EXPECT_FALSE(b.TryReserve(1));
  b.Release(100);
  EXPECT_TRUE(b.TryReserve(100));
  EXPECT_EQ(b.used(), b.limit());
  b.ForceReserve(10);  // Restores may go beyond.
  EXPECT_EQ(b.used(), b.limit() + 10);
}

TEST(MemoryBudgetTest, ReservationReleasesOnceWhenDestroyedOrMoved) {
  MemoryBudget b(1000);
  ASSERT_OK(b.Reserve(300, "x"));
  {
    MemoryReservation r(&b, 300);
    MemoryReservation moved = std::move(r);
    EXPECT_EQ(moved.bytes(), 300);
    EXPECT_EQ(b.used(), 300);
    ASSERT_OK(b.Reserve(200, "y"));
    MemoryReservation other(&b, 200);
    moved = std::move(other);  // Releases the 300 it held.
    EXPECT_EQ(b.used(), 200);
  }
  EXPECT_EQ(b.used(), 0);
}

TEST(WaitCounterTest, RefusesBeyondTheLimit) {
  WaitCounter w(2);
  ASSERT_OK(w.Enter("a"));
  ASSERT_OK(w.Enter("b"));
  EXPECT_EQ(w.Enter("Push: job j worker 3 step 7"),
            absl::ResourceExhaustedError(
                "Push: job j worker 3 step 7: 2 requests already wait at barriers on this shard, "
                "the most it allows (--max_waiting_pushes)"));
  EXPECT_EQ(w.waiting(), 2);
  w.Exit();
  EXPECT_OK(w.Enter("c"));
  EXPECT_EQ(w.waiting(), 2);
}

}  // namespace
}  // namespace gradmesh
