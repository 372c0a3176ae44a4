#include "server/parameter_service.h"

#include "common/status.h"

namespace gradmesh {
namespace {

template <typename T>
grpc::Status Reply(absl::StatusOr<T> result, T* response) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = std::move(result).value();
  return grpc::Status::OK;
}

}  // namespace

grpc::Status ParameterServiceImpl::InitJob(grpc::ServerContext*, const InitJobRequest* request,
                                           InitJobResponse* response) {
  return Reply(shard_->InitJob(*request), response);
}

grpc::Status ParameterServiceImpl::Push(grpc::ServerContext*, const PushRequest* request,
                                        PushResponse* response) {
  return Reply(shard_->Push(*request), response);
}

grpc::Status ParameterServiceImpl::Pull(grpc::ServerContext*, const PullRequest* request,
                                        PullResponse* response) {
  return ToGrpcStatus(shard_->Pull(*request, response));
}

grpc::Status ParameterServiceImpl::Finish(grpc::ServerContext*, const FinishRequest* request,
                                          FinishResponse*) {
  return ToGrpcStatus(shard_->Finish(*request));
}

grpc::Status ParameterServiceImpl::GetJobInfo(grpc::ServerContext*, const JobInfoRequest* request,
                                              JobInfoResponse* response) {
  return Reply(shard_->GetJobInfo(*request), response);
}

}  // namespace gradmesh
