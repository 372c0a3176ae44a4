// Collective backends and their registry (see collective.h).
#include "worker/allreduce/collective.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/daemon.h"
#include "common/status.h"
#include "worker/allreduce/grpc_ring.h"
#include "worker/allreduce/tcp_ring.h"
#include "worker/nccl/nccl_communicator.h"

namespace gradmesh {
namespace {

// What a rank that sent `id` instead of an NCCL id said ("!" and its error), or what it sent;
// a peer's bytes, so never assumed to be either.
std::string NcclIdError(const std::string& id) {
  if (!id.empty() && id[0] == '!') return id.substr(1);
  return absl::StrCat("it sent ", id.size(), " bytes instead of ", kNcclUniqueIdBytes);
}

class RingCollective final : public Collective {
 public:
  RingCollective(std::unique_ptr<RingTransport> transport, RingOptions options)
      : transport_(std::move(transport)), options_(options) {}
  int rank() const override { return transport_->rank(); }
  int size() const override { return transport_->size(); }
  absl::Status AllreduceSum(absl::Span<float> data) override {
    return RingAllreduce(transport_.get(), data, options_, &bytes_sent_);
  }
  absl::Status AllreduceSumStreaming(absl::Span<float> data,
                                     const FinalRangeFn& on_final) override {
    return RingAllreduce(transport_.get(), data, options_, &bytes_sent_, &on_final);
  }
  absl::StatusOr<std::vector<std::string>> Allgather(absl::string_view mine) override {
    ASSIGN_OR_RETURN(std::vector<std::string> all, RingAllgather(transport_.get(), mine, options_));
    for (int r = 0; r < size(); ++r) {
      if (r != rank()) bytes_sent_ += static_cast<int64_t>(all[r].size());
    }
    return all;
  }
  int64_t bytes_sent() const override { return bytes_sent_; }
  std::string backend() const override { return "ring"; }
  std::string transport() const override { return transport_->kind(); }

