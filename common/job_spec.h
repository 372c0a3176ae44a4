// Reading, defaulting and validating JobSpec (proto/gradmesh.proto).
//
// A spec is YAML or JSON (JSON is YAML, so one parser serves both) following protobuf's JSON
// mapping: field names as written in the .proto or in lowerCamelCase. Unknown fields are
// rejected with their path and the known names, e.g.
//   unknown field "optimiser" in job spec (known fields: name, model, dataset, ...)
//
// Thread safety: pure functions.
#ifndef GRADMESH_COMMON_JOB_SPEC_H_
#define GRADMESH_COMMON_JOB_SPEC_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/mode.h"
#include "proto/gradmesh.pb.h"

namespace gradmesh {

// Parses YAML/JSON text. InvalidArgument with a message naming the problem.
absl::StatusOr<JobSpec> ParseJobSpec(const std::string& text);

// Reads and parses a file. NotFound if it cannot be read.
absl::StatusOr<JobSpec> LoadJobSpecFile(const std::string& path);

// Fills unset fields with their documented defaults (see JobSpec in gradmesh.proto).
// `num_servers` is used for num_shards when that is unset.
void ApplyJobSpecDefaults(int num_servers, JobSpec* spec);

// Limits of a spec (ValidateJobSpec refuses more; the coordinator checks them at submit).
inline constexpr int64_t kMaxSpecWorkers = 1024;            // num_workers: 1..1024.
inline constexpr int64_t kMaxSpecShards = 256;              // num_shards: 1..256.
inline constexpr int64_t kMaxSpecBatchSize = 1 << 20;       // batch_size: 1..2^20.
inline constexpr int64_t kMaxSpecSteps = int64_t{1} << 40;  // steps, every_steps, ...: 0..2^40.
inline constexpr int64_t kMaxSpecEpochs = 1'000'000;        // epochs: 0..10^6.
inline constexpr int64_t kMaxSpecChunkBytes = int64_t{1} << 30;  // chunk/bucket bytes: <= 1 GiB.
inline constexpr double kMaxSpecSeconds = 7 * 86400.0;           // timeouts, intervals: 0..7 days.
inline constexpr size_t kMaxSpecStringBytes = 4096;              // names, paths, codec specs.

// Checks the whole spec: every name a strategy is made from (model, dataset, mode, optimizer,
// lr_schedule, durability mode, codecs of pulls and gossip, topology, backend, transport,
// sync_lr_scaling), every number finite and in range (float32 hyper-parameters finite as
// float32, lr > 0 also as a float32), the limits above, and no unknown fields (a spec that
// arrived as protobuf bytes from a newer client). InvalidArgument naming the field, the value
// and what is allowed, e.g. "job spec: optimizer.lr: 1e+39 is not a finite float32".
// compression.push is checked by the caller that links the codec registry (the coordinator).
absl::Status ValidateJobSpec(const JobSpec& spec);

// The spec's mode as an enum (common/mode.h), for a spec that ValidateJobSpec accepted (an unset
// mode is async; an invalid one also reads as async, so validate first).
Mode SpecMode(const JobSpec& spec);

// True for the modes that train through parameter-server shards: async (or ps), ssp:<s>, sync.
// For mode strings at the edges (flags); code with a spec uses IsPsMode(SpecMode(spec)).
bool IsPsMode(const std::string& mode);

// The spec as single-line JSON (for logs and for sending to other processes).
std::string JobSpecToJson(const JobSpec& spec);

// lr_scaling (JobSpec): the factor k on optimizer.lr for `workers` ranks (global batch =
// batch_size * accumulation_steps * workers): global / base_batch_size ("linear"), its square
// root ("sqrt"), 1 ("none" or unset).
double LrScalingFactor(const JobSpec& spec, int64_t workers);

// The optimizer the job's updates use: spec.optimizer with lr_scaling applied for `workers`
// ranks (lr * k; a warm-up over lr_scaling.warmup_steps updates from lr to lr * k, i.e.
// warmup_start_fraction 1 / k). spec.optimizer itself when lr_scaling is off.
OptimizerSpec ScaledOptimizer(const JobSpec& spec, int64_t workers);

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_JOB_SPEC_H_
