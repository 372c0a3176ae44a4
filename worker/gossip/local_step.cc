// The local step of a gossip rank (see local_step.h).
#include "worker/gossip/local_step.h"

namespace gradmesh {

void ApplyLocalStep(const Optimizer& optimizer, int64_t update, float lr_scale,
                    absl::Span<const float> grad, int64_t param_numel, float* const* slots,
                    absl::Span<float> x) {
  optimizer.Apply(update, lr_scale, grad.data(), x.data(), slots, param_numel);
  const int64_t n = static_cast<int64_t>(x.size());
  for (int64_t i = param_numel; i < n; ++i) x[i] += grad[i];
}

}  // namespace gradmesh
