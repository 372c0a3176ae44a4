// gRPC implementation of CoordinatorClient (see coordinator_client.h).
#include "cli/coordinator_client.h"

#include <grpcpp/client_context.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "proto/coordinator.grpc.pb.h"
#include "rpc/auth.h"
#include "rpc/grpc_status.h"

namespace gradmesh {
namespace cli {
namespace {

class GrpcCoordinatorClient final : public CoordinatorClient {
 public:
  explicit GrpcCoordinatorClient(CoordinatorClientOptions options)
      : options_(std::move(options)),
        stub_(JobService::NewStub(MakeChannel(options_.address, options_.rpc))) {}

  absl::StatusOr<JobStatus> SubmitJob(const JobSpec& spec, bool dry_run, bool resume) override {
    SubmitJobRequest req;
    *req.mutable_spec() = spec;
    req.set_dry_run(dry_run);
    req.set_resume(resume);
    SubmitJobResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx, /*unary=*/true);
    RETURN_IF_ERROR(FromGrpcStatus(stub_->SubmitJob(&ctx, req, &resp)));
    return resp.job();
  }

  absl::StatusOr<JobStatus> GetJob(const std::string& job_id) override {
    GetJobRequest req;
    req.set_job_id(job_id);
    JobStatus resp;
    grpc::ClientContext ctx;
    Prepare(&ctx, /*unary=*/true);
    RETURN_IF_ERROR(FromGrpcStatus(stub_->GetJob(&ctx, req, &resp)));
    return resp;
  }

  absl::StatusOr<std::vector<JobStatus>> ListJobs() override {
    ListJobsResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx, /*unary=*/true);
    RETURN_IF_ERROR(FromGrpcStatus(stub_->ListJobs(&ctx, ListJobsRequest(), &resp)));
    return std::vector<JobStatus>(resp.jobs().begin(), resp.jobs().end());
  }

  absl::StatusOr<GetLogsResponse> GetLogs(const std::string& job_id, int rank,
                                          int64_t after_sequence) override {
    GetLogsRequest req;
    req.set_job_id(job_id);
    req.set_rank(rank);
    req.set_after_sequence(after_sequence);
    GetLogsResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx, /*unary=*/true);
    RETURN_IF_ERROR(FromGrpcStatus(stub_->GetLogs(&ctx, req, &resp)));
    return resp;
  }

  absl::StatusOr<JobStatus> CancelJob(const std::string& job_id) override {
    CancelJobRequest req;
    req.set_job_id(job_id);
    JobStatus resp;
    grpc::ClientContext ctx;
    Prepare(&ctx, /*unary=*/true);
    RETURN_IF_ERROR(FromGrpcStatus(stub_->CancelJob(&ctx, req, &resp)));
    return resp;
  }

  absl::StatusOr<PublishedModel> GetModel(const std::string& job_id, ModelKind kind) override {
    GetModelRequest req;
    req.set_job_id(job_id);
    req.set_kind(kind);
    grpc::ClientContext ctx;
    Prepare(&ctx, /*unary=*/false);
    ctx.set_deadline(std::chrono::system_clock::now() +
                     absl::ToChronoMilliseconds(options_.model_deadline));
    std::unique_ptr<grpc::ClientReader<ModelChunk>> reader = stub_->GetModel(&ctx, req);
    PublishedModel model;
    ModelChunk msg;
    bool have_header = false;
    std::string bad;
    while (bad.empty() && reader->Read(&msg)) {
      if (!have_header) {
        if (!msg.has_header() || msg.header().total_bytes() < 0) {
          bad = "the first message has no header";
          break;
        }
        have_header = true;
        model.header = msg.header();
        // Reserve at most 1 GiB up front: the header's claim is checked as the bytes arrive.
        model.payload.reserve(
            static_cast<size_t>(std::min<int64_t>(model.header.total_bytes(), int64_t{1} << 30)));
      } else if (msg.has_header()) {
        bad = "a second header";
      }
      if (static_cast<int64_t>(model.payload.size() + msg.data().size()) >
          model.header.total_bytes()) {
        bad = absl::StrCat("more than the header's ", model.header.total_bytes(), " bytes");
      }
      model.payload.append(msg.data());
    }
    if (!bad.empty()) {
      ctx.TryCancel();
      reader->Finish();
      return absl::DataLossError(absl::StrCat("GetModel of job ", job_id, ": ", bad));
    }
    RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
    if (!have_header || static_cast<int64_t>(model.payload.size()) != model.header.total_bytes()) {
      return absl::DataLossError(absl::StrCat(
          "GetModel of job ", job_id, ": the stream ended after ", model.payload.size(), " of ",
          model.header.total_bytes(), " bytes", have_header ? "" : " (no header)"));
    }
    return model;
  }

  absl::Status WatchJob(const std::string& job_id,
                        const std::function<void(const JobStatus&)>& on_update) override {
    WatchJobRequest req;
    req.set_job_id(job_id);
    grpc::ClientContext ctx;
    Prepare(&ctx, /*unary=*/false);
    std::unique_ptr<grpc::ClientReader<JobStatus>> reader = stub_->WatchJob(&ctx, req);
    JobStatus msg;
    while (reader->Read(&msg)) on_update(msg);
    return FromGrpcStatus(reader->Finish());
  }

 private:
  void Prepare(grpc::ClientContext* ctx, bool unary) const {
    AddBearerToken(options_.auth_token, ctx);
    if (unary) {
      ctx->set_deadline(std::chrono::system_clock::now() +
                        absl::ToChronoMilliseconds(options_.deadline));
    }
  }

  const CoordinatorClientOptions options_;
  const std::unique_ptr<JobService::Stub> stub_;
};

}  // namespace

std::unique_ptr<CoordinatorClient> NewGrpcCoordinatorClient(CoordinatorClientOptions options) {
  return std::make_unique<GrpcCoordinatorClient>(std::move(options));
}

}  // namespace cli
}  // namespace gradmesh
