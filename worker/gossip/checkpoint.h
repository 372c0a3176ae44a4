// Gossip checkpoints: one file per rank, <dir>/<job>/rank-<r>.ckpt, holding what a rank needs
// to continue: its values, push-sum weight, optimizer slots and steps done (the data position
// follows from the step; see BatchLoader::Options::first_step).
//
// Format (little-endian): "GMGOSCK1", int32 rank, int32 num_workers, int64 numel,
// int32 num_slots, int64 step, float64 weight, numel float32 values, num_slots * numel float32
// slots, then the CRC-32 (zlib) of everything before it as uint32.
// Written to <path>.tmp, flushed, then renamed over <path>: a crash leaves the old or the new
// file, never a torn one.
//
// Thread safety: functions are thread-safe for distinct paths.
#ifndef GRADMESH_WORKER_GOSSIP_CHECKPOINT_H_
#define GRADMESH_WORKER_GOSSIP_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace gradmesh {

struct GossipCheckpoint {
  int32_t rank = 0;
  int32_t num_workers = 1;
  int64_t step = 0;                 // Local steps done.
  double weight = 1;                // Push-sum weight.
  std::vector<float> values;        // Flat parameters (de-biased).
  std::vector<float> slots;         // num_slots * values.size() optimizer slots, slot-major.
  int32_t num_slots = 0;
};

// <dir>/<job>/rank-<rank>.ckpt
std::string GossipCheckpointPath(const std::string& dir, const std::string& job, int32_t rank);

// Creates the parent directory if needed. Internal naming the path on I/O errors.
absl::Status WriteGossipCheckpoint(const std::string& path, const GossipCheckpoint& ckpt);

// NOT_FOUND if the file does not exist; DATA_LOSS naming the path if it is truncated, has
// the wrong magic or sizes, or fails the CRC.
absl::StatusOr<GossipCheckpoint> ReadGossipCheckpoint(const std::string& path);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_CHECKPOINT_H_