 private:
  std::unique_ptr<RingTransport> transport_;
  const RingOptions options_;
  int64_t bytes_sent_ = 0;
};

// All-reduces through NCCL; all-gathers (rare, small) over the gRPC ring that bootstrapped it.
class NcclCollective final : public Collective {
 public:
  NcclCollective(std::unique_ptr<RingTransport> ring, RingOptions options,
                 std::unique_ptr<NcclCommunicator> comm)
      : ring_(std::move(ring)), options_(options), comm_(std::move(comm)) {}
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->world(); }
  absl::Status AllreduceSum(absl::Span<float> data) override {
    // TODO(gpu): with a CUDA LibTorch (--repo_env=GRADMESH_TORCH_CUDA) the model and its
    // gradients could live on the GPU and be reduced in place (AllReduceSum takes device
    // pointers); today the buckets are host memory, staged through the GPU by NCCL's caller.
    RETURN_IF_ERROR(Annotate(comm_->AllReduceSum(data.data(), data.size()),
                             absl::StrCat("nccl all-reduce on device ", comm_->device())));
    const int n = size();
    bytes_sent_ += static_cast<int64_t>(data.size() * sizeof(float)) * 2 * (n - 1) / n;
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> Allgather(absl::string_view mine) override {
    if (ring_ == nullptr) {  // A node-local communicator inside "hierarchical".
      return absl::FailedPreconditionError("nccl collective without a ring: no all-gather");
    }
    return RingAllgather(ring_.get(), mine, options_);
  }
  int64_t bytes_sent() const override { return bytes_sent_; }
  std::string backend() const override { return "nccl"; }
  std::string transport() const override { return ring_ != nullptr ? ring_->kind() : ""; }

 private:
  std::unique_ptr<RingTransport> ring_;
  const RingOptions options_;
  std::unique_ptr<NcclCommunicator> comm_;
  int64_t bytes_sent_ = 0;
};

RingOptions RingOptionsOf(const CollectiveContext& c) {
  RingOptions ro;
  ro.timeout = c.timeout;
  ro.segment_bytes = c.segment_bytes;
  ro.codec = c.codec;
  return ro;
}

absl::StatusOr<std::unique_ptr<RingTransport>> ConnectGrpcRing(const CollectiveContext& c) {
  GrpcRingOptions o;
  o.job = c.job;
  o.rank = c.rank;
  o.peers = c.peers;
  o.rpc = c.rpc;
  o.local = c.local;
  o.job_token = c.job_token;
  o.rank_token = c.rank_token;
  o.rank_token_hashes = c.rank_token_hashes;
  o.close_timeout = c.timeout;
  o.abort = c.abort;
  return NewGrpcRingTransport(o);
}

// The job's ring over the transport `c.transport` names.
absl::StatusOr<std::unique_ptr<RingTransport>> ConnectRing(const CollectiveContext& c) {
  const NamedRegistry<RingTransportFactory> transports = RingTransportsWithBuiltins();
  ASSIGN_OR_RETURN(const RingTransportFactory* factory,
                   transports.Find(c.transport.empty() ? "tcp" : c.transport));
  return (*factory)(c);
}

// Every rank's placement, over the ring (one all-gather).
absl::StatusOr<std::vector<RankPlacement>> GatherPlacements(RingTransport* ring,
                                                            const CollectiveContext& c) {
  RankPlacement mine;
  mine.host = c.host.empty() ? HostName() : c.host;
  mine.cuda_devices = CudaDeviceCount();
  mine.nccl_built_in = NcclBuiltIn();
  ASSIGN_OR_RETURN(std::vector<std::string> all,
                   RingAllgather(ring, EncodePlacement(mine), RingOptionsOf(c)));
  std::vector<RankPlacement> out;
  for (size_t r = 0; r < all.size(); ++r) {
    absl::StatusOr<RankPlacement> p = DecodePlacement(all[r]);
    if (!p.ok()) return Annotate(p.status(), absl::StrCat("placement of rank ", r));
    out.push_back(*std::move(p));
  }
  return out;
}

// Rank 0 makes the NCCL id and hands it to the others over the ring; each rank joins on its
// local rank's device. `placements` must satisfy NcclUnsuitable.
absl::StatusOr<std::unique_ptr<Collective>> ConnectNccl(
    std::unique_ptr<RingTransport> ring, const CollectiveContext& c,
    const std::vector<RankPlacement>& placements) {
  const int n = static_cast<int>(placements.size());
  // Rank 0 sends the 128-byte id, or (it could not make one) "!" and the error, cut short
  // of 128 bytes, so that the other ranks fail at once with the reason instead of timing out.
  std::string mine;
  if (c.rank == 0) {
    absl::StatusOr<std::string> id = NcclCommunicator::GetUniqueId();
    mine = id.ok() ? *id : absl::StrCat("!", id.status().ToString()).substr(0, 100);
  }
  ASSIGN_OR_RETURN(std::vector<std::string> ids, RingAllgather(ring.get(), mine, RingOptionsOf(c)));
  if (ids[0].size() != kNcclUniqueIdBytes) {
    return absl::UnavailableError(absl::StrCat(
        "allreduce backend nccl: rank 0 could not create an NCCL id: ", NcclIdError(ids[0])));
  }
  int local_rank = 0;
  for (int r = 0; r < c.rank; ++r) local_rank += placements[r].host == placements[c.rank].host;
  const int device = local_rank % CudaDeviceCount();
  NcclOptions no;
  no.timeout = c.timeout;
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
      NcclCommunicator::Create(c.rank, n, ids[0], device, no);
  if (!comm.ok()) {
    return Annotate(comm.status(), absl::StrCat("allreduce backend nccl: rank ", c.rank,
                                                " joining on device ", device));
  }
  return std::unique_ptr<Collective>(
      new NcclCollective(std::move(ring), RingOptionsOf(c), *std::move(comm)));
}

// NCCL (or, in tests, a ring) among the ranks of each host, the gRPC ring among one leader
// per host, then the leaders' sums spread through each host's group: the group all-reduces
// again with every rank but the leader contributing zeros (adding zeros is exact, so every
// rank ends with the leader's bits).
class HierarchicalCollective final : public Collective {
 public:
  HierarchicalCollective(std::unique_ptr<RingTransport> world, RingOptions options,
                         std::unique_ptr<Collective> local, std::unique_ptr<Collective> cross,
                         bool leader, std::string local_backend)
      : world_(std::move(world)),
        options_(options),
        local_(std::move(local)),
        cross_(std::move(cross)),
        leader_(leader),
        local_backend_(std::move(local_backend)) {}
  int rank() const override { return world_->rank(); }
  int size() const override { return world_->size(); }
  absl::Status AllreduceSum(absl::Span<float> data) override {
    if (local_ != nullptr) {
      RETURN_IF_ERROR(Annotate(local_->AllreduceSum(data), "hierarchical all-reduce in the node"));
    }
    if (leader_ && cross_ != nullptr) {
      RETURN_IF_ERROR(Annotate(cross_->AllreduceSum(data), "hierarchical all-reduce across nodes"));
    }
    if (local_ != nullptr) {
      if (!leader_) std::fill(data.begin(), data.end(), 0.0f);
      RETURN_IF_ERROR(Annotate(local_->AllreduceSum(data), "hierarchical broadcast in the node"));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> Allgather(absl::string_view mine) override {
    ASSIGN_OR_RETURN(std::vector<std::string> all, RingAllgather(world_.get(), mine, options_));
    for (int r = 0; r < size(); ++r) {
      if (r != rank()) gather_bytes_ += static_cast<int64_t>(all[r].size());
    }
    return all;
  }
  int64_t bytes_sent() const override {
    return gather_bytes_ + (local_ != nullptr ? local_->bytes_sent() : 0) +
           (cross_ != nullptr ? cross_->bytes_sent() : 0);
  }
  std::string backend() const override { return "hierarchical(" + local_backend_ + "+ring)"; }
  std::string transport() const override { return world_->kind(); }

 private:
  std::unique_ptr<RingTransport> world_;
  const RingOptions options_;
  std::unique_ptr<Collective> local_;  // Null when this host has one rank.
  std::unique_ptr<Collective> cross_;  // Null unless this rank leads its host and hosts > 1.
  const bool leader_;
  const std::string local_backend_;
  int64_t gather_bytes_ = 0;
};

// Builds the hierarchical collective over the connected job-wide ring `world`. Every rank
// calls it at once with the same placements. `local_backend`: "nccl" or "ring".
absl::StatusOr<std::unique_ptr<Collective>> ConnectHierarchicalOver(
    std::unique_ptr<RingTransport> world, const CollectiveContext& c,
    const std::vector<RankPlacement>& placements, const std::string& local_backend) {
  const int n = static_cast<int>(placements.size());
  const std::string& host = placements[c.rank].host;
  std::vector<int> group, leaders;
  std::set<std::string> seen;
  for (int r = 0; r < n; ++r) {
    if (placements[r].host == host) group.push_back(r);
    if (seen.insert(placements[r].host).second) leaders.push_back(r);
  }
  const int local_index =
      static_cast<int>(std::find(group.begin(), group.end(), c.rank) - group.begin());
  const bool leader = group[0] == c.rank;
  const RingOptions ro = RingOptionsOf(c);

  // NCCL ids: the leader of every multi-rank host makes one; one all-gather hands them out
  // (every rank takes part, so the world ring's order of collectives stays the same).
  std::string my_id;
  if (local_backend == "nccl" && leader && group.size() > 1) {
    absl::StatusOr<std::string> id = NcclCommunicator::GetUniqueId();
    my_id = id.ok() ? *id : absl::StrCat("!", id.status().ToString()).substr(0, 100);
  }
  std::vector<std::string> ids;
  if (local_backend == "nccl") {
    ASSIGN_OR_RETURN(ids, RingAllgather(world.get(), my_id, ro));
  }

  std::unique_ptr<Collective> local;
  if (group.size() > 1) {
    if (local_backend == "nccl") {
      const std::string& id = ids[group[0]];
      if (id.size() != kNcclUniqueIdBytes) {
        return absl::UnavailableError(
            absl::StrCat("allreduce backend hierarchical: rank ", group[0],
                         " could not create an NCCL id: ", NcclIdError(id)));
      }
      NcclOptions no;
      no.timeout = c.timeout;
      const int device = local_index % std::max(1, CudaDeviceCount());
      absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
          NcclCommunicator::Create(local_index, static_cast<int>(group.size()), id, device, no);
      if (!comm.ok()) {
        return Annotate(comm.status(), absl::StrCat("allreduce backend hierarchical: rank ", c.rank,
                                                    " joining on device ", device));
      }
      local.reset(new NcclCollective(nullptr, ro, *std::move(comm)));
    } else {
      CollectiveContext lc = c;
      lc.job = absl::StrCat(c.job, "/host:", host);
      lc.rank = local_index;
      lc.peers.clear();
      for (int r : group) lc.peers.push_back(c.peers[r]);
      ASSIGN_OR_RETURN(std::unique_ptr<RingTransport> t, ConnectRing(lc));
      local = NewRingCollective(std::move(t), ro);
    }
  }
  std::unique_ptr<Collective> cross;
  if (leader && leaders.size() > 1) {
    CollectiveContext xc = c;
    xc.job = absl::StrCat(c.job, "/leaders");
    xc.rank = static_cast<int>(std::find(leaders.begin(), leaders.end(), c.rank) - leaders.begin());
    xc.peers.clear();
    for (int r : leaders) xc.peers.push_back(c.peers[r]);
    ASSIGN_OR_RETURN(std::unique_ptr<RingTransport> t, ConnectRing(xc));
    cross = NewRingCollective(std::move(t), ro);
  }
  return std::unique_ptr<Collective>(new HierarchicalCollective(
      std::move(world), ro, std::move(local), std::move(cross), leader, local_backend));
}

}  // namespace

std::unique_ptr<Collective> NewRingCollective(std::unique_ptr<RingTransport> transport,
                                              RingOptions options) {
  return std::make_unique<RingCollective>(std::move(transport), options);
}

std::string ResolveBackend(const std::string& backend) {
  return backend.empty() ? "auto" : backend;
}

std::string EncodePlacement(const RankPlacement& p) {
  return absl::StrCat(p.nccl_built_in ? 1 : 0, " ", p.cuda_devices, " ", p.host);
}

absl::StatusOr<RankPlacement> DecodePlacement(absl::string_view s) {
  RankPlacement p;
  const size_t a = s.find(' ');
  const size_t b = a == absl::string_view::npos ? a : s.find(' ', a + 1);
  int nccl = -1;
  if (b == absl::string_view::npos || !absl::SimpleAtoi(s.substr(0, a), &nccl) ||
      (nccl != 0 && nccl != 1) || !absl::SimpleAtoi(s.substr(a + 1, b - a - 1), &p.cuda_devices) ||
      p.cuda_devices < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad rank placement \"", s, "\" (want \"<0|1> <devices> <host>\")"));
  }
  p.nccl_built_in = nccl == 1;
  p.host = std::string(s.substr(b + 1));
  return p;
}

std::string NcclUnsuitable(const std::vector<RankPlacement>& ranks) {
  const int n = static_cast<int>(ranks.size());
  for (int r = 0; r < n; ++r) {
    if (!ranks[r].nccl_built_in) {
      return absl::StrCat("rank ", r, " (host ", ranks[r].host,
                          ") runs a worker built without --config=cuda");
    }
    if (ranks[r].cuda_devices == 0) {
      return absl::StrCat("rank ", r, " (host ", ranks[r].host, ") has no CUDA device");
    }
    if (ranks[r].host != ranks[0].host) {
      return absl::StrCat("rank ", r, " runs on host ", ranks[r].host, ", rank 0 on ",
                          ranks[0].host,
                          " (NCCL is used within one node; jobs across nodes use the ring)");
    }
  }
  if (n > 0 && ranks[0].cuda_devices < n) {
    return absl::StrCat(n, " ranks on host ", ranks[0].host, " but only ", ranks[0].cuda_devices,
                        " CUDA device(s) (one GPU per rank)");
  }
  return "";
}

std::string HierarchicalUnsuitable(const std::vector<RankPlacement>& ranks) {
  std::map<std::string, int> per_host;
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (!ranks[r].nccl_built_in) {
      return absl::StrCat("rank ", r, " (host ", ranks[r].host,
                          ") runs a worker built without --config=cuda");
    }
    if (ranks[r].cuda_devices == 0) {
      return absl::StrCat("rank ", r, " (host ", ranks[r].host, ") has no CUDA device");
    }
    ++per_host[ranks[r].host];
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    const int here = per_host[ranks[r].host];
    if (ranks[r].cuda_devices < here) {
      return absl::StrCat(here, " ranks on host ", ranks[r].host, " but only ",
                          ranks[r].cuda_devices, " CUDA device(s) (one GPU per rank)");
    }
  }
  return "";
}

