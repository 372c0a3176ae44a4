#include "server/pull_encoder.h"

#include <cstring>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "compression/changes.h"
#include "compression/compressor.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

std::string Dense(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

class PullEncoderTest : public ::testing::Test {
 protected:
  PullFormat Format(const std::string& codec) {
    auto f = PullEncoder::ParseFormat("j", codec, codecs_);
    EXPECT_OK(f);
    return f.ok() ? *f : PullFormat{};
  }

  CompressorRegistry registry_ = CompressorRegistry::WithBuiltins();
  CodecCache codecs_{&registry_};
  // Owned chunks 3 and 7 of a job with two workers.
  PullEncoder encoder_{2, std::vector<int64_t>{3, 7}};
};

TEST_F(PullEncoderTest, FormatsAndTheirErrors) {
  EXPECT_EQ(Format("").kind, PullFormat::Kind::kDense);
  EXPECT_EQ(Format("changes").kind, PullFormat::Kind::kChanges);
  const PullFormat fp16 = Format("fp16");
  EXPECT_EQ(fp16.kind, PullFormat::Kind::kNarrow);
  ASSERT_NE(fp16.compressor, nullptr);
  EXPECT_EQ(fp16.compressor->name(), "fp16");
  EXPECT_EQ(Format("bf16").compressor->name(), "bf16");
  for (const std::string bad : {"topk:0.1", "changez", "FP16", "randomk:0.5"}) {
    auto f = PullEncoder::ParseFormat("job7", bad, codecs_);
    EXPECT_STATUS(f, absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(f.status().message(),
              "Pull: job job7 codec \"" + bad + "\" is not one of \"\", fp16, bf16, changes");
  }
}

TEST_F(PullEncoderTest, DenseIsTheRawFloats) {
  const std::vector<float> v = {1.5f, -2.0f, 0.0f};
  ChunkData out;
  ASSERT_OK(encoder_.Encode(Format(""), 3, 0, -1, v, 4, &out));
  EXPECT_EQ(out.codec(), "");
  EXPECT_EQ(out.data(), Dense(v));
}

TEST_F(PullEncoderTest, NarrowUsesTheCodec) {
  const std::vector<float> v = {1.0f, 0.5f, -3.25f};
  const PullFormat fp16 = Format("fp16");
  std::string want;
  ASSERT_OK(fp16.compressor->Encode(v, 0, &want));
  ChunkData out;
  ASSERT_OK(encoder_.Encode(fp16, 7, 1, -1, v, 1, &out));
  EXPECT_EQ(out.codec(), "fp16");
  EXPECT_EQ(out.data(), want);
  std::vector<float> back(3);
  ASSERT_OK(fp16.compressor->Decode(out.data(), absl::MakeSpan(back)));
  EXPECT_EQ(back, v);  // Exactly representable in fp16.
}

TEST_F(PullEncoderTest, ChangesFirstDenseThenOnlyTheDifferences) {
  std::vector<float> v(100);
  for (int i = 0; i < 100; ++i) v[i] = 0.25f * i;
  const PullFormat changes = Format("changes");
  ChunkData out;
  // The worker's held version is unknown to the shard: dense.
  ASSERT_OK(encoder_.Encode(changes, 3, 0, 5, v, 5, &out));
  EXPECT_EQ(out.codec(), "");
  EXPECT_EQ(out.data(), Dense(v));
  std::vector<float> worker = v;

  v[10] = -1.0f;
  v[90] = 7.0f;
  out.Clear();
  ASSERT_OK(encoder_.Encode(changes, 3, 0, 5, v, 6, &out));
  EXPECT_EQ(out.codec(), "changes");
  EXPECT_EQ(out.data().size(), 1u + 2u + 8u);  // count, gaps 10 and 79, two values.
  ASSERT_OK(DecodeChanges(out.data(), absl::MakeSpan(worker)));
  EXPECT_EQ(worker, v);

  // Unchanged since version 6: the single byte 0.
  out.Clear();
  ASSERT_OK(encoder_.Encode(changes, 3, 0, 6, v, 6, &out));
  EXPECT_EQ(out.codec(), "changes");
  EXPECT_EQ(out.data(), std::string(1, '\0'));
}

TEST_F(PullEncoderTest, HeldVersionMismatchOrUnknownIsDense) {
  std::vector<float> v = {1, 2, 3, 4, 5, 6, 7, 8};
  const PullFormat changes = Format("changes");
  ChunkData out;
  ASSERT_OK(encoder_.Encode(changes, 7, 1, -1, v, 2, &out));
  EXPECT_EQ(out.codec(), "");
  for (int64_t held : {-1, 1, 3}) {  // Unknown, older, newer than what was sent (2).
    out.Clear();
    ASSERT_OK(encoder_.Encode(changes, 7, 1, held, v, 2, &out));
    EXPECT_EQ(out.codec(), "") << held;
    EXPECT_EQ(out.data(), Dense(v)) << held;
  }
  out.Clear();
  ASSERT_OK(encoder_.Encode(changes, 7, 1, 2, v, 2, &out));
  EXPECT_EQ(out.codec(), "changes");
}

TEST_F(PullEncoderTest, WorkersAndChunksAreTrackedSeparately) {
  std::vector<float> v = {1, 2, 3, 4, 5, 6, 7, 8};
  const PullFormat changes = Format("changes");
  ChunkData out;
  ASSERT_OK(encoder_.Encode(changes, 3, 0, -1, v, 1, &out));
  // Worker 1 and chunk 7 have been sent nothing yet.
  out.Clear();
  ASSERT_OK(encoder_.Encode(changes, 3, 1, 1, v, 1, &out));
  EXPECT_EQ(out.codec(), "");
  out.Clear();
  ASSERT_OK(encoder_.Encode(changes, 7, 0, 1, v, 1, &out));
  EXPECT_EQ(out.codec(), "");
  out.Clear();
  ASSERT_OK(encoder_.Encode(changes, 3, 0, 1, v, 1, &out));
  EXPECT_EQ(out.codec(), "changes");
}

TEST_F(PullEncoderTest, FullyChangedChunkGoesDenseAndIsThenHeld) {
  std::vector<float> v = {1, 2, 3, 4};
  const PullFormat changes = Format("changes");
  ChunkData out;
  ASSERT_OK(encoder_.Encode(changes, 3, 0, -1, v, 1, &out));
  v = {5, 6, 7, 8};  // Changes would take 1 + 4 + 16 bytes > 16 dense.
  out.Clear();
  ASSERT_OK(encoder_.Encode(changes, 3, 0, 1, v, 2, &out));
  EXPECT_EQ(out.codec(), "");
  EXPECT_EQ(out.data(), Dense(v));
  v[2] = 0;
  out.Clear();
  ASSERT_OK(encoder_.Encode(changes, 3, 0, 2, v, 3, &out));
  EXPECT_EQ(out.codec(), "changes");
  std::string zero(4, '\0');
  EXPECT_EQ(out.data(), std::string("\x01\x02", 2) + zero);
}

}  // namespace
}  // namespace gradmesh

