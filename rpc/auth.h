// API-token authentication for the control plane (gradmesh_coordinator's JobService and
// NodeService, and the clients that call them: the `gradmesh` CLI, daemons with
// --coordinator).
//
// The coordinator may hold two tokens: the API token (--auth_token_file) for JobService (users,
// the CLI) and a node token (--node_token_file) for NodeService (daemons), so a daemon, or
// code running in one, cannot call JobService and read other jobs' tokens. Without
// --node_token_file the API token serves both.
//
// A token is a shared secret read from a file (--auth_token_file). Clients send it as the
// gRPC metadata header `authorization: Bearer <token>`; the server checks it at the top of
// every method and answers UNAUTHENTICATED "missing or wrong API token" otherwise. Tokens are
// compared in constant time (no early exit on the first differing byte).
//
//   ASSIGN_OR_RETURN(std::string token, ReadTokenFile(path));        // both sides
//   TokenChecker checker(token);                                       // server
//   if (absl::Status s = checker.Check(*ctx); !s.ok()) return ToGrpcStatus(s);
//   grpc::ClientContext ctx; AddBearerToken(token, &ctx);             // client
//
// Thread safety: free functions are pure; a TokenChecker is immutable after construction and
// may be used from any number of threads.
#ifndef GRADMESH_RPC_AUTH_H_
#define GRADMESH_RPC_AUTH_H_

#include <grpcpp/support/string_ref.h>

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "rpc/grpc_status.h"

namespace grpc {
class ClientContext;
class ServerContextBase;
}  // namespace grpc

namespace gradmesh {

// The metadata key (lower case, as gRPC requires) and the scheme prefix of its value.
inline constexpr char kAuthorizationMetadataKey[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";
// The per-node token the coordinator issued at registration (RegisterResponse.node_token),
// sent by daemons on every NodeService call besides the node token above
// (coordinator/coordinator.h "# Node identity").
inline constexpr char kNodeIdentityMetadataKey[] = "x-gradmesh-node-token";

// Reads a token file: the content with leading and trailing whitespace (including the final
// newline) removed. NotFound if the file cannot be read; InvalidArgument if it holds no token
// (empty or only whitespace) or the token contains whitespace or control characters (it must
// fit in one header value).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// True if a and b are equal. Takes time that depends only on the lengths, not on where the
// strings differ.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// Checks `authorization: Bearer <token>` in a request's metadata against `token`.
// OK if it matches; Unauthenticated "missing or wrong <what>" if the header is absent,
// malformed or holds another token. (The message does not say which, so a caller cannot probe.)
absl::Status CheckBearerToken(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                              absl::string_view token, absl::string_view what = "API token");

// Adds `authorization: Bearer <token>` to an outgoing call. Does nothing for an empty token
// (a coordinator without --auth_token_file accepts calls without the header).
void AddBearerToken(absl::string_view token, grpc::ClientContext* context);

// Server-side check bound to one token. An empty token disables the check (every call is
// accepted), which is how a coordinator without --auth_token_file runs.
// `what` names the token in the error ("API token", "node token").
class TokenChecker {
 public:
  explicit TokenChecker(std::string token, std::string what = "API token")
      : token_(std::move(token)), what_(std::move(what)) {}

  bool enabled() const { return !token_.empty(); }

  // OK, or Unauthenticated as CheckBearerToken.
  absl::Status Check(const grpc::ServerContextBase& context) const;

 private:
  const std::string token_;
  const std::string what_;
};

}  // namespace gradmesh

#endif  // GRADMESH_RPC_AUTH_H_
