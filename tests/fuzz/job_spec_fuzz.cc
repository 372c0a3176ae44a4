// Fuzz target: job specs (common/job_spec.h), the YAML or JSON text a user submits to the
// coordinator (and a daemon reads from --job files).
//
// Input: the spec text. Checked: ParseJobSpec refuses with INVALID_ARGUMENT only; a spec it
// accepts prints as JSON (JobSpecToJson) that parses back to the same message; defaults and
// validation run on it without crashing, and ValidateJobSpec refuses with INVALID_ARGUMENT
// only.
#include <string>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "google/protobuf/util/message_differencer.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradmesh;
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<JobSpec> spec = ParseJobSpec(text);
  if (!spec.ok()) {
    FUZZ_CHECK(spec.status().code() == absl::StatusCode::kInvalidArgument,
               spec.status().ToString());
    return 0;
  }
  const std::string json = JobSpecToJson(*spec);
  const absl::StatusOr<JobSpec> again = ParseJobSpec(json);
  FUZZ_CHECK(again.ok(), absl::StrCat("JobSpecToJson's output does not parse: ",
                                      again.status().ToString(), "\n", json));
  FUZZ_CHECK(google::protobuf::util::MessageDifferencer::Equals(*spec, *again),
             absl::StrCat("JSON round trip changed the spec:\n", json));
  ApplyJobSpecDefaults(1 + static_cast<int>(size % 4), &*spec);
  const absl::Status valid = ValidateJobSpec(*spec);
  FUZZ_CHECK(valid.ok() || valid.code() == absl::StatusCode::kInvalidArgument, valid.ToString());
  (void)SpecMode(*spec);
  return 0;
}
