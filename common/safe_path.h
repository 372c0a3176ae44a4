// Paths built from names (job names, rank file names) that must stay inside their directory.
//
// JoinUnder(dir, component) appends one path component to `dir` after checking that the
// component cannot leave it: not empty, not "." or "..", no '/', no NUL, no control
// characters, at most kMaxPathComponent bytes. It does not touch the file system (no
// symlink resolution): it guards against names, not against a hostile directory tree.
//
// Thread safety: pure functions.
#ifndef GRADMESH_COMMON_SAFE_PATH_H_
#define GRADMESH_COMMON_SAFE_PATH_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradmesh {

// Longest component accepted, bytes (NAME_MAX on Linux).
inline constexpr size_t kMaxPathComponent = 255;

// OK if `component` is one safe path component (see above); INVALID_ARGUMENT saying why not.
absl::Status CheckPathComponent(absl::string_view component);

// `dir` + "/" + `component` (no doubled '/' when `dir` ends with one; `dir` empty: the
// component alone, relative to the working directory). INVALID_ARGUMENT naming `dir` and the
// component when the component is unsafe.
absl::StatusOr<std::string> JoinUnder(absl::string_view dir, absl::string_view component);

// A rank's checkpoint file, <dir>/<job>/rank-<rank>.ckpt (allreduce and gossip). INVALID_ARGUMENT
// when `job` breaks the name rule (common/job_name.h), the path would leave `dir`, or rank < 0.
absl::StatusOr<std::string> RankCheckpointPath(absl::string_view dir, const std::string& job,
                                               int rank);

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_SAFE_PATH_H_
