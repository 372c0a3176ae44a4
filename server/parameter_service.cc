#include "server/parameter_service.h"

#include <utility>

#include "common/status.h"
#include "common/token_hash.h"
#include "rpc/grpc_status.h"

namespace gradmesh {
namespace {

template <typename T>
grpc::Status Reply(absl::StatusOr<T> result, T* response) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = std::move(result).value();
  return grpc::Status::OK;
}

// One Push or Pull in the callback API. It finishes when the shard completes the call; if
// gRPC cancels the call first (client cancellation, deadline, server shutdown), the shard
// withdraws its wait and completes it then. Deletes itself when gRPC is done with it.
class WaitingReactor final : public grpc::ServerUnaryReactor {
 public:
  WaitCancel* cancel() { return &cancel_; }
  // Finishes the call; the reactor (and the call's response) may be gone when this returns.
  void Complete(const absl::Status& status) { Finish(ToGrpcStatus(status)); }

  void OnCancel() override { cancel_.Cancel(); }
  void OnDone() override { delete this; }

 private:
  WaitCancel cancel_;
};

}  // namespace

absl::Status ParameterServiceImpl::CheckToken(grpc::ServerContextBase* ctx,
                                              const std::string& job) const {
  if (tokens_ == nullptr) return absl::OkStatus();
  absl::string_view presented;
  const auto& md = ctx->client_metadata();
  auto it = md.find("x-gradmesh-job-token");
  if (it != md.end()) presented = absl::string_view(it->second.data(), it->second.size());
  return tokens_->Check(job, presented);
}

std::string ParameterServiceImpl::Incarnation(grpc::ServerContextBase* ctx) const {
  if (tokens_ == nullptr) return "";
  const auto& md = ctx->client_metadata();
  auto it = md.find("x-gradmesh-job-token");
  if (it == md.end() || it->second.empty()) return "";
  return HexOf(Sha256(absl::string_view(it->second.data(), it->second.size())));
}

grpc::Status ParameterServiceImpl::InitJob(grpc::ServerContext* ctx, const InitJobRequest* request,
                                           InitJobResponse* response) {
  if (absl::Status st = CheckToken(ctx, request->job()); !st.ok()) return ToGrpcStatus(st);
  // Which submission of the job this is: the hash of the token it presented (never the token).
  return Reply(shard_->InitJob(*request, Incarnation(ctx)), response);
}

grpc::ServerUnaryReactor* ParameterServiceImpl::Push(grpc::CallbackServerContext* ctx,
                                                     const PushRequest* request,
                                                     PushResponse* response) {
  auto* reactor = new WaitingReactor();
  if (absl::Status st = CheckToken(ctx, request->job()); !st.ok()) {
    reactor->Complete(st);
    return reactor;
  }
  shard_->PushAsync(
      *request,
      [reactor, response](absl::StatusOr<PushResponse> result) {
        if (result.ok()) *response = std::move(result).value();
        reactor->Complete(result.status());
      },
      reactor->cancel());
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServiceImpl::Pull(grpc::CallbackServerContext* ctx,
                                                     const PullRequest* request,
                                                     PullResponse* response) {
  auto* reactor = new WaitingReactor();
  if (absl::Status st = CheckToken(ctx, request->job()); !st.ok()) {
    reactor->Complete(st);
    return reactor;
  }
  // `request` and `response` live until the reactor finishes.
  shard_->PullAsync(
      *request, response, [reactor](absl::Status st) { reactor->Complete(st); }, reactor->cancel());
  return reactor;
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
