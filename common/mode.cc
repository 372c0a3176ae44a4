#include "common/mode.h"

#include <cstdint>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace gradmesh {

absl::StatusOr<Mode> ParseMode(absl::string_view mode) {
  if (mode == "async" || mode == "ps") return Mode::kAsync;
  if (mode == "sync") return Mode::kSync;
  if (mode == "gossip") return Mode::kGossip;
  if (mode == "allreduce") return Mode::kAllreduce;
  if (mode == "diloco") return Mode::kDiloco;
  if (absl::StartsWith(mode, "ssp:")) {
    int64_t s = 0;
    if (!absl::SimpleAtoi(mode.substr(4), &s) || s < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job spec: mode \"", mode, "\": the staleness bound after ssp: must be an integer >= 0"));
    }
    return Mode::kSsp;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "job spec: mode \"", mode,
      "\" is not one of async (or ps), ssp:<staleness>, sync, gossip, allreduce, diloco"));
}

absl::string_view ModeName(Mode mode) {
  switch (mode) {
    case Mode::kAsync:
      return "async";
    case Mode::kSsp:
      return "ssp";
    case Mode::kSync:
      return "sync";
    case Mode::kGossip:
      return "gossip";
    case Mode::kAllreduce:
      return "allreduce";
    case Mode::kDiloco:
      return "diloco";
  }
  return "async";
}

bool IsPsMode(Mode mode) {
  return mode == Mode::kAsync || mode == Mode::kSsp || mode == Mode::kSync || mode == Mode::kDiloco;
}

bool UsesSyncBarrier(Mode mode) { return mode == Mode::kSync || mode == Mode::kDiloco; }

}  // namespace gradmesh
