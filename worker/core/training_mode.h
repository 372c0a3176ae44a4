// TrainingMode: what one training mode adds to the one training loop (worker/training_loop.h).
//
// The loop owns everything the modes share: the data (sharded, prefetched batches), the model
// (creation, the float32 check), forward/backward (the only backward() call of worker/),
// timing (data / compute / comm), progress lines and reports, stop requests, evaluation and
// saving. A mode supplies only what differs, through these hooks, called in this order:
//
//   Start(model, info)            connect, initialise or restore; returns the first step
//   UseDeviceGradients(g)         once, after Start, where the gradients stay on a device
//   per step:
//     BeforeForward(step)         e.g. gossip copies the latest mixed values into the model
//     AwaitParameters(b, e)       before the forward reads entries [b, e) (ps overlap: 2)
//     BeforeBackward(step, ...)   e.g. allreduce opens the step's buckets
//     OnBufferDeltas(deltas)      the buffers' deltas, known after the last forward
//                                 (only if wants_gradient_hook() and the model has buffers)
//     OnGradient(i, grad)         during backward, as each parameter's gradient is produced
//                                 (only if wants_gradient_hook())
//     Exchange(step, grads, ...)  the step's exchange and update (push/pull, all-reduce and
//                                 optimizer, local update and gossip round)
//     MaybeCheckpoint(step + 1)   after the step is counted
//   Finish(step, result)          the final exchange; leaves the final model in the model
//                                 view and says whether this rank evaluates and saves it
//
// A new mode is one file implementing this interface plus one line registering its factory
// (worker/modes.h). Modes never see LibTorch: the model is a list of float32 spans that
// alias the parameters' storage.
//
// Thread safety: a mode is used by one training thread, except OnGradient, which LibTorch may
// call from its autograd thread while backward runs (the loop's thread waits for it), and
// SetGroup and OnStopRequested, which may be called from any thread at any time.
#ifndef GRADMESH_WORKER_TRAINING_MODE_H_
#define GRADMESH_WORKER_TRAINING_MODE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/logging.h"
#include "common/registry.h"
#include "worker/core/device_gradients.h"
#include "worker/core/examples.h"
#include "worker/core/grad_clip.h"
#include "worker/core/train_util.h"

namespace gradmesh {

// The model as the modes see it: every trainable parameter as a contiguous float32 span over
// the model's own storage (writing through a span changes the model), in the model's fixed
// parameter order, followed by the model's buffers (BatchNorm running statistics,
// num_batches_tracked, ...) as float32 mirrors that the loop keeps.
//
// Entries [0, num_params) are parameters; [num_params, size) are buffers. For a buffer entry:
// * the loop copies the mirror into the model's buffer before every forward (after
//   BeforeForward), and after backward writes the buffer's new value into the mirror;
// * the "gradient" the mode gets for it (OnGradient is never called for buffers; Exchange's
//   grads holds it) is the delta the step's forward added: new value - value before forward;
// * a mode never applies its optimizer to it. What it does instead is the buffer semantics of
//   the mode: ps modes push the delta (the shards add the mean of the pushed deltas, see
//   TensorSpec.buffer) and overwrite the mirror with the pulled value; allreduce averages the
//   deltas (mirror = before + mean delta, so every rank holds the same buffers); gossip keeps
//   the local delta and averages the mirror with the parameters.
// Integer buffers travel as float32 (exact below 2^24) and are rounded back into the model.
struct ModelView {
  std::vector<std::string> names;            // "fc1.weight", ..., "bn1.running_mean", ...
  std::vector<std::vector<int64_t>> shapes;  // Tensor shapes.
  std::vector<absl::Span<float>> params;     // Parameters alias the model; buffers: mirrors.
  std::vector<ElemType> dtypes;              // The model's element type of each entry.
  int num_params = 0;                        // Entries before the first buffer.

