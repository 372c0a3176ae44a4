// Reading small files a user names (job specs, token files) with a bound, so that a wrong
// path (/dev/zero, a multi-GB file) fails with a message instead of filling memory.
//
// Thread safety: pure functions.
#ifndef GRADMESH_COMMON_FILE_READ_H_
#define GRADMESH_COMMON_FILE_READ_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradmesh {

// The contents of `path` when it holds at most `max_bytes`. NOT_FOUND when it cannot be
// opened; INVALID_ARGUMENT naming `what`, the path and the limit when it holds more (only
// max_bytes + 1 bytes are read, so a file that never ends is refused too).
absl::StatusOr<std::string> ReadFileUpTo(const std::string& path, int64_t max_bytes,
                                         absl::string_view what);

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_FILE_READ_H_
