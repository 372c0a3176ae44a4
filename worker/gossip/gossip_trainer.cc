#include "worker/gossip/gossip_trainer.h"

namespace gradmesh {

absl::StatusOr<TrainResult> RunGossip(const TrainerOptions&, GossipServiceImpl*,
                                         const std::atomic<bool>&) {
  return absl::UnimplementedError("gossip mode is not implemented yet");
}

}  // namespace gradmesh
