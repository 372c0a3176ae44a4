#include "common/file_read.h"

#include <algorithm>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace gradmesh {

absl::StatusOr<std::string> ReadFileUpTo(const std::string& path, int64_t max_bytes,
                                         absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " ", path));
  std::string out;
  char buf[1 << 16];
  while (in) {
    const int64_t want = std::min<int64_t>(sizeof(buf), max_bytes + 1 - out.size());
    in.read(buf, want);
    out.append(buf, static_cast<size_t>(in.gcount()));
    if (static_cast<int64_t>(out.size()) > max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is larger than ", max_bytes,
                                                     " bytes; is it the right file?"));
    }
  }
  return out;
}

}  // namespace gradmesh
