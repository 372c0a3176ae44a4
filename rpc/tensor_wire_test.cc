#include "rpc/tensor_wire.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/escaping.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "proto/gradmesh.pb.h"

namespace gradmesh {
namespace {

std::string Flatten(const grpc::ByteBuffer& bb) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(bb.Dump(&slices).ok());
  std::string out;
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

grpc::ByteBuffer FromString(const std::string& s) {
  grpc::Slice slice(s.data(), s.size());
  return grpc::ByteBuffer(&slice, 1);
}

TEST(TensorWireTest, PushEncodingIsWhatProtobufParses) {
  std::vector<float> a = {1.5f, -2.0f, 3.25f};
  std::vector<float> b(70000);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i) * 0.5f;
  grpc::ByteBuffer bb = EncodePushRequest(
      "job-1", 3, 123456789012LL, 0xfedcba9876543210ull,
      {{0, 0, 0, a.data(), 3}, {7, 2, 41, b.data(), static_cast<int64_t>(b.size())}});
  PushRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(bb)));
  EXPECT_EQ(parsed.job(), "job-1");
  EXPECT_EQ(parsed.worker(), 3);
  EXPECT_EQ(parsed.step(), 123456789012LL);
  EXPECT_EQ(parsed.request_id(), 0xfedcba9876543210ull);
  ASSERT_EQ(parsed.chunks_size(), 2);
  EXPECT_EQ(parsed.chunks(0).tensor(), 0);
  EXPECT_EQ(parsed.chunks(0).dtype(), FLOAT32);
  EXPECT_EQ(parsed.chunks(0).data(), std::string(reinterpret_cast<char*>(a.data()), 12));
  EXPECT_EQ(parsed.chunks(1).tensor(), 7);
  EXPECT_EQ(parsed.chunks(1).chunk(), 2);
  EXPECT_EQ(parsed.chunks(1).version(), 41);
  EXPECT_EQ(parsed.chunks(1).data(),
            std::string(reinterpret_cast<char*>(b.data()), b.size() * sizeof(float)));
  // Byte-identical to protobuf's own encoding of the same message.
  EXPECT_EQ(Flatten(bb), parsed.SerializeAsString());
}

TEST(TensorWireTest, PushNonFiniteFlagIsWhatProtobufParses) {
  std::vector<float> zeros(4, 0.0f);
  PushRequest flagged, plain;
  ASSERT_TRUE(flagged.ParseFromString(
      Flatten(EncodePushRequest("j", 1, 9, 3, {{0, 0, 0, zeros.data(), 4}}, true))));
  ASSERT_TRUE(plain.ParseFromString(
      Flatten(EncodePushRequest("j", 1, 9, 3, {{0, 0, 0, zeros.data(), 4}}))));
  EXPECT_TRUE(flagged.nonfinite());
  EXPECT_FALSE(plain.nonfinite());
  EXPECT_EQ(flagged.chunks_size(), 1);
}

TEST(TensorWireTest, PushWithAPullIsWhatProtobufWrites) {
  std::vector<float> g = {0.5f, -1.0f};
  PullRequest pull;
  pull.set_job("j");
  pull.set_worker(2);
  pull.set_codec("fp16");
  grpc::ByteBuffer bb =
      EncodePushRequest("j", 2, 7, 11, {{0, 0, 3, g.data(), 2}}, false, pull.SerializeAsString());
  PushRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(bb)));
  ASSERT_TRUE(parsed.has_pull());
  EXPECT_EQ(parsed.pull().worker(), 2);
  EXPECT_EQ(parsed.pull().codec(), "fp16");
  EXPECT_EQ(Flatten(bb), parsed.SerializeAsString());
}