namespace gradmesh {
namespace {

// The "changes" copies reserve from the budget as they are made; without room the chunk goes
// dense and is not remembered (so it stays dense), and the encoder releases what it reserved.
TEST(PullEncoderBudgetTest, RemembersOnlyWhatTheBudgetHolds) {
  CompressorRegistry registry = CompressorRegistry::WithBuiltins();
  CodecCache codecs{&registry};
  auto changes = PullEncoder::ParseFormat("j", "changes", codecs);
  ASSERT_OK(changes);
  MemoryBudget budget(20);  // Room for one copy of a 4-float chunk (16 bytes).
  std::vector<float> v = {1, 2, 3, 4};
  {
    PullEncoder encoder(2, std::vector<int64_t>{0}, &budget);
    ChunkData out;
    ASSERT_OK(encoder.Encode(*changes, 0, 0, -1, v, 1, &out));  // Worker 0: remembered.
    EXPECT_EQ(out.codec(), "");
    EXPECT_EQ(budget.used(), 16);
    ASSERT_OK(encoder.Encode(*changes, 0, 1, -1, v, 1, &out));  // Worker 1: no room.
    EXPECT_EQ(out.codec(), "");
    EXPECT_EQ(out.data(), Dense(v));
    EXPECT_EQ(budget.used(), 16);
    v[2] = 30;
    // Worker 0 holds version 1: only the change is sent.
    ChunkData w0;
    ASSERT_OK(encoder.Encode(*changes, 0, 0, 1, v, 2, &w0));
    EXPECT_EQ(w0.codec(), "changes");
    // Worker 1 names version 1 too, but it was not remembered: dense, exact.
    ChunkData w1;
    ASSERT_OK(encoder.Encode(*changes, 0, 1, 1, v, 2, &w1));
    EXPECT_EQ(w1.codec(), "");
    EXPECT_EQ(w1.data(), Dense(v));
    EXPECT_EQ(budget.used(), 16);
  }
  EXPECT_EQ(budget.used(), 0);
}

}  // namespace
}  // namespace gradmesh
