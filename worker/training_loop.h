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
// After the last step (or a stop request) the mode finishes; if it says this rank evaluates,
// the loop evaluates the final model on the test set, logs `evaluated`, reports the accuracy
// and saves the model to spec.output() when set.
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
