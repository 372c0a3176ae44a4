// RunTrainingLoop: the one training loop of every mode (see worker/training_mode.h for what a
// mode adds).
//
// Per step: take this rank's next batch (prefetched by BatchLoader), forward, loss, backward
// (the only backward() call in worker/), then the mode's exchange; count the step, let the
// mode checkpoint, and every spec.log_every steps (and at the last step) log one progress
// line and call options.on_progress. The progress line has the same keys in every mode:
//
//   job rank mode step total epoch epochs loss samples_per_s data_ms compute_ms comm_ms
//   bytes_per_step [checkpoint_step] + the mode's own fields (TrainingMode::ProgressFields)
//
// data_ms: waiting for the next batch; compute_ms: forward and backward; comm_ms: the mode's
// exchange and update (push/pull; all-reduce wait and optimizer; local update); all per step,
// averaged over this run. bytes_per_step: bytes this rank sent per step.
//
// Any model and any data: the batch's x and y become tensors of the dataset's element types
// and shapes (worker/core/examples.h); the loss is JobSpec.loss (worker/model.h: LossKind).
// Before anything is started (no shard or peer contacted) the loop checks the model against
// one real batch (CheckModelFitsData): a model whose output does not fit the loss fails the
// job at start with a message naming the files, shapes and dtypes. A parameter the forward
// does not use gets a zero gradient.
//
// Buffers (BatchNorm running statistics, ...) are part of the ModelView as float32 mirrors:
// see worker/core/training_mode.h for how they move between the model and the modes.
//
// After the last step (or a stop request) the mode finishes; if it says this rank evaluates,
// the loop evaluates the final model on the test set (test_loss always; accuracy for
// classification, token accuracy and perplexity for sequence models), logs `evaluated`,
// reports the figures and saves the model to spec.output() when set. In gossip and
// allreduce jobs rank 0 also hands the model to options.on_model after checkpoints, every
// options.model_publish_interval and at the end (for `gradmesh export`).
//
// Thread safety: call from one thread; `stop` may be set from any thread.
#ifndef GRADMESH_WORKER_TRAINING_LOOP_H_
#define GRADMESH_WORKER_TRAINING_LOOP_H_

#include <atomic>

#include "absl/status/statusor.h"
#include "worker/core/train_util.h"
#include "worker/core/training_mode.h"

namespace gradmesh {

// Runs rank options.rank of options.spec with `mode` (not owned). `options` has been checked
// by Trainer::Create.
absl::StatusOr<TrainResult> RunTrainingLoop(const TrainerOptions& options, TrainingMode* mode,
                                            const std::atomic<bool>& stop);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_TRAINING_LOOP_H_
