// gRPC adapters of the coordinator (see service.h).
#include "coordinator/service.h"

#include <grpcpp/security/auth_context.h>

#include <exception>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "rpc/grpc_status.h"

namespace gradmesh {
namespace {

bool IsFinal(JobState s) { return s == SUCCEEDED || s == FAILED || s == CANCELLED; }

// Runs a handler's body; an exception (a bug: inputs are bounded so none is expected, e.g.
// bad_alloc) becomes INTERNAL naming the method instead of gRPC's UNKNOWN "Unexpected error in
// RPC handling", and never reaches gRPC.
template <typename Body>
grpc::Status Guarded(const char* method, Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        absl::StrCat(method, ": internal error: ", e.what()));
  } catch (...) {
    return grpc::Status(grpc::StatusCode::INTERNAL, absl::StrCat(method, ": internal error"));
  }
}

}  // namespace

std::string CertificateNodeName(const grpc::ServerContext& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  const std::vector<grpc::string_ref> cn = auth->FindPropertyValues("x509_common_name");
  if (cn.size() != 1) return "";
  return std::string(cn[0].data(), cn[0].size());
}

Coordinator::NodeCredentials NodeCredentialsOf(const grpc::ServerContext& context,
                                               const NodeIdentityFn& identity) {
  Coordinator::NodeCredentials c;
  const auto& metadata = context.client_metadata();
  const auto range = metadata.equal_range(kNodeIdentityMetadataKey);
  // Exactly one header: two would make the caller's identity ambiguous.
  if (range.first != range.second && std::next(range.first) == range.second) {
    c.token.assign(range.first->second.data(), range.first->second.size());
  }
  if (identity) c.proved_name = identity(context);
  return c;
}

#define GM_CHECK_AUTH(context)                         \
  do {                                                 \
    absl::Status gm_auth_ = auth_->Check(*(context));  \
    if (!gm_auth_.ok()) return ToGrpcStatus(gm_auth_); \
  } while (0)

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext* context,
                                       const SubmitJobRequest* request,
                                       SubmitJobResponse* response) {
  return Guarded("SubmitJob", [&]() -> grpc::Status {
    GM_CHECK_AUTH(context);
    absl::StatusOr<JobStatus> job = coordinator_->SubmitJob(*request);
    if (!job.ok()) return ToGrpcStatus(job.status());
    *response->mutable_job() = std::move(job).value();
    return grpc::Status::OK;
  });
}

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext* context, const GetJobRequest* request,
                                    JobStatus* response) {
  return Guarded("GetJob", [&]() -> grpc::Status {
    GM_CHECK_AUTH(context);
    absl::StatusOr<JobStatus> job = coordinator_->GetJob(request->job_id());
    if (!job.ok()) return ToGrpcStatus(job.status());
    *response = std::move(job).value();
    return grpc::Status::OK;
  });
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext* context,
                                      const ListJobsRequest* /*request*/,
                                      ListJobsResponse* response) {
  return Guarded("ListJobs", [&]() -> grpc::Status {
    GM_CHECK_AUTH(context);
    for (JobStatus& job : coordinator_->ListJobs()) *response->add_jobs() = std::move(job);
    return grpc::Status::OK;
  });
}

grpc::Status JobServiceImpl::GetLogs(grpc::ServerContext* context, const GetLogsRequest* request,
                                     GetLogsResponse* response) {
  return Guarded("GetLogs", [&]() -> grpc::Status {
    GM_CHECK_AUTH(context);
    absl::StatusOr<GetLogsResponse> logs =
        coordinator_->GetLogs(request->job_id(), request->rank(), request->after_sequence());
    if (!logs.ok()) return ToGrpcStatus(logs.status());
    *response = std::move(logs).value();
    return grpc::Status::OK;
  });
}

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext* context,
                                       const CancelJobRequest* request, JobStatus* response) {
  return Guarded("CancelJob", [&]() -> grpc::Status {
    GM_CHECK_AUTH(context);
    absl::StatusOr<JobStatus> job = coordinator_->CancelJob(request->job_id());
    if (!job.ok()) return ToGrpcStatus(job.status());
    *response = std::move(job).value();
    return grpc::Status::OK;
  });
}

