#include "coordinator/task_state.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace gradmesh {
namespace {

constexpr std::pair<TaskState, absl::string_view> kNames[] = {
    {TaskState::kPending, "pending"},     {TaskState::kRunning, "running"},
    {TaskState::kSucceeded, "succeeded"}, {TaskState::kFailed, "failed"},
    {TaskState::kStopped, "stopped"},     {TaskState::kLost, "lost"},
};

}  // namespace

absl::string_view TaskStateName(TaskState state) {
  for (const auto& [s, name] : kNames) {
    if (s == state) return name;
  }
  return "unknown";  // Unreachable for a valid enum value.
}

absl::StatusOr<TaskState> ParseTaskState(absl::string_view name) {
  for (const auto& [s, n] : kNames) {
    if (n == name) return s;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown task state \"", name,
                   "\" (known: pending, running, succeeded, failed, stopped, lost)"));
}

}  // namespace gradmesh
