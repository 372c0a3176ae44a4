// Optimizers applied by parameter-server shards (and by workers in gossip and allreduce modes) to
// chunks of float32 parameters.
//
// An Optimizer is stateless itself: the per-element state ("slots", e.g. momentum buffers or
// Adam moments) is owned by the caller, one float per slot per element, so a shard can keep
// it beside the chunk it belongs to and persist it. The math follows torch::optim of LibTorch
// 1.13 exactly (same order of operations, float32 arithmetic), and is tested against it.
//
// Registry: optimizers are created by name from an OptimizerSpec through an
// OptimizerRegistry; unknown names are InvalidArgument listing the known ones.
//
// Thread safety: Optimizer::Apply is const and may run concurrently on different chunks.
// OptimizerRegistry is not thread-safe while being modified; Create() is const.
#ifndef GRADMESH_COMMON_OPTIMIZER_H_
#define GRADMESH_COMMON_OPTIMIZER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/registry.h"
#include "proto/gradmesh.pb.h"

namespace gradmesh {

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // Number of float slots per parameter element (0 for plain SGD, 1 for momentum, 2 for Adam).
  virtual int num_slots() const = 0;

  // Applies one update to param[0, n) from grad[0, n). `slots[i]` points at the i-th slot
  // array of n floats (zero-initialised before the first update). `step` is the 1-based
  // number of this update of these elements. `lr_scale` multiplies the learning rate (1 for
  // the spec's rate; consistency policies may damp it). Never fails: inputs are validated
  // before (finite gradients of the right length).
  virtual void Apply(int64_t step, float lr_scale, const float* grad, float* param,
                     float* const* slots, int64_t n) const = 0;
};

// Factor by which spec.lr is scaled for the update with 0-based index `update` of a chunk,
// following spec.lr_schedule (see OptimizerSpec in gradmesh.proto). Assumes the spec passed
// ValidateLrSchedule().
float LrScheduleFactor(const OptimizerSpec& spec, int64_t update);

// InvalidArgument for an unknown schedule (listing the known ones) or bad parameters.
absl::Status ValidateLrSchedule(const OptimizerSpec& spec);

class OptimizerRegistry {
 public:
  using Factory =
      std::function<absl::StatusOr<std::unique_ptr<Optimizer>>(const OptimizerSpec& spec)>;

  // A registry holding "sgd", "adam" and "adamw".
  static OptimizerRegistry WithBuiltins();

  // Adds or replaces a factory.
  void Register(const std::string& name, Factory factory);

  // InvalidArgument for an unknown name (listing the known ones) or bad hyper-parameters.
  absl::StatusOr<std::unique_ptr<Optimizer>> Create(const OptimizerSpec& spec) const;

  std::vector<std::string> names() const;

 private:
  NamedRegistry<Factory> factories_{"optimizer"};
};

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_OPTIMIZER_H_
