// A fake gradmesh_coordinator JobService for CLI tests: canned jobs, scripted WatchJob
// streams, optional API-token check, and a record of what was asked. Implements the
// generated callback service, served over real gRPC on 127.0.0.1 by FakeCoordinator.
//
// Thread safety: all methods may be called concurrently (gRPC calls the handlers on its
// threads while the test reads the records).
#ifndef GRADMESH_CLI_FAKE_JOB_SERVICE_H_
#define GRADMESH_CLI_FAKE_JOB_SERVICE_H_

#include <grpcpp/server.h>

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "proto/coordinator.grpc.pb.h"

namespace gradmesh {
namespace cli {

class FakeJobService final : public JobService::CallbackService {
 public:
  // One WatchJob call's answer: these messages in order, then `end` (or, with hold, nothing
  // until the call is cancelled, e.g. by the server shutting down).
  struct WatchScript {
    std::vector<JobStatus> messages;
    grpc::Status end = grpc::Status::OK;
    bool hold = false;
  };

  // Jobs answered by GetJob/ListJobs/CancelJob, in the order added (ListJobs order).
  void AddJob(const JobStatus& job) ABSL_LOCKS_EXCLUDED(mu_);
  // SubmitJob answers this error instead of accepting.
  void SetSubmitError(grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  // When set, every call must carry `authorization: Bearer <token>` (else UNAUTHENTICATED).
  void SetRequiredToken(std::string token) ABSL_LOCKS_EXCLUDED(mu_);
  // Queued answers of successive WatchJob calls; with none left, WatchJob is NOT_FOUND.
  void AddWatchScript(WatchScript script) ABSL_LOCKS_EXCLUDED(mu_);

  // Queued answers of successive GetLogs calls (an error status, or OK and the response);
  // with none left, GetLogs is NOT_FOUND.
  void AddLogsAnswer(grpc::Status status, GetLogsResponse response = {}) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<GetLogsRequest> logs_requests() const ABSL_LOCKS_EXCLUDED(mu_);

  // GetModel answers: the header, then the payload in kModelChunkBytes pieces. A job added
  // without a model of the asked kind is FAILED_PRECONDITION (the coordinator's message).
  static constexpr size_t kModelChunkBytes = 1 << 20;
  void SetModel(ModelHeader header, std::string payload) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<GetModelRequest> model_requests() const ABSL_LOCKS_EXCLUDED(mu_);

  // What was asked: every SubmitJob request, the authorization header of every call ("" when
  // absent), the number of calls, and WatchJob calls started.
  std::vector<SubmitJobRequest> submits() const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::string> authorizations() const ABSL_LOCKS_EXCLUDED(mu_);
  int calls() const ABSL_LOCKS_EXCLUDED(mu_);
  int watches() const ABSL_LOCKS_EXCLUDED(mu_);

  grpc::ServerUnaryReactor* SubmitJob(grpc::CallbackServerContext* ctx,
                                      const SubmitJobRequest* request,
                                      SubmitJobResponse* response) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* ctx, const GetJobRequest* request,
                                   JobStatus* response) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx,
                                     const ListJobsRequest* request,
                                     ListJobsResponse* response) override;
  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* ctx,
                                      const CancelJobRequest* request,
                                      JobStatus* response) override;
  grpc::ServerWriteReactor<JobStatus>* WatchJob(grpc::CallbackServerContext* ctx,
                                                const WatchJobRequest* request) override;
  grpc::ServerUnaryReactor* GetLogs(grpc::CallbackServerContext* ctx, const GetLogsRequest* request,
                                    GetLogsResponse* response) override;
  grpc::ServerWriteReactor<ModelChunk>* GetModel(grpc::CallbackServerContext* ctx,
                                                 const GetModelRequest* request) override;

 private:
  // Records the call and checks its token.
  grpc::Status Admit(grpc::CallbackServerContext* ctx) ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  std::vector<JobStatus> jobs_ ABSL_GUARDED_BY(mu_);
  grpc::Status submit_error_ ABSL_GUARDED_BY(mu_);
  std::string required_token_ ABSL_GUARDED_BY(mu_);
  std::deque<WatchScript> scripts_ ABSL_GUARDED_BY(mu_);
  std::vector<SubmitJobRequest> submits_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> authorizations_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<grpc::Status, GetLogsResponse>> logs_answers_ ABSL_GUARDED_BY(mu_);
  std::vector<GetLogsRequest> logs_requests_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, int>, std::pair<ModelHeader, std::string>> models_
      ABSL_GUARDED_BY(mu_);
  std::vector<GetModelRequest> model_requests_ ABSL_GUARDED_BY(mu_);
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  int watches_ ABSL_GUARDED_BY(mu_) = 0;
};

// A FakeJobService served on 127.0.0.1:`port` (0: any free port).
class FakeCoordinator {
 public:
  // Null if the server could not start (e.g. the port is taken).
  static std::unique_ptr<FakeCoordinator> Start(int port = 0);
  ~FakeCoordinator();  // Shuts the server down (in-flight calls are cancelled).

  FakeJobService& service() { return service_; }
  int port() const { return port_; }
  std::string address() const;
  // Stops serving now; held watch streams are cancelled.
  void Shutdown();

 private:
  FakeCoordinator() = default;

  FakeJobService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace cli
}  // namespace gradmesh

#endif  // GRADMESH_CLI_FAKE_JOB_SERVICE_H_
