// Status helpers shared by every module.
//
// * RETURN_IF_ERROR / ASSIGN_OR_RETURN: early return on error.
// (The mapping to grpc::Status is rpc/grpc_status.h: this header links no gRPC.)
// * StatusCodeName: the canonical upper-case name of a code, for messages and tests.
//
// Thread safety: all functions are pure.
#ifndef GRADMESH_COMMON_STATUS_H_
#define GRADMESH_COMMON_STATUS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define GM_STATUS_CONCAT_INNER_(a, b) a##b
#define GM_STATUS_CONCAT_(a, b) GM_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the caller if it is not OK.
#define RETURN_IF_ERROR(expr)                \
  do {                                       \
    ::absl::Status gm_status_ = (expr);      \
    if (!gm_status_.ok()) return gm_status_; \
  } while (0)

// `lhs` = value of `rexpr` (an absl::StatusOr<T>), or returns its status from the caller.
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  GM_ASSIGN_OR_RETURN_IMPL_(GM_STATUS_CONCAT_(gm_statusor_, __LINE__), lhs, rexpr)
#define GM_ASSIGN_OR_RETURN_IMPL_(var, lhs, rexpr) \
  auto var = (rexpr);                              \
  if (!var.ok()) return var.status();              \
  lhs = std::move(var).value()

namespace gradmesh {

// "OK", "INVALID_ARGUMENT", ... as in google.rpc.Code.
std::string StatusCodeName(absl::StatusCode code);

// Returns `status` with `context + ": "` prepended to its message (code unchanged).
absl::Status Annotate(const absl::Status& status, const std::string& context);

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_STATUS_H_