  int size() const { return static_cast<int>(params.size()); }
  bool is_buffer(int i) const { return i >= num_params; }
  int64_t numel() const {
    int64_t n = 0;
    for (const absl::Span<float>& p : params) n += static_cast<int64_t>(p.size());
    return n;
  }
};

// What the loop knows before the first step.
struct LoopInfo {
  int64_t total_steps = 0;      // Steps of the whole job for this rank (from the data).
  int64_t steps_per_epoch = 0;  // >= 1.
};

// The result of one step's exchange.
struct StepOutcome {
  double loss = 0;    // The step's training loss as reported (allreduce: mean over ranks).
  bool stop = false;  // Every rank stops after this step (a stop decided collectively).
  // Loss scaling: the step's gradient was not finite, so nothing was updated (modes that
  // unscale themselves, and SkipStep, set it).
  bool skipped = false;
};

// How the step's time went so far (seconds), for modes that adapt to it (auto codec).
struct StepTiming {
  double compute_s = 0;  // Forward and backward of this step.
};

class TrainingMode {
 public:
  virtual ~TrainingMode() = default;

  // Connects, initialises or restores the mode for `model` (whose parameters hold the seeded
  // initial values; the mode may overwrite them, e.g. with the shards' or a checkpoint's
  // values). Returns the first step to run: 0 for a new job, > 0 when resuming. `model`
  // outlives the mode.
  virtual absl::StatusOr<int64_t> Start(ModelView* model, const LoopInfo& info) = 0;

  // Mode-specific fields of the train_start line (the loop logs the common ones).
  virtual std::vector<LogField> StartFields() const { return {}; }

  // True when a stop request is decided collectively: the loop does not stop by itself but
  // passes the request to BeforeBackward, and stops after the step whose outcome says stop.
  // False: the loop stops before the next step.
  virtual bool collective_stop() const { return false; }

  // Before the forward pass of `step` (0-based).
  virtual absl::Status BeforeForward(int64_t step) { return absl::OkStatus(); }

  // The previous step's Exchange may return before its pulled values have all arrived (ps
  // overlap: 2). Waits until entries [begin, end) of the model view hold them; returns that
  // exchange's first error (the loop then ends the run). OK at once when nothing is owed.
  // The loop calls it before a forward reads those entries: layer by layer from inside the
  // forward where the model can (Model::SetParameterGate), else for every entry before the
  // forward; and for every entry after the step's first forward (before backward and
  // BeforeBackward). Finish and MaybeCheckpoint settle what is still owed themselves.
  virtual absl::Status AwaitParameters(int begin, int end) { return absl::OkStatus(); }

  // After the forward pass of `step`, before backward: its local loss and whether a stop was
  // requested (only meaningful when collective_stop()).
  virtual void BeforeBackward(int64_t step, double loss, bool stop_requested) {}

  // Whether OnGradient should be called during backward.
  virtual bool wants_gradient_hook() const { return false; }

  // Offered once, after Start, when the gradients stay where backward produced them (a GPU;
  // worker/core/device_gradients.h says when the loop offers it). True: from now on the mode
  // reads every step's parameter gradients through `gradients` (valid until Finish returns),
  // and the parameters' entries of Exchange's grads are not refreshed (buffer deltas are);
  // false (the default): nothing changes.
  virtual bool UseDeviceGradients(DeviceGradients* gradients) { return false; }

  // Parameter `param`'s gradient (param < num_params), the moment backward has produced it
  // (float32, contiguous, valid only during the call).
  virtual void OnGradient(int param, absl::Span<const float> grad) {}

  // The step's buffer deltas (entries num_params.. of the model view, as Exchange's grads will
  // hold them), after the step's last forward and BeforeBackward, before backward; valid
  // until Exchange returns.
  virtual void OnBufferDeltas(absl::Span<const absl::Span<const float>> deltas) {}

  // Backward failed after BeforeBackward: undo what the step started.
  virtual void AbortStep() {}

  // The step's exchange and update. `grads` holds every entry's gradient in model order: the
  // parameters' gradients, then the buffers' deltas (see ModelView; valid during the call).
  // INTERNAL/UNAVAILABLE/... end the run with that status.
  virtual absl::StatusOr<StepOutcome> Exchange(int64_t step,
                                               absl::Span<const absl::Span<const float>> grads,
                                               double loss, const StepTiming& timing) = 0;

