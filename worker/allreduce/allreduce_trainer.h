// Mode "allreduce": synchronous data parallel training without shards.
//
// STUB INTERFACE (to be implemented): every rank holds the full model and its own copy of
// the optimizer (common/optimizer.h, the shards' math), computes gradients on its share of
// the batch, all-reduces them (average) and applies the same update, so all ranks stay equal.
#ifndef GRADMESH_WORKER_ALLREDUCE_ALLREDUCE_TRAINER_H_
#define GRADMESH_WORKER_ALLREDUCE_ALLREDUCE_TRAINER_H_

#include <atomic>

#include "absl/status/statusor.h"
#include "worker/train_util.h"

namespace gradmesh {

class CollectiveServiceImpl;  // worker/allreduce/collective_service.h

// Runs options.rank's part of an allreduce job. options.peers lists every rank's peer-service
// address; `local` is this process's CollectiveService (already serving on
// options.peers[options.rank]), through which peers' chunks arrive. Returns when the job's
// last step is done (rank 0 evaluates if options.evaluate), when `stop` becomes true
// (stopped_early), or with an error naming the peer when a peer fails or times out.
absl::StatusOr<TrainResult> RunAllreduce(const TrainerOptions& options,
                                         CollectiveServiceImpl* local,
                                         const std::atomic<bool>& stop);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_ALLREDUCE_TRAINER_H_
