#include "rpc/grpc_util.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <algorithm>
#include <climits>

#include "absl/strings/str_cat.h"
#include "common/daemon.h"
#include "rpc/tls.h"

namespace gradmesh {
namespace {
int ClampToInt(int64_t v) { return v > INT_MAX ? INT_MAX : static_cast<int>(v); }
}  // namespace

std::vector<std::pair<std::string, int>> FlowControlArguments(const RpcOptions& options) {
  if (options.http2_window_bytes <= 0) return {};
  constexpr int64_t kMaxHttp2Frame = (int64_t{1} << 24) - 1;  // HTTP/2's largest frame.
  return {{GRPC_ARG_HTTP2_BDP_PROBE, 0},
          {GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, ClampToInt(options.http2_window_bytes)},
          {GRPC_ARG_HTTP2_MAX_FRAME_SIZE,
           ClampToInt(std::min(options.http2_window_bytes, kMaxHttp2Frame))}};
}

grpc::ChannelArguments ChannelArgumentsFor(const RpcOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(ClampToInt(options.max_message_bytes));
  args.SetMaxSendMessageSize(ClampToInt(options.max_message_bytes));
  // Each client gets its own TCP connection rather than sharing one per target: pushes of
  // different workers in one process must not serialise on one socket.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, ClampToInt(options.min_reconnect_backoff_ms));
  // Despite its name, the minimum time a connection attempt gets (RpcOptions).
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, ClampToInt(options.connect_timeout_ms));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, ClampToInt(options.max_reconnect_backoff_ms));
  if (options.keepalive_time_ms > 0) {
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ClampToInt(options.keepalive_time_ms));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ClampToInt(options.keepalive_timeout_ms));
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    // Keep pinging while a call waits without data (a sync push at the barrier): gRPC's
    // default stops after 2 pings without data, which would leave that wait unwatched.
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
  for (const auto& [name, value] : FlowControlArguments(options)) args.SetInt(name, value);
  return args;
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, const RpcOptions& options) {
  return grpc::CreateCustomChannel(address, ChannelCredentialsFor(options.tls),
                                   ChannelArgumentsFor(options));
}

void ConfigureServerBuilder(const RpcOptions& options, grpc::ServerBuilder* builder) {
  // gRPC sets SO_REUSEPORT by default: a second server on a taken port would then start and
  // share its connections with the first (two daemons, or two tests' servers, answering each
  // other's clients). A taken port must fail instead.
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Clients ping as often as RpcOptions says (MakeChannel), also with no call open: answer
  // every ping rather than count it against them (gRPC's default sends GOAWAY "too_many_pings"
  // after 2 pings under 5 min apart without data). And ping idle clients, so that a dead
  // one's connection and streams are closed.
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 0);
  if (options.max_concurrent_streams > 0) {
    builder->AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                                ClampToInt(options.max_concurrent_streams));
  }
  if (options.keepalive_time_ms > 0) {
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                                ClampToInt(std::max<int64_t>(options.keepalive_time_ms, 30000)));
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                                ClampToInt(options.keepalive_timeout_ms));
  }
  for (const auto& [name, value] : FlowControlArguments(options)) {
    builder->AddChannelArgument(name, value);
  }
  builder->SetMaxReceiveMessageSize(ClampToInt(options.max_message_bytes));
  builder->SetMaxSendMessageSize(ClampToInt(options.max_message_bytes));
}

}  // namespace gradmesh

namespace gradmesh {

absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::string& address, const std::vector<grpc::Service*>& services,
    const RpcOptions& options, const std::string& port_file, int* port) {
  *port = 0;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentialsFor(options.tls);
  if (!credentials.ok()) return credentials.status();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, *credentials, port);
  ConfigureServerBuilder(options, &builder);
  for (grpc::Service* s : services) builder.RegisterService(s);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  if (!port_file.empty()) {
    if (absl::Status st = WritePortFile(port_file, *port); !st.ok()) return st;
  }
  return server;
}

}  // namespace gradmesh
