#include "server/parameter_service.h"

#include "common/status.h"
#include "rpc/grpc_status.h"

namespace gradmesh {
namespace {

template <typename T>
grpc::Status Reply(absl::StatusOr<T> result, T* response) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = std::move(result).value();
  return grpc::Status::OK;
}

}  // namespace

absl::Status ParameterServiceImpl::CheckToken(grpc::ServerContext* ctx,
                                              const std::string& job) const {
  if (tokens_ == nullptr) return absl::OkStatus();
  absl::string_view presented;
  const auto& md = ctx->client_metadata();
  auto it = md.find("x-gradmesh-job-token");
  if (it != md.end()) presented = absl::string_view(it->second.data(), it->second.size());
  return tokens_->Check(job, presented);
}

grpc::Status ParameterServiceImpl::InitJob(grpc::ServerContext* ctx, const InitJobRequest* request,
                                           InitJobResponse* response) {
  if (absl::Status st = CheckToken(ctx, request->job()); !st.ok()) return ToGrpcStatus(st);
  return Reply(shard_->InitJob(*request), response);
}

grpc::Status ParameterServiceImpl::Push(grpc::ServerContext* ctx, const PushRequest* request,
                                        PushResponse* response) {
  if (absl::Status st = CheckToken(ctx, request->job()); !st.ok()) return ToGrpcStatus(st);
  return Reply(shard_->Push(*request), response);
}

grpc::Status ParameterServiceImpl::Pull(grpc::ServerContext* ctx, const PullRequest* request,
                                        PullResponse* response) {
  if (absl::Status st = CheckToken(ctx, request->job()); !st.ok()) return ToGrpcStatus(st);
  return ToGrpcStatus(shard_->Pull(*request, response));
}

grpc::Status ParameterServiceImpl::Finish(grpc::ServerContext* ctx, const FinishRequest* request,
                                          FinishResponse*) {
  if (absl::Status st = CheckToken(ctx, request->job()); !st.ok()) return ToGrpcStatus(st);
  return ToGrpcStatus(shard_->Finish(*request));
}

// GetJobInfo is open: layout, progress and statistics, no tensor values (monitoring tools and
// tests read it without the job's token).
grpc::Status ParameterServiceImpl::GetJobInfo(grpc::ServerContext*, const JobInfoRequest* request,
                                              JobInfoResponse* response) {
  return Reply(shard_->GetJobInfo(*request), response);
}

}  // namespace gradmesh
