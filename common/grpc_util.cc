#include "common/grpc_util.h"

#include <climits>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

namespace gradmesh {
namespace {
int ClampToInt(int64_t v) { return v > INT_MAX ? INT_MAX : static_cast<int>(v); }
}  // namespace

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, const RpcOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(ClampToInt(options.max_message_bytes));
  args.SetMaxSendMessageSize(ClampToInt(options.max_message_bytes));
  // Each client gets its own TCP connection rather than sharing one per target: pushes of
  // different workers in one process must not serialise on one socket.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, ClampToInt(options.min_reconnect_backoff_ms));
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, ClampToInt(options.min_reconnect_backoff_ms));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, ClampToInt(options.max_reconnect_backoff_ms));
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

void ConfigureServerBuilder(const RpcOptions& options, grpc::ServerBuilder* builder) {
  builder->SetMaxReceiveMessageSize(ClampToInt(options.max_message_bytes));
  builder->SetMaxSendMessageSize(ClampToInt(options.max_message_bytes));
}

}  // namespace gradmesh
