// Writing exported tensors as a PyTorch state_dict file: the output of `gradmesh export`,
// loadable with Python's `torch.load(path)` (a dict name -> float32 tensor, in layout order)
// and with LibTorch's torch::pickle_load.
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
// InvalidArgument if a tensor's values do not match its shape or two tensors share a name;
// Internal (with the path) if the file cannot be written.
absl::Status SaveStateDict(const std::string& path, const std::vector<ExportedTensor>& tensors);

}  // namespace cli
}  // namespace gradmesh

#endif  // GRADMESH_CLI_STATE_DICT_H_