grpc::Status JobServiceImpl::WatchJob(grpc::ServerContext* context, const WatchJobRequest* request,
                                      grpc::ServerWriter<JobStatus>* writer) {
  return Guarded("WatchJob", [&]() -> grpc::Status {
    GM_CHECK_AUTH(context);
    int64_t seen = 0;  // Versions start at 1: the first wait returns the current status.
    while (!context->IsCancelled()) {
      absl::StatusOr<Coordinator::JobView> view =
          coordinator_->WaitForJobChange(request->job_id(), seen, absl::Now() + watch_poll_);
      if (!view.ok()) return ToGrpcStatus(view.status());
      if (view->version == seen) continue;  // Poll deadline: check for cancellation.
      seen = view->version;
      if (!writer->Write(view->status)) {
        return grpc::Status(grpc::StatusCode::CANCELLED, "watcher went away");
      }
      if (IsFinal(view->status.state())) return grpc::Status::OK;
    }
    return grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled by the client");
  });
}

grpc::Status JobServiceImpl::GetModel(grpc::ServerContext* context, const GetModelRequest* request,
                                      grpc::ServerWriter<ModelChunk>* writer) {
  return Guarded("GetModel", [&]() -> grpc::Status {
    GM_CHECK_AUTH(context);
    absl::Status s = coordinator_->GetModel(
        request->job_id(), request->kind(),
        [&](const ModelHeader& header) {
          ModelChunk first;
          *first.mutable_header() = header;
          return writer->Write(first);
        },
        [&](absl::string_view piece) {
          if (context->IsCancelled()) return false;
          ModelChunk chunk;
          chunk.set_data(piece.data(), piece.size());
          return writer->Write(chunk);
        });
    if (absl::IsCancelled(s)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "GetModel: the reader went away");
    }
    return ToGrpcStatus(s);
  });
}

grpc::Status NodeServiceImpl::Register(grpc::ServerContext* context, const RegisterRequest* request,
                                       RegisterResponse* response) {
  return Guarded("Register", [&]() -> grpc::Status {
    GM_CHECK_AUTH(context);
    absl::StatusOr<RegisterResponse> r =
        coordinator_->Register(*request, NodeCredentialsOf(*context, identity_));
    if (!r.ok()) return ToGrpcStatus(r.status());
    *response = std::move(r).value();
    return grpc::Status::OK;
  });
}

grpc::Status NodeServiceImpl::Heartbeat(grpc::ServerContext* context,
                                        const HeartbeatRequest* request,
                                        HeartbeatResponse* response) {
  return Guarded("Heartbeat", [&]() -> grpc::Status {
    GM_CHECK_AUTH(context);
    absl::StatusOr<HeartbeatResponse> r =
        coordinator_->Heartbeat(*request, NodeCredentialsOf(*context, identity_));
    if (!r.ok()) return ToGrpcStatus(r.status());
    *response = std::move(r).value();
    return grpc::Status::OK;
  });
}

grpc::Status NodeServiceImpl::PublishModel(grpc::ServerContext* context,
                                           grpc::ServerReader<ModelChunk>* reader,
                                           PublishModelResponse* response) {
  return Guarded("PublishModel", [&]() -> grpc::Status {
    GM_CHECK_AUTH(context);
    const Coordinator::NodeCredentials credentials = NodeCredentialsOf(*context, identity_);
    ModelChunk chunk;
    if (!reader->Read(&chunk) || !chunk.has_header()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "PublishModel: the first message must carry the header");
    }
    const ModelHeader header = chunk.header();
    if (absl::Status s = coordinator_->CheckModelHeader(header, credentials); !s.ok()) {
      return ToGrpcStatus(s);
    }
    // One at a time per job and kind: a publisher cannot hold many buffered payloads.
    if (absl::Status s = coordinator_->BeginPublish(header); !s.ok()) return ToGrpcStatus(s);
    const absl::Cleanup end_publish = [&] { coordinator_->EndPublish(header); };
    // total_bytes is within --max_model_bytes and the caller is rank 0's node (checked above).
    std::string payload;
    payload.reserve(static_cast<size_t>(header.total_bytes()));
    do {
      if (static_cast<int64_t>(payload.size() + chunk.data().size()) > header.total_bytes()) {
        return grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("PublishModel of job ", header.job_id(),
                         ": more payload than header.total_bytes (", header.total_bytes(), ")"));
      }
      payload.append(chunk.data());
      chunk.Clear();
      if (!reader->Read(&chunk)) break;
      if (chunk.has_header()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("PublishModel of job ", header.job_id(),
                                         ": a second header in the stream"));
      }
    } while (true);
    if (context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "PublishModel: the publisher went away");
    }
    if (absl::Status s = coordinator_->PublishModel(header, payload, credentials); !s.ok()) {
      return ToGrpcStatus(s);
    }
    response->set_stored_bytes(static_cast<int64_t>(payload.size()));
    return grpc::Status::OK;
  });
}

#undef GM_CHECK_AUTH

}  // namespace gradmesh