TEST(TensorWireTest, FindMessageFieldSharesTheFieldsBytes) {
  PushResponse r;
  r.set_duplicate(true);
  r.add_new_versions(4);
  r.mutable_prepared()->set_grad_sq_norm(2.5);
  ChunkData* c = r.mutable_pulled()->add_chunks();
  c->set_tensor(1);
  c->set_version(9);
  c->set_data(std::string(4000, 'x'));
  grpc::ByteBuffer sub;
  bool found = false;
  ASSERT_OK(FindMessageField(FromString(r.SerializeAsString()), 4, &sub, &found));
  EXPECT_TRUE(found);
  EXPECT_EQ(Flatten(sub), r.pulled().SerializeAsString());
  ASSERT_OK(FindMessageField(FromString(r.SerializeAsString()), 3, &sub, &found));
  EXPECT_TRUE(found);
  EXPECT_EQ(Flatten(sub), r.prepared().SerializeAsString());

  PushResponse none;
  none.add_new_versions(1);
  ASSERT_OK(FindMessageField(FromString(none.SerializeAsString()), 4, &sub, &found));
  EXPECT_FALSE(found);
  EXPECT_EQ(sub.Length(), 0u);

  std::string cut = r.SerializeAsString();
  cut.resize(cut.size() - 10);
  EXPECT_EQ(FindMessageField(FromString(cut), 4, &sub, &found).code(), absl::StatusCode::kDataLoss);
  // Twice (protobuf would merge them): refused rather than half-read.
  const std::string twice = r.SerializeAsString() + r.SerializeAsString();
  EXPECT_EQ(FindMessageField(FromString(twice), 4, &sub, &found).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_FALSE(found);
}

// The copy-free encoders (EncodeStreamResponse & co.) and the decoders write and read these
// messages field by field: a field added to any of them must be added there too (this test
// then fails until it is).
TEST(TensorWireTest, HandEncodedMessagesHaveTheFieldsTheEncodersKnow) {
  auto numbers = [](const google::protobuf::Descriptor* d) {
    std::vector<int> n;
    for (int i = 0; i < d->field_count(); ++i) n.push_back(d->field(i)->number());
    std::sort(n.begin(), n.end());
    return n;
  };
  // batch (15) is never set on a message object: batches are built from encoded messages
  // (TakeStreamMessages) and taken apart before decoding (SplitStreamBatch).
  EXPECT_EQ(numbers(StreamResponse::descriptor()), (std::vector<int>{1, 2, 3, 4, 5, 15}));
  // pad (14) is written by JoinAlignedStreamRequests only, and read by nobody.
  EXPECT_EQ(numbers(StreamRequest::descriptor()), (std::vector<int>{1, 2, 3, 14, 15}));
  EXPECT_EQ(numbers(PushResponse::descriptor()), (std::vector<int>{1, 2, 3, 4}));
  EXPECT_EQ(numbers(PullResponse::descriptor()), (std::vector<int>{1, 2}));
  EXPECT_EQ(numbers(ChunkData::descriptor()), (std::vector<int>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(ChunkData::descriptor()->FindFieldByNumber(6)->name(), "data");
  EXPECT_EQ(numbers(PushRequest::descriptor()), (std::vector<int>{1, 2, 3, 4, 5, 6, 7}));
}

// EncodeStreamResponse writes protobuf's bytes while moving the pulled data into slices.
TEST(TensorWireTest, StreamResponseEncodingIsWhatProtobufWrites) {
  auto chunk = [](PullResponse* r, int32_t tensor, int64_t version, const std::string& data,
                  const std::string& codec) {
    ChunkData* c = r->add_chunks();
    c->set_tensor(tensor);
    c->set_chunk(1);
    c->set_version(version);
    c->set_dtype(FLOAT32);
    c->set_codec(codec);
    c->set_data(data);
  };
  std::vector<StreamResponse> cases(5);
  cases[0].set_call(7);  // A pull: chunks (one empty), commit_missing.
  chunk(cases[0].mutable_pull(), 0, 3, std::string(70000, 'a'), "");
  chunk(cases[0].mutable_pull(), 2, 0, "", "");
  chunk(cases[0].mutable_pull(), 5, 1 << 20, "xyz", "bf16");
  cases[1].set_call(8);  // A fused push: head fields, then the pulled values.
  cases[1].mutable_push()->set_duplicate(true);
  cases[1].mutable_push()->add_new_versions(4);
  cases[1].mutable_push()->add_new_versions(9);
  chunk(cases[1].mutable_push()->mutable_pulled(), 1, 2, std::string(5000, 'b'), "");
  cases[2].set_call(9);  // A plain push.
  cases[2].mutable_push()->add_new_versions(1);
  cases[3].set_call(10);  // An error.
  cases[3].set_code(5);
  cases[3].set_message("job nope is not held");
  cases[4].mutable_pull()->set_commit_missing(true);
  for (size_t i = 0; i < cases.size(); ++i) {
    StreamResponse r = cases[i];
    const std::string want = r.SerializeAsString();
    EXPECT_EQ(Flatten(EncodeStreamResponse(&r)), want) << "case " << i;
  }
  // The 70000 data bytes were moved, not copied: the response no longer holds them.
  StreamResponse r = cases[0];
  grpc::ByteBuffer bb = EncodeStreamResponse(&r);
  EXPECT_TRUE(r.pull().chunks(0).data().empty());
  EXPECT_EQ(r.pull().chunks(0).version(), 3);
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(bb.Dump(&slices).ok());
  EXPECT_TRUE(std::any_of(slices.begin(), slices.end(),
                          [](const grpc::Slice& s) { return s.size() == 70000; }));
}

TEST(TensorWireTest, PullDecodingReportsCommitMissing) {
  PullResponse missing;
  missing.set_commit_missing(true);
  auto never = [](int32_t, int32_t, int64_t, int32_t, absl::string_view,
                  int64_t) -> absl::StatusOr<char*> {
    return absl::InternalError("no chunk expected");
  };
  bool flag = false;
  ASSERT_OK(DecodePullResponse(FromString(missing.SerializeAsString()), never, &flag));
  EXPECT_TRUE(flag);
  ASSERT_OK(DecodePullResponse(FromString(PullResponse().SerializeAsString()), never, &flag));
  EXPECT_FALSE(flag);
  // Without an out-parameter the field is read and ignored.
  ASSERT_OK(DecodePullResponse(FromString(missing.SerializeAsString()), never));
}

TEST(TensorWireTest, EncodedPushChunksCarryTheirCodec) {
  std::vector<float> a = {1, 2};
  const std::string payload = "\x01\x02payload";
  PushChunkRef enc{1, 0, 5, nullptr, 100, "topk:0.01+fp16", payload};
  grpc::ByteBuffer bb = EncodePushRequest("j", 1, 2, 3, {{0, 0, 0, a.data(), 2}, enc});
  PushRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(bb)));
  ASSERT_EQ(parsed.chunks_size(), 2);
  EXPECT_EQ(parsed.chunks(0).codec(), "");
  EXPECT_EQ(parsed.chunks(1).codec(), "topk:0.01+fp16");
  EXPECT_EQ(parsed.chunks(1).data(), payload);
  EXPECT_EQ(parsed.chunks(1).version(), 5);
  EXPECT_EQ(Flatten(bb), parsed.SerializeAsString());
}

TEST(TensorWireTest, PushDataIsNotCopied) {
  std::vector<float> big(1 << 16, 1.0f);
  grpc::ByteBuffer bb = EncodePushRequest("j", 0, 1, 1, {{0, 0, 0, big.data(), 1 << 16}});
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(bb.Dump(&slices).ok());
  bool found = false;
  for (const auto& s : slices) {
    if (s.begin() == reinterpret_cast<const uint8_t*>(big.data())) found = true;
  }
  EXPECT_TRUE(found) << "gradient data should be referenced, not copied";
}

TEST(TensorWireTest, PullDecodingWritesIntoCallerMemory) {
  PullResponse resp;
  std::vector<std::vector<float>> want = {{1, 2, 3}, std::vector<float>(50000, 7.0f)};
  for (int i = 0; i < 2; ++i) {
    ChunkData* c = resp.add_chunks();
    c->set_tensor(i);
    c->set_chunk(i * 5);
    c->set_version(100 + i);
    c->set_dtype(FLOAT32);
    if (i == 1) c->set_codec("fp16");  // Passed through to the sink (payload here is raw).
    c->set_data(std::string(reinterpret_cast<const char*>(want[i].data()), want[i].size() * 4));
  }
  std::vector<std::vector<float>> got = {std::vector<float>(3), std::vector<float>(50000)};
  std::vector<int64_t> versions;
  ASSERT_OK(
      DecodePullResponse(FromString(resp.SerializeAsString()),
                         [&](int32_t tensor, int32_t chunk, int64_t version, int32_t dtype,
                             absl::string_view codec, int64_t bytes) -> absl::StatusOr<char*> {
                           EXPECT_EQ(codec, tensor == 1 ? "fp16" : "");
                           EXPECT_EQ(chunk, tensor * 5);
                           EXPECT_EQ(dtype, FLOAT32);
                           EXPECT_EQ(bytes, static_cast<int64_t>(got[tensor].size() * 4));
                           versions.push_back(version);
                           return reinterpret_cast<char*>(got[tensor].data());
                         }));
  EXPECT_EQ(got, want);
  EXPECT_EQ(versions, (std::vector<int64_t>{100, 101}));
}

TEST(TensorWireTest, PullDecodingRejectsTruncatedAndSinkErrors) {
  PullResponse resp;
  ChunkData* c = resp.add_chunks();
  c->set_tensor(1);
  c->set_data(std::string(400, 'x'));
  const std::string full = resp.SerializeAsString();
  std::vector<char> dest(400);
  auto sink = [&](int32_t, int32_t, int64_t, int32_t, absl::string_view,
                  int64_t) -> absl::StatusOr<char*> { return dest.data(); };
  for (size_t cut : {size_t{1}, size_t{3}, full.size() / 2, full.size() - 1}) {
    EXPECT_STATUS(DecodePullResponse(FromString(full.substr(0, cut)), sink),
                  absl::StatusCode::kDataLoss)
        << "cut at " << cut;
  }
  EXPECT_STATUS_MSG(
      DecodePullResponse(FromString(full),
                         [](int32_t t, int32_t, int64_t, int32_t, absl::string_view,
                            int64_t) -> absl::StatusOr<char*> {
                           return absl::InternalError("no such tensor " + std::to_string(t));
                         }),
      absl::StatusCode::kInternal, "no such tensor 1");
  ASSERT_OK(DecodePullResponse(FromString(full), sink));
  EXPECT_EQ(std::string(dest.begin(), dest.end()), std::string(400, 'x'));
  // A data length beyond the message is refused before the sink is asked for memory.
  std::string lying = full;
  // Layout: [0x0a len(2)] [0x08 0x01] [0x32 len(2)=400] data. Make data claim 0x7f7f bytes.
  const size_t data_len_pos = lying.find(static_cast<char>(0x32)) + 1;
  lying[data_len_pos] = static_cast<char>(0xff);
  lying[data_len_pos + 1] = static_cast<char>(0x7f);
  bool sink_called = false;
  EXPECT_STATUS_MSG(DecodePullResponse(FromString(lying),
                                       [&](int32_t, int32_t, int64_t, int32_t, absl::string_view,
                                           int64_t) -> absl::StatusOr<char*> {
                                         sink_called = true;
                                         return dest.data();
                                       }),
                    absl::StatusCode::kDataLoss, "more than the message holds");
  EXPECT_FALSE(sink_called);
}

// Found by //tests/fuzz:tensor_wire_fuzz (corpus/tensor_wire_fuzz/crash-header-after-data):
// a chunk whose header fields follow its data was decoded with the header read so far
// (tensor 0 instead of 1), while protobuf takes the later values. Now DATA_LOSS.
TEST(TensorWireTest, PullDecodingRefusesHeaderFieldsOrSecondDataAfterData) {
  std::vector<char> dest(8);
  std::vector<int32_t> tensors;
  auto sink = [&](int32_t t, int32_t, int64_t, int32_t, absl::string_view,
                  int64_t) -> absl::StatusOr<char*> {
    tensors.push_back(t);
    return dest.data();
  };
  // ChunkData {data: "abcd", tensor: 1}: [0x0a 8] [0x32 4 a b c d] [0x08 1].
  const std::string after_data(
      "\x0a\x08\x32\x04"
      "abcd"
      "\x08\x01",
      10);
  PullResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(after_data));
  ASSERT_EQ(parsed.chunks(0).tensor(), 1);  // What protobuf makes of it.
  EXPECT_STATUS_MSG(DecodePullResponse(FromString(after_data), sink), absl::StatusCode::kDataLoss,
                    "chunk 0 has field 1 after its data");
  // ChunkData {data: "ab", data: "cd"}: protobuf keeps "cd".
  const std::string two_data(
      "\x0a\x08\x32\x02"
      "ab"
      "\x32\x02"
      "cd",
      10);
  EXPECT_STATUS_MSG(DecodePullResponse(FromString(two_data), sink), absl::StatusCode::kDataLoss,
                    "chunk 0 has field 6 after its data");
  // Unknown fields after the data are still skipped, as protobuf does.
  tensors.clear();
  const std::string unknown_after(
      "\x0a\x0a\x08\x02\x32\x04"
      "abcd"
      "\x78\x05",
      12);
  ASSERT_OK(DecodePullResponse(FromString(unknown_after), sink));
  EXPECT_EQ(tensors, (std::vector<int32_t>{2}));
}

