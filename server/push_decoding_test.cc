#include "server/push_decoding.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "compression/compressor.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

ChunkData Raw(const std::vector<float>& v) {
  ChunkData c;
  c.set_dtype(FLOAT32);
  c.set_data(Bytes(v));
  return c;
}

TEST(PushDecodingTest, CheckDenseFloatsExactErrors) {
  EXPECT_OK(CheckDenseFloats(Raw({1, 2, 3}), 3, "w"));
  ChunkData c = Raw({1, 2, 3});
  c.set_dtype(DTYPE_UNSPECIFIED);
  EXPECT_OK(CheckDenseFloats(c, 3, "w"));
  EXPECT_EQ(CheckDenseFloats(Raw({1, 2}), 3, "here"),
            absl::InvalidArgumentError("here: expected 3 float32 values (12 bytes), got 8 bytes"));
  c = Raw({1, 2, 3});
  c.set_dtype(FLOAT16);
  EXPECT_EQ(CheckDenseFloats(c, 3, "here"),
            absl::InvalidArgumentError("here: dtype FLOAT16 is not supported; use FLOAT32"));
  c = Raw({1, 2, 3});
  c.set_codec("fp16");
  EXPECT_EQ(CheckDenseFloats(c, 3, "here"),
            absl::InvalidArgumentError("here: codec \"fp16\" is not supported by this shard"));
  EXPECT_EQ(CheckDenseFloats(Raw({1, std::numeric_limits<float>::infinity(), 3}), 3, "here"),
            absl::InvalidArgumentError("here: element 1 is not finite (inf); nothing was applied"));
}

TEST(PushDecodingTest, FloatViewAlignsOnlyWhenNeeded) {
  const std::vector<float> v = {1.5f, -2.5f};
  const std::string aligned = Bytes(v);
  std::vector<float> scratch;
  const float* x = FloatView(aligned, &scratch);
  EXPECT_EQ(static_cast<const void*>(x), static_cast<const void*>(aligned.data()));
  EXPECT_TRUE(scratch.empty());
  EXPECT_EQ(x[0], 1.5f);
  EXPECT_EQ(x[1], -2.5f);
}

TEST(PushDecodingTest, DecodesCompressedPushes) {
  CompressorRegistry registry = CompressorRegistry::WithBuiltins();
  CodecCache codecs(&registry);
  ASSERT_OK_AND_ASSIGN(auto fp16, codecs.Get("fp16"));
  ASSERT_OK_AND_ASSIGN(auto again, codecs.Get("fp16"));
  EXPECT_EQ(fp16.get(), again.get());  // Cached.
  ChunkData c;
  c.set_dtype(FLOAT32);
  c.set_codec("fp16");
  ASSERT_OK(fp16->Encode(std::vector<float>{0.5f, -1.0f, 2.0f}, 0, c.mutable_data()));
  std::vector<float> scratch;
  ASSERT_OK_AND_ASSIGN(const float* g, DecodePushedChunk(codecs, c, nullptr, 3, "w", &scratch));
  EXPECT_EQ(std::vector<float>(g, g + 3), (std::vector<float>{0.5f, -1.0f, 2.0f}));

  std::vector<float> raw_scratch;
  // A raw chunk is read in place: it must outlive the pointer (ASan saw a temporary here).
  const ChunkData raw = Raw({4, 5});
  ASSERT_OK_AND_ASSIGN(const float* r,
                       DecodePushedChunk(codecs, raw, nullptr, 2, "w", &raw_scratch));
  EXPECT_EQ(std::vector<float>(r, r + 2), (std::vector<float>{4, 5}));
}

