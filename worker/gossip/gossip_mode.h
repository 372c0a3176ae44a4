// Mode "gossip" as a TrainingMode: decentralised training without shards.
//
// Each rank keeps a replica x and a push-sum weight w (replica.h); the model is copied from the
// replica before every forward pass (BeforeForward), the local optimizer step is applied to the
// replica under its lock (Exchange: AD-PSGD applies the gradient to the current, possibly
// freshly mixed, model), and every gossip.every_steps steps the background Gossiper
// (gossiper.h) runs an exchange round with peers. Checkpoints (checkpoint.every_steps) hold
// the replica, the weight and the optimizer slots; a rank resumes from its own.
//
// Finish: a finished rank hands its final (x, w) to rank 0, which averages every live rank's
// final into the model and evaluates it; a stopped rank writes a checkpoint and keeps its
// state for a resume.
//
// Thread safety: see worker/training_mode.h.
#ifndef GRADMESH_WORKER_GOSSIP_GOSSIP_MODE_H_
#define GRADMESH_WORKER_GOSSIP_GOSSIP_MODE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/core/training_mode.h"

namespace gradmesh {

class GossipServiceImpl;  // worker/gossip/gossip_service.h

// `local`: this process's gossip peer service (serving on options.peers[rank]); not owned.
// INVALID_ARGUMENT if it is null, the rank or the peer list do not fit the job, or the gossip
// spec has no timeout or period (defaults not applied).
absl::StatusOr<std::unique_ptr<TrainingMode>> NewGossipMode(const TrainerOptions& options,
                                                            GossipServiceImpl* local);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_GOSSIP_MODE_H_
