// gRPC adapters of the coordinator (see service.h).
#include "coordinator/service.h"

#include "absl/time/clock.h"
#include "common/status.h"
#include "rpc/grpc_status.h"

namespace gradmesh {
namespace {

bool IsFinal(JobState s) { return s == SUCCEEDED || s == FAILED || s == CANCELLED; }

}  // namespace

#define GM_CHECK_AUTH(context)                         \
  do {                                                 \
    absl::Status gm_auth_ = auth_->Check(*(context));  \
    if (!gm_auth_.ok()) return ToGrpcStatus(gm_auth_); \
  } while (0)

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext* context,
                                       const SubmitJobRequest* request,
                                       SubmitJobResponse* response) {
  GM_CHECK_AUTH(context);
  absl::StatusOr<JobStatus> job = coordinator_->SubmitJob(*request);
  if (!job.ok()) return ToGrpcStatus(job.status());
  *response->mutable_job() = std::move(job).value();
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext* context, const GetJobRequest* request,
                                    JobStatus* response) {
  GM_CHECK_AUTH(context);
  absl::StatusOr<JobStatus> job = coordinator_->GetJob(request->job_id());
  if (!job.ok()) return ToGrpcStatus(job.status());
  *response = std::move(job).value();
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext* context,
                                      const ListJobsRequest* /*request*/,
                                      ListJobsResponse* response) {
  GM_CHECK_AUTH(context);
  for (JobStatus& job : coordinator_->ListJobs()) *response->add_jobs() = std::move(job);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::GetLogs(grpc::ServerContext* context, const GetLogsRequest* request,
                                     GetLogsResponse* response) {
  GM_CHECK_AUTH(context);
  absl::StatusOr<GetLogsResponse> logs =
      coordinator_->GetLogs(request->job_id(), request->rank(), request->after_sequence());
  if (!logs.ok()) return ToGrpcStatus(logs.status());
  *response = std::move(logs).value();
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext* context,
                                       const CancelJobRequest* request, JobStatus* response) {
  GM_CHECK_AUTH(context);
  absl::StatusOr<JobStatus> job = coordinator_->CancelJob(request->job_id());
  if (!job.ok()) return ToGrpcStatus(job.status());
  *response = std::move(job).value();
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::WatchJob(grpc::ServerContext* context, const WatchJobRequest* request,
                                      grpc::ServerWriter<JobStatus>* writer) {
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
}

grpc::Status NodeServiceImpl::Register(grpc::ServerContext* context, const RegisterRequest* request,
                                       RegisterResponse* response) {
  GM_CHECK_AUTH(context);
  absl::StatusOr<RegisterResponse> r = coordinator_->Register(*request);
  if (!r.ok()) return ToGrpcStatus(r.status());
  *response = std::move(r).value();
  return grpc::Status::OK;
}

grpc::Status NodeServiceImpl::Heartbeat(grpc::ServerContext* context,
                                        const HeartbeatRequest* request,
                                        HeartbeatResponse* response) {
  GM_CHECK_AUTH(context);
  absl::StatusOr<HeartbeatResponse> r = coordinator_->Heartbeat(*request);
  if (!r.ok()) return ToGrpcStatus(r.status());
  *response = std::move(r).value();
  return grpc::Status::OK;
}

#undef GM_CHECK_AUTH

}  // namespace gradmesh
