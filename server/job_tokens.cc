#include "server/job_tokens.h"

#include "absl/strings/str_cat.h"
#include "rpc/auth.h"

namespace gradmesh {

void JobTokens::Set(const std::string& job, const std::string& token) {
  absl::MutexLock lock(&mu_);
  tokens_[job] = token;
}

void JobTokens::Remove(const std::string& job) {
  absl::MutexLock lock(&mu_);
  tokens_.erase(job);
}

absl::Status JobTokens::Check(const std::string& job, absl::string_view presented) const {
  absl::MutexLock lock(&mu_);
  auto it = tokens_.find(job);
  if (it == tokens_.end()) {
    if (!required_) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat(
        "job ", job, " is not placed on this shard (yet): no task from the coordinator"));
  }
  if (!ConstantTimeEquals(it->second, presented)) {
    return absl::PermissionDeniedError(
        absl::StrCat("job ", job, ": missing or wrong job token (metadata x-gradmesh-job-token)"));
  }
  return absl::OkStatus();
}

}  // namespace gradmesh
