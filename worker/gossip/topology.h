// Gossip topologies: which peer a rank mixes with in each round, and how (the mixing kind).
//
//   "random"       D-PSGD / AD-PSGD pairwise averaging: each round a rank picks one peer
//                  uniformly at random among the peers currently available (not backing off,
//                  not finished); both end at (x_i + x_j) / 2 (see replica.h).
//   "exponential"  Stochastic Gradient Push (Assran et al. 2019): push-sum over a time-varying
//                  exponential graph. In round t rank i sends to (i + 2^(t mod K)) mod n with
//                  K = ceil(log2 n); every round's graph is a permutation, so with all ranks
//                  alive each rank sends one share and receives one. If that peer is not
//                  available the round is skipped (the rank keeps its whole mass): push-sum
//                  stays exact on any column-stochastic schedule.
//
// The choice is a pure function of (seed, rank, n, round, availability), so runs and tests
// are reproducible. Topologies are created by name through a TopologyRegistry (a plain
// value; unknown names are InvalidArgument listing the known ones).
//
// Thread safety: Topology methods are const and may be called concurrently. A registry must
// not be modified while used.
#ifndef GRADMESH_WORKER_GOSSIP_TOPOLOGY_H_
#define GRADMESH_WORKER_GOSSIP_TOPOLOGY_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/registry.h"

namespace gradmesh {

// How a rank mixes with the peer a topology picks (see replica.h for the math).
enum class MixingKind {
  kPairwiseAverage,  // x_i = x_j = (x_i + x_j) / 2; weights stay 1.
  kPushSum,          // Send half of (x*w, w), keep half; the model is x = mass / w.
};

class Topology {
 public:
  virtual ~Topology() = default;

  virtual std::string name() const = 0;
  virtual MixingKind mixing() const = 0;

  // The peer `rank` (in [0, n)) exchanges with in `round` (>= 0), or nullopt when it has none
  // this round (n == 1, or no suitable peer is available). `available(p)` says whether peer p
  // may be contacted now; it is only called for p != rank.
  virtual std::optional<int32_t> Peer(int32_t rank, int32_t n, int64_t round,
                                      const std::function<bool(int32_t)>& available) const = 0;

  // Whether rank `from` may ever send a mixing exchange to rank `to` (both in [0, n), distinct)
  // in some round: the receiver refuses exchanges from other ranks (PERMISSION_DENIED).
  // "random": any rank; "exponential": to - from = 2^k mod n for some k < ExponentialPeriod(n).
  virtual bool MaySend(int32_t from, int32_t to, int32_t n) const = 0;
};

// The ranks that may send mixing exchanges to `rank` under `topology` (in_neighbours[r]).
std::vector<bool> InNeighbours(const Topology& topology, int32_t rank, int32_t n);

// The exponential graph's distance exponents: K = ceil(log2 n) (at least 1), so round t uses
// distance 2^(t mod K) < n.
int ExponentialPeriod(int32_t n);

class TopologyRegistry {
 public:
  // `seed` is the job's seed: random choices derive from it.
  using Factory = std::function<absl::StatusOr<std::unique_ptr<Topology>>(uint64_t seed)>;

  // "random" and "exponential".
  static TopologyRegistry WithBuiltins();

  void Register(const std::string& name, Factory factory);

  // InvalidArgument `unknown gossip topology "x" (known: exponential, random)`.
  absl::StatusOr<std::unique_ptr<Topology>> Create(const std::string& name, uint64_t seed) const;

  std::vector<std::string> names() const { return factories_.Names(); }

 private:
  NamedRegistry<Factory> factories_{"gossip topology"};
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_TOPOLOGY_H_
