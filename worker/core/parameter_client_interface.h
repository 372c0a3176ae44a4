// ParameterClient: how a worker talks to the parameter-server shards of its job (the
// interface; worker/parameter_client.h has the gRPC implementation, NewGrpcParameterClient).
//
// A client is bound to one job and one worker rank. The training modes see only this
// interface (no gRPC), so tests can substitute either side.
//
// Thread safety: all methods may be called concurrently; each call blocks until every shard
// answered (or retries are exhausted).
#ifndef GRADMESH_WORKER_PARAMETER_CLIENT_INTERFACE_H_
#define GRADMESH_WORKER_PARAMETER_CLIENT_INTERFACE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/gradmesh.pb.h"
#include "worker/core/device_gradients.h"

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
  // sync only: two-phase apply (InitJobRequest.commit_steps): PushPrepared, PullCommitted.
  bool commit_steps = false;
  double clip_grad_value = 0;  // With commit_steps: the shards clamp the averaged gradient.
  Placement placement = PLACEMENT_GREEDY;  // Chunks on shards (common/partitioner.h).
};

// What the shards hold of a prepared step of a commit_steps job (proto PreparedStep), over all
// shards: squared norms added in shard order (so every worker gets the same bits), flags OR-ed.
struct PreparedFigures {
  double grad_sq_norm = 0;
  bool nonfinite = false;
  bool value_clipped = false;
  // Shards that had applied the step but no longer held its figures (restarted since: the
  // decisions of committed steps are not durable); the figures above leave their parts out.
  int forgotten = 0;
};

class ParameterClient {
 public:
  virtual ~ParameterClient() = default;

  // Registers the job on every shard with `initial` values (one span per tensor, layout
  // order). Idempotent: if the job exists with the same layout nothing changes.
  virtual absl::Status InitJob(const std::vector<absl::Span<const float>>& initial) = 0;

  // Pushes one gradient per tensor (layout order) computed at `step`.
  virtual absl::Status Push(int64_t step, const std::vector<absl::Span<const float>>& grads) = 0;

  // Push with the base versions given (as PulledVersions returned them after the pull whose
  // values the gradients were computed on) instead of the last pull's: for callers that pull
  // again before pushing (the pipelined exchange, worker/ps/ps_mode.cc). INVALID_ARGUMENT
  // (nothing sent) if `base_versions` is not one entry per chunk.
  virtual absl::Status PushFrom(int64_t step, const std::vector<absl::Span<const float>>& grads,
                                const std::vector<int64_t>& base_versions) = 0;

  // Overwrites `params` (one span per tensor, layout order) with the shards' current values.
  virtual absl::Status Pull(const std::vector<absl::Span<float>>& params) = 0;

  // Push (PushFrom when `base_versions` is not null) and then Pull, as one round trip to each
  // shard where the client can (PushRequest.pull; ps-lite's ZPushPull): every shard applies
  // the push and answers with its values after it. The gRPC client makes two calls for sync
  // jobs (the shard completing a step would otherwise run every worker's pull in turn) and
  // for shards that do not answer with values. On error nothing of `params` can be relied
  // on; a retried push is applied once (request ids), as with Push.
  virtual absl::Status PushPull(int64_t step, const std::vector<absl::Span<const float>>& grads,
                                const std::vector<absl::Span<float>>& params,
                                const std::vector<int64_t>* base_versions) {
    absl::Status pushed =
        base_versions != nullptr ? PushFrom(step, grads, *base_versions) : Push(step, grads);
    if (!pushed.ok()) return pushed;
    return Pull(params);
  }

  // Push codecs run where the gradients are (worker/core/device_gradients.h): true if this
  // client can encode its push codec there, and then reads the parameters' gradients of every
  // later push through `gradients` (valid while the client is used), not through their spans
  // (buffers' deltas, and a non-finite step's placeholders, still come from the spans). False
  // (no push codec, or one the device does not encode): nothing changes. Afterwards
  // SetPushCodec refuses codecs the device does not encode (FAILED_PRECONDITION).
  virtual bool UseDeviceGradients(DeviceGradients* gradients) { return false; }

  // The job's shards.
  virtual int32_t num_shards() const = 0;
  // For each tensor (layout order), the shards that hold its chunks, ascending (empty for a
  // tensor without elements).
  virtual std::vector<std::vector<int32_t>> TensorShards() const = 0;

  // PushPull(step, grads, params, nullptr) for `shards` only (distinct, ascending, each in
  // [0, num_shards)): only their chunks of `grads` are read and of `params` written. Pushing
  // a step's shards in several calls, each shard once, is pushing the step once (JobSpec
  // overlap: a shard's part leaves as soon as backward produced it). Calls that run at the
  // same time must name disjoint shards. INVALID_ARGUMENT (nothing sent) for a bad list; an
  // empty one does nothing.
  virtual absl::Status PushPullShards(int64_t step,
                                      const std::vector<absl::Span<const float>>& grads,
                                      const std::vector<absl::Span<float>>& params,
                                      const std::vector<int32_t>& shards) = 0;

  // The version of every chunk as of the last Pull (one entry per chunk, opaque to callers).
  virtual std::vector<int64_t> PulledVersions() const = 0;

  // commit_steps jobs (server/sync_commits.h). Pushes step `step` and returns, once its
  // barrier completed on every shard, what the shards hold of it. `nonfinite`: this worker's
  // gradient of the step was not finite; `grads` then holds finite placeholders (zeros).
  virtual absl::StatusOr<PreparedFigures> PushPrepared(
      int64_t step, const std::vector<absl::Span<const float>>& grads, bool nonfinite) {
    return absl::UnimplementedError("PushPrepared: this client does not commit sync steps");
  }
  // A Pull that first commits `commit` on every shard. False if some shard did not hold the
  // step (it restarted between the phases): push the step again with PushPrepared, then
  // commit again (`params` are then not all fresh).
  virtual absl::StatusOr<bool> PullCommitted(const SyncCommit& commit,
                                             const std::vector<absl::Span<float>>& params) {
    return absl::UnimplementedError("PullCommitted: this client does not commit sync steps");
  }

  // Tells every shard this worker is done.
  virtual absl::Status Finish(int64_t step) = 0;

  // Job state as seen by each shard, in shard order.
  virtual absl::StatusOr<std::vector<JobInfoResponse>> GetJobInfo() = 0;
  // The same, except that a shard that does not hold the job answers an empty
  // JobInfoResponse (job "") instead of failing the call with NOT_FOUND.
  virtual absl::StatusOr<std::vector<JobInfoResponse>> GetJobInfoWhereHeld() = 0;

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

  // The run is stopping (a cancelled job, a daemon shutting down): from now on failures are
  // not retried (a call waiting to retry returns CANCELLED), so a dead shard cannot hold the
  // stop for the whole retry budget. Any thread, any time; calls in flight go on.
  virtual void StopRetrying() {}
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_PARAMETER_CLIENT_INTERFACE_H_
