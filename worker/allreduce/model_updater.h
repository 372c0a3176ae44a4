// The model side of an allreduce step: what the averaged gradients and buffer deltas do to
// the model, and the model's part of a checkpoint. The model is given as the entries of a
// ModelView (worker/core/training_mode.h): float32 spans, parameters then buffers; the
// updater does not include that header, so it builds and tests without the training loop.
//
// Parameters [0, num_params): the optimizer runs on every rank on the averaged gradient, piece
// by piece as the BucketReducer finishes them (the optimizers are elementwise), with one set
// of slots per parameter.
//
// Buffers [num_params, size) (BatchNorm running statistics, num_batches_tracked, ...): buffers
// averaged every step, the analogue of DDP's broadcast_buffers. Each rank's forward moved its
// buffers by its own delta; the deltas are all-reduced (in bucket(s) after the parameters')
// and every rank sets buffer = value before the step's forward + mean delta. No optimizer, no
// slots. The value before the forward is kept here (`before_`, the buffers as the last
// exchange left them), not recomputed as mirror - own delta: that would round differently on
// each rank, and the ranks' buffers would drift apart; before_ + mean is bit-identical on
// every rank because both terms are.
//
// Checkpoint arrays, in order: every entry (parameters, then buffers), then the optimizer
// slots of each parameter (slot-major per parameter). For a model without buffers this is
// the layout written before buffers existed, so those checkpoints still load.
//
// Thread safety: one thread (the training thread) uses an updater.
#ifndef GRADMESH_WORKER_ALLREDUCE_MODEL_UPDATER_H_
#define GRADMESH_WORKER_ALLREDUCE_MODEL_UPDATER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/optimizer.h"
#include "worker/allreduce/bucket_reducer.h"
#include "worker/allreduce/checkpoint.h"
#include "worker/core/grad_clip.h"
#include "worker/core/loss_scaler.h"

namespace gradmesh {

class ModelUpdater {
 public:
  // `entries`: ModelView::params (the spans' storage must outlive the updater), `names`:
  // ModelView::names, `num_params`: ModelView::num_params. The buffers' current values are
  // their values before the first step. `optimizer_spec` is the job's (decay updates already
  // applied). INVALID_ARGUMENT for an unknown optimizer or num_params out of range.
  static absl::StatusOr<std::unique_ptr<ModelUpdater>> Create(
      std::vector<absl::Span<float>> entries, std::vector<std::string> names, int num_params,
      const OptimizerSpec& optimizer_spec);

  // Every entry's numel (parameters, then buffers): the BucketReducer's `numels`.
  const std::vector<int64_t>& numels() const { return numels_; }
  int num_params() const { return num_params_; }
  int num_slots() const { return num_slots_; }
  // Parameter `p`'s optimizer slots: num_slots() arrays of its numel. Buffers have none.
  const std::vector<std::vector<float>>& slots(int p) const { return slots_[p]; }

  // Ends step `step` (0-based): hands the buffers' deltas (grads[num_params, size)) to
  // `reducer` (its parameters' gradients came through ParamReady during backward), waits for
  // the all-reduce and applies it as it arrives: the optimizer on the parameters, buffer =
  // before + mean delta. `grads` holds every entry in model order (Exchange's). Returns the
  // reducer's error.
  absl::Status FinishStep(BucketReducer* reducer, int64_t step,
                          absl::Span<const absl::Span<const float>> grads);

  // Clipping of the averaged gradient (JobSpec.clip_grad_norm / clip_grad_value): the global
  // norm, bit-identical on every rank. With it on, FinishStep gathers the whole mean gradient
  // before the optimizer runs (the all-reduce still overlaps backward). Default off.
  void set_clip(const ClipOptions& clip) { clip_ = clip; }
  // Dynamic loss scaling (JobSpec.loss_scale): the gradients of the next FinishStep are
  // multiplied by `scale`. FinishStep then gathers the whole mean (buffer deltas too),
  // divides the gradient by the scale and, if any element of it or of the buffers' mean
  // deltas is not finite, skips the step: no optimizer, buffers back to their values before
  // it. The same verdict on every rank, since every rank checks the same bit-identical mean.
  void set_loss_scale(float scale) {
    scaling_ = true;
    loss_scale_ = scale;
  }
  // Whether the last FinishStep skipped the optimizer (loss scaling found a non-finite mean).
  bool last_step_skipped() const { return skipped_; }

  // The clipping counters since the last call (reset).
  ClipCounters TakeClipCounters() {
    ClipCounters c = clip_counters_;
    clip_counters_ = ClipCounters{};
    return c;
  }

  // Seconds spent in the optimizer so far.
  double optimizer_seconds() const { return opt_s_; }

  // The arrays of this rank's checkpoint (views of the model and the slots).
  std::vector<absl::Span<const float>> CheckpointArrays() const;
  // Whether `c` has this model's number of arrays (else it is another model's).
  bool Fits(const RankCheckpoint& c) const;
  // Copies `c` (read from `path`) into the model and the slots; the buffers' restored values
  // become the values before the next step. FAILED_PRECONDITION naming the path and entry
  // when an array has the wrong size (nothing is changed then).
  absl::Status Restore(const RankCheckpoint& c, const std::string& path);

 private:
  ModelUpdater(std::vector<absl::Span<float>> entries, std::vector<std::string> names,
               int num_params, const OptimizerSpec& optimizer_spec,
               std::unique_ptr<Optimizer> optimizer);
  std::string EntryName(size_t i) const;
  // Buffer `p`'s piece [begin, begin + mean.size()): value = before = before + mean delta.
  void ApplyBufferMean(int p, int64_t begin, absl::Span<const float> mean);
  // FinishStep with clipping or loss scaling: the whole mean first, unscaled and checked,
  // clipped, then the optimizer.
  absl::Status FinishGatheredStep(BucketReducer* reducer, int64_t step, float lr_factor);

  const std::vector<absl::Span<float>> entries_;
  const std::vector<std::string> names_;
  const OptimizerSpec optimizer_spec_;
  const std::unique_ptr<Optimizer> optimizer_;
  const int num_params_;
  const int num_slots_;
  std::vector<int64_t> numels_;
  std::vector<std::vector<std::vector<float>>> slots_;  // [param][slot][element].
  std::vector<float*> slot_ptrs_;
  std::vector<std::vector<float>> before_;  // [buffer][element]: before the step's forward.
  bool scaling_ = false;
  float loss_scale_ = 1;
  bool skipped_ = false;
  double opt_s_ = 0;
  ClipOptions clip_;
  ClipCounters clip_counters_;
  std::vector<std::vector<float>> means_;  // [param][element]: the step's mean, when clipping.
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_MODEL_UPDATER_H_
