// Job and node names: one rule for every entry point (job specs, the CLI, daemon flags, the
// coordinator's Submit/Register, a shard's InitJob, the workers' peer RPCs).
//
// The rule (DNS-label-like): 1 to 63 characters, each a lowercase ASCII letter, a digit or
// '-', the first and last a letter or digit. No dots, no '_', no '/', no uppercase, no
// non-ASCII. Names become file names (checkpoints `<dir>/<job>/rank-<r>.ckpt`), RocksDB key
// parts ("/" separates key parts), log values and Kubernetes/DNS labels, so a name that
// passes can be used in all of them unchanged.
//
// Thread safety: pure functions.
#ifndef GRADMESH_COMMON_JOB_NAME_H_
#define GRADMESH_COMMON_JOB_NAME_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace gradmesh {

// Longest valid name, in characters (a DNS label).
inline constexpr size_t kMaxNameLength = 63;

// The rule in words, for error messages.
inline constexpr char kNameRule[] =
    "1-63 characters: lowercase letters a-z, digits 0-9 and '-', starting and ending with a "
    "letter or digit (no dots, '_', '/', uppercase or non-ASCII)";

// True if `name` follows the rule above.
inline bool IsValidName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxNameLength) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
    if (!ok) return false;
  }
  return name.front() != '-' && name.back() != '-';
}

// Job names follow the rule above.
inline bool IsValidJobName(absl::string_view name) { return IsValidName(name); }

// OK, or INVALID_ARGUMENT `<field> "<name>" is not a valid name: <rule>` (`field` says where
// the name came from, e.g. "job spec: name", "InitJob: job", "--node"). An over-long name is
// quoted only in part.
inline absl::Status CheckName(absl::string_view field, absl::string_view name) {
  if (IsValidName(name)) return absl::OkStatus();
  if (name.size() > 80) {
    return absl::InvalidArgumentError(absl::StrCat(field, " \"", name.substr(0, 80), "...\" (",
                                                   name.size(),
                                                   " bytes) is not a valid name: ", kNameRule));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " \"", name, "\" is not a valid name: ", kNameRule));
}

// A valid name made from a host name, for a daemon started without --node: the first DNS
// label, lowercased, every other character outside the rule replaced by '-', cut to 63
// characters, leading and trailing '-' dropped; "node" if nothing is left.
// "Worker_1.Example.com" -> "worker-1".
inline std::string NameFromHost(absl::string_view host) {
  std::string out;
  for (char c : host.substr(0, host.find('.'))) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    const bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
    out.push_back(ok ? c : '-');
    if (out.size() == kMaxNameLength) break;
  }
  const size_t first = out.find_first_not_of('-');
  if (first == std::string::npos) return "node";
  out = out.substr(first, out.find_last_not_of('-') - first + 1);
  return out;
}

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_JOB_NAME_H_
