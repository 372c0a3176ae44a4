// Placement strategies: which alive nodes run a new job's shards and ranks.
//
// A strategy sees the alive nodes of each role with their slot capacity and current load
// (ranks or shards of the coordinator's active jobs) and returns one node per shard and per
// rank, or FAILED_PRECONDITION saying what is missing and what to do about it.
//
// Built-ins (PlacementRegistry::WithBuiltins()):
// * "spread" (default except for allreduce): each rank goes to the least-loaded worker node
//   with a free slot (load = used / slots, ties: more free slots, then name), so ranks fan
//   out over nodes.
// * "pack" (default for allreduce): ranks fill as few hosts as possible (hosts with the most
//   candidate nodes first; within a host, least-loaded nodes first), so consecutive ranks
//   share a machine (NCCL/shared memory within a host).
// Both place shards the same way: num_shards distinct server nodes with a free slot, least
// loaded first. gossip and allreduce jobs get no shards.
//
// One rank per node per job in gossip and allreduce: a worker daemon serves one peer address,
// which identifies one rank of a job, so these modes never put two ranks of one job on one
// node (a placement that would need it is refused; see OneRankPerNode). ps-mode ranks talk
// only to shards, so a node may run several ranks of one ps job, up to its slots.
//
// Thread safety: strategies are stateless (const methods may be called concurrently); the
// registry follows common/registry.h.
#ifndef GRADMESH_COORDINATOR_PLACEMENT_H_
#define GRADMESH_COORDINATOR_PLACEMENT_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/registry.h"
#include "proto/gradmesh.pb.h"

namespace gradmesh {

// A node as placement sees it.
struct NodeLoad {
  std::string name;
  std::string host;  // Machine; empty means the node is its own host.
  int slots = 0;     // Capacity (NodeInfo.slots).
  int used = 0;      // Ranks or shards of active jobs on it now.

  int free() const { return used < slots ? slots - used : 0; }
};

struct PlacementInput {
  JobSpec spec;                   // Defaults applied and validated.
  std::vector<NodeLoad> servers;  // Alive server nodes.
  std::vector<NodeLoad> workers;  // Alive worker nodes.
  // Resuming a ps job: its shards stay where they are (the caller keeps them), so only ranks
  // are placed and shard_nodes comes back empty.
  bool skip_shards = false;
};

struct JobPlacement {
  std::vector<std::string> shard_nodes;   // Index = shard (empty for gossip/allreduce).
  std::vector<std::string> worker_nodes;  // Index = rank.
};

class PlacementStrategy {
 public:
  virtual ~PlacementStrategy() = default;

  // A placement for input.spec, or FAILED_PRECONDITION naming the need, the offer (each alive
  // node with its free slots) and the fix. Deterministic for a given input.
  virtual absl::StatusOr<JobPlacement> Place(const PlacementInput& input) const = 0;
};

using PlacementFactory = std::function<std::unique_ptr<PlacementStrategy>()>;

class PlacementRegistry {
 public:
  static PlacementRegistry WithBuiltins();

  void Register(const std::string& name, PlacementFactory factory) {
    factories_.Set(name, std::move(factory));
  }
  // INVALID_ARGUMENT listing the known names for an unknown one.
  absl::StatusOr<std::unique_ptr<PlacementStrategy>> Create(const std::string& name) const;
  std::vector<std::string> Names() const { return factories_.Names(); }

 private:
  NamedRegistry<PlacementFactory> factories_{"placement strategy"};
};

// "pack" for allreduce, "spread" otherwise.
std::string DefaultPlacementFor(const JobSpec& spec);

// True for modes whose ranks are addressed by their node's peer address (gossip, allreduce).
bool OneRankPerNode(const JobSpec& spec);

// Where a rank goes when its node failed: the least-loaded candidate (as "spread" orders
// them) regardless of free slots (a moved rank may exceed a node's slots rather than stop
// the job).
// nullopt when there is no candidate. The caller filters candidates (alive, not the failed
// node, and for OneRankPerNode modes not already running a rank of the job).
std::optional<std::string> PickReplacement(const std::vector<NodeLoad>& candidates);

}  // namespace gradmesh

#endif  // GRADMESH_COORDINATOR_PLACEMENT_H_
