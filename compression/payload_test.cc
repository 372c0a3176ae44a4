#include "compression/payload.h"

#include <string>
#include <vector>

#include "common/status_testing.h"
#include "compression/rng.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(PayloadHeaderTest, RoundTripAndErrors) {
  PayloadHeader h;
  h.codec = CodecId::kTopK;
  h.value_type = ValueType::kFloat16;
  h.aux = 2;
  h.n = 0x0102030405060708ULL;
  std::string buf(16, '\xff');
  WritePayloadHeader(h, &buf[0]);
  EXPECT_EQ(buf, std::string("\x01\x04\x01\x02\0\0\0\0\x08\x07\x06\x05\x04\x03\x02\x01", 16));
  ASSERT_OK_AND_ASSIGN(PayloadHeader back, ReadPayloadHeader(buf));
  EXPECT_EQ(back.codec, CodecId::kTopK);
  EXPECT_EQ(back.value_type, ValueType::kFloat16);
  EXPECT_EQ(back.aux, 2);
  EXPECT_EQ(back.n, h.n);

  EXPECT_STATUS_MSG(ReadPayloadHeader(buf.substr(0, 15)), absl::StatusCode::kInvalidArgument,
                    "payload of 15 bytes is shorter than its 16-byte header");
  std::string bad = buf;
  bad[0] = 2;
  EXPECT_STATUS_MSG(ReadPayloadHeader(bad), absl::StatusCode::kInvalidArgument,
                    "payload format version 2 (supported: 1)");
  bad = buf;
  bad[5] = 1;
  EXPECT_STATUS_MSG(ReadPayloadHeader(bad), absl::StatusCode::kInvalidArgument, "reserved");
  EXPECT_EQ(CodecIdName(7), "qsgd");
  EXPECT_EQ(CodecIdName(99), "codec 99");
}

// A plain LEB128 encoder, for reference.
std::string RefVarints(const std::vector<uint32_t>& idx) {
  std::string out;
  uint64_t next = 0;
  for (uint32_t i : idx) {
    uint64_t v = i - next;
    next = static_cast<uint64_t>(i) + 1;
    do {
      uint8_t byte = v & 0x7f;
      v >>= 7;
      if (v) byte |= 0x80;
      out.push_back(static_cast<char>(byte));
    } while (v);
  }
  return out;
}

std::string Encode(IndexEncoding e, uint64_t n, const std::vector<uint32_t>& idx, size_t bytes) {
  std::string out(bytes, '\xaa');
  WriteIndices(e, n, idx, &out[0]);
  return out;
}

TEST(IndexEncodingTest, ChoosesTheSmallerEncoding) {
  size_t bytes = 0;
  // Sparse: 10 indices of 10000 -> varints (~20 bytes) beat a 1250-byte bitmap.
  std::vector<uint32_t> sparse;
  for (uint32_t i = 0; i < 10; ++i) sparse.push_back(i * 997 + 3);
  EXPECT_EQ(ChooseIndexEncoding(10000, sparse, &bytes), IndexEncoding::kDeltaVarint);
  EXPECT_EQ(bytes, RefVarints(sparse).size());
  EXPECT_EQ(Encode(IndexEncoding::kDeltaVarint, 10000, sparse, bytes), RefVarints(sparse));
  // Dense: every other index -> a bitmap (n/8 bytes) beats one byte per index.
  std::vector<uint32_t> dense;
  for (uint32_t i = 0; i < 10000; i += 2) dense.push_back(i);
  EXPECT_EQ(ChooseIndexEncoding(10000, dense, &bytes), IndexEncoding::kBitmap);
  EXPECT_EQ(bytes, 1250u);
  // Tie (n = 64: bitmap 8 bytes; 8 one-byte varints) -> varints.
  std::vector<uint32_t> tie = {0, 8, 16, 24, 32, 40, 48, 56};
  EXPECT_EQ(ChooseIndexEncoding(64, tie, &bytes), IndexEncoding::kDeltaVarint);
  EXPECT_EQ(bytes, 8u);
  tie.push_back(63);
  EXPECT_EQ(ChooseIndexEncoding(64, tie, &bytes), IndexEncoding::kBitmap);
  EXPECT_EQ(bytes, 8u);
  // Everything -> nothing at all.
  std::vector<uint32_t> all = {0, 1, 2, 3, 4};
  EXPECT_EQ(ChooseIndexEncoding(5, all, &bytes), IndexEncoding::kAll);
  EXPECT_EQ(bytes, 0u);
  // Random sets of every density: the choice is the minimum of the two exact sizes.
  Rng rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const uint64_t n = 1 + rng.Uniform(5000);
    std::vector<uint32_t> idx;
    const uint64_t keep = 1 + rng.Uniform(64);
    for (uint32_t i = 0; i < n; ++i) {
      if (rng.Uniform(keep) == 0) idx.push_back(i);
    }
    if (idx.size() == n) continue;
    const size_t varint = RefVarints(idx).size();
    const size_t bitmap = (n + 7) / 8;
    const IndexEncoding e = ChooseIndexEncoding(n, idx, &bytes);
    EXPECT_EQ(bytes, std::min(varint, bitmap));
    EXPECT_EQ(e, varint <= bitmap ? IndexEncoding::kDeltaVarint : IndexEncoding::kBitmap);
    EXPECT_EQ(DeltaVarintBytes(idx), varint);
  }
}

