// The single mapping between absl::Status and grpc::Status (same code, same message), used by
// every service adapter and client. Core code returns absl::Status and never sees this.
//
// Thread safety: pure functions.
#ifndef GRADMESH_RPC_GRPC_STATUS_H_
#define GRADMESH_RPC_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace gradmesh {

// Converts with the same code and message. OK maps to OK.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace gradmesh

#endif  // GRADMESH_RPC_GRPC_STATUS_H_
