#include "rpc/rpc_options.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "common/status_testing.h"

namespace gradmesh {
namespace {

// --http2_window_kb: 0 keeps gRPC's probed windows; a fixed window is 64 KiB to 1 GiB, in
// bytes; anything else is InvalidArgument naming the flag and the value.
TEST(Http2WindowBytesFromKbTest, ZeroOrSixtyFourKiBToOneGiB) {
  const std::pair<int64_t, int64_t> valid[] = {{0, 0},
                                               {64, int64_t{64} << 10},
                                               {8192, int64_t{8} << 20},
                                               {int64_t{1} << 20, int64_t{1} << 30}};
  for (const auto& [kb, bytes] : valid) {
    ASSERT_OK_AND_ASSIGN(int64_t got, Http2WindowBytesFromKb(kb));
    EXPECT_EQ(got, bytes) << kb;
  }
  for (int64_t kb :
       {int64_t{-1}, int64_t{1}, int64_t{63}, (int64_t{1} << 20) + 1, int64_t{1} << 50}) {
    EXPECT_STATUS_MSG(
        Http2WindowBytesFromKb(kb).status(), absl::StatusCode::kInvalidArgument,
        "--http2_window_kb must be 0 (gRPC's own) or 64 to 1048576, got " + std::to_string(kb));
  }
}

}  // namespace
}  // namespace gradmesh
