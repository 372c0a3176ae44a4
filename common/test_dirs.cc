#include "common/test_dirs.h"

#include <errno.h>
#include <sys/stat.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace gradmesh {
namespace testutil {
namespace {

std::string ErrnoText(int err) { return absl::StrCat(std::strerror(err), " (errno ", err, ")"); }

}  // namespace

std::string TestTmpDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  std::string out = dir != nullptr && *dir != '\0' ? dir : "/tmp";
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

absl::StatusOr<std::string> MakeTestDir(const std::string& name) {
  const std::string dir = absl::StrCat(TestTmpDir(), "/", name);
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::InternalError(absl::StrCat("MakeTestDir: mkdir ", dir, ": ", ErrnoText(errno)));
  }
  return dir;
}

absl::StatusOr<std::string> MakeUniqueTestDir(const std::string& prefix) {
  std::string tmpl = absl::StrCat(TestTmpDir(), "/", prefix, ".XXXXXX");
  if (mkdtemp(tmpl.data()) == nullptr) {
    return absl::InternalError(
        absl::StrCat("MakeUniqueTestDir: mkdtemp ", tmpl, ": ", ErrnoText(errno)));
  }
  return tmpl;
}

}  // namespace testutil
}  // namespace gradmesh