  // Dynamic loss scaling (JobSpec loss_scale, worker/core/loss_scaler.h). The gradients the
  // mode gets (OnGradient, Exchange) are then multiplied by the loss scale. A mode that
  // returns true here unscales and checks them itself (allreduce: the averaged gradient, so
  // every rank skips the same steps): the loop calls SetLossScale before every Exchange and
  // reads StepOutcome.skipped. Otherwise the loop unscales the gradient before Exchange and,
  // when it is not finite, calls SkipStep instead of Exchange.
  virtual bool unscales_gradients() const { return false; }
  virtual void SetLossScale(float scale) {}

  // A step whose gradient was not finite: no update and no exchange of that gradient. The
  // default does nothing else (async/ssp: no push; gossip: no local step, no round); a mode
  // whose step must still happen overrides it (diloco: a round that ends at this step).
  virtual absl::StatusOr<StepOutcome> SkipStep(int64_t step, double loss) {
    StepOutcome out;
    out.loss = loss;
    out.skipped = true;
    return out;
  }

  // After `steps_done` steps (absolute): writes a checkpoint if one is due. True if written.
  virtual absl::StatusOr<bool> MaybeCheckpoint(int64_t steps_done) { return false; }

  // Bytes this rank has sent so far (on the wire), for the progress lines.
  virtual int64_t bytes_sent() const = 0;

  // Mode-specific fields of a progress line: `done` steps in this run (>= 1), `window` steps
  // since the last progress line.
  virtual std::vector<LogField> ProgressFields(int64_t done, int64_t window) { return {}; }

  // Modes that clip the gradient themselves (allreduce: the averaged one): the counters since
  // the last call, which resets them. Called at every progress line.
  virtual ClipCounters TakeClipCounters() { return {}; }

  // After the last step (`step` absolute; result->stopped_early says whether a stop request
  // ended the run). Does the final exchange, fills the byte counts of *result (and may add to
  // comm_s / set consensus_distance), and returns true if this rank evaluates and saves: then
  // the model view holds the job's final model.
  virtual absl::StatusOr<bool> Finish(int64_t step, TrainResult* result) = 0;

  // Mode-specific fields of the evaluated line.
  virtual std::vector<LogField> EvaluatedFields() const { return {}; }

  // A sync job's barrier group was re-formed: the ranks still in it (empty: all) and whether
  // this rank evaluates at the end. Ignored by modes without such a group.
  virtual void SetGroup(std::vector<int32_t> active_ranks, bool evaluate) {}

  // The coordinator moved a peer rank (or it lost its node: address ""): `peers`, one address
  // per rank, replaces the peer addresses this rank started with. Gossip takes them in place
  // (a restart would lose the rank's progress); other modes ignore it. Any thread.
  virtual void SetPeers(std::vector<std::string> peers) {}

  // A stop was requested (SIGTERM, cancel) while the mode may be inside Finish: waits there
  // that are only courtesy to peers should end. Any thread, any time.
  virtual void OnStopRequested() {}

  // The coordinator restarts every rank of this job (a new generation: a peer was lost or
  // moved), so this run is over at once, without a collective stop: waits on peers end and
  // the run fails (ABORTED; its report, under the old generation, is not counted). Nothing
  // of an unfinished step is kept. Any thread, any time; modes without peers to wait on
  // ignore it (a stop request ends them as promptly).
  virtual void Abort() {}
};

// Makes a mode for one rank of one job. `options` (with options.mode parsed) outlives the mode.
using TrainingModeFactory =
    std::function<absl::StatusOr<std::unique_ptr<TrainingMode>>(const TrainerOptions& options)>;

// Modes by name (ModeName(): "async", "ssp", "sync", "gossip", "allreduce"). The built-in
// modes are registered by worker/modes.h, which binds them to this process's services.
using TrainingModeRegistry = NamedRegistry<TrainingModeFactory>;

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_TRAINING_MODE_H_
