// Built-in placement strategies (see placement.h).
#include "coordinator/placement.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"

namespace gradmesh {
namespace {

// a is less loaded than b: lower used/slots, then more free slots, then name.
bool LessLoaded(const NodeLoad& a, const NodeLoad& b) {
  const int64_t lhs = static_cast<int64_t>(a.used) * std::max(b.slots, 1);
  const int64_t rhs = static_cast<int64_t>(b.used) * std::max(a.slots, 1);
  if (lhs != rhs) return lhs < rhs;
  if (a.free() != b.free()) return a.free() > b.free();
  return a.name < b.name;
}

// "w0: 1, w1: 0" (free slots per alive node), or "none alive".
std::string Offer(const std::vector<NodeLoad>& nodes) {
  if (nodes.empty()) return "none alive";
  std::vector<NodeLoad> sorted = nodes;
  std::sort(sorted.begin(), sorted.end(),
            [](const NodeLoad& a, const NodeLoad& b) { return a.name < b.name; });
  std::vector<std::string> parts;
  for (const NodeLoad& n : sorted) parts.push_back(absl::StrCat(n.name, ": ", n.free()));
  return absl::StrJoin(parts, ", ");
}

int TotalFree(const std::vector<NodeLoad>& nodes, bool one_per_node) {
  int total = 0;
  for (const NodeLoad& n : nodes) total += one_per_node ? std::min(n.free(), 1) : n.free();
  return total;
}

absl::Status NotEnoughWorkers(const PlacementInput& in, bool one_per_node) {
  const int offered = TotalFree(in.workers, one_per_node);
  if (one_per_node) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job needs ", in.spec.num_workers(), " workers on distinct worker nodes (mode ",
        in.spec.mode(), ": a node's peer address serves one rank per job) but only ", offered,
        " alive worker nodes have a free slot (", Offer(in.workers),
        "); start more gradmesh_worker --coordinator=... daemons or lower num_workers"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "job needs ", in.spec.num_workers(), " workers but the alive worker nodes offer ", offered,
      " slots (", Offer(in.workers),
      "); start more gradmesh_worker --coordinator=... daemons or lower num_workers"));
}

// num_shards distinct least-loaded server nodes with a free slot (none for peer modes).
absl::StatusOr<std::vector<std::string>> PlaceShards(const PlacementInput& in) {
  if (!IsPsMode(SpecMode(in.spec)) || in.skip_shards) return std::vector<std::string>{};
  std::vector<NodeLoad> candidates;
  for (const NodeLoad& n : in.servers) {
    if (n.free() > 0) candidates.push_back(n);
  }
  const int need = in.spec.num_shards();
  if (static_cast<int>(candidates.size()) < need) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job needs ", need, " shards on distinct server nodes but only ", candidates.size(),
        " alive server nodes have a free slot (", Offer(in.servers),
        "); start more gradmesh_server --coordinator=... daemons or lower num_shards"));
  }
  std::sort(candidates.begin(), candidates.end(), LessLoaded);
  std::vector<std::string> out;
  for (int s = 0; s < need; ++s) out.push_back(candidates[s].name);
  return out;
}

class SpreadPlacement : public PlacementStrategy {
 public:
  absl::StatusOr<JobPlacement> Place(const PlacementInput& in) const override {
    JobPlacement p;
    auto shards = PlaceShards(in);
    if (!shards.ok()) return shards.status();
    p.shard_nodes = std::move(shards).value();
    const bool one = OneRankPerNode(in.spec);
    if (TotalFree(in.workers, one) < in.spec.num_workers()) return NotEnoughWorkers(in, one);
    std::vector<NodeLoad> nodes = in.workers;
    std::vector<bool> taken(nodes.size(), false);
    for (int r = 0; r < in.spec.num_workers(); ++r) {
      int best = -1;
      for (size_t i = 0; i < nodes.size(); ++i) {
        if (nodes[i].free() == 0 || (one && taken[i])) continue;
        if (best < 0 || LessLoaded(nodes[i], nodes[best])) best = static_cast<int>(i);
      }
      // TotalFree above guarantees a candidate.
      p.worker_nodes.push_back(nodes[best].name);
      nodes[best].used++;
      taken[best] = true;
    }
    return p;
  }
};

class PackPlacement : public PlacementStrategy {
 public:
  absl::StatusOr<JobPlacement> Place(const PlacementInput& in) const override {
    JobPlacement p;
    auto shards = PlaceShards(in);
    if (!shards.ok()) return shards.status();
    p.shard_nodes = std::move(shards).value();
    const bool one = OneRankPerNode(in.spec);
    if (TotalFree(in.workers, one) < in.spec.num_workers()) return NotEnoughWorkers(in, one);
    // Hosts by capacity for this job, largest first: taking the largest groups first uses the
    // fewest hosts.
    std::map<std::string, std::vector<NodeLoad>> by_host;
    for (const NodeLoad& n : in.workers) {
      if (n.free() > 0) by_host[n.host.empty() ? n.name : n.host].push_back(n);
    }
    struct Host {
      std::string name;
      int capacity;
      std::vector<NodeLoad> nodes;
    };
    std::vector<Host> hosts;
    for (auto& kv : by_host) {
      std::sort(kv.second.begin(), kv.second.end(), LessLoaded);
      hosts.push_back({kv.first, TotalFree(kv.second, one), std::move(kv.second)});
    }
    std::stable_sort(hosts.begin(), hosts.end(),
                     [](const Host& a, const Host& b) { return a.capacity > b.capacity; });
    const int need = in.spec.num_workers();
    for (const Host& h : hosts) {
      for (const NodeLoad& n : h.nodes) {
        const int take = one ? 1 : n.free();
        for (int k = 0; k < take && static_cast<int>(p.worker_nodes.size()) < need; ++k) {
          p.worker_nodes.push_back(n.name);
        }
      }
      if (static_cast<int>(p.worker_nodes.size()) == need) break;
    }
    return p;
  }
};

}  // namespace

PlacementRegistry PlacementRegistry::WithBuiltins() {
  PlacementRegistry registry;
  registry.Register("spread", [] { return std::make_unique<SpreadPlacement>(); });
  registry.Register("pack", [] { return std::make_unique<PackPlacement>(); });
  return registry;
}

absl::StatusOr<std::unique_ptr<PlacementStrategy>> PlacementRegistry::Create(
    const std::string& name) const {
  auto factory = factories_.Find(name);
  if (!factory.ok()) return factory.status();
  return (**factory)();
}

std::string DefaultPlacementFor(const JobSpec& spec) {
  return SpecMode(spec) == Mode::kAllreduce ? "pack" : "spread";
}

bool OneRankPerNode(const JobSpec& spec) {
  const Mode mode = SpecMode(spec);
  return mode == Mode::kGossip || mode == Mode::kAllreduce;
}

std::optional<std::string> PickReplacement(const std::vector<NodeLoad>& candidates) {
  if (candidates.empty()) return std::nullopt;
  const NodeLoad* best = &candidates[0];
  for (const NodeLoad& n : candidates) {
    if (LessLoaded(n, *best)) best = &n;
  }
  return best->name;
}

}  // namespace gradmesh
