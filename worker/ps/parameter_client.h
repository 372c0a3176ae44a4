// ParameterClient: how a worker talks to the parameter-server shards of its job.
//
// The training modes see only the interface (worker/parameter_client_interface.h, no gRPC);
// NewGrpcParameterClient() returns this gRPC implementation. A client is bound to one job and one
// worker rank. It cuts every tensor into chunks with the shared partitioner (common/partitioner.h),
// sends each shard one message per operation carrying all of that shard's chunks (small tensors
// fused), talks to all shards in parallel, and remembers the version of every chunk it last pulled
// so that each push carries the version its gradient was computed from.
//
// Compression: with a push codec each chunk's gradient is encoded (through error feedback for
// biased codecs, with optional DGC momentum correction and density warm-up) and sent as that
// codec's payload; with a pull codec the shards send fp16/bf16 values, decoded here. Chunks of
// buffer tensors (TensorSpec.buffer) are always pushed and pulled dense float32 (the shards
// send them dense whatever the pull codec), so buffer deltas and values travel exactly.
//
// Transport: by default each shard's pushes and pulls go over one long-lived
// ParameterService.Stream call (rpc/op_stream.h), shared by concurrent callers, which costs
// far less per operation than a unary call; options.transport = "unary" uses one unary call
// per operation instead, and so do large messages (options.stream_max_bytes). With "shm" a shard
// on the same machine gets the operations through shared memory (BytePS's inter-process path:
// no loopback TCP, HTTP/2 or gRPC thread hops; the Stream's framing, checks and codes), any
// size that fits the channel's area. Other RPCs are unary either way. A stream that breaks fails
// its operations UNAVAILABLE (retried below, over a new stream); an operation past its deadline
// breaks its stream (the other operations on it are retried too).
//
// Retries: UNAVAILABLE, DEADLINE_EXCEEDED and ABORTED are retried with exponential backoff
// (bounded and logged); a retried push reuses its request id, so a shard that already applied
// it acknowledges without applying it again. After StopRetrying (a cancelled job, a daemon
// shutting down) nothing more is retried: a call whose attempt failed, or that is waiting out
// a backoff, returns CANCELLED within ~50 ms.
//
// Thread safety: all methods may be called concurrently; each call blocks until every shard
// answered (or retries are exhausted).
#ifndef GRADMESH_WORKER_PS_PARAMETER_CLIENT_H_
#define GRADMESH_WORKER_PS_PARAMETER_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/logging.h"
#include "proto/gradmesh.pb.h"
#include "rpc/grpc_util.h"
#include "worker/core/parameter_client_interface.h"

namespace gradmesh {

struct GrpcParameterClientOptions {
  std::vector<std::string> servers;  // "host:port" of each shard, shard order. Required.
  int32_t worker = 0;                // This worker's rank.
  RpcOptions rpc;
  absl::Duration rpc_deadline = absl::Seconds(60);  // Per attempt.
  int32_t max_attempts = 8;                         // Per RPC, first try included.
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
  const Logger* logger = nullptr;  // Not owned; may be null.
  // Compression (see CompressionSpec in gradmesh.proto). push_codec: "" = dense float32;
  // pull_codec: "", "fp16", "bf16" or "changes". With "changes" the caller must hand Pull the
  // same buffers every time and leave what Pull wrote untouched between pulls (they are
  // updated in place), and must not run two Pulls at once.
  std::string push_codec;
  std::string pull_codec;
  bool error_feedback = true;  // For biased push codecs; one residual per chunk.
  float ef_momentum = 0;       // DGC momentum correction (0 = off).
  int64_t warmup_steps = 0;    // DGC warm-up of the sparsity (0 = off).
  uint64_t seed = 1;           // Stochastic codecs: mixed with worker, step and chunk.
  // Per-job secret the shards check (metadata x-gradmesh-job-token; server/job_tokens.h).
  std::string job_token;
  // How pushes and pulls travel: "stream" (one ParameterService.Stream per shard), "unary",
  // or "shm": a shared-memory channel per shard (rpc/shm_op_channel.h) for shards on this
  // machine, one operation at a time, and the Stream for whatever it cannot take (a shard on
  // another machine, user or PID namespace, or an operation while one is in flight).
  std::string transport = "stream";
  // With "stream": a push or pull whose tensor payload for a shard exceeds this many bytes
  // takes a unary call instead. A call's fixed cost is small next to such a message (both
  // transports measure the same at 4 MiB, within noise), and a message over the size limit
  // (RpcOptions.max_message_bytes) then fails only its own call, not every operation on the
  // shared stream.
  int64_t stream_max_bytes = 1 << 20;
  // A caller waiting for its shards' answers first spins (yielding the CPU) for up to this
  // long while recent waits were shorter than it (common/spin_wait.h); 0 = always block.
  // A lone 4 KiB push or pull on loopback answers in about half the time, and the waits of a
  // real model's step (milliseconds) never spin.
  absl::Duration spin_wait = absl::Microseconds(300);
};

// Sets the codec, error-feedback and seed fields of `options` from `spec` (compression.push
// "auto" starts dense: the trainer switches codecs once it has measured the job).
void SetClientOptionsFromSpec(const JobSpec& spec, GrpcParameterClientOptions* options);

// InvalidArgument if the layout or options are unusable (no servers, bad rank, ...).
absl::StatusOr<std::unique_ptr<ParameterClient>> NewGrpcParameterClient(
    JobLayout layout, GrpcParameterClientOptions options);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_PS_PARAMETER_CLIENT_H_
