// GossipServiceImpl: the gRPC GossipService of a worker process (proto/gossip.proto), a thin
// adapter over the GossipReplicas of the gossip jobs this process runs.
//
// RunGossip registers its rank's replica when it starts and unregisters it when it returns;
// several jobs (and ranks) can share one service, keyed by (job, rank). Requests for a
// (job, rank) that is not registered are NOT_FOUND, which senders treat like an unreachable
// peer (backoff, retried later), so ranks may start in any order. Everything else, including
// every validation, is GossipReplica::Handle; its absl::Status becomes the grpc::Status with
// the same code and message. A bad request never changes a replica and never crashes the
// process.
//
// Thread safety: all methods may be called concurrently. Handlers run on gRPC's callback
// threads and do their (CPU-only, short) work inline; a replica stays alive while a handler
// uses it even if it is unregistered meanwhile (shared ownership).
#ifndef GRADMESH_WORKER_GOSSIP_GOSSIP_SERVICE_H_
#define GRADMESH_WORKER_GOSSIP_GOSSIP_SERVICE_H_

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "proto/gossip.grpc.pb.h"
#include "worker/gossip/replica.h"

namespace gradmesh {

class GossipServiceImpl final : public GossipService::CallbackService {
 public:
  GossipServiceImpl() = default;

  // Serves `replica` under (its job, its rank). ALREADY_EXISTS if that key is taken.
  absl::Status Register(std::shared_ptr<GossipReplica> replica);
  // Stops serving (job, rank); no-op if absent.
  void Unregister(const std::string& job, int32_t rank);

  grpc::ServerUnaryReactor* Exchange(grpc::CallbackServerContext* context,
                                     const GossipExchangeRequest* request,
                                     GossipExchangeResponse* response) override;
  grpc::ServerUnaryReactor* GetState(grpc::CallbackServerContext* context,
                                     const GossipStateRequest* request,
                                     GossipStateResponse* response) override;

 private:
  // The replica of (job, rank), or NOT_FOUND naming them.
  absl::StatusOr<std::shared_ptr<GossipReplica>> Find(const std::string& job, int32_t rank) const;

  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, int32_t>, std::shared_ptr<GossipReplica>> replicas_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_GOSSIP_SERVICE_H_
