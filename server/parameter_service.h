// gRPC adapter of ParameterService over a Shard: converts status codes, nothing else.
//
// Thread safety: as Shard; gRPC calls the methods from its thread pool.
#ifndef GRADMESH_SERVER_PARAMETER_SERVICE_H_
#define GRADMESH_SERVER_PARAMETER_SERVICE_H_

#include "proto/gradmesh.grpc.pb.h"
#include "server/shard.h"

namespace gradmesh {

class ParameterServiceImpl final : public ParameterService::Service {
 public:
  // `shard` is not owned and must outlive the service.
  explicit ParameterServiceImpl(Shard* shard) : shard_(shard) {}

  grpc::Status InitJob(grpc::ServerContext*, const InitJobRequest* request,
                       InitJobResponse* response) override;
  grpc::Status Push(grpc::ServerContext*, const PushRequest* request,
                    PushResponse* response) override;
  grpc::Status Pull(grpc::ServerContext*, const PullRequest* request,
                    PullResponse* response) override;
  grpc::Status Finish(grpc::ServerContext*, const FinishRequest* request,
                      FinishResponse* response) override;
  grpc::Status GetJobInfo(grpc::ServerContext*, const JobInfoRequest* request,
                          JobInfoResponse* response) override;

 private:
  Shard* const shard_;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_PARAMETER_SERVICE_H_
