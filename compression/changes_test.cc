#include "compression/changes.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

std::string Bytes(std::initializer_list<int> b) {
  std::string s;
  for (int x : b) s.push_back(static_cast<char>(x));
  return s;
}

std::string FloatBytes(float f) {
  std::string s(4, '\0');
  std::memcpy(&s[0], &f, 4);
  return s;
}

TEST(ChangesTest, EncodesCountGapsAndValuesExactly) {
  std::vector<float> now(1000), held(1000);
  for (int i = 0; i < 1000; ++i) now[i] = held[i] = 0.5f * i;
  now[3] = -1.25f;
  now[700] = 1e-3f;
  now[999] = 42.0f;
  std::string payload;
  ASSERT_TRUE(EncodeChanges(now, absl::MakeSpan(held), 4000, &payload));
  // count 3; gaps 3, 696 (0xb8 0x05), 298 (0xaa 0x02); then the three values.
  EXPECT_EQ(payload, Bytes({3, 3, 0xb8, 0x05, 0xaa, 0x02}) + FloatBytes(-1.25f) +
                         FloatBytes(1e-3f) + FloatBytes(42.0f));
  EXPECT_EQ(held, now);
}

TEST(ChangesTest, UnchangedIsOneZeroByte) {
  std::vector<float> now = {1, 2, 3};
  std::vector<float> held = now;
  std::string payload = "old";
  ASSERT_TRUE(EncodeChanges(now, absl::MakeSpan(held), 13, &payload));
  EXPECT_EQ(payload, std::string(1, '\0'));
}

TEST(ChangesTest, ComparesBitsNotValues) {
  // -0.0 == 0.0 as floats, but the receiver must hold exactly the sender's bits.
  std::vector<float> now = {-0.0f, 1.0f}, held = {0.0f, 1.0f};
  std::string payload;
  ASSERT_TRUE(EncodeChanges(now, absl::MakeSpan(held), 100, &payload));
  EXPECT_EQ(payload, Bytes({1, 0}) + FloatBytes(-0.0f));
  EXPECT_TRUE(std::signbit(held[0]));
}

TEST(ChangesTest, RefusedWhenNotSmallerThanMaxBytes) {
  std::vector<float> now = {1, 2, 3, 4}, held = {0, 0, 0, 0};
  const std::vector<float> before = held;
  std::string payload = "untouched";
  // 1 count + 4 gaps + 16 value bytes = 21 bytes: refused at 21, accepted at 22.
  EXPECT_FALSE(EncodeChanges(now, absl::MakeSpan(held), 21, &payload));
  EXPECT_EQ(held, before);
  EXPECT_EQ(payload, "untouched");
  ASSERT_TRUE(EncodeChanges(now, absl::MakeSpan(held), 22, &payload));
  EXPECT_EQ(payload.size(), 21u);
  EXPECT_EQ(held, now);
}

TEST(ChangesTest, NonFiniteChangeGoesDense) {
  std::vector<float> now = {1, std::numeric_limits<float>::infinity()}, held = {0, 0};
  std::string payload = "untouched";
  EXPECT_FALSE(EncodeChanges(now, absl::MakeSpan(held), 1000, &payload));
  EXPECT_EQ(held, (std::vector<float>{0, 0}));
  EXPECT_EQ(payload, "untouched");
  // An unchanged non-finite entry is not a change.
  std::vector<float> nan_held = {0, std::numeric_limits<float>::infinity()};
  ASSERT_TRUE(EncodeChanges(now, absl::MakeSpan(nan_held), 1000, &payload));
  EXPECT_EQ(payload, Bytes({1, 0}) + FloatBytes(1.0f));
}

TEST(ChangesTest, MismatchedSizesAreRefused) {
  std::vector<float> now = {1, 2}, held = {0};
  std::string payload;
  EXPECT_FALSE(EncodeChanges(now, absl::MakeSpan(held), 1000, &payload));
}

