// Fuzz target: the tensor wire (rpc/tensor_wire.h), DecodePullResponse, which a worker runs on
// every pull answer straight out of gRPC's buffers.
//
// Input: byte 0 cuts the rest into up to 4 slices (as gRPC may deliver them), the rest is a
// serialised PullResponse. Checked against protobuf's own parser: whatever the decoder
// accepts and protobuf parses has the same chunks (tensor, chunk, version, dtype, codec,
// data) in the same order; refusals are DATA_LOSS; the decoder asks its sink for at most the
// bytes the message holds (and, under ASan, never writes past what the sink returned).
#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/gradmesh.pb.h"
#include "rpc/tensor_wire.h"
#include "tests/fuzz/fuzz_slices.h"
#include "tests/fuzz/fuzz_util.h"

namespace gradmesh {
namespace {

struct SeenChunk {
  int32_t tensor, chunk;
  int64_t version;
  int32_t dtype;
  std::string codec;
  std::string data;
};

bool Ascii(const std::string& s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

}  // namespace
}  // namespace gradmesh

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradmesh;
  FuzzInput in(data, size);
  const uint8_t cuts = in.Byte();
  const std::string bytes(in.Rest());
  const grpc::ByteBuffer buffer = SlicedByByte(bytes, cuts, 7);

  std::vector<SeenChunk> seen;
  const absl::Status st = DecodePullResponse(
      buffer,
      [&](int32_t tensor, int32_t chunk, int64_t version, int32_t dtype, absl::string_view codec,
          int64_t n) -> absl::StatusOr<char*> {
        FUZZ_CHECK(n >= 0 && static_cast<size_t>(n) <= bytes.size(),
                   absl::StrCat("sink asked for ", n, " bytes of ", bytes.size()));
        seen.push_back({tensor, chunk, version, dtype, std::string(codec),
                        std::string(static_cast<size_t>(n), '\0')});
        return seen.back().data.data();
      });
  if (!st.ok()) {
    FUZZ_CHECK(st.code() == absl::StatusCode::kDataLoss, st.ToString());
    return 0;
  }
  for (const SeenChunk& c : seen) {
    if (!Ascii(c.codec)) return 0;  // protobuf also checks UTF-8 there; the decoder does not.
  }
  PullResponse proto;
  // protobuf's parser is stricter about some unknown fields (e.g. an overlong tag varint,
  // corpus/tensor_wire_fuzz/overlong-tag) that CodedInputStream skips: leniency there is
  // harmless. Whatever protobuf parses must decode to the same chunks.
  if (!proto.ParseFromString(bytes)) return 0;
  FUZZ_CHECK(static_cast<size_t>(proto.chunks_size()) == seen.size(),
             absl::StrCat(seen.size(), " chunks decoded, protobuf has ", proto.chunks_size()));
  for (size_t i = 0; i < seen.size(); ++i) {
    const ChunkData& p = proto.chunks(static_cast<int>(i));
    const SeenChunk& c = seen[i];
    FUZZ_CHECK(
        p.tensor() == c.tensor && p.chunk() == c.chunk && p.version() == c.version &&
            static_cast<int32_t>(p.dtype()) == c.dtype && p.codec() == c.codec,
        absl::StrCat("chunk ", i, " header differs from protobuf's: ", p.ShortDebugString()));
    FUZZ_CHECK(p.data() == c.data, absl::StrCat("chunk ", i, " data differs from protobuf's"));
  }
  return 0;
}
