// JoinUnder (see safe_path.h).
#include "common/safe_path.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/job_name.h"
#include "common/status.h"

namespace gradmesh {

absl::Status CheckPathComponent(absl::string_view c) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("path component \"",
                                                   absl::CHexEscape(c.substr(0, 80)), "\"",
                                                   c.size() > 80 ? "..." : "", " ", why));
  };
  if (c.empty()) return bad("is empty");
  if (c == "." || c == "..") return bad("would not name an entry inside the directory");
  if (c.size() > kMaxPathComponent) {
    return bad(absl::StrCat("is ", c.size(), " bytes long (at most ", kMaxPathComponent, ")"));
  }
  for (char ch : c) {
    if (ch == '/') return bad("contains '/'");
    if (ch == '\0') return bad("contains a NUL byte");
    if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) {
      return bad("contains a control character");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> JoinUnder(absl::string_view dir, absl::string_view component) {
  if (absl::Status st = CheckPathComponent(component); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("refusing a path under \"", dir, "\": ", st.message()));
  }
  if (dir.empty()) return std::string(component);
  if (dir.back() == '/') return absl::StrCat(dir, component);
  return absl::StrCat(dir, "/", component);
}

absl::StatusOr<std::string> RankCheckpointPath(absl::string_view dir, const std::string& job,
                                               int rank) {
  RETURN_IF_ERROR(CheckName("checkpoint: job", job));
  if (rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint: rank ", rank, " is negative"));
  }
  ASSIGN_OR_RETURN(const std::string job_dir, JoinUnder(dir, job));
  return JoinUnder(job_dir, absl::StrCat("rank-", rank, ".ckpt"));
}

}  // namespace gradmesh
