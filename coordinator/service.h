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
// Thread safety: both services may be called concurrently; they hold no state of their own
// besides constant pointers. The Coordinator and TokenChecker must outlive them.
#ifndef GRADMESH_COORDINATOR_SERVICE_H_
#define GRADMESH_COORDINATOR_SERVICE_H_

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

 private:
  Coordinator* const coordinator_;
  const TokenChecker* const auth_;
  const absl::Duration watch_poll_;
};

class NodeServiceImpl final : public NodeService::Service {
 public:
  NodeServiceImpl(Coordinator* coordinator, const TokenChecker* auth)
      : coordinator_(coordinator), auth_(auth) {}

  grpc::Status Register(grpc::ServerContext* context, const RegisterRequest* request,
                        RegisterResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const HeartbeatRequest* request,
                         HeartbeatResponse* response) override;

 private:
  Coordinator* const coordinator_;
  const TokenChecker* const auth_;
};

}  // namespace gradmesh

#endif  // GRADMESH_COORDINATOR_SERVICE_H_
