// JobTokens: which per-job secret a shard accepts for each job (set by the coordinator's tasks
// in service mode), so the workers of one job cannot read or write another job's tensors.
//
// Clients send the token as gRPC metadata `x-gradmesh-job-token` on InitJob, Push, Pull and
// Finish (GetJobInfo, which returns no tensor values, is open). A job with a token set
// accepts only that token (PERMISSION_DENIED otherwise). A job without one is open when
// tokens are not required (standalone shards, started without --coordinator); when they are
// required (service mode), calls for it are UNAVAILABLE until the coordinator's task arrives,
// which workers retry.
//
// Thread safety: all methods may be called concurrently.
#ifndef GRADMESH_SERVER_JOB_TOKENS_H_
#define GRADMESH_SERVER_JOB_TOKENS_H_

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace gradmesh {

class JobTokens {
 public:
  explicit JobTokens(bool required) : required_(required) {}

  void Set(const std::string& job, const std::string& token) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the job's token: its calls are then treated as for a job never set.
  void Remove(const std::string& job) ABSL_LOCKS_EXCLUDED(mu_);

  // OK if `presented` may act on `job` (see above).
  absl::Status Check(const std::string& job, absl::string_view presented) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const bool required_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> tokens_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_JOB_TOKENS_H_
