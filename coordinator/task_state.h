// TaskState: the state of one placed task (a job's rank on a worker daemon, as reported by
// TaskReport.state and shown in WorkerPlacement.state). The strings are the wire and stored
// form (proto/coordinator.proto, the coordinator's RocksDB records); code inside coordinator/
// compares the enum and converts exactly where a string enters (a report, a loaded record)
// or leaves (a placement's state field, a log line).
//
// Job states are not here: they are the proto enum gradmesh::JobState already.
//
// Thread safety: pure functions.
#ifndef GRADMESH_COORDINATOR_TASK_STATE_H_
#define GRADMESH_COORDINATOR_TASK_STATE_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradmesh {

enum class TaskState {
  kPending,    // "pending": placed, its daemon has not reported it running yet.
  kRunning,    // "running"
  kSucceeded,  // "succeeded"
  kFailed,     // "failed": the job fails with it.
  kStopped,    // "stopped": its daemon left cleanly (reports only; the rank moves).
  kLost,       // "lost": no node could take it (placements only).
};

// "pending", "running", "succeeded", "failed", "stopped", "lost".
absl::string_view TaskStateName(TaskState state);

// The inverse of TaskStateName (exact, lower case). INVALID_ARGUMENT naming `name` and the
// known names otherwise (also for "").
absl::StatusOr<TaskState> ParseTaskState(absl::string_view name);

// Whether a rank in this state still has to run (pending or running).
inline bool IsUnfinished(TaskState state) {
  return state == TaskState::kPending || state == TaskState::kRunning;
}

}  // namespace gradmesh

#endif  // GRADMESH_COORDINATOR_TASK_STATE_H_
