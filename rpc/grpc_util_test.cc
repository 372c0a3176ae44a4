#include "rpc/grpc_util.h"

#include <grpc/grpc.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace gradmesh {
namespace {

// The integer channel arguments of `options`' client channels, by name.
std::map<std::string, int> IntArgs(const RpcOptions& options) {
  grpc::ChannelArguments args = ChannelArgumentsFor(options);
  const grpc_channel_args c = args.c_channel_args();
  std::map<std::string, int> out;
  for (size_t i = 0; i < c.num_args; ++i) {
    if (c.args[i].type == GRPC_ARG_INTEGER) out[c.args[i].key] = c.args[i].value.integer;
  }
  return out;
}

// http2_window_bytes 0 leaves gRPC's flow control alone (probing on, its own windows); N turns
// probing off with an initial stream window of N and frames of up to min(N, 16 MiB - 1). The
// servers' builder (ConfigureServerBuilder) takes the same list.
TEST(FlowControlArgumentsTest, FixedWindowTurnsProbingOffAndSetsWindowAndFrame) {
  using Args = std::vector<std::pair<std::string, int>>;
  RpcOptions options;
  EXPECT_EQ(FlowControlArguments(options), Args());
  options.http2_window_bytes = 8 << 20;
  EXPECT_EQ(FlowControlArguments(options), (Args{{GRPC_ARG_HTTP2_BDP_PROBE, 0},
                                                 {GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 8 << 20},
                                                 {GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 8 << 20}}));
  options.http2_window_bytes = int64_t{1} << 30;
  EXPECT_EQ(FlowControlArguments(options), (Args{{GRPC_ARG_HTTP2_BDP_PROBE, 0},
                                                 {GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1 << 30},
                                                 {GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (1 << 24) - 1}}));
}

// A client channel carries them with its other limits.
TEST(ChannelArgumentsForTest, CarriesTheFlowControlArguments) {
  RpcOptions options;
  std::map<std::string, int> args = IntArgs(options);
  EXPECT_EQ(args.count(GRPC_ARG_HTTP2_BDP_PROBE), 0u);
  EXPECT_EQ(args.count(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES), 0u);
  EXPECT_EQ(args.at(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH), 256 << 20);
  options.http2_window_bytes = 64 << 20;
  args = IntArgs(options);
  EXPECT_EQ(args.at(GRPC_ARG_HTTP2_BDP_PROBE), 0);
  EXPECT_EQ(args.at(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES), 64 << 20);
  EXPECT_EQ(args.at(GRPC_ARG_HTTP2_MAX_FRAME_SIZE), (1 << 24) - 1);
  EXPECT_EQ(args.at(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH), 256 << 20);
}

}  // namespace
}  // namespace gradmesh
