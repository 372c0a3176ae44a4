// gRPC adapters of gradmesh_coordinator: JobServiceImpl and NodeServiceImpl map
// proto/coordinator.proto's calls onto the Coordinator core and absl::Status onto
// grpc::Status (same code and message). Every method first checks the API token
// (common/auth.h; UNAUTHENTICATED "missing or wrong API token").
//
// WatchJob runs on a sync-server thread in a waiting loop: it sends the job's status, then
// waits on the core for the next change with a short deadline (watch_poll) and checks between
// waits whether the client went away or the server is shutting down, so an abandoned watch
// ends within one poll interval and no thread outlives its call.
//
// NodeServiceImpl also passes the caller's node credentials to the core (coordinator.h "# Node
// identity"): the per-node token from the metadata `x-gradmesh-node-token` (exactly one such
// header, else none) and the name a NodeIdentityFn proves from the call's transport. The hook
// is where mutual TLS plugs in: a function reading the client certificate's name from
// ServerContext::auth_context() (e.g. property "x509_common_name") makes that name the node's
// identity, and then a node needs no token at all. Without a hook only tokens count.
//
// Thread safety: both services may be called concurrently; they hold no state of their own
// besides constant pointers. The Coordinator and TokenChecker must outlive them.
#ifndef GRADMESH_COORDINATOR_SERVICE_H_
#define GRADMESH_COORDINATOR_SERVICE_H_

#include <functional>
#include <string>

#include "absl/time/time.h"
#include "coordinator/coordinator.h"
#include "proto/coordinator.grpc.pb.h"
#include "rpc/auth.h"

namespace gradmesh {

class JobServiceImpl final : public JobService::Service {
 public:
  JobServiceImpl(Coordinator* coordinator, const TokenChecker* auth,
                 absl::Duration watch_poll = absl::Milliseconds(200))
      : coordinator_(coordinator), auth_(auth), watch_poll_(watch_poll) {}

  grpc::Status SubmitJob(grpc::ServerContext* context, const SubmitJobRequest* request,
                         SubmitJobResponse* response) override;
  grpc::Status GetLogs(grpc::ServerContext* context, const GetLogsRequest* request,
                       GetLogsResponse* response) override;
  grpc::Status GetJob(grpc::ServerContext* context, const GetJobRequest* request,
                      JobStatus* response) override;
  grpc::Status ListJobs(grpc::ServerContext* context, const ListJobsRequest* request,
                        ListJobsResponse* response) override;
  grpc::Status CancelJob(grpc::ServerContext* context, const CancelJobRequest* request,
                         JobStatus* response) override;
  grpc::Status WatchJob(grpc::ServerContext* context, const WatchJobRequest* request,
                        grpc::ServerWriter<JobStatus>* writer) override;
  // The header, then the stored payload pieces (1 MiB each), from one RocksDB snapshot.
  grpc::Status GetModel(grpc::ServerContext* context, const GetModelRequest* request,
                        grpc::ServerWriter<ModelChunk>* writer) override;

 private:
  Coordinator* const coordinator_;
  const TokenChecker* const auth_;
  const absl::Duration watch_poll_;
};

// The node name a call's transport proved (e.g. an mTLS client certificate's), or "" if none.
using NodeIdentityFn = std::function<std::string(const grpc::ServerContext& context)>;

// A NodeIdentityFn for mutual TLS: the common name (x509_common_name) of the client
// certificate gRPC verified for this call, or "" when the peer is not authenticated (plaintext,
// TLS without client certificates). With it, a node's certificate must name the node (CN =
// the daemon's --node name); gradmesh_coordinator --node_identity_from_certificate.
std::string CertificateNodeName(const grpc::ServerContext& context);

// The caller's credentials of a NodeService call: the x-gradmesh-node-token header (one, else
// "") and `identity`'s name (when given).
Coordinator::NodeCredentials NodeCredentialsOf(const grpc::ServerContext& context,
                                               const NodeIdentityFn& identity);

class NodeServiceImpl final : public NodeService::Service {
 public:
  // `identity` may be empty (no transport identity: per-node tokens only).
  NodeServiceImpl(Coordinator* coordinator, const TokenChecker* auth,
                  NodeIdentityFn identity = nullptr)
      : coordinator_(coordinator), auth_(auth), identity_(std::move(identity)) {}

  grpc::Status Register(grpc::ServerContext* context, const RegisterRequest* request,
                        RegisterResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const HeartbeatRequest* request,
                         HeartbeatResponse* response) override;
  // Checks the header (caller, job, bounds) as soon as it arrives, so a refused upload is
  // answered before its payload is received; then collects the payload (at most
  // header.total_bytes) and hands it to the core, which checks again and stores it.
  grpc::Status PublishModel(grpc::ServerContext* context, grpc::ServerReader<ModelChunk>* reader,
                            PublishModelResponse* response) override;

 private:
  Coordinator* const coordinator_;
  const TokenChecker* const auth_;
  const NodeIdentityFn identity_;
};

}  // namespace gradmesh

#endif  // GRADMESH_COORDINATOR_SERVICE_H_
