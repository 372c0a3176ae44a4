// Consistency policies: when a shard applies pushed gradients and when a pull may proceed.
//
// A policy is chosen per job by name (JobSpec.mode / InitJobRequest.consistency) through a
// ConsistencyRegistry; unknown names are InvalidArgument listing the known ones.
//
//   "async": every push is applied on arrival; pulls never wait. Staleness (chunk version at
//            apply time minus the version the gradient was computed from) is recorded by the
//            shard for every applied chunk.
//
// Thread safety: a policy instance belongs to one job of one shard; its methods are called
// concurrently from many RPC threads and must be internally synchronised.
#ifndef GRADMESH_SERVER_CONSISTENCY_H_
#define GRADMESH_SERVER_CONSISTENCY_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace gradmesh {

struct ConsistencyConfig {
  std::string name;     // Registry key.
  int32_t num_workers;  // Workers of the job (> 0).
};

class ConsistencyPolicy {
 public:
  virtual ~ConsistencyPolicy() = default;
  virtual std::string name() const = 0;

  // Called for a validated push of `worker` at `step`. `apply(lr_scale)` applies the push's
  // gradients to its chunks; the policy calls it (now, or never for a dropped push) and
  // returns what the push returns to the worker.
  virtual absl::Status OnPush(int32_t worker, int64_t step,
                              const std::function<void(float lr_scale)>& apply) = 0;

  // Called before serving a pull of `worker`, which is at `step`. May block (bounded
  // staleness); returns an error to fail the pull.
  virtual absl::Status BeforePull(int32_t worker, int64_t step) = 0;
};

class ConsistencyRegistry {
 public:
  using Factory =
      std::function<absl::StatusOr<std::unique_ptr<ConsistencyPolicy>>(const ConsistencyConfig&)>;

  // A registry holding "async".
  static ConsistencyRegistry WithBuiltins();

  void Register(const std::string& name, Factory factory);
  absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> Create(const ConsistencyConfig& config) const;
  std::vector<std::string> names() const;

 private:
  std::map<std::string, Factory> factories_;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_CONSISTENCY_H_
