// Mode "allreduce" as a TrainingMode: synchronous data parallel over a Collective.
//
// Start: connect the collective (ring, nccl, hierarchical: collective.h), check that every
// rank runs the same job (a fingerprint all-gathered), and resume from the newest checkpoint
// step every rank has. During backward each gradient goes to its bucket the moment autograd
// produces it (OnGradient), and a communication thread all-reduces each full bucket while
// backward continues (bucket_reducer.h, as PyTorch DDP). Exchange: every rank applies the same
// update, from bit-identical averaged gradients, piece by piece as the all-reduce finishes them
// (the optimizers are elementwise). A stop request rides with the step's last bucket, so every
// rank stops after the same step (collective_stop()).
//
// Thread safety: see worker/training_mode.h (OnGradient runs on autograd's thread).
#ifndef GRADMESH_WORKER_ALLREDUCE_ALLREDUCE_MODE_H_
#define GRADMESH_WORKER_ALLREDUCE_ALLREDUCE_MODE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/core/training_mode.h"

namespace gradmesh {

class CollectiveServiceImpl;  // worker/allreduce/collective_service.h

// `local`: this process's collective peer service; not owned. INVALID_ARGUMENT if it is null
// or the peer list does not name every rank.
absl::StatusOr<std::unique_ptr<TrainingMode>> NewAllreduceMode(const TrainerOptions& options,
                                                               CollectiveServiceImpl* local);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_ALLREDUCE_MODE_H_