// Found by //tests/fuzz:tensor_wire_fuzz (corpus/tensor_wire_fuzz/crash-chunk-longer-than-
// message): a chunk claiming more bytes than the message holds let its data field claim more
// too (up to ~2 GiB), and the sink was asked for that memory before the read failed.
TEST(TensorWireTest, PullDecodingRefusesAChunkLongerThanTheMessage) {
  bool sink_called = false;
  auto sink = [&](int32_t, int32_t, int64_t, int32_t, absl::string_view,
                  int64_t) -> absl::StatusOr<char*> {
    sink_called = true;
    return absl::InternalError("must not be asked");
  };
  // [0x0a len=0x3fff] [0x32 len=0x3f00] "abcd": both lengths lie.
  const std::string lying(
      "\x0a\xff\x7f\x32\x80\x7e"
      "abcd",
      10);
  EXPECT_STATUS_MSG(DecodePullResponse(FromString(lying), sink), absl::StatusCode::kDataLoss,
                    "chunk 0 claims 16383 bytes, more than the message holds");
  EXPECT_FALSE(sink_called);
}

TEST(TensorWireTest, ChangesRoundTripExactlyAndOnlyWhenSmaller) {
  std::vector<float> now(1000), held(1000), receiver(1000);
  for (int i = 0; i < 1000; ++i) now[i] = held[i] = receiver[i] = 0.5f * i;
  now[3] = -1.25f;
  now[700] = 1e-3f;
  now[999] = 42.0f;
  std::string payload;
  ASSERT_TRUE(EncodeChanges(now.data(), held.data(), 1000, 4000, &payload));
  EXPECT_EQ(held, now);                                // The sender now records what it sent.
  EXPECT_EQ(payload.size(), 1u + 1u + 2u + 2u + 12u);  // count, 3 gaps (3, 696, 298), values.
  ASSERT_OK(DecodeChanges(payload, absl::MakeSpan(receiver)));
  EXPECT_EQ(receiver, now);
  // Nothing changed: an empty payload.
  ASSERT_TRUE(EncodeChanges(now.data(), held.data(), 1000, 4000, &payload));
  EXPECT_EQ(payload, std::string(1, '\0'));
  // Everything changed: not smaller than dense, so refused and `held` untouched.
  std::vector<float> all(1000, 7.0f);
  EXPECT_FALSE(EncodeChanges(all.data(), held.data(), 1000, 4000, &payload));
  EXPECT_EQ(held, now);
}

