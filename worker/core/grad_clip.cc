// ClipGradients (see grad_clip.h).
#include "worker/core/grad_clip.h"

#include <algorithm>
#include <cmath>

namespace gradmesh {

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
  if (options.max_norm > 0 && std::isfinite(s.norm)) {
    const double coef = options.max_norm / (s.norm + 1e-6);
    if (coef < 1) {
      const float f = static_cast<float>(coef);
      for (absl::Span<float> g : grads) {
        for (float& x : g) x *= f;
      }
      s.clipped = true;
    }
  }
  return s;
}

}  // namespace gradmesh
