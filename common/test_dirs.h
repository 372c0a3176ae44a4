// Directories for tests under Bazel's $TEST_TMPDIR: per-test folders for logs and port files,
// and fresh, empty ones for durable state. Test-only (the targets that use it are testonly).
//
// Thread safety: thread-safe free functions.
#ifndef GRADMESH_COMMON_TEST_DIRS_H_
#define GRADMESH_COMMON_TEST_DIRS_H_

#include <string>

#include "absl/status/statusor.h"

namespace gradmesh {
namespace testutil {

// $TEST_TMPDIR (or /tmp outside Bazel), without a trailing '/'.
std::string TestTmpDir();

// Creates (if needed) and returns TestTmpDir()/<name>; for per-test logs and port files.
absl::StatusOr<std::string> MakeTestDir(const std::string& name);

// Creates a new, empty directory TestTmpDir()/<prefix>.XXXXXX (mkdtemp) and returns it; each
// call gets its own, so state from an earlier run or call (a durable store) is never reused.
absl::StatusOr<std::string> MakeUniqueTestDir(const std::string& prefix);

}  // namespace testutil
}  // namespace gradmesh

#endif  // GRADMESH_COMMON_TEST_DIRS_H_