TEST(TensorWireTest, MalformedChangesChangeNothing) {
  std::vector<float> now = {1, 2, 3, 4}, held = {0, 2, 0, 4};
  std::string good;
  ASSERT_TRUE(EncodeChanges(now.data(), held.data(), 4, 1000, &good));
  std::vector<float> target = {9, 9, 9, 9};
  for (size_t cut = 0; cut < good.size(); ++cut) {
    EXPECT_STATUS(DecodeChanges(good.substr(0, cut), absl::MakeSpan(target)),
                  absl::StatusCode::kDataLoss)
        << "cut " << cut;
  }
  EXPECT_STATUS_MSG(DecodeChanges(good + "x", absl::MakeSpan(target)), absl::StatusCode::kDataLoss,
                    "value bytes");
  std::vector<float> small(2, 9);
  EXPECT_STATUS(DecodeChanges(good, absl::MakeSpan(small)), absl::StatusCode::kDataLoss);
  std::string nan = good;
  const float q = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(&nan[nan.size() - 4], &q, 4);
  EXPECT_STATUS_MSG(DecodeChanges(nan, absl::MakeSpan(target)), absl::StatusCode::kDataLoss,
                    "non-finite");
  EXPECT_EQ(target, (std::vector<float>{9, 9, 9, 9}));
  ASSERT_OK(DecodeChanges(good, absl::MakeSpan(target)));
  EXPECT_EQ(target, (std::vector<float>{1, 9, 3, 9}));
}

// A framed push is byte for byte the StreamRequest protobuf would write, and shares the
// gradient's memory (no copy).
TEST(TensorWireTest, StreamRequestFramingIsWhatProtobufWrites) {
  const std::vector<float> g = {1.5f, -2.0f, 0.25f, 8.0f};
  const grpc::ByteBuffer push = EncodePushRequest("job", 1, 7, 42, {{0, 0, 3, g.data(), 4}});
  const grpc::ByteBuffer framed = FrameStreamRequest(9, StreamOp::kPush, push);
  StreamRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(framed)));
  EXPECT_EQ(parsed.call(), 9u);
  ASSERT_TRUE(parsed.has_push());
  EXPECT_EQ(parsed.push().SerializeAsString(), Flatten(push));
  EXPECT_EQ(Flatten(framed), parsed.SerializeAsString());
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(framed.Dump(&slices).ok());
  bool shared = false;
  for (const grpc::Slice& s : slices) {
    shared |= s.begin() == reinterpret_cast<const uint8_t*>(g.data());
  }
  EXPECT_TRUE(shared);

  PullRequest pull;
  pull.set_job("job");
  const std::string wire = pull.SerializeAsString();
  grpc::Slice slice(wire.data(), wire.size());
  StreamRequest want;
  want.set_call(1ull << 40);
  *want.mutable_pull() = pull;
  EXPECT_EQ(Flatten(FrameStreamRequest(1ull << 40, StreamOp::kPull, grpc::ByteBuffer(&slice, 1))),
            want.SerializeAsString());
}

TEST(TensorWireTest, StreamResponseSplitsIntoHeadAndBody) {
  StreamResponse r;
  r.set_call(77);
  ChunkData* c = r.mutable_pull()->add_chunks();
  c->set_tensor(2);
  c->set_data(std::string(64, 'x'));
  const std::string wire = r.SerializeAsString();
  // Split across slices, as gRPC may deliver it.
  std::vector<grpc::Slice> parts;
  for (size_t i = 0; i < wire.size(); i += 5) {
    parts.emplace_back(wire.data() + i, std::min<size_t>(5, wire.size() - i));
  }
  StreamResponseHead head;
  grpc::ByteBuffer body;
  ASSERT_OK(SplitStreamResponse(grpc::ByteBuffer(parts.data(), parts.size()), &head, &body));
  EXPECT_EQ(head.call, 77u);
  EXPECT_EQ(head.code, 0);
  EXPECT_EQ(head.op, 5);
  EXPECT_EQ(Flatten(body), r.pull().SerializeAsString());

  StreamResponse err;
  err.set_call(3);
  err.set_code(7);
  err.set_message("no");
  const std::string ew = err.SerializeAsString();
  grpc::Slice es(ew.data(), ew.size());
  ASSERT_OK(SplitStreamResponse(grpc::ByteBuffer(&es, 1), &head, &body));
  EXPECT_EQ(head.call, 3u);
  EXPECT_EQ(head.code, 7);
  EXPECT_EQ(head.message, "no");
  EXPECT_EQ(head.op, 0);
  EXPECT_EQ(body.Length(), 0u);

  const std::string bad = wire.substr(0, wire.size() - 3);  // Truncated body.
  grpc::Slice bs(bad.data(), bad.size());
  EXPECT_EQ(SplitStreamResponse(grpc::ByteBuffer(&bs, 1), &head, &body).code(),
            absl::StatusCode::kDataLoss);
}

// `s` cut into slices at the given offsets (as gRPC delivers a message: in pieces).
grpc::ByteBuffer Cut(const std::string& s, std::vector<size_t> cuts) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  cuts.push_back(s.size());
  for (size_t c : cuts) {
    c = std::min(c, s.size());
    if (c > at) slices.emplace_back(s.data() + at, c - at);
    at = std::max(at, c);
  }
  if (slices.empty()) slices.emplace_back();
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// What DecodePushRequest gave, with each raw chunk's data put back where protobuf keeps it.
// (An empty `dense`: protobuf parsed it whole, every payload in its place.)
PushRequest Restored(const PushRequest& request, const DenseChunks& dense) {
  PushRequest r = request;
  if (dense.empty()) return r;
  EXPECT_EQ(dense.size(), static_cast<size_t>(r.chunks_size()));
  for (int i = 0; i < r.chunks_size(); ++i) {
    if (!dense[i].present) continue;
    EXPECT_TRUE(r.chunks(i).data().empty()) << "chunk " << i;
    r.mutable_chunks(i)->set_data(
        std::string(reinterpret_cast<const char*>(dense[i].data()), dense[i].bytes));
  }
  return r;
}

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

PushRequest SamplePush() {
  PushRequest p;
  p.set_job("job-é");
  p.set_worker(2);
  p.set_step(77);
  p.set_request_id(9);
  std::vector<float> big(40000);  // 160,000 bytes: three scan blocks, the NaN in the second.
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i);
  big[20000] = std::numeric_limits<float>::quiet_NaN();
  big[30000] = std::numeric_limits<float>::infinity();
  ChunkData* c = p.add_chunks();
  c->set_tensor(1);
  c->set_version(5);
  c->set_data(Bytes(big));
  c = p.add_chunks();  // Five bytes: one whole float, then one byte.
  c->set_tensor(3);
  c->set_data(std::string("\x00\x00\x80\x3f\x07", 5));
  c = p.add_chunks();  // No data at all.
  c->set_tensor(4);
  p.mutable_pull()->set_job("job-é");
  p.mutable_pull()->set_codec("fp16");
  return p;
}

