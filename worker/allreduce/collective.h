// Collective: what the allreduce trainer needs from a backend (sum all-reduce of float32
// buffers, all-gather of small byte strings), and the registry that builds one by the name
// in JobSpec.allreduce.backend.
//
// Backends: "ring" (ring all-reduce over the workers' gRPC CollectiveService, ring.h +
// grpc_ring.h). "nccl" is registered as Unimplemented in builds without CUDA; a CUDA build
// replaces it (CollectiveRegistry::Register). "auto" is resolved by the caller
// (ResolveBackend).
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
  // All ranks' `mine`, in rank order.
  virtual absl::StatusOr<std::vector<std::string>> Allgather(absl::string_view mine) = 0;
  // Payload bytes this rank has sent so far.
  virtual int64_t bytes_sent() const = 0;
};

// Everything a backend may need to connect the ranks of one job.
struct CollectiveContext {
  std::string job;
  int rank = 0;
  std::vector<std::string> peers;           // Every rank's peer-service address.
  CollectiveServiceImpl* local = nullptr;   // This process's CollectiveService; not owned.
  absl::Duration timeout = absl::Seconds(30);  // Longest wait for a peer.
  int64_t segment_bytes = 2 << 20;          // Ring: pipelining segment (see RingOptions).
};

using CollectiveFactory =
    std::function<absl::StatusOr<std::unique_ptr<Collective>>(const CollectiveContext&)>;

class CollectiveRegistry {
 public:
  // "ring", and "nccl" answering UNIMPLEMENTED (needs a --config=cuda build).
  static CollectiveRegistry WithBuiltins();
  void Register(const std::string& name, CollectiveFactory factory);
  // INVALID_ARGUMENT for an unknown name (listing the known ones); the factory's errors.
  absl::StatusOr<std::unique_ptr<Collective>> Create(const std::string& name,
                                                     const CollectiveContext& context) const;

 private:
  NamedRegistry<CollectiveFactory> factories_{"allreduce backend"};
};

// "auto" -> "ring" (the NCCL backend decides for itself once built in); others unchanged.
std::string ResolveBackend(const std::string& backend);

// A Collective over any RingTransport (owned).
std::unique_ptr<Collective> NewRingCollective(std::unique_ptr<RingTransport> transport,
                                              RingOptions options);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_COLLECTIVE_H_
