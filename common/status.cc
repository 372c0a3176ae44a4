#include "common/status.h"

#include <grpcpp/support/status.h>

#include "absl/strings/str_cat.h"

namespace gradmesh {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering (google.rpc.Code).
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::string StatusCodeName(absl::StatusCode code) {
  std::string s = absl::StatusCodeToString(code);
  for (char& c : s) {
    if (c == ' ') c = '_';
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  }
  return s;
}

absl::Status Annotate(const absl::Status& status, const std::string& context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace gradmesh
