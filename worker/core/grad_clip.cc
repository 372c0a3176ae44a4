// ClipGradients (see grad_clip.h).
#include "worker/core/grad_clip.h"

#include <algorithm>
#include <cmath>

namespace gradmesh {

double ClipCoefficient(double max_norm, double norm) {
  if (!(max_norm > 0) || !std::isfinite(norm)) return 1;
  const double coef = max_norm / (norm + 1e-6);
  return coef < 1 ? coef : 1;
}

ClipStats ClipGradients(absl::Span<const absl::Span<float>> grads, const ClipOptions& options) {
  ClipStats s;
  if (options.max_value > 0) {
    const float v = static_cast<float>(options.max_value);
    for (absl::Span<float> g : grads) {
      for (float& x : g) {
        const float c = std::clamp(x, -v, v);
        if (c != x) s.clipped = true;
        x = c;
      }
    }
  }
  double sq = 0;
  for (absl::Span<float> g : grads) {
    for (float x : g) sq += static_cast<double>(x) * x;
  }
  s.norm = std::sqrt(sq);
  if (const double coef = ClipCoefficient(options.max_norm, s.norm); coef < 1) {
    const float f = static_cast<float>(coef);
    for (absl::Span<float> g : grads) {
      for (float& x : g) x *= f;
    }
    s.clipped = true;
  }
  return s;
}

}  // namespace gradmesh
