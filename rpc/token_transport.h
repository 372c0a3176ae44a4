// The rule that tokens (API token, node token, job tokens) never travel in plaintext to
// another machine: a client that holds a token and has no TLS may send it only to a loopback
// address, unless --allow_insecure says otherwise. Free of gRPC, so option checks in gRPC-free
// code (the Trainer) can apply it.
//
// Thread safety: pure functions.
#ifndef GRADMESH_RPC_TOKEN_TRANSPORT_H_
#define GRADMESH_RPC_TOKEN_TRANSPORT_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "rpc/rpc_options.h"

namespace gradmesh {

// True if `address` ("host:port", "[v6]:port", with an optional "dns:"/"ipv4:"/"ipv6:"
// scheme, or "unix:...") can only reach this machine: 127.0.0.0/8, ::1, localhost, a unix
// socket.
bool IsLoopbackAddress(absl::string_view address);

// Refuses to send a token (`what`: "API token", "node token", "job token") over a plaintext
// channel to another machine: FailedPrecondition naming the address and the flags to use,
// when `token` is non-empty, TLS is off, `address` is not loopback and
// tls.allow_insecure is false; OK otherwise.
absl::Status CheckTokenTransport(absl::string_view address, const TlsOptions& tls,
                                 absl::string_view token, absl::string_view what);

}  // namespace gradmesh

#endif  // GRADMESH_RPC_TOKEN_TRANSPORT_H_
