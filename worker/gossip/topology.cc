// Built-in gossip topologies (see topology.h).
#include "worker/gossip/topology.h"

#include "compression/rng.h"

namespace gradmesh {
namespace {

class RandomTopology final : public Topology {
 public:
  explicit RandomTopology(uint64_t seed) : seed_(seed) {}
  std::string name() const override { return "random"; }
  MixingKind mixing() const override { return MixingKind::kPairwiseAverage; }

  std::optional<int32_t> Peer(int32_t rank, int32_t n, int64_t round,
                              const std::function<bool(int32_t)>& available) const override {
    std::vector<int32_t> candidates;
    for (int32_t p = 0; p < n; ++p) {
      if (p != rank && available(p)) candidates.push_back(p);
    }
    if (candidates.empty()) return std::nullopt;
    // One independent stream per (seed, rank, round): reproducible, and ranks choose
    // independently of each other.
    Rng rng(Rng::Mix(Rng::Mix(seed_, static_cast<uint64_t>(rank)), static_cast<uint64_t>(round)));
    return candidates[rng.Uniform(candidates.size())];
  }

  bool MaySend(int32_t from, int32_t to, int32_t n) const override {
    return from != to && from >= 0 && to >= 0 && from < n && to < n;
  }

 private:
  const uint64_t seed_;
};

class ExponentialTopology final : public Topology {
 public:
  std::string name() const override { return "exponential"; }
  MixingKind mixing() const override { return MixingKind::kPushSum; }

  std::optional<int32_t> Peer(int32_t rank, int32_t n, int64_t round,
                              const std::function<bool(int32_t)>& available) const override {
    if (n < 2) return std::nullopt;
    const int64_t distance = int64_t{1} << (round % ExponentialPeriod(n));
    const int32_t peer = static_cast<int32_t>((rank + distance) % n);
    if (!available(peer)) return std::nullopt;
    return peer;
  }

  bool MaySend(int32_t from, int32_t to, int32_t n) const override {
    if (from == to || from < 0 || to < 0 || from >= n || to >= n) return false;
    const int64_t distance = (static_cast<int64_t>(to) - from + n) % n;
    for (int k = 0; k < ExponentialPeriod(n); ++k) {
      if (distance == (int64_t{1} << k) % n) return true;
    }
    return false;
  }
};

}  // namespace

std::vector<bool> InNeighbours(const Topology& topology, int32_t rank, int32_t n) {
  std::vector<bool> in(n > 0 ? n : 0, false);
  for (int32_t from = 0; from < n; ++from) in[from] = topology.MaySend(from, rank, n);
  return in;
}

int ExponentialPeriod(int32_t n) {
  int k = 0;
  while ((int64_t{1} << k) < n) ++k;
  return k < 1 ? 1 : k;
}

TopologyRegistry TopologyRegistry::WithBuiltins() {
  TopologyRegistry r;
  r.Register("random", [](uint64_t seed) -> absl::StatusOr<std::unique_ptr<Topology>> {
    return std::make_unique<RandomTopology>(seed);
  });
  r.Register("exponential", [](uint64_t) -> absl::StatusOr<std::unique_ptr<Topology>> {
    return std::make_unique<ExponentialTopology>();
  });
  return r;
}

void TopologyRegistry::Register(const std::string& name, Factory factory) {
  factories_.Set(name, std::move(factory));
}

absl::StatusOr<std::unique_ptr<Topology>> TopologyRegistry::Create(const std::string& name,
                                                                   uint64_t seed) const {
  auto f = factories_.Find(name);
  if (!f.ok()) return f.status();
  return (**f)(seed);
}

}  // namespace gradmesh
