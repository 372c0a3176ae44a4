// Mode "allreduce": synchronous data parallel training without shards.
//
// Every rank builds the model from the job's seed (identical initial parameters), reads its
// shard of the data (LoaderOptions(spec, rank), like DistributedSampler) and keeps its own
// copy of the optimizer (common/optimizer.h, the shards' torch::optim math; lr schedule over
// decay_updates = total steps when 0). Each step: forward, backward; LibTorch gradient hooks
// put each gradient into its bucket (bucket_reducer.h: ~allreduce.bucket_bytes, reverse
// parameter order), and a bucket is all-reduced on a communication thread as soon as it is
// complete, overlapping the rest of backward (as DDP). The optimizer then runs piece by piece
// as the all-reduce finalises the gradient (BucketReducer's streaming FinishStep: each ring
// segment once its sum is complete), so the update of one piece overlaps the transfer of the
// next. The averaged gradients are bit-identical on every rank, so is the update: 2 ranks
// with batch b compute what one process with batch 2b does (up to float summation order).
//
// Collectives: JobSpec.allreduce.backend through CollectiveRegistry (collective.h): "ring"
// is the ring all-reduce over the workers' gRPC CollectiveService (ring.h, grpc_ring.h);
// "nccl" is NCCL on one GPU per rank within one node (--config=cuda builds; UNIMPLEMENTED in
// CPU builds); "auto" takes nccl where every rank can, else the ring (the train_start line
// says which). Before training the ranks check they run the same model/schedule
// (FAILED_PRECONDITION otherwise).
//
// Failures: a peer that dies, or sends nothing for allreduce.timeout_s, fails the step on the
// others with UNAVAILABLE or DEADLINE_EXCEEDED naming the peer's rank and address; never a
// hang. Stop: a stop request is voted with the step's last bucket, so all ranks stop after
// the same step (stopped_early). Progress lines: event=progress job rank step total epoch
// loss (mean over ranks) samples_per_s data_ms compute_ms comm_ms (from the end of backward
// to the end of the update, optimizer included) opt_ms (inside the optimizer, overlapping
// comm_ms) allreduce_ms (communication thread busy) bytes_per_step.
//
// Checkpoints (spec.checkpoint.every_steps > 0): after every such step each rank writes
// params + optimizer slots + step to <checkpoint.dir or options.checkpoint_dir>/<job>/
// rank-<r>.ckpt (checkpoint.h, atomic, previous kept as .prev). On start the ranks exchange
// the steps they have and resume from the newest step all of them have (with the data they
// would have seen); FAILED_PRECONDITION listing every rank's steps if there is none in
// common.
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
