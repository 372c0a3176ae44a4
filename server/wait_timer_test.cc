#include "server/wait_timer.h"

#include <atomic>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(WaitTimerTest, RunsCallbacksInTimeOrderNotBefore) {
  WaitTimer timer;
  absl::Mutex mu;
  std::vector<int> order;
  absl::Notification last;
  const absl::Time now = absl::Now();
  std::vector<absl::Time> ran(3);
  auto record = [&](int i) {
    return [&, i] {
      absl::MutexLock lock(&mu);
      ran[i] = absl::Now();
      order.push_back(i);
      if (order.size() == 3) last.Notify();
    };
  };
  timer.Schedule(now + absl::Milliseconds(200), record(2));
  timer.Schedule(now + absl::Milliseconds(50), record(0));
  timer.Schedule(now + absl::Milliseconds(100), record(1));
  ASSERT_TRUE(last.WaitForNotificationWithTimeout(absl::Seconds(10)));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  EXPECT_GE(ran[0], now + absl::Milliseconds(50));
  EXPECT_GE(ran[2], now + absl::Milliseconds(200));
}

TEST(WaitTimerTest, CancelledCallbackNeverRuns) {
  WaitTimer timer;
  std::atomic<int> runs{0};
  absl::Notification after;
  const WaitTimer::Id id =
      timer.Schedule(absl::Now() + absl::Milliseconds(50), [&] { runs.fetch_add(1); });
  EXPECT_TRUE(timer.Cancel(id));
  EXPECT_FALSE(timer.Cancel(id));
  timer.Schedule(absl::Now() + absl::Milliseconds(100), [&] { after.Notify(); });
  ASSERT_TRUE(after.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(runs.load(), 0);
  EXPECT_EQ(timer.pending(), 0u);
}

TEST(WaitTimerTest, EarlierScheduleWakesTheThread) {
  WaitTimer timer;
  timer.Schedule(absl::Now() + absl::Hours(1), [] {});
  absl::Notification soon;
  const absl::Time start = absl::Now();
  timer.Schedule(absl::Now(), [&] { soon.Notify(); });
  ASSERT_TRUE(soon.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(timer.pending(), 1u);  // The one an hour away.
}

TEST(WaitTimerTest, DestructorRunsWhatIsPending) {
  int runs = 0;
  {
    WaitTimer timer;
    timer.Schedule(absl::Now() + absl::Hours(1), [&] { ++runs; });
    timer.Schedule(absl::Now() + absl::Hours(2), [&] { runs *= 10; });
  }
  EXPECT_EQ(runs, 10);
}

TEST(WaitTimerTest, CallbacksMayScheduleAndCancel) {
  WaitTimer timer;
  absl::Notification second;
  WaitTimer::Id far = timer.Schedule(absl::Now() + absl::Hours(1), [] {});
  timer.Schedule(absl::Now(), [&] {
    EXPECT_TRUE(timer.Cancel(far));
    timer.Schedule(absl::Now(), [&] { second.Notify(); });
  });
  ASSERT_TRUE(second.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(timer.pending(), 0u);
}

}  // namespace
}  // namespace gradmesh
