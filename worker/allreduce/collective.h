// Collective: what the allreduce trainer needs from a backend (sum all-reduce of float32
// buffers, all-gather of small byte strings), and the registry that builds one by the name
// in JobSpec.allreduce.backend.
//
// Backends (every rank of a job must ask for the same one):
//   "ring"  ring all-reduce (ring.h) over the transport CollectiveContext::transport names:
//           plain TCP links set up over the workers' gRPC CollectiveService (tcp_ring.h,
//           the default) or the gRPC streams themselves (grpc_ring.h).
//   "nccl"  NCCL (worker/nccl/), one GPU per rank (device = local rank mod
//           CudaDeviceCount()), for the ranks of one node. The ranks first connect the gRPC
//           ring, over which rank 0 hands its ncclUniqueId (128 bytes) to the others and
//           which then carries the all-gathers; all-reduces go through NCCL. UNIMPLEMENTED
//           naming --config=cuda in a build without CUDA; FAILED_PRECONDITION on every rank
//           (naming the rank and host) when some rank has no CUDA device, the ranks are on
//           several hosts, or a host has fewer GPUs than ranks (NCCL refuses two ranks on
//           one device).
//   "hierarchical"  (--config=cuda) ranks on several nodes: NCCL among the ranks of each
//           node (one id per node, made by its lowest rank and handed out over the job's
//           gRPC ring), then the gRPC ring among one leader per node, then each node's
//           leader spreads the sum through NCCL again (the others contribute zeros, which
//           is exact). Refused like "nccl" when a rank has no GPU or a node has fewer GPUs
//           than ranks.
//   "auto"  connects the ring, all-gathers every rank's placement (host name, CUDA device
//           count, NCCL built in) and takes "nccl" when every rank could on one host,
//           "hierarchical" when they could on several (ChooseAutoBackend), else stays on the
//           ring. Every rank decides from the same data, so they agree.
// Gradients are host buffers; NcclCommunicator stages them through the GPU (see the TODO in
// collective.cc).
//
// Thread safety: a Collective is used by one thread at a time; collectives of a job must be
// called in the same order on every rank. The registry's const methods may run concurrently.
#ifndef GRADMESH_WORKER_ALLREDUCE_COLLECTIVE_H_
#define GRADMESH_WORKER_ALLREDUCE_COLLECTIVE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/registry.h"
#include "rpc/rpc_options.h"
#include "worker/allreduce/ring.h"

namespace gradmesh {

class CollectiveServiceImpl;

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Sums `data` over all ranks in place; every rank ends with the same bits.
  virtual absl::Status AllreduceSum(absl::Span<float> data) = 0;
  // The same, telling `on_final` about ranges whose sums are final before it returns (see
  // FinalRangeFn in ring.h; every element is reported once if it returns OK). The default
  // reports the whole buffer after AllreduceSum.
  virtual absl::Status AllreduceSumStreaming(absl::Span<float> data, const FinalRangeFn& on_final) {
    absl::Status st = AllreduceSum(data);
    if (st.ok() && !data.empty()) on_final(0, static_cast<int64_t>(data.size()));
    return st;
  }
  // All ranks' `mine`, in rank order.
  virtual absl::StatusOr<std::vector<std::string>> Allgather(absl::string_view mine) = 0;
  // Payload bytes this rank has sent so far (NCCL: what the ring algorithm would send).
  virtual int64_t bytes_sent() const = 0;
  // The backend actually in use: "ring", "nccl" or "hierarchical(...)".
  virtual std::string backend() const = 0;
  // The RingTransport kind of its job-wide ring ("tcp", "grpc"); "" without one.
  virtual std::string transport() const { return ""; }
};