TEST(TensorWireTest, PushDecodingIsProtobufsParseWithTheRawDataAside) {
  const PushRequest sent = SamplePush();
  const std::string wire = sent.SerializeAsString();
  for (const std::vector<size_t>& cuts : std::vector<std::vector<size_t>>{
           {}, {1, 2, 3}, {50, 65536 + 7, 100001}, {wire.size() - 1}}) {
    PushRequest got;
    DenseChunks dense;
    ASSERT_OK(DecodePushRequest(Cut(wire, cuts), &got, &dense));
    ASSERT_EQ(dense.size(), 3u);
    EXPECT_TRUE(dense[0].present);
    EXPECT_EQ(dense[0].bytes, 160000);
    EXPECT_EQ(dense[0].first_nonfinite, 20000);
    EXPECT_EQ(dense[0].values[39999], 39999.0f);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(dense[0].values.get()) % alignof(float), 0u);
    EXPECT_TRUE(dense[1].present);
    EXPECT_EQ(dense[1].bytes, 5);
    EXPECT_EQ(dense[1].values[0], 1.0f);
    EXPECT_EQ(dense[1].first_nonfinite, -1);
    EXPECT_FALSE(dense[2].present);
    EXPECT_EQ(Restored(got, dense).SerializeAsString(), wire);
  }
}

TEST(TensorWireTest, PushWithAnEncodedChunkIsParsedWholeByProtobuf) {
  PushRequest p = SamplePush();
  ChunkData* c = p.add_chunks();  // An encoded payload (and a raw buffer chunk beside it).
  c->set_tensor(2);
  c->set_codec("fp16");
  c->set_data(std::string("\x01\x02\x03", 3));
  const std::string wire = p.SerializeAsString();
  PushRequest got;
  DenseChunks dense;
  ASSERT_OK(DecodePushRequest(Cut(wire, {9, 70000}), &got, &dense));
  EXPECT_TRUE(dense.empty());
  EXPECT_EQ(got.SerializeAsString(), wire);
  StreamRequest r;
  *r.mutable_push() = p;
  StreamRequest sgot;
  ASSERT_OK(DecodeStreamRequest(FromString(r.SerializeAsString()), &sgot, &dense));
  EXPECT_TRUE(dense.empty());
  EXPECT_EQ(sgot.SerializeAsString(), r.SerializeAsString());
}

// A push of more chunks than the decoder is allowed is INVALID_ARGUMENT, raw or encoded, alone
// or in a StreamRequest (where every push field's chunks count: protobuf merges them), and
// one at the limit decodes as without one.
TEST(TensorWireTest, PushDecodingRefusesMoreChunksThanAllowed) {
  PushRequest raw = SamplePush();  // 3 chunks.
  PushRequest encoded = SamplePush();
  encoded.mutable_chunks(2)->set_codec("fp16");
  for (const PushRequest& p : {raw, encoded}) {
    PushRequest got;
    DenseChunks dense;
    const absl::Status st = DecodePushRequest(FromString(p.SerializeAsString()), &got, &dense, 2);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(st.message(), "PushRequest: more than 2 chunks");
    EXPECT_TRUE(dense.empty());
    ASSERT_OK(DecodePushRequest(FromString(p.SerializeAsString()), &got, &dense, 3));
    EXPECT_EQ(Restored(got, dense).SerializeAsString(), p.SerializeAsString());
  }
  // Two push fields of 3 chunks each: one push of 6 once merged.
  StreamRequest r;
  r.set_call(4);
  *r.mutable_push() = raw;
  const std::string twice = r.SerializeAsString() + r.SerializeAsString();
  StreamRequest got;
  DenseChunks dense;
  const absl::Status st = DecodeStreamRequest(FromString(twice), &got, &dense, 5);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "StreamRequest: more than 5 chunks");
  ASSERT_OK(DecodeStreamRequest(FromString(twice), &got, &dense, 6));
  EXPECT_EQ(got.push().chunks_size(), 6);
}

// Shared-memory requests: JoinAlignedStreamRequests puts each large push's data 64-byte
// aligned (a pad field first; a batch's elements each), the request decodes to the same
// operations, and with in_place (the request copied and scanned by CopyAndScan) the shard's
// decoder uses the data where it lies in the copy, its NaN/Inf found by that scan, instead of
// copying it (and copies it when it is not float-aligned there).
TEST(TensorWireTest, AlignedSharedMemoryRequestsAreReadInPlace) {
  std::vector<std::vector<float>> grads;
  for (int64_t n : {int64_t{10000}, int64_t{12345}, int64_t{9000}}) {
    std::vector<float> g(n);
    for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(i) * 0.5f;
    grads.push_back(std::move(g));
  }
  grads[1][7] = std::numeric_limits<float>::infinity();
  std::vector<grpc::ByteBuffer> framed;
  std::vector<PushRequest> want;
  for (size_t k = 0; k < grads.size(); ++k) {
    PushChunkRef r;
    r.tensor = static_cast<int32_t>(k);
    r.chunk = 3;
    r.version = 200 + k;  // Varints of different lengths ahead of the data.
    r.data = grads[k].data();
    r.numel = static_cast<int64_t>(grads[k].size());
    const grpc::ByteBuffer body = EncodePushRequest("job", 1, 5, 10 + k, {r});
    PushRequest p;
    ASSERT_TRUE(p.ParseFromString(Flatten(body)));
    want.push_back(p);
    framed.push_back(FrameStreamRequest(k + 1, StreamOp::kPush, body));
  }
  for (const bool batch : {false, true}) {
    const std::vector<grpc::ByteBuffer> messages =
        batch ? framed : std::vector<grpc::ByteBuffer>{framed[1]};
    const std::string wire = Flatten(JoinAlignedStreamRequests(messages));
    // The request as the shard holds it: at the start of its aligned, scanned copy; then one
    // byte further in (the worker's alignment broken).
    for (const size_t shift : {size_t{0}, size_t{1}}) {
      const std::string held = std::string(shift, 'x') + wire;
      std::unique_ptr<char[]> owned(new char[held.size() + 64]);
      char* copy = owned.get() + (64 - reinterpret_cast<uintptr_t>(owned.get()) % 64) % 64;
      ScannedCopy scanned;
      CopyAndScan(held.data(), copy, held.size(), &scanned);
      char* base = copy + shift;
      grpc::Slice in_place(base, wire.size(), grpc::Slice::STATIC_SLICE);
      std::vector<grpc::ByteBuffer> parts;
      bool is_batch = false;
      ASSERT_OK(SplitStreamBatch(grpc::ByteBuffer(&in_place, 1), 256, &parts, &is_batch));
      EXPECT_EQ(is_batch, batch);
      if (!is_batch) parts.push_back(grpc::ByteBuffer(&in_place, 1));
      ASSERT_EQ(parts.size(), messages.size());
      for (size_t i = 0; i < parts.size(); ++i) {
        const size_t k = batch ? i : 1;
        StreamRequest got;
        DenseChunks dense;
        ASSERT_OK(DecodeStreamRequest(parts[i], &got, &dense, kNoChunkLimit, &scanned));
        EXPECT_EQ(got.call(), k + 1);
        ASSERT_EQ(dense.size(), 1u);
        EXPECT_EQ(Restored(got.push(), dense).SerializeAsString(), want[k].SerializeAsString());
        EXPECT_EQ(dense[0].first_nonfinite, k == 1 ? 7 : -1);
        if (shift == 0) {  // In place, 64-byte aligned from the request's start.
          const char* at = reinterpret_cast<const char*>(dense[0].view);
          ASSERT_NE(at, nullptr) << "message " << k;
          EXPECT_TRUE(at >= base && at < base + wire.size());
          EXPECT_EQ((at - base) % 64, 0) << "message " << k;
          EXPECT_EQ(dense[0].values, nullptr);
        } else {  // Not float-aligned there: copied.
          EXPECT_EQ(dense[0].view, nullptr);
          EXPECT_NE(dense[0].values, nullptr);
        }
        // Without in_place: always a copy.
        DenseChunks copied;
        ASSERT_OK(DecodeStreamRequest(parts[i], &got, &copied));
        EXPECT_EQ(copied[0].view, nullptr);
      }
    }
  }
  // Small messages are joined as they are.
  StreamRequest small;
  small.set_call(1);
  small.mutable_pull()->set_job("job");
  const grpc::ByteBuffer one = FromString(small.SerializeAsString());
  EXPECT_EQ(Flatten(JoinAlignedStreamRequests({one})), small.SerializeAsString());
  std::vector<grpc::Slice> plain;
  AppendStreamBatchElement(one, &plain);
  AppendStreamBatchElement(one, &plain);
  EXPECT_EQ(Flatten(JoinAlignedStreamRequests({one, one})),
            Flatten(grpc::ByteBuffer(plain.data(), plain.size())));
}

