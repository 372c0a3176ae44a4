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
// Authentication (worker/core/peer_token.h): each registered (job, rank) has the job's token;
// Exchange and GetState must carry it as metadata `x-gradmesh-job-token`, checked in constant
// time before anything is read or changed: none presented is UNAUTHENTICATED, another token
// (a stranger, a rank of another job) PERMISSION_DENIED. A rank registered with an empty
// token is open (standalone runs without one). Order of checks: the job name (INVALID_ARGUMENT,
// common/job_name.h), whether (job, rank) runs here (NOT_FOUND), the token, then the replica's
// own checks (GossipReplica::Handle: a sender the topology does not allow is
// PERMISSION_DENIED there).
//
// Thread safety: all methods may be called concurrently. Handlers run on gRPC's callback
// threads and do their (CPU-only, short) work inline; a replica stays alive while a handler
// uses it even if it is unregistered meanwhile (shared ownership).
#ifndef GRADMESH_WORKER_GOSSIP_GOSSIP_SERVICE_H_
#define GRADMESH_WORKER_GOSSIP_GOSSIP_SERVICE_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "proto/gossip.grpc.pb.h"
#include "worker/gossip/replica.h"

namespace gradmesh {

class GossipServiceImpl final : public GossipService::CallbackService {
 public:
  GossipServiceImpl() = default;

  // Serves `replica` under (its job, its rank), accepting calls that carry `job_token` (empty:
  // any call) and, when `rank_token_hashes` is not empty, an Exchange only with the rank token
  // of the rank it claims to come from (worker/core/peer_token.h, "Rank identity").
  // ALREADY_EXISTS if that key is taken.
  absl::Status Register(std::shared_ptr<GossipReplica> replica, std::string job_token = "",
                        std::vector<std::string> rank_token_hashes = {});
  // Stops serving (job, rank); no-op if absent.
  void Unregister(const std::string& job, int32_t rank);

  grpc::ServerUnaryReactor* Exchange(grpc::CallbackServerContext* context,
                                     const GossipExchangeRequest* request,
                                     GossipExchangeResponse* response) override;
  grpc::ServerUnaryReactor* GetState(grpc::CallbackServerContext* context,
                                     const GossipStateRequest* request,
                                     GossipStateResponse* response) override;

 private:
  struct Entry {
    std::shared_ptr<GossipReplica> replica;
    std::string token;                     // Empty: open.
    std::vector<std::string> rank_hashes;  // Empty: ranks not checked.
  };
  // The replica of (job, rank) if the call may use it: INVALID_ARGUMENT for a bad job name,
  // NOT_FOUND when it does not run here, UNAUTHENTICATED / PERMISSION_DENIED for the job
  // token, and for the rank token of `from` unless it is nullopt (GetState: a read).
  absl::StatusOr<std::shared_ptr<GossipReplica>> Find(grpc::CallbackServerContext* context,
                                                      const char* method, const std::string& job,
                                                      int32_t rank,
                                                      std::optional<int64_t> from) const;

  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, int32_t>, Entry> replicas_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_GOSSIP_SERVICE_H_
