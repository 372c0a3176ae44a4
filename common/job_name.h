// Job names: [A-Za-z0-9_.-]+. They appear in logs, RocksDB keys ("/" separates key parts)
// and file names, so every entry point checks them the same way.
//
// Thread safety: pure function.
#ifndef GRADMESH_COMMON_JOB_NAME_H_
#define GRADMESH_COMMON_JOB_NAME_H_

#include "absl/strings/string_view.h"

namespace gradmesh {

// True if `name` is non-empty and uses only letters, digits, '_', '.' and '-'.
inline bool IsValidJobName(absl::string_view name) {
  if (name.empty()) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_JOB_NAME_H_
