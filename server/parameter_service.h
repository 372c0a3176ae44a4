// gRPC adapter of ParameterService over a Shard: checks the per-job token (server/job_tokens.h)
// and converts status codes, nothing else.
//
// Thread safety: as Shard; gRPC calls the methods from its thread pool.
#ifndef GRADMESH_SERVER_PARAMETER_SERVICE_H_
#define GRADMESH_SERVER_PARAMETER_SERVICE_H_

#include "proto/gradmesh.grpc.pb.h"
#include "server/job_tokens.h"
#include "server/shard.h"

namespace gradmesh {

class ParameterServiceImpl final : public ParameterService::Service {
 public:
  // `shard` and `tokens` are not owned and must outlive the service; null `tokens` means no
  // per-job access check (every call's job is checked against it otherwise).
  explicit ParameterServiceImpl(Shard* shard, const JobTokens* tokens = nullptr)
      : shard_(shard), tokens_(tokens) {}

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
  absl::Status CheckToken(grpc::ServerContext* ctx, const std::string& job) const;

  Shard* const shard_;
  const JobTokens* const tokens_;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_PARAMETER_SERVICE_H_
