// The built-in model names, checked without LibTorch's headers (they cost ~15 s and 1 GB per
// translation unit): for code that validates a job spec before any model exists.
#ifndef GRADMESH_WORKER_MODEL_NAMES_H_
#define GRADMESH_WORKER_MODEL_NAMES_H_

#include <string>

#include "absl/status/status.h"

namespace gradmesh {

// OK if ModelRegistry::WithBuiltins() (worker/model.h) knows `name`; otherwise its
// INVALID_ARGUMENT listing the known names.
absl::Status CheckModelName(const std::string& name);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_MODEL_NAMES_H_