// CopyAndScan copies every byte and lists the offsets of the non-finite words, all of them up
// to kMaxListed (across its 64 KiB blocks); past that it says the list is incomplete, and a
// push's data referenced in the copy is then scanned by the decoder itself: the same
// first_nonfinite either way.
TEST(TensorWireTest, CopyAndScanListsTheNonFiniteWords) {
  for (const int bad_words : {0, 3, 64, 65, 200}) {
    std::vector<float> values(50001, 1.5f);  // 200,000 bytes scanned (four blocks), then more.
    std::vector<uint32_t> want;
    for (int b = 0; b < bad_words; ++b) {
      const size_t at = 1000 + static_cast<size_t>(b) * 240;
      values[at] = b % 2 == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
      want.push_back(static_cast<uint32_t>(at * 4));
    }
    std::vector<float> copy(values.size(), 0.0f);
    ScannedCopy scanned;
    CopyAndScan(reinterpret_cast<const char*>(values.data()), reinterpret_cast<char*>(copy.data()),
                50000 * 4 + 2, &scanned);  // And two bytes of a last, partial word.
    EXPECT_EQ(std::memcmp(copy.data(), values.data(), 50000 * 4 + 2), 0);
    EXPECT_EQ(scanned.complete, bad_words <= 64) << bad_words;
    if (scanned.complete) {
      EXPECT_EQ(scanned.nonfinite, want);
    } else {
      EXPECT_EQ(scanned.nonfinite.size(), ScannedCopy::kMaxListed);
    }
    // One chunk of the 40,000 floats from index 9,000 on, decoded from the scanned copy.
    PushChunkRef r;
    r.data = values.data() + 9000;
    r.numel = 40000;
    const std::string wire = Flatten(JoinAlignedStreamRequests(
        {FrameStreamRequest(1, StreamOp::kPush, EncodePushRequest("job", 0, 1, 1, {r}))}));
    std::vector<float> held(wire.size() / 4 + 1);
    CopyAndScan(wire.data(), reinterpret_cast<char*>(held.data()), wire.size(), &scanned);
    grpc::Slice in_place(scanned.base, wire.size(), grpc::Slice::STATIC_SLICE);
    StreamRequest got;
    DenseChunks dense;
    ASSERT_OK(
        DecodeStreamRequest(grpc::ByteBuffer(&in_place, 1), &got, &dense, kNoChunkLimit, &scanned));
    ASSERT_EQ(dense.size(), 1u);
    EXPECT_NE(dense[0].view, nullptr);
    int64_t first = -1;
    for (int64_t i = 0; i < 40000 && first < 0; ++i) {
      if (!std::isfinite(values[9000 + i])) first = i;
    }
    EXPECT_EQ(dense[0].first_nonfinite, first) << bad_words;
  }
}

TEST(TensorWireTest, PushDecodingKeepsTheLastDataAndCodecAsProtobufDoes) {
  ChunkData first, second;
  first.set_tensor(1);
  first.set_data(Bytes({1, 2}));
  first.set_codec("fp16");
  second.set_data(Bytes({3, 4, 5}));
  second.set_codec("");  // Explicitly empty: not emitted, so "fp16" stays.
  PushRequest p;
  p.set_job("j");
  // One ChunkData sent as two concatenated halves: protobuf merges them.
  const std::string chunk = first.SerializeAsString() + second.SerializeAsString();
  std::string wire = p.SerializeAsString();
  wire += '\x2a';  // Field 5, length-delimited.
  wire += static_cast<char>(chunk.size());
  wire += chunk;
  PushRequest want;
  ASSERT_TRUE(want.ParseFromString(wire));
  ASSERT_EQ(want.chunks(0).codec(), "fp16");
  PushRequest got;
  DenseChunks dense;
  ASSERT_OK(DecodePushRequest(FromString(wire), &got, &dense));
  EXPECT_TRUE(dense.empty());  // It has a codec: protobuf parses it, payload and all.
  EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());

  // Raw after all: a codec, then an explicitly empty one (the last wins).
  ChunkData raw;
  raw.set_data(Bytes({3, 4, 5}));
  const std::string raw_chunk =
      std::string("\x2a\x04", 2) + "fp16" + std::string("\x2a\x00", 2) + raw.SerializeAsString();
  wire = p.SerializeAsString() + std::string("\x2a", 1) + static_cast<char>(raw_chunk.size()) +
         raw_chunk;
  ASSERT_TRUE(want.ParseFromString(wire));
  ASSERT_EQ(want.chunks(0).codec(), "");
  ASSERT_OK(DecodePushRequest(FromString(wire), &got, &dense));
  ASSERT_EQ(dense.size(), 1u);
  EXPECT_TRUE(dense[0].present);
  EXPECT_EQ(Restored(got, dense).SerializeAsString(), want.SerializeAsString());
}

