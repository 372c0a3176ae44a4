// Writing exported tensors as a PyTorch state_dict file: the output of `gradmesh export`,
// loadable with Python's `torch.load(path)` (a dict name -> tensor, in layout order, each
// tensor of its ExportedTensor.dtype: parameters float32, buffers such as
// num_batches_tracked int64, an empty shape a 0-dim tensor) so that a module's
// load_state_dict(strict=True) accepts it, and with LibTorch's torch::pickle_load.
//
// The only cli/ file that includes LibTorch (it costs ~15 s to compile).
//
// Thread safety: pure function; blocks on file I/O.
#ifndef GRADMESH_CLI_STATE_DICT_H_
#define GRADMESH_CLI_STATE_DICT_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cli/shard_export.h"

namespace gradmesh {
namespace cli {

// Serialises with torch::pickle_save (the zip format of torch.save) and writes `path`
// through a temporary file renamed into place, so a failed export leaves no partial file.
// Values are converted to each tensor's dtype: float64 exactly, float16/bfloat16 rounded to
// nearest even, integers rounded to nearest (halves away from zero) and clamped to the type's
// range, bool as value != 0.
// InvalidArgument if a tensor's values do not match its shape, two tensors share a name or a
// dtype is unknown;
// Internal (with the path) if the file cannot be written.
absl::Status SaveStateDict(const std::string& path, const std::vector<ExportedTensor>& tensors);

}  // namespace cli
}  // namespace gradmesh

#endif  // GRADMESH_CLI_STATE_DICT_H_
