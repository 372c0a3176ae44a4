// gRPC plumbing shared by daemons and clients: channels and servers with explicit message
// size limits on both ends (gRPC's 4 MiB receive default is too small for tensor chunks).
//
// Thread safety: pure functions.
#ifndef GRADMESH_COMMON_GRPC_UTIL_H_
#define GRADMESH_COMMON_GRPC_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>

#include <grpcpp/channel.h>
#include <grpcpp/server_builder.h>

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

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_GRPC_UTIL_H_