// What a transport that decoded the raw data itself (DenseData) gets is what the message with
// the data in it gets: the same values, the same errors.
TEST(PushDecodingTest, DenseDataAsTheMessageWouldBe) {
  CompressorRegistry registry = CompressorRegistry::WithBuiltins();
  CodecCache codecs(&registry);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    std::vector<float> values;
    int64_t numel;
    DType dtype;
  };
  for (const Case& k :
       {Case{{1, 2, 3}, 3, FLOAT32}, Case{{1, nan, 3}, 3, FLOAT32}, Case{{1, 2}, 3, FLOAT32},
        Case{{1, 2, 3}, 3, FLOAT16}, Case{{-INFINITY}, 1, DTYPE_UNSPECIFIED}}) {
    const ChunkData with = Raw(k.values);
    ChunkData without = with;
    without.set_dtype(k.dtype);
    ChunkData message = without;
    without.clear_data();
    DenseData dense;
    dense.present = true;
    dense.bytes = static_cast<int64_t>(with.data().size());
    dense.values.reset(new float[k.values.size()]);
    std::copy(k.values.begin(), k.values.end(), dense.values.get());
    for (size_t i = 0; i < k.values.size() && dense.first_nonfinite < 0; ++i) {
      if (!std::isfinite(k.values[i])) dense.first_nonfinite = static_cast<int64_t>(i);
    }
    std::vector<float> s1, s2;
    auto a = DecodePushedChunk(codecs, message, nullptr, k.numel, "Push: w", &s1);
    auto b = DecodePushedChunk(codecs, without, &dense, k.numel, "Push: w", &s2);
    ASSERT_EQ(a.status(), b.status());
    if (a.ok()) {
      EXPECT_EQ(std::vector<float>(*a, *a + k.numel), std::vector<float>(*b, *b + k.numel));
      EXPECT_EQ(*b, dense.values.get());  // Read in place.
    }
  }
  std::vector<float> scratch;
  DenseData nan_at_1;
  nan_at_1.present = true;
  nan_at_1.bytes = 8;
  nan_at_1.values.reset(new float[2]{0.0f, nan});
  nan_at_1.first_nonfinite = 1;
  EXPECT_EQ(
      DecodePushedChunk(codecs, ChunkData(), &nan_at_1, 2, "Push: w", &scratch).status(),
      absl::InvalidArgumentError("Push: w: element 1 is not finite (nan); nothing was applied"));
}

TEST(PushDecodingTest, CompressedPushErrors) {
  CompressorRegistry registry = CompressorRegistry::WithBuiltins();
  CodecCache codecs(&registry);
  std::vector<float> scratch;
  ChunkData c;
  c.set_dtype(FLOAT16);
  c.set_codec("fp16");
  EXPECT_EQ(DecodePushedChunk(codecs, c, nullptr, 3, "Push: x", &scratch).status(),
            absl::InvalidArgumentError(
                "Push: x: dtype FLOAT16 with codec \"fp16\"; the codec's payload describes its "
                "own encoding, dtype must be FLOAT32"));
  c.set_dtype(FLOAT32);
  c.set_codec("nope");
  EXPECT_STATUS_MSG(DecodePushedChunk(codecs, c, nullptr, 3, "Push: x", &scratch),
                    absl::StatusCode::kInvalidArgument, "Push: x: ");
  c.set_codec("fp16");
  c.set_data("garbage");
  EXPECT_STATUS_MSG(DecodePushedChunk(codecs, c, nullptr, 3, "Push: x", &scratch),
                    absl::StatusCode::kInvalidArgument, "Push: x: malformed \"fp16\" payload");
  ASSERT_OK_AND_ASSIGN(auto fp16, codecs.Get("fp16"));
  c.clear_data();
  ASSERT_OK(fp16->Encode(std::vector<float>{1, 2, 3}, 0, c.mutable_data()));
  // A payload for 3 elements where the chunk has 4 is malformed too.
  EXPECT_STATUS_MSG(DecodePushedChunk(codecs, c, nullptr, 4, "Push: x", &scratch),
                    absl::StatusCode::kInvalidArgument, "malformed \"fp16\" payload");
}

}  // namespace
}  // namespace gradmesh
