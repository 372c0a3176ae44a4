// The local step of a gossip rank: what its own gradient and buffer deltas do to its replica's
// values x (replica.h), between gossip exchanges.
//
// x holds the whole model in ModelView order (worker/core/training_mode.h): the parameters'
// elements [0, param_numel) first, then the buffers' (BatchNorm running statistics,
// num_batches_tracked, ...). The optimizer runs on the parameters only, with slots for the
// parameters only. A buffer is not optimised: the step's forward already moved it, by its
// delta; that move is added to x (x += delta), to the current shared value like the
// gradient step (AD-PSGD applies the update to the values as mixed since the forward).
// Without it the next BeforeForward would copy the old x back into the model and the
// forward's change would be lost. Mixing (push-sum or pairwise averaging) treats buffers
// like parameters: they are averaged in every exchange (replica.h).
//
// Not LibTorch- or gRPC-dependent.
#ifndef GRADMESH_WORKER_GOSSIP_LOCAL_STEP_H_
#define GRADMESH_WORKER_GOSSIP_LOCAL_STEP_H_

#include <cstdint>

#include "absl/types/span.h"
#include "common/optimizer.h"

namespace gradmesh {

// One local step on x (x.size() == grad.size() >= param_numel): the optimizer's update number
// `update` (1-based) at `lr_scale` on x[0, param_numel) from grad[0, param_numel), with
// `slots` (optimizer.num_slots() arrays of param_numel floats); x[i] += grad[i] for the
// buffers' elements i >= param_numel (grad there holds their deltas).
void ApplyLocalStep(const Optimizer& optimizer, int64_t update, float lr_scale,
                    absl::Span<const float> grad, int64_t param_numel, float* const* slots,
                    absl::Span<float> x);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_LOCAL_STEP_H_