std::string ChooseAutoBackend(const std::vector<RankPlacement>& ranks) {
  if (NcclUnsuitable(ranks).empty()) return "nccl";
  std::set<std::string> hosts;
  for (const RankPlacement& p : ranks) hosts.insert(p.host);
  if (hosts.size() > 1 && HierarchicalUnsuitable(ranks).empty()) return "hierarchical";
  return "ring";
}

absl::StatusOr<std::unique_ptr<Collective>> ConnectHierarchical(const CollectiveContext& c,
                                                                const std::string& local_backend) {
  if (local_backend != "nccl" && local_backend != "ring") {
    return absl::InvalidArgumentError(absl::StrCat("hierarchical all-reduce: node-local backend \"",
                                                   local_backend, "\" is not one of nccl, ring"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<RingTransport> t, ConnectRing(c));
  ASSIGN_OR_RETURN(std::vector<RankPlacement> placements, GatherPlacements(t.get(), c));
  return ConnectHierarchicalOver(std::move(t), c, placements, local_backend);
}

NamedRegistry<RingTransportFactory> RingTransportsWithBuiltins() {
  NamedRegistry<RingTransportFactory> r("allreduce transport");
  r.Set("grpc", ConnectGrpcRing);
  r.Set("tcp", [](const CollectiveContext& c) -> absl::StatusOr<std::unique_ptr<RingTransport>> {
    ASSIGN_OR_RETURN(std::unique_ptr<RingTransport> bootstrap, ConnectGrpcRing(c));
    if (bootstrap->size() < 2) return bootstrap;  // No links to connect.
    absl::StatusOr<std::unique_ptr<RingTransport>> t =
        ConnectTcpRing(bootstrap.get(), c.peers, TcpRingOptions{c.timeout, -1, c.abort});
    if (!t.ok()) {
      return Annotate(t.status(), absl::StrCat("allreduce transport tcp, rank ", c.rank));
    }
    return t;
  });
  return r;
}

CollectiveRegistry CollectiveRegistry::WithBuiltins() {
  CollectiveRegistry r;
  r.Register("ring", [](const CollectiveContext& c) -> absl::StatusOr<std::unique_ptr<Collective>> {
    ASSIGN_OR_RETURN(std::unique_ptr<RingTransport> t, ConnectRing(c));
    return NewRingCollective(std::move(t), RingOptionsOf(c));
  });
  r.Register("nccl", [](const CollectiveContext& c) -> absl::StatusOr<std::unique_ptr<Collective>> {
    if (!NcclBuiltIn()) {
      return absl::UnimplementedError(
          "allreduce.backend nccl needs a worker built with --config=cuda (this one is "
          "CPU-only); use backend ring or auto");
    }
    ASSIGN_OR_RETURN(std::unique_ptr<RingTransport> t, ConnectRing(c));
    ASSIGN_OR_RETURN(std::vector<RankPlacement> placements, GatherPlacements(t.get(), c));
    // Every rank sees the same placements, so all of them fail here together.
    if (std::string why = NcclUnsuitable(placements); !why.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "allreduce.backend nccl cannot be used: ", why, "; use backend ring or auto"));
    }
    return ConnectNccl(std::move(t), c, placements);
  });
  r.Register(
      "hierarchical",
      [](const CollectiveContext& c) -> absl::StatusOr<std::unique_ptr<Collective>> {
        if (!NcclBuiltIn()) {
          return absl::UnimplementedError(
              "allreduce.backend hierarchical needs a worker built with --config=cuda (this one "
              "is CPU-only); use backend ring or auto");
        }
        ASSIGN_OR_RETURN(std::unique_ptr<RingTransport> t, ConnectRing(c));
        ASSIGN_OR_RETURN(std::vector<RankPlacement> placements, GatherPlacements(t.get(), c));
        if (std::string why = HierarchicalUnsuitable(placements); !why.empty()) {
          return absl::FailedPreconditionError(
              absl::StrCat("allreduce.backend hierarchical cannot be used: ", why,
                           "; use backend ring or auto"));
        }
        return ConnectHierarchicalOver(std::move(t), c, placements, "nccl");
      });
  r.Register("auto", [](const CollectiveContext& c) -> absl::StatusOr<std::unique_ptr<Collective>> {
    ASSIGN_OR_RETURN(std::unique_ptr<RingTransport> t, ConnectRing(c));
    ASSIGN_OR_RETURN(std::vector<RankPlacement> placements, GatherPlacements(t.get(), c));
    const std::string choice = ChooseAutoBackend(placements);
    if (choice == "nccl") return ConnectNccl(std::move(t), c, placements);
    if (choice == "hierarchical") {
      return ConnectHierarchicalOver(std::move(t), c, placements, "nccl");
    }
    return NewRingCollective(std::move(t), RingOptionsOf(c));
  });
  return r;
}

void CollectiveRegistry::Register(const std::string& name, CollectiveFactory factory) {
  factories_.Set(name, std::move(factory));
}

absl::StatusOr<std::unique_ptr<Collective>> CollectiveRegistry::Create(
    const std::string& name, const CollectiveContext& context) const {
  ASSIGN_OR_RETURN(const CollectiveFactory* f, factories_.Find(name));
  return (*f)(context);
}

}  // namespace gradmesh
