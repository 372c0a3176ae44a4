// Per-rank checkpoints of mode "allreduce": <dir>/<job>/rank-<r>.ckpt holds the step, the
// parameters, the buffers and the parameters' optimizer slots of one rank, as float32 arrays
// (the layout is ModelUpdater's, model_updater.h).
//
// File format: common/checkpoint.h, kind "allreduce"; metadata "step" (int64); float32 arrays
// "a0", "a1", ... in the caller's order. Written atomically: a temporary file in the same
// directory is written and fsynced, the old <path> (when it is a valid checkpoint) is renamed
// to rank-<r>.ckpt.prev, the new one renamed over <path>, the directory fsynced. So a crash
// at any point leaves the newest complete checkpoint, and the one before it, readable
// (PlanResume uses both when ranks stopped between their checkpoints of one step).
//
// Files of the old allreduce format (before common/checkpoint: little-endian "GMARCKP1", u64
// step, u32 count, per array u64 length and the floats, u32 CRC-32 of the rest) are still
// read; gossip checkpoints are refused.
//
// Thread safety: free functions; concurrent calls on the same path are not supported.
#ifndef GRADMESH_WORKER_ALLREDUCE_CHECKPOINT_H_
#define GRADMESH_WORKER_ALLREDUCE_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace gradmesh {

struct RankCheckpoint {
  int64_t step = 0;
  std::vector<std::vector<float>> arrays;  // Parameters, buffers, then optimizer slots.
};

// Creates the directory if needed. INTERNAL (naming the path and errno) on I/O errors.
absl::Status WriteCheckpoint(const std::string& path, int64_t step,
                             const std::vector<absl::Span<const float>>& arrays);

// Reads exactly `path` (no fallback to .prev: ReadAvailableCheckpoints reads both).
// NOT_FOUND if the file does not exist; DATA_LOSS naming the path if it is truncated or its
// checksum does not match; FAILED_PRECONDITION for a checkpoint of another kind or with
// arrays that are not float32.
absl::StatusOr<RankCheckpoint> ReadCheckpoint(const std::string& path);

// The checkpoints this rank can resume from: `path` and `path`.prev, newest first (absent
// or unreadable ones skipped).
std::vector<RankCheckpoint> ReadAvailableCheckpoints(const std::string& path);

// What ReadAvailableCheckpoints would return, without keeping the arrays in memory: each
// file is verified (checksums streamed in constant memory), then only its header is kept.
struct RankCheckpointInfo {
  std::string path;  // `path` or `path`.prev: pass it to ReadCheckpoint.
  int64_t step = 0;
  std::vector<int64_t> array_sizes;  // Elements per array.
};
std::vector<RankCheckpointInfo> ListAvailableCheckpoints(const std::string& path);

// Where the ranks resume, given the steps each has checkpoints for (per rank, any order):
// the largest step all ranks have (each restores its own file), or, when no step is common
// (a rank moved to a node without its files, or whose files were lost), the newest step any
// rank has, which `source`, the lowest rank holding it, sends to the others (every replica of
// an allreduce job holds the same model and optimizer state). Step 0: no rank has any.
struct ResumePlan {
  int64_t step = 0;
  int source = -1;  // -1: every rank has `step`.
};
ResumePlan PlanResume(const std::vector<std::vector<int64_t>>& steps_per_rank);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_CHECKPOINT_H_
