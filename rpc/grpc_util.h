// gRPC plumbing shared by daemons and clients: channels and servers with explicit message
// size limits on both ends (gRPC's 4 MiB receive default is too small for tensor chunks).
//
// Thread safety: pure functions.
#ifndef GRADMESH_RPC_GRPC_UTIL_H_
#define GRADMESH_RPC_GRPC_UTIL_H_

#include <grpcpp/channel.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace gradmesh {

struct RpcOptions {
  // Largest message sent or received, bytes. Default 256 MiB.
  int64_t max_message_bytes = 256ll << 20;
  // Reconnection to a peer that went away: first retry after this long, doubling up to
  // max. gRPC's defaults (1 s, 120 s) are too slow for a shard that restarts in a second.
  int64_t min_reconnect_backoff_ms = 100;
  int64_t max_reconnect_backoff_ms = 5000;
  // Models a slower link for a client's tensor traffic (each direction paced separately, as a
  // full-duplex NIC), in bits per second; 0 = as fast as the transport goes. For measuring
  // compression on a slow network with loopback daemons (see worker --link_mbit).
  double link_bits_per_s = 0;
};

// An insecure channel to `address` ("host:port") with the limits of `options`.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, const RpcOptions& options);

// Applies the limits of `options` to a server being built.
void ConfigureServerBuilder(const RpcOptions& options, grpc::ServerBuilder* builder);

// Starts an insecure server on `address` ("host:port"; port 0 picks a free one) serving
// `services` (not owned; they must outlive the server) with the limits of `options`, and
// writes the bound port to `port_file` when it is not empty (see WritePortFile). Sets *port.
// Unavailable if the address cannot be bound; the port file's error if it cannot be written.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::string& address, const std::vector<grpc::Service*>& services,
    const RpcOptions& options, const std::string& port_file, int* port);

}  // namespace gradmesh

#endif  // GRADMESH_RPC_GRPC_UTIL_H_
