// Writing a TorchScript module with exported weights: `gradmesh export --format torchscript`.
//
// The module is the file the job's rank 0 uploaded (its spec.model.path); its parameters and
// buffers are replaced, by name, with the exported tensors (converted to each module tensor's
// own dtype, e.g. num_batches_tracked back to int64), and the module is saved with
// torch::jit::Module::save, so Python loads it with torch.jit.load(FILE).
//
// One of the two cli/ files that include LibTorch (with state_dict.cc); this header does not.
//
// Thread safety: pure function; blocks on file I/O.
#ifndef GRADMESH_CLI_TORCHSCRIPT_EXPORT_H_
#define GRADMESH_CLI_TORCHSCRIPT_EXPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/shard_export.h"

namespace gradmesh {
namespace cli {

struct TorchScriptExportResult {
  int64_t tensors = 0;      // Module parameters and buffers written.
  int64_t frozen_kept = 0;  // Frozen parameters the export lacked: the module's values kept.
  // Exported tensors the module has no parameter or buffer for (not written).
  std::vector<std::string> unused;
};

// Loads the module from `module_bytes`, copies every tensor of `tensors` into the module's
// parameter or buffer of that name (a tensor the module holds under two names, tied weights,
// is covered by its first name, as the worker lists it), and writes the module to `path` through a
// temporary file renamed into place (a failed export leaves no partial file). Errors:
// INVALID_ARGUMENT when the bytes are not a TorchScript module, or a tensor's values do not
// match its shape; FAILED_PRECONDITION naming the module tensors that `tensors` lacks (every
// one must be covered, but for frozen parameters, FrozenTensors, which keep the module's
// values) or whose shapes differ; INTERNAL (with the path) when the file cannot
// be written.
absl::StatusOr<TorchScriptExportResult> SaveTorchScriptWithWeights(
    const std::string& module_bytes, const std::vector<ExportedTensor>& tensors,
    const std::string& path);

// Tied weights: the names under which the module holds a parameter or buffer it already
// holds under an earlier name (the worker trains and exchanges it once, under the first), as
// (alias, first name) pairs in the module's order. A state_dict of such a module has both
// names (PyTorch's state_dict() lists each), so an export adds the aliases for a strict
// load_state_dict. INVALID_ARGUMENT when the bytes are not a TorchScript module.
struct TiedName {
  std::string alias;
  std::string first;
};
absl::StatusOr<std::vector<TiedName>> TiedTensorNames(const std::string& module_bytes);

// Frozen parameters: those the module holds with requires_grad off while others have it on
// (all off: none are frozen). The worker neither trains nor exchanges them (worker/model.h),
// so the shards and a published model lack them; a state_dict export adds them with the
// module's values (as float32 values with the parameter's dtype). INVALID_ARGUMENT when the
// bytes are not a TorchScript module.
absl::StatusOr<std::vector<ExportedTensor>> FrozenTensors(const std::string& module_bytes);

}  // namespace cli
}  // namespace gradmesh

#endif  // GRADMESH_CLI_TORCHSCRIPT_EXPORT_H_
