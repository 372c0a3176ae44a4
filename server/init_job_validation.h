// The checks an InitJob passes before the shard allocates anything for the job (issue #15
// items 3 and 5): every field of the request, against the shard's limits, and the memory the
// job will hold, so that no hostile or mistaken request can make the shard allocate more than
// its limits allow, throw from a std container, or run an optimizer that turns parameters
// into inf/NaN.
//
// Order, as Shard::InitJob runs them:
//   ValidateInitJob      pure checks of the request (no allocation beyond bounded scratch)
//   Partition::Create    the layout's partition (bounded by the limits just checked)
//   CheckInitialValues   the initial values match this shard's chunks exactly, all finite
//   EstimateJobMemory    what the job will hold, reserved from the shard's MemoryBudget
//
// All errors are INVALID_ARGUMENT prefixed "InitJob: job <J>" and naming the field (e.g.
// "InitJob: job j optimizer.lr 1e+39 is not a finite float32 > 0"); memory and job-count
// refusals are RESOURCE_EXHAUSTED (Shard::InitJob).
//
// Thread safety: pure functions of their arguments; safe to call concurrently.
#ifndef GRADMESH_SERVER_INIT_JOB_VALIDATION_H_
#define GRADMESH_SERVER_INIT_JOB_VALIDATION_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "common/optimizer.h"
#include "common/partitioner.h"
#include "proto/gradmesh.pb.h"
#include "server/consistency.h"
#include "server/shard_limits.h"

namespace gradmesh {

// Largest chunk_elems: 2^28 (1 GiB of float32, the job spec's largest chunk_bytes), so one
// chunk always fits a protobuf bytes field (< 2 GiB) in pushes, pulls and snapshots.
inline constexpr int64_t kMaxChunkElems = int64_t{1} << 28;

// Longest barrier_timeout_s a job may ask for: 7 days.
inline constexpr double kMaxBarrierTimeoutS = 7 * 86400.0;

// Checks every field of `r` (job name, tensors: count, names, dimensions, element count and
// its overflow, dtype: FLOAT32 or unset for parameters, any known DType for buffers; chunk_elems
// and the job's chunk count; num_shards and shard_index; num_workers; the optimizer: known name and
// every hyper-parameter finite and in range as float32; the consistency mode and its parameter;
// staleness damping; timeouts; durability) against `limits` and the registries. Allocates nothing
// that depends on the request's numbers. OK means Partition::Create of the layout succeeds within
// the limits.
absl::Status ValidateInitJob(const InitJobRequest& r, const ShardLimits& limits,
                             const OptimizerRegistry& optimizers,
                             const ConsistencyRegistry& consistency);

// The optimizer part of ValidateInitJob: the registry knows the name and accepts the spec,
// and every numeric field (used by that optimizer or not) is finite and in its documented
// range, also after rounding to float32 (lr 1e39 becomes inf, eps 1e-50 becomes 0). Errors
// name "optimizer.<field>" after `context`.
absl::Status ValidateOptimizerSpec(const OptimizerSpec& s, const OptimizerRegistry& optimizers,
                                   const std::string& context);

// The partition of validated layout `r` (bounded by the limits ValidateInitJob checked).
absl::StatusOr<Partition> LayoutPartition(const InitJobRequest& r);

// The request's initial values against partition `p` (of the validated layout): exactly one
// entry for each chunk shard `r.shard_index()` owns, each exactly that chunk's numel finite
// raw float32 values. INVALID_ARGUMENT naming the chunk.
absl::Status CheckInitialValues(const InitJobRequest& r, const Partition& p);

// Bytes one job holds on this shard, by part (saturating at int64 max).
struct JobMemory {
  int64_t values = 0;       // Owned elements x 4.
  int64_t slots = 0;        // Optimizer slots: num_slots x owned parameter elements x 4.
  int64_t barrier = 0;      // sync: one gradient copy per worker waiting at the barrier.
  int64_t snapshot = 0;     // Durable jobs: the snapshot being written (values + slots).
  int64_t ledger = 0;       // Request ids remembered per worker (dedupe window).
  int64_t bookkeeping = 0;  // Partition, chunk records, per-worker records, layout.
  int64_t total() const;
  // "values 1.0 GiB, adam slots 2.0 GiB, ..." (parts that are not zero).
  std::string Describe(const std::string& optimizer) const;
};

// What the job of validated layout `r` with partition `p` holds on its shard, with
// `num_slots` optimizer slots per element and `dedupe_window` ids per worker. The "changes"
// pull caches are not included: they reserve as they grow (server/pull_encoder.h).
JobMemory EstimateJobMemory(const InitJobRequest& r, const Partition& p, int num_slots,
                            int64_t dedupe_window);

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_INIT_JOB_VALIDATION_H_
