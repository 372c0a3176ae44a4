#include "coordinator/task_state.h"

#include <string>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(TaskStateTest, NamesRoundTrip) {
  for (TaskState s : {TaskState::kPending, TaskState::kRunning, TaskState::kSucceeded,
                      TaskState::kFailed, TaskState::kStopped, TaskState::kLost}) {
    ASSERT_OK_AND_ASSIGN(TaskState parsed, ParseTaskState(TaskStateName(s)));
    EXPECT_EQ(parsed, s) << TaskStateName(s);
  }
}

TEST(TaskStateTest, WireNamesAreTheProtoStrings) {
  EXPECT_EQ(TaskStateName(TaskState::kPending), "pending");
  EXPECT_EQ(TaskStateName(TaskState::kRunning), "running");
  EXPECT_EQ(TaskStateName(TaskState::kSucceeded), "succeeded");
  EXPECT_EQ(TaskStateName(TaskState::kFailed), "failed");
  EXPECT_EQ(TaskStateName(TaskState::kStopped), "stopped");
  EXPECT_EQ(TaskStateName(TaskState::kLost), "lost");
}

TEST(TaskStateTest, UnknownNamesAreInvalidArgument) {
  EXPECT_STATUS_MSG(ParseTaskState("Running"), absl::StatusCode::kInvalidArgument,
                    "unknown task state \"Running\"");
  EXPECT_STATUS(ParseTaskState(""), absl::StatusCode::kInvalidArgument);
}

TEST(TaskStateTest, Unfinished) {
  EXPECT_TRUE(IsUnfinished(TaskState::kPending));
  EXPECT_TRUE(IsUnfinished(TaskState::kRunning));
  EXPECT_FALSE(IsUnfinished(TaskState::kSucceeded));
  EXPECT_FALSE(IsUnfinished(TaskState::kFailed));
  EXPECT_FALSE(IsUnfinished(TaskState::kStopped));
  EXPECT_FALSE(IsUnfinished(TaskState::kLost));
}

}  // namespace
}  // namespace gradmesh
