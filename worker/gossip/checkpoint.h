// Gossip checkpoints: one file per rank, <dir>/<job>/rank-<r>.ckpt, holding what a rank needs
// to continue: its values, push-sum weight, optimizer slots and steps done (the data position
// follows from the step; see BatchLoader::Options::first_step).
//
// Format: common/checkpoint.h, kind "gossip"; metadata rank, num_workers, step, num_slots,
// buffer_values (int64) and weight (double); float32 arrays "values" (numel: the parameters,
// then buffer_values elements of the model's buffers) and "slots" (num_slots * the
// parameters' numel, slot-major; buffers have no slots). Files without buffer_values (written
// before buffers were part of the model) have none: they load as before. Written crash-safely
// (temporary file, fsync, rename, directory fsync) keeping the previous file as <path>.prev; reads
// fall back to it when <path> is missing or corrupt.
//
// Files of the old gossip format (before common/checkpoint; little-endian "GMGOSCK1", int32
// rank, int32 num_workers, int64 numel, int32 num_slots, int64 step, float64 weight, the
// values, the slots, CRC-32 of the rest) are still read; old allreduce files are refused.
//
// Thread safety: functions are thread-safe for distinct paths.
#ifndef GRADMESH_WORKER_GOSSIP_CHECKPOINT_H_
#define GRADMESH_WORKER_GOSSIP_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/checkpoint.h"

namespace gradmesh {

struct GossipCheckpoint {
  int32_t rank = 0;
  int32_t num_workers = 1;
  int64_t step = 0;           // Local steps done.
  double weight = 1;          // Push-sum weight.
  std::vector<float> values;  // Flat parameters, then buffers (de-biased).
  int64_t buffer_values = 0;  // The buffers' elements: the last ones of `values`.
  // num_slots * (values.size() - buffer_values) optimizer slots (parameters only), slot-major.
  std::vector<float> slots;
  int32_t num_slots = 0;
};

// Creates the parent directory if needed. INTERNAL naming the path on I/O errors;
// INVALID_ARGUMENT when buffer_values is not in [0, values.size()] or slots.size() !=
// num_slots * (values.size() - buffer_values).
absl::Status WriteGossipCheckpoint(const std::string& path, const GossipCheckpoint& ckpt);

// Reads <path>, or <path>.prev when <path> is missing, truncated or corrupt.
// NOT_FOUND if neither file exists; DATA_LOSS naming the file(s) if they are truncated, have
// the wrong magic or sizes, or fail the CRC; FAILED_PRECONDITION for a checkpoint of another
// kind (e.g. an allreduce one).
absl::StatusOr<GossipCheckpoint> ReadGossipCheckpoint(const std::string& path);

// The same, also telling which file was read and why <path> was not (when it was not).
absl::StatusOr<GossipCheckpoint> ReadGossipCheckpoint(const std::string& path,
                                                      ckpt::CheckpointSource* source);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_CHECKPOINT_H_
