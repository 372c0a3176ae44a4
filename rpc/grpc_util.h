// gRPC plumbing shared by daemons and clients: channels and servers with explicit message
// size limits on both ends (gRPC's 4 MiB receive default is too small for tensor chunks) and
// the transport security of RpcOptions::tls (rpc/tls.h): every server and channel of the
// daemons and the CLI is made here.
//
// Thread safety: pure functions.
#ifndef GRADMESH_RPC_GRPC_UTIL_H_
#define GRADMESH_RPC_GRPC_UTIL_H_

#include <grpcpp/channel.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/channel_arguments.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "rpc/rpc_options.h"

namespace gradmesh {

// RpcOptions.http2_window_bytes as gRPC channel arguments (name, value), the same for client
// channels and servers: none for gRPC's probed windows (0); else probing off
// (grpc.http2.bdp_probe 0), the initial stream window (grpc.http2.lookahead_bytes) and the
// largest frame (grpc.http2.max_frame_size: the window, at most HTTP/2's 16 MiB - 1).
std::vector<std::pair<std::string, int>> FlowControlArguments(const RpcOptions& options);

// The channel arguments of a client channel with `options` (limits, reconnection, keepalive,
// HTTP/2 flow control), as MakeChannel uses them.
grpc::ChannelArguments ChannelArgumentsFor(const RpcOptions& options);

// A channel to `address` ("host:port") with the limits of `options`: TLS (mutual when
// options.tls.cert_file is set) when options.tls.enabled(), else plaintext. Unusable
// certificate files make every call fail UNAVAILABLE (MakeTlsOptions checks them at start).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, const RpcOptions& options);

// Applies the limits of `options` to a server being built.
void ConfigureServerBuilder(const RpcOptions& options, grpc::ServerBuilder* builder);

// Starts a server on `address` ("host:port"; port 0 picks a free one) serving
// `services` (not owned; they must outlive the server) with the limits of `options`, and
// writes the bound port to `port_file` when it is not empty (see WritePortFile). Sets *port.
// TLS when options.tls.enabled() (see ServerCredentialsFor). InvalidArgument if TLS is on
// without a certificate and key; Unavailable if the address cannot be bound; the port file's error
// if it cannot be written.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::string& address, const std::vector<grpc::Service*>& services,
    const RpcOptions& options, const std::string& port_file, int* port);

}  // namespace gradmesh

#endif  // GRADMESH_RPC_GRPC_UTIL_H_
