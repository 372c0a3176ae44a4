// Reading a parameter-server job's current model (parameters and buffers) back from its
// shards, for `gradmesh export`.
//
// Asks every shard for the job's layout (GetJobInfo) and checks that they agree and that shard
// i of the address list calls itself shard i of N; rebuilds the partition (common/partitioner.h)
// and pulls every shard's chunks (dense float32), placing each at its offset in its tensor.
// Every call carries `x-gradmesh-job-token: <job_token>` when a token is given.
//
// A pull is made as the job's slowest unfinished rank on that shard, so an ssp job that is
// still running never makes it wait. The shards are read one after another: for a job that is
// still training the tensors are a live mix of nearby steps; for a finished job they are the
// final model.
//
// Thread safety: a pure function of the shards' state; blocks on RPCs.
#ifndef GRADMESH_CLI_SHARD_EXPORT_H_
#define GRADMESH_CLI_SHARD_EXPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/gradmesh.pb.h"
#include "rpc/grpc_util.h"

namespace gradmesh {
namespace cli {

struct ExportedTensor {
  std::string name;            // e.g. "fc1.weight", "bn1.num_batches_tracked".
  std::vector<int64_t> shape;  // Empty: a scalar (0-dim tensor, one value).
  std::vector<float> values;   // Row-major, numel(shape) elements, as the shards store them.
  // The model's element type (TensorSpec.dtype; FLOAT32 when unset): SaveStateDict writes
  // the tensor with it, so load_state_dict(strict=True) accepts e.g. an int64 buffer.
  DType dtype = FLOAT32;
  bool buffer = false;  // TensorSpec.buffer: a model buffer, not a trainable parameter.
};

struct ShardExportOptions {
  std::string job;
  std::vector<std::string> shards;  // "host:port" of each shard, in shard order. Required.
  std::string job_token;            // Per-job secret; empty: no token header.
  RpcOptions rpc;
  absl::Duration deadline = absl::Seconds(60);  // Per RPC.
};

// The job's tensors (parameters and buffers) in layout order. Errors name the shard (index and
// address): the shard's own status (e.g. NOT_FOUND for a job it does not hold, PERMISSION_DENIED
// for a wrong token, UNAVAILABLE), or FAILED_PRECONDITION when shards disagree on the layout or a
// pull does not hold exactly the chunks the partition assigns to that shard.
absl::StatusOr<std::vector<ExportedTensor>> FetchJobTensors(const ShardExportOptions& options);

}  // namespace cli
}  // namespace gradmesh

#endif  // GRADMESH_CLI_SHARD_EXPORT_H_