// Everything a backend may need to connect the ranks of one job.
struct CollectiveContext {
  std::string job;
  int rank = 0;
  std::vector<std::string> peers;          // Every rank's peer-service address.
  RpcOptions rpc;                          // Channels to the peers (limits, TLS).
  CollectiveServiceImpl* local = nullptr;  // This process's CollectiveService; not owned.
  // The job's token, carried by every ring stream and required from the previous rank's
  // (grpc_ring.h; the TCP ring's rendezvous runs over that ring). Empty: none (open).
  std::string job_token;
  // This rank's token and every rank's token hash (TrainerOptions.rank_token*): the ring
  // stream carries the former, and a rank's inbox takes only the previous rank's. Empty: not
  // checked (standalone).
  std::string rank_token;
  std::vector<std::string> rank_token_hashes;
  absl::Duration timeout = absl::Seconds(30);  // Longest wait for a peer.
  // Ends every wait on the ring's transports early with ABORTED (ring.h RingAbort), set-up
  // included; not owned, outlives the collective. Null: never. NCCL's own waits ignore it.
  const RingAbort* abort = nullptr;
  // Ring: what carries the ring's bytes, a name in RingTransportsWithBuiltins(). Empty:
  // "tcp".
  std::string transport = "tcp";
  int64_t segment_bytes = 2 << 20;     // Ring: pipelining segment (see RingOptions).
  RingCodec codec = RingCodec::kNone;  // Ring: wire format (see RingOptions).
  // This rank's host, as compared between ranks by "auto"/"nccl". Empty: the machine's
  // host name (tests set it to place ranks on different "hosts").
  std::string host;
};

using RingTransportFactory =
    std::function<absl::StatusOr<std::unique_ptr<RingTransport>>(const CollectiveContext&)>;

// The ring transports (JobSpec.allreduce.transport), every rank of a job must use the same:
//   "grpc"  one CollectiveService.Ring stream per link (grpc_ring.h);
//   "tcp"   one plain TCP connection per link, set up over the gRPC ring, which is then
//           closed (tcp_ring.h). Faster: no second copy of received bytes, no thread
//           hand-offs (README, Performance). Needs ephemeral TCP ports open between workers.
// Every backend's ring (the job's, a host's, the leaders') uses the context's transport.
NamedRegistry<RingTransportFactory> RingTransportsWithBuiltins();

using CollectiveFactory =
    std::function<absl::StatusOr<std::unique_ptr<Collective>>(const CollectiveContext&)>;

class CollectiveRegistry {
 public:
  // "ring", "nccl" and "auto" (see the file comment).
  static CollectiveRegistry WithBuiltins();
  void Register(const std::string& name, CollectiveFactory factory);
  // INVALID_ARGUMENT for an unknown name (listing the known ones); the factory's errors.
  absl::StatusOr<std::unique_ptr<Collective>> Create(const std::string& name,
                                                     const CollectiveContext& context) const;

 private:
  NamedRegistry<CollectiveFactory> factories_{"allreduce backend"};
};

// "" -> "auto"; others unchanged.
std::string ResolveBackend(const std::string& backend);

// Where a rank runs, as "auto" and "nccl" compare it.
struct RankPlacement {
  std::string host;      // Host name.
  int cuda_devices = 0;  // CudaDeviceCount() there.
  bool nccl_built_in = false;
};
std::string EncodePlacement(const RankPlacement& p);
// INVALID_ARGUMENT for a malformed string.
absl::StatusOr<RankPlacement> DecodePlacement(absl::string_view s);

// Why NCCL cannot serve ranks placed as `ranks` (rank order), naming the first offending
// rank and its host; empty if it can: NCCL built in everywhere, one host, and at least as many
// CUDA devices there as ranks.
std::string NcclUnsuitable(const std::vector<RankPlacement>& ranks);

// Why hierarchical NCCL + ring cannot serve `ranks`; empty if it can: NCCL built in and a
// CUDA device at every rank, and at least as many devices on each host as ranks there.
std::string HierarchicalUnsuitable(const std::vector<RankPlacement>& ranks);

// "nccl" if NcclUnsuitable(ranks) is empty; else "hierarchical" if the ranks span several
// hosts and HierarchicalUnsuitable is empty; else "ring".
std::string ChooseAutoBackend(const std::vector<RankPlacement>& ranks);

// The hierarchical collective with node-local backend `local_backend`: "nccl" (what the
// "hierarchical" backend uses) or "ring" (a gRPC ring per host; it lets CPU builds and tests
// run the same composition). Connects the job's ring and gathers placements first; every
// rank must call it at once. INVALID_ARGUMENT for another local backend.
absl::StatusOr<std::unique_ptr<Collective>> ConnectHierarchical(const CollectiveContext& c,
                                                                const std::string& local_backend);

// A Collective over any RingTransport (owned).
std::unique_ptr<Collective> NewRingCollective(std::unique_ptr<RingTransport> transport,
                                              RingOptions options);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_COLLECTIVE_H_