TEST(ChangesTest, DecodeAppliesExactOverwrite) {
  std::vector<float> values = {9, 9, 9, 9, 9};
  ASSERT_OK(DecodeChanges(Bytes({2, 1, 2}) + FloatBytes(0.25f) + FloatBytes(-3.0f),
                          absl::MakeSpan(values)));
  EXPECT_EQ(values, (std::vector<float>{9, 0.25f, 9, 9, -3.0f}));
  ASSERT_OK(DecodeChanges(std::string(1, '\0'), absl::MakeSpan(values)));
  EXPECT_EQ(values, (std::vector<float>{9, 0.25f, 9, 9, -3.0f}));
}

TEST(ChangesTest, DecodeErrorsAreExactAndChangeNothing) {
  const std::vector<float> start = {9, 9, 9, 9};
  std::vector<float> v = start;
  auto span = absl::MakeSpan(v);
  EXPECT_STATUS_MSG(DecodeChanges("", span), absl::StatusCode::kDataLoss,
                    "changes payload: bad entry count");
  EXPECT_STATUS_MSG(DecodeChanges(Bytes({5}), span), absl::StatusCode::kDataLoss,
                    "changes payload: bad entry count");
  EXPECT_STATUS_MSG(DecodeChanges(Bytes({1}), span), absl::StatusCode::kDataLoss,
                    "changes payload: truncated or bad index");
  EXPECT_STATUS_MSG(DecodeChanges(Bytes({1, 4}), span), absl::StatusCode::kDataLoss,
                    "changes payload: truncated or bad index");
  EXPECT_STATUS_MSG(DecodeChanges(Bytes({2, 3, 0}) + FloatBytes(1) + FloatBytes(2), span),
                    absl::StatusCode::kDataLoss, "changes payload: index 4 out of range [0, 4)");
  EXPECT_STATUS_MSG(DecodeChanges(Bytes({1, 0}) + "abc", span), absl::StatusCode::kDataLoss,
                    "changes payload: 3 value bytes for 1 entries");
  EXPECT_STATUS_MSG(DecodeChanges(Bytes({1, 0}) + FloatBytes(1) + "x", span),
                    absl::StatusCode::kDataLoss, "changes payload: 5 value bytes for 1 entries");
  EXPECT_STATUS_MSG(
      DecodeChanges(Bytes({1, 0}) + FloatBytes(std::numeric_limits<float>::quiet_NaN()), span),
      absl::StatusCode::kDataLoss, "changes payload: non-finite value");
  // An 11-byte varint is malformed.
  EXPECT_STATUS_MSG(
      DecodeChanges(Bytes({0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00}),
                    span),
      absl::StatusCode::kDataLoss, "changes payload: bad entry count");
  EXPECT_EQ(v, start);
}

TEST(ChangesTest, LongVarintsDecodeAsProtobufDoes) {
  // A padded 10-byte varint for 1 (protobuf accepts non-canonical varints).
  std::vector<float> v = {0, 0};
  ASSERT_OK(DecodeChanges(
      Bytes({0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00, 1}) + FloatBytes(5),
      absl::MakeSpan(v)));
  EXPECT_EQ(v, (std::vector<float>{0, 5}));
}

TEST(ChangesTest, RoundTripOfRandomEdits) {
  std::vector<float> now(5000), held(5000), receiver(5000);
  for (int i = 0; i < 5000; ++i) now[i] = held[i] = receiver[i] = 0.001f * i;
  for (int i = 0; i < 5000; i += 37) now[i] += 1.0f;
  std::string payload;
  ASSERT_TRUE(EncodeChanges(now, absl::MakeSpan(held), 5000 * 4, &payload));
  // 136 changes: 2 count bytes (136 >= 128), gaps 0 then 36 (one byte each), 136 values.
  EXPECT_EQ(payload.size(), 2u + 136u + 4u * 136u);
  ASSERT_OK(DecodeChanges(payload, absl::MakeSpan(receiver)));
  EXPECT_EQ(receiver, now);
}

}  // namespace
}  // namespace gradmesh