TEST(TensorWireTest, PushDecodingKeepsAnEmptyEncodedPayload) {
  // codec "fp16" and a data field of length 0, written out (found by push_request_fuzz).
  const std::string chunk = std::string("\x2a\x04", 2) + "fp16" + std::string("\x32\x00", 2);
  const std::string wire = std::string("\x2a", 1) + static_cast<char>(chunk.size()) + chunk;
  PushRequest want, got;
  ASSERT_TRUE(want.ParseFromString(wire));
  DenseChunks dense;
  ASSERT_OK(DecodePushRequest(FromString(wire), &got, &dense));
  EXPECT_TRUE(dense.empty());
  EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
}

TEST(TensorWireTest, StreamDecodingFollowsTheOneof) {
  const PushRequest push = SamplePush();
  StreamRequest r;
  r.set_call(12);
  *r.mutable_push() = push;
  StreamRequest got;
  DenseChunks dense;
  ASSERT_OK(DecodeStreamRequest(FromString(r.SerializeAsString()), &got, &dense));
  EXPECT_EQ(got.call(), 12u);
  ASSERT_TRUE(got.has_push());
  ASSERT_EQ(dense.size(), 3u);
  EXPECT_EQ(Restored(got.push(), dense).SerializeAsString(), push.SerializeAsString());

  // A push sent in two parts merges: the second part's chunks follow the first's.
  StreamRequest part;
  part.mutable_push()->add_chunks()->set_data(Bytes({7}));
  std::string wire = r.SerializeAsString() + part.SerializeAsString();
  ASSERT_OK(DecodeStreamRequest(FromString(wire), &got, &dense));
  ASSERT_EQ(got.push().chunks_size(), 4);
  ASSERT_EQ(dense.size(), 4u);
  EXPECT_EQ(dense[3].values[0], 7.0f);

  // A pull after the push replaces it, chunks and all.
  StreamRequest pull;
  pull.mutable_pull()->set_job("j");
  wire = r.SerializeAsString() + pull.SerializeAsString();
  ASSERT_OK(DecodeStreamRequest(FromString(wire), &got, &dense));
  EXPECT_TRUE(got.has_pull());
  EXPECT_TRUE(dense.empty());
  // And a push after that starts afresh.
  wire += part.SerializeAsString();
  ASSERT_OK(DecodeStreamRequest(FromString(wire), &got, &dense));
  ASSERT_TRUE(got.has_push());
  EXPECT_EQ(got.push().chunks_size(), 1);
  EXPECT_EQ(dense.size(), 1u);
}

TEST(TensorWireTest, PushDecodingRefusesWhatProtobufRefuses) {
  const std::string wire = SamplePush().SerializeAsString();
  PushRequest got;
  DenseChunks dense;
  // Truncated anywhere (every prefix protobuf refuses).
  for (size_t n = 0; n < wire.size(); n += 997) {
    PushRequest pb;
    const bool protobuf_ok = pb.ParseFromString(wire.substr(0, n));
    EXPECT_EQ(DecodePushRequest(FromString(wire.substr(0, n)), &got, &dense).ok(), protobuf_ok)
        << n;
  }
  // A chunk claiming more bytes than the message holds.
  std::string longer = "\x2a\xff\xff\xff\x07";
  EXPECT_STATUS_MSG(DecodePushRequest(FromString(longer), &got, &dense),
                    absl::StatusCode::kDataLoss, "PushRequest: malformed");
  // Data claiming more bytes than its chunk holds (the chunk itself fits).
  std::string data_longer = std::string("\x2a\x04\x32\x7f\x00\x00", 6);
  EXPECT_FALSE(DecodePushRequest(FromString(data_longer), &got, &dense).ok());
  EXPECT_TRUE(dense.empty());
  EXPECT_EQ(got.chunks_size(), 0);
  // Invalid UTF-8 in a string field: protobuf refuses it, and so does the decoder.
  PushRequest bad;
  bad.add_chunks()->set_data(Bytes({1}));
  std::string bad_wire = bad.SerializeAsString() + std::string("\x0a\x02\xc3\x28", 4);
  EXPECT_FALSE(bad.ParseFromString(bad_wire));
  EXPECT_FALSE(DecodePushRequest(FromString(bad_wire), &got, &dense).ok());
}

// Random corruptions of real messages: the decoder accepts exactly what protobuf accepts, and
// what it accepts is the same message.
TEST(TensorWireTest, PushDecodingAgreesWithProtobufOnCorruptedMessages) {
  PushRequest small;
  small.set_job("j");
  small.set_step(3);
  for (int i = 0; i < 3; ++i) {
    ChunkData* c = small.add_chunks();
    c->set_tensor(i);
    c->set_data(Bytes({1.0f * i, 2, 3}));
    if (i == 1) c->set_codec("fp16");
  }
  small.mutable_pull()->set_job("j");
  const std::string wire = small.SerializeAsString();
  std::mt19937 rng(11);
  int accepted = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    std::string w = wire;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % w.size();
      switch (rng() % 3) {
        case 0:
          w[at] = static_cast<char>(rng());
          break;
        case 1:
          w.erase(at, 1 + rng() % 4);
          break;
        default:
          w.insert(at, 1, static_cast<char>(rng()));
          break;
      }
      if (w.empty()) w = "x";
    }
    PushRequest pb, got;
    DenseChunks dense;
    const bool protobuf_ok = pb.ParseFromString(w);
    const bool ours = DecodePushRequest(Cut(w, {rng() % w.size()}), &got, &dense).ok();
    ASSERT_EQ(ours, protobuf_ok) << "trial " << trial;
    if (!ours) continue;
    ++accepted;
    ASSERT_TRUE(dense.empty() || dense.size() == static_cast<size_t>(got.chunks_size()));
    ASSERT_EQ(Restored(got, dense).SerializeAsString(), pb.SerializeAsString()) << trial;
  }
  EXPECT_GT(accepted, 1000);  // The corruptions reach past the refusals.
}

