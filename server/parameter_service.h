// gRPC adapter of ParameterService over a Shard: checks the per-job token (server/job_tokens.h)
// and converts status codes, nothing else.
//
// Push and Pull use gRPC's callback API: a push waiting at a sync barrier (or a pull held by
// an ssp bound) is parked in the shard with its reactor's completion and takes no thread; its
// reactor finishes when the shard completes it (step applied, barrier timeout, ...). A call
// the client cancels (or whose deadline passes, or that a server shutdown cancels) withdraws
// its wait: nothing of a cancelled push is applied. The unary contract seen by clients (codes,
// messages, responses) is that of Shard::Push and Shard::Pull. InitJob, Finish and GetJobInfo
// never wait for other workers and stay on gRPC's synchronous thread pool.
//
// Stream carries many pushes and pulls over one call (a worker keeps one per shard): each is
// checked and handled exactly as the unary Push or Pull, waits the same way without a thread
// (a waiting push holds up none of the stream's other operations) and is answered by call id
// in completion order. It reads raw bytes and parses them itself, so a message that is not a
// StreamRequest ends the stream with INVALID_ARGUMENT (operations in flight are withdrawn).
// Cancelling the stream withdraws its waiting operations, as cancelling unary calls would.
//
// OpenShm gives a worker on the same machine a shared-memory channel
// (server/shm_op_server.h): the same operations as Stream, one at a time, through memory both
// processes map, for as long as the call stays open.
//
// Thread safety: as Shard; gRPC calls the methods from its threads.
#ifndef GRADMESH_SERVER_PARAMETER_SERVICE_H_
#define GRADMESH_SERVER_PARAMETER_SERVICE_H_

#include <atomic>
#include <cstdint>

#include "common/logging.h"
#include "proto/gradmesh.grpc.pb.h"
#include "server/job_tokens.h"
#include "server/shard.h"

namespace gradmesh {

// Shared-memory channels (OpenShm, server/shm_op_server.h).
struct ShmChannelOptions {
  int32_t max_channels = 64;  // Open at once; 0 refuses every OpenShm.
  // Largest area a channel may ask for (each of its two); a worker whose messages are larger
  // keeps the Stream.
  int64_t max_area_bytes = int64_t{256} << 20;
  const Logger* logger = nullptr;  // Not owned; may be null.
  // ShmOpServer::Options.spin of every channel (--shm_spin_us; 0: block at once).
  absl::Duration spin = absl::ZeroDuration();
};

class ParameterServiceImpl final
    : public ParameterService::WithCallbackMethod_OpenShm<
          ParameterService::WithRawCallbackMethod_Stream<
              ParameterService::WithRawCallbackMethod_Push<
                  ParameterService::WithRawCallbackMethod_Pull<ParameterService::Service>>>> {
 public:
  // `shard` and `tokens` are not owned and must outlive the service; null `tokens` means no
  // per-job access check (every call's job is checked against it otherwise).
  explicit ParameterServiceImpl(Shard* shard, const JobTokens* tokens = nullptr,
                                ShmChannelOptions shm = {})
      : shard_(shard), tokens_(tokens), shm_(shm) {}

  grpc::Status InitJob(grpc::ServerContext*, const InitJobRequest* request,
                       InitJobResponse* response) override;
  // Push and Pull on raw bytes: the request is parsed here (INVALID_ARGUMENT if it does not
  // parse), and the pulled values move into the response's slices without a second copy
  // (rpc/tensor_wire.h); the bytes on the wire are protobuf's.
  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Pull(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      grpc::CallbackServerContext* context) override;
  // A worker on this machine opens a shared-memory channel: FAILED_PRECONDITION for a peer
  // that is not loopback or a Unix socket, or once max_channels are open; INVALID_ARGUMENT for
  // an area outside [4 KiB, max_area_bytes]. The channel lives as long as the call.
  grpc::ServerBidiReactor<ShmOpenRequest, ShmOpenResponse>* OpenShm(
      grpc::CallbackServerContext* context) override;
  // Shared-memory channels open now.
  int32_t shm_channels() const { return shm_open_.load(); }
  grpc::Status Finish(grpc::ServerContext*, const FinishRequest* request,
                      FinishResponse* response) override;
  grpc::Status GetJobInfo(grpc::ServerContext*, const JobInfoRequest* request,
                          JobInfoResponse* response) override;

 private:
  absl::Status CheckToken(grpc::ServerContextBase* ctx, const std::string& job) const;
  // InitJobRequest.incarnation of a call: hex SHA-256 of its job token ("" without tokens).
  std::string Incarnation(grpc::ServerContextBase* ctx) const;

  Shard* const shard_;
  const JobTokens* const tokens_;
  const ShmChannelOptions shm_;
  std::atomic<int32_t> shm_open_{0};
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_PARAMETER_SERVICE_H_
