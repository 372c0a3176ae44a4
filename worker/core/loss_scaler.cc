#include "worker/core/loss_scaler.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

namespace gradmesh {

LossScaler::LossScaler(const LossScaleSpec& spec) {
  if (spec.mode() != "dynamic") return;
  enabled_ = true;
  scale_ = static_cast<float>(spec.init_scale());
  growth_factor_ = static_cast<float>(spec.growth_factor());
  backoff_factor_ = static_cast<float>(spec.backoff_factor());
  growth_interval_ = spec.growth_interval();
}

bool LossScaler::Unscale(absl::Span<const absl::Span<float>> grads) const {
  return UnscaleAndCheck(grads, scale_);
}

bool UnscaleAndCheck(absl::Span<const absl::Span<float>> grads, float scale) {
  // A multiplication by the reciprocal, as GradScaler does (exact for powers of two).
  const float inv = 1.0f / scale;
  bool finite = true;
  for (absl::Span<float> g : grads) {
    for (float& v : g) {
      v *= inv;
      finite &= std::isfinite(v);
    }
  }
  return finite;
}

float LossScaler::Update(bool skipped) {
  if (!enabled_) return scale_;
  if (skipped) {
    ++skipped_;
    good_in_a_row_ = 0;
    // Never to zero: the smallest normal float32 keeps the loss finite and the run going.
    scale_ = std::max(scale_ * backoff_factor_, FLT_MIN);
    return scale_;
  }
  if (++good_in_a_row_ >= growth_interval_) {
    good_in_a_row_ = 0;
    const float grown = scale_ * growth_factor_;
    // GradScaler grows only to a finite scale.
    if (std::isfinite(grown)) scale_ = grown;
  }
  return scale_;
}

}  // namespace gradmesh
