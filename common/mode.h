// The training modes as an enum: parsed once where a job spec is read (strings stay at the
// edges: the spec, logs, the CLI).
//
//   async, ps (= async), ssp:<staleness>, sync  the parameter-server modes (through shards)
//   gossip                                      decentralised averaging between workers
//   allreduce                                   synchronous data parallel over a collective
//   diloco                                      local SGD: H inner steps per worker, then the
//                                               shards average the pseudo-gradients and apply
//                                               the outer optimizer (a sync barrier per round)
//
// Thread safety: pure functions.
#ifndef GRADMESH_COMMON_MODE_H_
#define GRADMESH_COMMON_MODE_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradmesh {

enum class Mode { kAsync, kSsp, kSync, kGossip, kAllreduce, kDiloco };

// "async" and "ps" -> kAsync, "ssp:<s>" (s an integer >= 0) -> kSsp, "sync", "gossip",
// "allreduce". INVALID_ARGUMENT naming the string and the known modes otherwise.
absl::StatusOr<Mode> ParseMode(absl::string_view mode);

// The canonical name: "async", "ssp", "sync", "gossip", "allreduce".
absl::string_view ModeName(Mode mode);

// async, ssp, sync and diloco go through parameter-server shards.
bool IsPsMode(Mode mode);

// sync and diloco: the shards average each step's (round's) pushes of the barrier group and
// apply them once; a group that lost workers is re-formed by the coordinator.
bool UsesSyncBarrier(Mode mode);

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_MODE_H_
