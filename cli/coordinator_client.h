// CoordinatorClient: the `gradmesh` CLI's view of the coordinator's JobService.
//
// The commands in cli/cli.cc see only this interface; NewGrpcCoordinatorClient() returns the
// gRPC implementation, which sends `authorization: Bearer <token>` on every call when a token
// is set. Errors are the coordinator's status (same code and message), or the transport's
// (UNAVAILABLE when the coordinator cannot be reached: calls fail fast, they do not wait for
// the coordinator to come up).
//
// Thread safety: all methods may be called concurrently; each blocks until the coordinator
// answered or the deadline passed (Watch: until the stream ends).
#ifndef GRADMESH_CLI_COORDINATOR_CLIENT_H_
#define GRADMESH_CLI_COORDINATOR_CLIENT_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/coordinator.pb.h"
#include "rpc/grpc_util.h"

namespace gradmesh {
namespace cli {

class CoordinatorClient {
 public:
  virtual ~CoordinatorClient() = default;

  virtual absl::StatusOr<JobStatus> SubmitJob(const JobSpec& spec, bool dry_run, bool resume) = 0;
  virtual absl::StatusOr<JobStatus> GetJob(const std::string& job_id) = 0;
  virtual absl::StatusOr<std::vector<JobStatus>> ListJobs() = 0;
  virtual absl::StatusOr<JobStatus> CancelJob(const std::string& job_id) = 0;
  // JobService.GetLogs: rank -1 = every rank; lines with a sequence above after_sequence.
  virtual absl::StatusOr<GetLogsResponse> GetLogs(const std::string& job_id, int rank,
                                                  int64_t after_sequence) = 0;

  // A model the job's rank 0 published (proto/coordinator.proto "Published models").
  struct PublishedModel {
    ModelHeader header;
    std::string payload;  // header.total_bytes bytes.
  };
  // JobService.GetModel, collected whole: the coordinator's error (NOT_FOUND unknown job,
  // FAILED_PRECONDITION nothing published yet), or DATA_LOSS when the stream does not hold a
  // header followed by exactly header.total_bytes payload bytes. Deadline: model_deadline.
  virtual absl::StatusOr<PublishedModel> GetModel(const std::string& job_id, ModelKind kind) = 0;

  // Streams the job's status: calls `on_update` with every message, in order, on the calling
  // thread. Returns when the stream ends: OK if the coordinator ended it (the last message
  // had a final state), else the stream's error (e.g. UNAVAILABLE when the coordinator went
  // away). No deadline.
  virtual absl::Status WatchJob(const std::string& job_id,
                                const std::function<void(const JobStatus&)>& on_update) = 0;
};

struct CoordinatorClientOptions {
  std::string address;     // "host:port" of gradmesh_coordinator. Required.
  std::string auth_token;  // API token; empty: no authorization header.
  RpcOptions rpc;
  absl::Duration deadline = absl::Seconds(30);  // Per unary call.
  // Of a whole GetModel download (models can have GiBs).
  absl::Duration model_deadline = absl::Minutes(30);
};

std::unique_ptr<CoordinatorClient> NewGrpcCoordinatorClient(CoordinatorClientOptions options);

}  // namespace cli
}  // namespace gradmesh

#endif  // GRADMESH_CLI_COORDINATOR_CLIENT_H_
