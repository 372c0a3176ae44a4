// The parameter-server modes (async, ssp:<s>, sync) as a TrainingMode.
//
// The job's layout is the model view: parameters, then buffers (TensorSpec.buffer = true,
// dtype the model's element type). A buffer is one more tensor on the shards: its initial
// value is the mirror's, its "gradient" is the delta the step's forward added (the shards add
// it as is in async/ssp, the mean of the step's deltas in sync; no optimizer), and every pull
// overwrites the mirror with the shards' value. Buffer chunks are pushed and pulled dense
// whatever the codecs (worker/ps/parameter_client.h).
//
// Start: every worker offers the same seeded initial values (InitJob: the first wins, the rest
// find the job), then pulls the shards' values (parameters and buffers) and resumes after the
// last step the shards recorded for this rank (the minimum over shards; 0 for a new job).
// Exchange: push every gradient and buffer delta to its shards in parallel, then pull fresh
// values into the model (compression.push "auto" lets AutoCodec switch the push codec as it
// measures the job).
// Pipeline (JobSpec.pipeline: 1; async and ssp): step t's push and pull run on a background
// thread while step t+1 (all its micro-batches) computes on the values pulled after step t-1;
// the push of step t carries the chunk versions its gradients were computed on, so the
// shards' staleness (histogram, staleness damping) counts the one step of staleness the
// pipeline adds. The next Exchange waits for that exchange (the exposed part of its time; the
// rest is hidden behind compute, reported as exchange_ms / exposed_ms / hidden in progress
// lines), then copies the pulled values into the model. Finish, and a stop, wait for it
// first, so every counted step's push is acknowledged.
// Overlap (JobSpec.overlap: 1; async, ssp, sync without commit_steps): each shard's part of
// step t's exchange (push fused with pull, ParameterClient::PushPullShards) is sent by a
// background thread as soon as backward has produced every gradient and buffer delta that
// shard holds; Exchange sends the rest and waits (worker/ps/backward_overlap.h). Progress
// lines carry exchange_ms / exposed_ms / hidden / early_shards.
// Checkpoints are the shards' durable snapshots (checkpoint.every_steps turns them on, see
// common/job_spec.h); the loop reports them at those steps.
// Finish: tell the shards this worker finished (not after a stop request: the shards keep
// waiting for a worker that may be resumed); the evaluating rank waits until every worker of
// the group finished, then pulls the final parameters.
//
// Thread safety: see worker/training_mode.h; SetGroup may be called from any thread.
#ifndef GRADMESH_WORKER_PS_PS_MODE_H_
#define GRADMESH_WORKER_PS_PS_MODE_H_

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "worker/core/parameter_client_interface.h"
#include "worker/core/training_mode.h"

namespace gradmesh {

// Makes the ParameterClient once the model (and so the job's layout) is known.
using ParameterClientFactory =
    std::function<absl::StatusOr<std::unique_ptr<ParameterClient>>(JobLayout layout)>;

// INVALID_ARGUMENT if `client_factory` is empty.
absl::StatusOr<std::unique_ptr<TrainingMode>> NewPsMode(const TrainerOptions& options,
                                                        ParameterClientFactory client_factory);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_PS_PS_MODE_H_
