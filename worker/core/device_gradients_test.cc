#include "worker/core/device_gradients.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "compression/compressor.h"

namespace gradmesh {
namespace {

std::optional<DeviceCodec> Of(const std::string& spec) {
  absl::StatusOr<std::unique_ptr<Compressor>> c = CompressorRegistry::WithBuiltins().Create(spec);
  EXPECT_TRUE(c.ok()) << c.status();
  return DeviceCodecOf(**c);
}

TEST(DeviceCodecOfTest, TopKAndSixteenBitCodecsRunOnTheDevice) {
  std::optional<DeviceCodec> c = Of("topk:0.01");
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->codec, CodecId::kTopK);
  EXPECT_EQ(c->values, ValueType::kFloat32);
  EXPECT_DOUBLE_EQ(c->density, 0.01);
  c = Of("topk:0.25+fp16");
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->codec, CodecId::kTopK);
  EXPECT_EQ(c->values, ValueType::kFloat16);
  EXPECT_DOUBLE_EQ(c->density, 0.25);
  c = Of("topk:1+bf16");
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->values, ValueType::kBFloat16);
  EXPECT_DOUBLE_EQ(c->density, 1.0);
  c = Of("fp16");
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->codec, CodecId::kFp16);
  EXPECT_EQ(c->values, ValueType::kFloat16);
  c = Of("bf16");
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->codec, CodecId::kBf16);
  EXPECT_EQ(c->values, ValueType::kBFloat16);
}

TEST(DeviceCodecOfTest, AWarmUpDensityIsTheCodecsOwn) {
  std::unique_ptr<Compressor> c =
      CompressorRegistry::WithBuiltins().Create("topk:0.01+fp16").value();
  std::unique_ptr<Compressor> warm = c->WithDensity(0.3).value();
  std::optional<DeviceCodec> d = DeviceCodecOf(*warm);
  ASSERT_TRUE(d.has_value());
  EXPECT_DOUBLE_EQ(d->density, 0.3);
  EXPECT_EQ(d->values, ValueType::kFloat16);
}

TEST(DeviceCodecOfTest, OtherCodecsStayOnTheHost) {
  for (const char* spec : {"identity", "topk_approx:0.01", "topk_approx:0.01+fp16", "randomk:0.1",
                           "randomk:0.1+bf16", "qsgd:4"}) {
    EXPECT_FALSE(Of(spec).has_value()) << spec;
  }
}

}  // namespace
}  // namespace gradmesh
