// LossScaler: dynamic loss scaling with torch.cuda.amp.GradScaler's semantics (JobSpec
// loss_scale; proto LossScaleSpec). The loop multiplies each loss by scale() before backward
// and the step's gradient by 1 / scale() before the update (Unscale); a step whose gradient
// holds Inf or NaN is skipped, and Update then multiplies the scale by backoff_factor;
// growth_interval steps in a row without a skip multiply it by growth_factor.
//
// Every rank of an allreduce job sees the same verdicts (the averaged gradient is checked), so
// their scalers stay identical. No LibTorch: the gradient is float32 spans.
//
// Thread safety: none (the training thread owns it).
#ifndef GRADMESH_WORKER_CORE_LOSS_SCALER_H_
#define GRADMESH_WORKER_CORE_LOSS_SCALER_H_

#include <cstdint>

#include "absl/types/span.h"
#include "proto/gradmesh.pb.h"

namespace gradmesh {

// Multiplies every element by 1 / scale in place; true if all of the results are finite.
bool UnscaleAndCheck(absl::Span<const absl::Span<float>> grads, float scale);

class LossScaler {
 public:
  // Off (scale 1, never skips) unless spec.mode() is "dynamic"; the spec's fields must be
  // valid (ValidateJobSpec).
  explicit LossScaler(const LossScaleSpec& spec);

  bool enabled() const { return enabled_; }
  float scale() const { return scale_; }

  // Divides every element by scale() in place; true if all of them are finite (checked on
  // the result, so a value that was finite only while scaled also counts as overflow).
  bool Unscale(absl::Span<const absl::Span<float>> grads) const;

  // After a step: `skipped` says whether its gradient was not finite. Returns the new scale.
  float Update(bool skipped);

  int64_t skipped_steps() const { return skipped_; }

 private:
  bool enabled_ = false;
  float scale_ = 1;
  float growth_factor_ = 2;
  float backoff_factor_ = 0.5f;
  int64_t growth_interval_ = 2000;
  int64_t good_in_a_row_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_CORE_LOSS_SCALER_H_
