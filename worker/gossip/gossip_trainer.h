// Mode "gossip": decentralised training without shards.
//
// STUB INTERFACE (to be implemented): every rank holds the full model and its own optimizer,
// trains on its share of the data, and every gossip.every_steps steps averages parameters
// with peers chosen by the job's topology (worker/gossip/topology.h), never waiting for a slow
// or dead peer beyond gossip.timeout_s.
#ifndef GRADMESH_WORKER_GOSSIP_GOSSIP_TRAINER_H_
#define GRADMESH_WORKER_GOSSIP_GOSSIP_TRAINER_H_

#include <atomic>

#include "absl/status/statusor.h"
#include "worker/train_util.h"

namespace gradmesh {

class GossipServiceImpl;  // worker/gossip/gossip_service.h

// Runs options.rank's part of a gossip job. options.peers lists every rank's peer-service
// address; `local` is this process's GossipService (already serving on
// options.peers[options.rank]), through which peers' chunks arrive. Returns when the job's
// last step is done (rank 0 evaluates if options.evaluate), when `stop` becomes true
// (stopped_early). A dead or slow peer is skipped, never an error.
absl::StatusOr<TrainResult> RunGossip(const TrainerOptions& options,
                                         GossipServiceImpl* local,
                                         const std::atomic<bool>& stop);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_GOSSIP_TRAINER_H_