TEST(IndexEncodingTest, RoundTrips) {
  Rng rng(6);
  for (int trial = 0; trial < 500; ++trial) {
    const uint64_t n = 1 + rng.Uniform(trial < 250 ? 200 : 100000);
    std::vector<uint32_t> idx;
    const uint64_t keep = 1 + rng.Uniform(200);
    for (uint32_t i = 0; i < n; ++i) {
      if (rng.Uniform(keep) == 0) idx.push_back(i);
    }
    for (IndexEncoding e : {IndexEncoding::kDeltaVarint, IndexEncoding::kBitmap}) {
      const size_t bytes = e == IndexEncoding::kBitmap ? BitmapBytes(n) : DeltaVarintBytes(idx);
      const std::string enc = Encode(e, n, idx, bytes);
      std::vector<uint32_t> back = {77};
      ASSERT_OK(ReadIndices(static_cast<uint8_t>(e), n, idx.size(), enc, &back));
      ASSERT_EQ(back, idx);
    }
  }
  // Large gaps (4- and 5-byte varints), the largest index.
  std::vector<uint32_t> far = {0, 200, 70000, 20000000, 0xfffffffeu};
  const std::string enc = RefVarints(far);
  std::vector<uint32_t> back;
  ASSERT_OK(ReadIndices(1, 0xffffffffULL, far.size(), enc, &back));
  EXPECT_EQ(back, far);
}

TEST(IndexEncodingTest, RejectsMalformedSections) {
  std::vector<uint32_t> out;
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  // Varints.
  EXPECT_STATUS_MSG(ReadIndices(1, 10, 2, std::string("\x03\x80", 2), &out), kInvalid,
                    "truncated at index 1 of 2");
  EXPECT_STATUS_MSG(ReadIndices(1, 10, 2, std::string("\x03\x01\x01", 3), &out), kInvalid,
                    "1 bytes left after 2 indices");
  EXPECT_STATUS_MSG(ReadIndices(1, 10, 2, std::string("\x03\x06", 2), &out), kInvalid,
                    "index 10 (entry 1) out of range [0, 10)");
  EXPECT_STATUS_MSG(ReadIndices(1, 10, 1, std::string("\x83\x00", 2), &out), kInvalid,
                    "non-canonical varint at index 0");
  EXPECT_STATUS_MSG(
      ReadIndices(1, 0xffffffffULL, 1, std::string("\x80\x80\x80\x80\x80\x01", 6), &out), kInvalid,
      "longer than 5 bytes");
  EXPECT_STATUS_MSG(ReadIndices(1, 0xffffffffULL, 1, std::string("\xff\xff\xff\xff\x0f", 5), &out),
                    kInvalid, "out of range");
  EXPECT_STATUS_MSG(ReadIndices(1, 10, 3, std::string("\x01\x01", 2), &out), kInvalid,
                    "3 indices cannot fit in 2 bytes");
  // Duplicates and descending order cannot be written: gap - 1 is never negative. The same
  // bytes always mean ascending distinct indices.
  ASSERT_OK(ReadIndices(1, 10, 3, std::string("\x00\x00\x00", 3), &out));
  EXPECT_EQ(out, std::vector<uint32_t>({0, 1, 2}));
  // Bitmaps.
  EXPECT_STATUS_MSG(ReadIndices(2, 10, 1, std::string("\x01", 1), &out), kInvalid,
                    "1 bytes, expected 2 for n=10");
  EXPECT_STATUS_MSG(ReadIndices(2, 10, 2, std::string("\x01\x04", 2), &out), kInvalid,
                    "bits set beyond n=10");
  EXPECT_STATUS_MSG(ReadIndices(2, 10, 3, std::string("\x01\x02", 2), &out), kInvalid,
                    "2 bits set, header says k=3");
  ASSERT_OK(ReadIndices(2, 10, 3, std::string("\x05\x02", 2), &out));
  EXPECT_EQ(out, std::vector<uint32_t>({0, 2, 9}));
  // All.
  EXPECT_STATUS_MSG(ReadIndices(0, 10, 9, "", &out), kInvalid, "needs k == n");
  EXPECT_STATUS_MSG(ReadIndices(0, 10, 10, "x", &out), kInvalid, "index bytes=1");
  // Header-level.
  EXPECT_STATUS_MSG(ReadIndices(1, 10, 11, std::string(11, '\0'), &out), kInvalid, "k=11 of n=10");
  EXPECT_STATUS_MSG(ReadIndices(7, 10, 1, "x", &out), kInvalid, "unknown index encoding 7");
  EXPECT_STATUS_MSG(ReadIndices(1, 1ULL << 33, 1, "x", &out), kInvalid, "at most 4294967295");
}

}  // namespace
}  // namespace gradmesh
