// Gradient clipping (JobSpec.clip_grad_value, clip_grad_norm) over float32 spans, free of
// LibTorch, with torch.nn.utils semantics:
//   clip_grad_value_(v):  every element clamped to [-v, v];
//   clip_grad_norm_(c):   total = sqrt(sum of squares over every span); when
//                         c / (total + 1e-6) < 1, every element is multiplied by it.
// Values first, then the norm (as a script calling both in that order). Where it runs: the
// training loop for async, ssp and gossip (each worker's own gradient), the allreduce mode on
// the averaged gradient (so it is the global norm, identical on every rank); sync through the
// shards (server/sync_commits.h: the shards' parts of the norm, the workers' coefficient).
//
// Thread safety: pure functions of their arguments.
#ifndef GRADMESH_WORKER_CORE_GRAD_CLIP_H_
#define GRADMESH_WORKER_CORE_GRAD_CLIP_H_

#include <cstdint>

#include "absl/types/span.h"

namespace gradmesh {

struct ClipOptions {
  double max_norm = 0;   // <= 0: no norm clipping.
  double max_value = 0;  // <= 0: no value clipping.
  bool enabled() const { return max_norm > 0 || max_value > 0; }
};

struct ClipStats {
  double norm = 0;       // L2 norm over every span, after value clipping, before norm clipping.
  bool clipped = false;  // Some value was clamped or the norm was scaled.
};

// torch's clip_grad_norm_ coefficient for a gradient of L2 norm `norm`: max_norm / (norm +
// 1e-6) when that is below 1, else 1 (also when max_norm <= 0 or the norm is not finite).
double ClipCoefficient(double max_norm, double norm);

// Clips `grads` in place. A non-finite norm is left alone (reported, not scaled), as torch does
// with error_if_nonfinite=False: the mode's own checks then see it.
ClipStats ClipGradients(absl::Span<const absl::Span<float>> grads, const ClipOptions& options);

// Running totals for progress lines and metrics.
struct ClipCounters {
  int64_t steps = 0;    // Steps clipped at (options enabled).
  int64_t clipped = 0;  // ... of which something was clipped.
  double norm_sum = 0;  // Sum of pre-clip norms.
  void Add(const ClipStats& s) {
    ++steps;
    clipped += s.clipped ? 1 : 0;
    norm_sum += s.norm;
  }
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_CORE_GRAD_CLIP_H_
