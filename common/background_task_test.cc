#include "common/background_task.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(BackgroundTaskTest, RunsOffTheCallersThreadAndWaitReturnsTheTasksStatus) {
  BackgroundTask bg;
  EXPECT_OK(bg.Wait());  // Nothing started.
  absl::Notification release;
  std::atomic<int> ran{0};
  ASSERT_OK(bg.Start([&] {
    release.WaitForNotification();  // Blocks: Start must have returned for this to end.
    ++ran;
    return absl::DataLossError("chunk 3");
  }));
  EXPECT_TRUE(bg.pending());
  EXPECT_EQ(ran.load(), 0);
  release.Notify();
  const absl::Status st = bg.Wait();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(st.message(), "chunk 3");
  EXPECT_EQ(ran.load(), 1);
  EXPECT_FALSE(bg.pending());
  EXPECT_OK(bg.Wait());  // Waited for already.
  // The thread takes the next task.
  ASSERT_OK(bg.Start([&] {
    ++ran;
    return absl::OkStatus();
  }));
  EXPECT_OK(bg.Wait());
  EXPECT_EQ(ran.load(), 2);
}

TEST(BackgroundTaskTest, StartingTwiceWithoutWaitingIsRefused) {
  BackgroundTask bg;
  absl::Notification release;
  int ran = 0;
  ASSERT_OK(bg.Start([&] {
    release.WaitForNotification();
    ++ran;
    return absl::OkStatus();
  }));
  EXPECT_EQ(bg.Start([&] {
                ran += 100;
                return absl::OkStatus();
              }).code(),
            absl::StatusCode::kFailedPrecondition);
  release.Notify();
  EXPECT_OK(bg.Wait());
  EXPECT_EQ(ran, 1);  // The refused task never ran.
}

TEST(BackgroundTaskTest, DestructorWaitsForARunningTask) {
  std::atomic<bool> finished{false};
  {
    BackgroundTask bg;
    ASSERT_OK(bg.Start([&] {
      absl::SleepFor(absl::Milliseconds(50));
      finished = true;
      return absl::OkStatus();
    }));
  }
  EXPECT_TRUE(finished.load());
}

}  // namespace
}  // namespace gradmesh
