// ParameterClient: how a worker talks to the parameter-server shards of its job.
//
// The Trainer sees only this interface (no gRPC); NewGrpcParameterClient() returns the gRPC
// implementation. A client is bound to one job and one worker rank. It cuts every tensor into
// chunks with the shared partitioner (common/partitioner.h), sends each shard one message per
// operation carrying all of that shard's chunks (small tensors fused), talks to all shards in
// parallel, and remembers the version of every chunk it last pulled so that each push carries
// the version its gradient was computed from.
//
// Compression: with a push codec each chunk's gradient is encoded (through error feedback for
// biased codecs, with optional DGC momentum correction and density warm-up) and sent as that
// codec's payload; with a pull codec the shards send fp16/bf16 values, decoded here.
//
// Retries: UNAVAILABLE, DEADLINE_EXCEEDED and ABORTED are retried with exponential backoff
// (bounded and logged); a retried push reuses its request id, so a shard that already applied
// it acknowledges without applying it again.
//
// Thread safety: all methods may be called concurrently; each call blocks until every shard
// answered (or retries are exhausted).
#ifndef GRADMESH_WORKER_PARAMETER_CLIENT_H_
#define GRADMESH_WORKER_PARAMETER_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/grpc_util.h"
#include "common/logging.h"
#include "proto/gradmesh.pb.h"

namespace gradmesh {

// Everything a shard needs to know about a job, as the worker sees it.
struct JobLayout {
  std::string job;
  std::vector<TensorSpec> tensors;
  int64_t chunk_elems = 262144;  // 1 MiB of float32.
  OptimizerSpec optimizer;
  std::string consistency = "async";
  int32_t num_workers = 1;
  DurabilitySpec durability;       // Default: none.
  bool staleness_damping = false;  // async only.
  double barrier_timeout_s = 0;    // 0: the shard's default (120 s).
};

class ParameterClient {
 public:
  virtual ~ParameterClient() = default;

  // Registers the job on every shard with `initial` values (one span per tensor, layout
  // order). Idempotent: if the job exists with the same layout nothing changes.
  virtual absl::Status InitJob(const std::vector<absl::Span<const float>>& initial) = 0;

  // Pushes one gradient per tensor (layout order) computed at `step`.
  virtual absl::Status Push(int64_t step, const std::vector<absl::Span<const float>>& grads) = 0;

  // Overwrites `params` (one span per tensor, layout order) with the shards' current values.
  virtual absl::Status Pull(const std::vector<absl::Span<float>>& params) = 0;

  // Tells every shard this worker is done.
  virtual absl::Status Finish(int64_t step) = 0;

  // Job state as seen by each shard, in shard order.
  virtual absl::StatusOr<std::vector<JobInfoResponse>> GetJobInfo() = 0;

  // Bytes of tensor payload sent and received so far by Push and Pull (excluding protocol
  // overhead), as on the wire (after compression) and as float32 (before).
  virtual int64_t bytes_pushed() const = 0;
  virtual int64_t bytes_pulled() const = 0;
  virtual int64_t raw_bytes_pushed() const = 0;
  virtual int64_t raw_bytes_pulled() const = 0;
  // Seconds spent encoding pushes and decoding pulls.
  virtual double codec_seconds() const = 0;

  // Switches the push codec from the next Push on ("" = dense); error-feedback residuals start
  // from zero. InvalidArgument for an unknown codec (nothing changes).
  virtual absl::Status SetPushCodec(const std::string& spec) = 0;
};

struct GrpcParameterClientOptions {
  std::vector<std::string> servers;  // "host:port" of each shard, shard order. Required.
  int32_t worker = 0;                // This worker's rank.
  RpcOptions rpc;
  absl::Duration rpc_deadline = absl::Seconds(60);  // Per attempt.
  int32_t max_attempts = 8;                          // Per RPC, first try included.
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
  const Logger* logger = nullptr;  // Not owned; may be null.
  // Compression (see CompressionSpec in gradmesh.proto). push_codec: "" = dense float32;
  // pull_codec: "", "fp16", "bf16" or "changes". With "changes" the caller must hand Pull the
  // same buffers every time and leave what Pull wrote untouched between pulls (they are
  // updated in place), and must not run two Pulls at once.
  std::string push_codec;
  std::string pull_codec;
  bool error_feedback = true;   // For biased push codecs; one residual per chunk.
  float ef_momentum = 0;        // DGC momentum correction (0 = off).
  int64_t warmup_steps = 0;     // DGC warm-up of the sparsity (0 = off).
  uint64_t seed = 1;            // Stochastic codecs: mixed with worker, step and chunk.
  // Per-job secret the shards check (metadata x-gradmesh-job-token; server/job_tokens.h).
  std::string job_token;
};

// Sets the codec, error-feedback and seed fields of `options` from `spec` (compression.push
// "auto" starts dense: the trainer switches codecs once it has measured the job).
void SetClientOptionsFromSpec(const JobSpec& spec, GrpcParameterClientOptions* options);

// InvalidArgument if the layout or options are unusable (no servers, bad rank, ...).
absl::StatusOr<std::unique_ptr<ParameterClient>> NewGrpcParameterClient(
    JobLayout layout, GrpcParameterClientOptions options);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_PARAMETER_CLIENT_H_
