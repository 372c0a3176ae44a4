#include "common/status.h"

#include "absl/strings/str_cat.h"

namespace gradmesh {

std::string StatusCodeName(absl::StatusCode code) {
  std::string s = absl::StatusCodeToString(code);
  for (char& c : s) {
    if (c == ' ') c = '_';
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  }
  return s;
}

absl::Status Annotate(const absl::Status& status, const std::string& context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace gradmesh
