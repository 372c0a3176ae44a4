#include "worker/core/auto_codec.h"

#include <limits>

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

AutoCodecOptions Small() {
  AutoCodecOptions o;
  o.probe_steps = 4;
  o.window = 2;
  return o;
}

TEST(AutoCodecTest, StaysDenseWhenCommunicationIsCheap) {
  AutoCodec a(Small());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(a.Observe(1.0, 0.010, 0.001), std::nullopt);
  EXPECT_EQ(a.Observe(1.0, 0.010, 0.001), std::nullopt);  // ratio 0.1 < 0.25.
  EXPECT_DOUBLE_EQ(a.ratio(), 0.1);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(a.Observe(100.0, 0.01, 0.001), std::nullopt);
}

TEST(AutoCodecTest, PicksFp16ThenTopkAsCommunicationGrows) {
  AutoCodec mid(Small());
  for (int i = 0; i < 3; ++i) mid.Observe(1.0, 0.010, 0.005);
  EXPECT_EQ(mid.Observe(1.0, 0.010, 0.005), std::optional<std::string>("fp16"));
  AutoCodec slow(Small());
  for (int i = 0; i < 3; ++i) slow.Observe(1.0, 0.010, 0.030);
  EXPECT_EQ(slow.Observe(1.0, 0.010, 0.030), std::optional<std::string>("topk:0.01+fp16"));
  EXPECT_DOUBLE_EQ(slow.ratio(), 3.0);
}

TEST(AutoCodecTest, FallsBackToDenseWhenTheLossDiverges) {
  AutoCodec a(Small());
  for (int i = 0; i < 3; ++i) a.Observe(1.0, 0.01, 0.05);
  ASSERT_TRUE(a.Observe(1.0, 0.01, 0.05).has_value());  // Baseline window mean 1.0.
  EXPECT_EQ(a.Observe(1.2, 0.01, 0.01), std::nullopt);
  EXPECT_EQ(a.Observe(1.4, 0.01, 0.01), std::nullopt);  // Mean 1.3 <= 1.5: fine.
  EXPECT_EQ(a.Observe(1.6, 0.01, 0.01), std::nullopt);
  EXPECT_EQ(a.Observe(1.8, 0.01, 0.01), std::optional<std::string>(""));  // Mean 1.7 > 1.5.
  EXPECT_TRUE(a.fell_back());
  EXPECT_EQ(a.Observe(100.0, 0.01, 0.01), std::nullopt);  // Once.
}

TEST(AutoCodecTest, NonFiniteLossFallsBackAtOnce) {
  AutoCodec a(Small());
  for (int i = 0; i < 4; ++i) a.Observe(0.5, 0.01, 0.05);
  EXPECT_EQ(a.Observe(std::numeric_limits<double>::quiet_NaN(), 0.01, 0.01),
            std::optional<std::string>(""));
}

}  // namespace
}  // namespace gradmesh
