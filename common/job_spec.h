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

// Checks ranges and names. InvalidArgument naming the field and what is allowed.
absl::Status ValidateJobSpec(const JobSpec& spec);

// The spec's mode as an enum (common/mode.h), for a spec that ValidateJobSpec accepted (an unset
// mode is async; an invalid one also reads as async, so validate first).
Mode SpecMode(const JobSpec& spec);

// True for the modes that train through parameter-server shards: async (or ps), ssp:<s>, sync.
// For mode strings at the edges (flags); code with a spec uses IsPsMode(SpecMode(spec)).
bool IsPsMode(const std::string& mode);

// The spec as single-line JSON (for logs and for sending to other processes).
std::string JobSpecToJson(const JobSpec& spec);

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_JOB_SPEC_H_