// `wire` cut into slices of `piece` bytes, as gRPC may deliver a message.
grpc::ByteBuffer Sliced(const std::string& wire, size_t piece) {
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i < wire.size(); i += piece) {
    slices.emplace_back(wire.data() + i, std::min(piece, wire.size() - i));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// A batch built by TakeStreamMessages is what protobuf writes for StreamRequest.batch (and
// StreamResponse.batch), shares the queued messages' memory, and SplitStreamBatch gives back
// each element's bytes however the message is sliced.
TEST(TensorWireTest, StreamBatchesAreWhatProtobufWritesAndSplitBack) {
  std::vector<float> g(1000, 0.5f);
  std::deque<grpc::ByteBuffer> queue;
  std::vector<std::string> elements;
  StreamRequest want;
  for (int i = 0; i < 5; ++i) {
    queue.push_back(FrameStreamRequest(
        i + 1, StreamOp::kPush,
        EncodePushRequest("job", 1, i, 100 + i, {{0, i, 3, g.data(), 1000 - i}})));
    elements.push_back(Flatten(queue.back()));
    ASSERT_TRUE(want.add_batch()->ParseFromString(elements.back()));
  }
  PullRequest pull;
  pull.set_job("job");
  queue.push_back(FrameStreamRequest(9, StreamOp::kPull, FromString(pull.SerializeAsString())));
  elements.push_back(Flatten(queue.back()));
  *want.add_batch()->mutable_pull() = pull;
  want.mutable_batch(5)->set_call(9);
  StreamResponse response;
  response.set_call(3);
  response.set_code(5);
  queue.push_back(FromString(response.SerializeAsString()));  // An empty element's neighbour.
  elements.push_back(Flatten(queue.back()));
  queue.push_back(FromString(""));
  elements.push_back("");
  want.add_batch()->set_call(3);  // Parsed as a StreamRequest: call 3, code an unknown field.
  want.add_batch();

  const grpc::ByteBuffer batch = TakeStreamMessages(&queue, /*batch=*/true);
  EXPECT_TRUE(queue.empty());
  StreamRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(batch)));
  ASSERT_EQ(parsed.batch_size(), 8);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(parsed.batch(i).SerializeAsString(), want.batch(i).SerializeAsString()) << i;
  }
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(batch.Dump(&slices).ok());
  EXPECT_TRUE(std::any_of(slices.begin(), slices.end(), [&](const grpc::Slice& s) {
    return s.begin() == reinterpret_cast<const uint8_t*>(g.data());
  }));
  for (size_t piece :
       {size_t{1}, size_t{2}, size_t{3}, size_t{7}, size_t{100}, size_t{4001}, size_t{1} << 20}) {
    std::vector<grpc::ByteBuffer> parts;
    bool is_batch = false;
    ASSERT_OK(SplitStreamBatch(Sliced(Flatten(batch), piece), kMaxStreamBatch, &parts, &is_batch));
    EXPECT_TRUE(is_batch);
    ASSERT_EQ(parts.size(), elements.size()) << piece;
    for (size_t i = 0; i < parts.size(); ++i) EXPECT_EQ(Flatten(parts[i]), elements[i]) << i;
  }
  // Not batches: a single operation, and an empty message.
  for (const grpc::ByteBuffer& single : {Sliced(elements[0], 3), grpc::ByteBuffer()}) {
    std::vector<grpc::ByteBuffer> parts;
    bool is_batch = true;
    ASSERT_OK(SplitStreamBatch(single, kMaxStreamBatch, &parts, &is_batch));
    EXPECT_FALSE(is_batch);
    EXPECT_TRUE(parts.empty());
  }
}

// TakeStreamMessages: one message alone goes as itself; without `batch`, one at a time; a
// batch stops at kMaxStreamBatch elements and before kStreamBatchBytes (a larger message goes
// alone).
TEST(TensorWireTest, StreamBatchesStopAtTheirBounds) {
  std::deque<grpc::ByteBuffer> queue;
  queue.push_back(FromString("\x08\x01"));
  EXPECT_EQ(Flatten(TakeStreamMessages(&queue, true)), "\x08\x01");
  for (int i = 0; i < 3; ++i) queue.push_back(FromString("\x08\x02"));
  EXPECT_EQ(Flatten(TakeStreamMessages(&queue, false)), "\x08\x02");
  EXPECT_EQ(queue.size(), 2u);
  queue.clear();
  for (size_t i = 0; i < kMaxStreamBatch + 10; ++i) queue.push_back(FromString("\x08\x03"));
  StreamRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(TakeStreamMessages(&queue, true))));
  EXPECT_EQ(parsed.batch_size(), static_cast<int>(kMaxStreamBatch));
  EXPECT_EQ(queue.size(), 10u);
  queue.clear();
  const std::string big(kStreamBatchBytes / 2 + 1, 'x');
  for (int i = 0; i < 3; ++i) queue.push_back(FromString(big));
  EXPECT_EQ(Flatten(TakeStreamMessages(&queue, true)), big);  // Two would pass the bound.
  queue.push_front(FromString("\x08\x04"));
  std::vector<grpc::ByteBuffer> parts;
  bool is_batch = false;
  ASSERT_OK(SplitStreamBatch(TakeStreamMessages(&queue, true), 10, &parts, &is_batch));
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(Flatten(parts[0]), "\x08\x04");
  EXPECT_EQ(Flatten(parts[1]), big);
  EXPECT_EQ(queue.size(), 1u);
}

// A batch holding anything but its elements, too many elements, or an element longer than
// the message is DataLoss; so is a batch field inside a StreamResponse being decoded.
TEST(TensorWireTest, MalformedStreamBatchesAreRefused) {
  const std::string element = "\x7a\x02\x08\x01";  // batch { call: 1 }
  const std::vector<std::pair<std::string, size_t>> cases = {
      {element + "\x08\x05", 10},                        // call beside the batch
      {element + element + element, 2},                  // over max_parts
      {std::string("\x7a\x09\x08\x01", 4), 10},          // element longer than the message
      {std::string("\x7a\xff\xff\xff\xff\xff", 6), 10},  // bad length varint
      {element + "\x7a", 10},                            // truncated
  };
  for (const auto& [wire, max] : cases) {
    std::vector<grpc::ByteBuffer> parts;
    bool is_batch = false;
    EXPECT_EQ(SplitStreamBatch(Sliced(wire, 3), max, &parts, &is_batch).code(),
              absl::StatusCode::kDataLoss)
        << absl::CEscape(wire);
    EXPECT_TRUE(is_batch);
  }
  StreamResponseHead head;
  grpc::ByteBuffer body;
  EXPECT_EQ(SplitStreamResponse(FromString("\x08\x01" + element), &head, &body).code(),
            absl::StatusCode::kDataLoss);
}

// CopyBufferTo copies every slice in order, and nothing when the bytes exceed the capacity.
TEST(TensorWireTest, CopyBufferToCopiesAllSlicesOrNothing) {
  grpc::Slice parts[2] = {grpc::Slice(std::string("abc")), grpc::Slice(std::string("defg"))};
  const grpc::ByteBuffer buffer(parts, 2);
  std::string out(8, '.');
  EXPECT_FALSE(CopyBufferTo(buffer, out.data(), 6));
  EXPECT_EQ(out, "........");
  EXPECT_TRUE(CopyBufferTo(buffer, out.data(), 7));
  EXPECT_EQ(out, "abcdefg.");
}

}  // namespace
}  // namespace gradmesh
