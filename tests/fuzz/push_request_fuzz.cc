// Fuzz target: the shard's push decoders (rpc/tensor_wire.h DecodePushRequest and
// DecodeStreamRequest), which a shard runs on every push straight out of gRPC's buffers.
//
// A StreamRequest is decoded twice, copying the raw data and referencing it where it lies in a
// scanned private copy (in_place, as a shared-memory channel's shard does); both must agree
// with protobuf.
//
// Input: byte 0 picks the message (bit 0: StreamRequest, else PushRequest) and, with byte 1,
// where the rest is cut into up to 3 slices (as gRPC may deliver them); the rest is the
// serialised message. Checked against protobuf's own parser: whatever protobuf parses, the
// decoder parses to the same message once each raw chunk's data is put back from its
// DenseData (whose first_nonfinite is the first NaN/Inf among the whole floats; none at all
// when the message has an encoded chunk, which protobuf parses whole). Refusals are
// DATA_LOSS and leave nothing behind. The decoder may accept a little more than protobuf
// (overlong tag or length varints, which CodedInputStream reads): harmless, the result is still
// a valid message.
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/gradmesh.pb.h"
#include "rpc/tensor_wire.h"
#include "tests/fuzz/fuzz_slices.h"
#include "tests/fuzz/fuzz_util.h"

namespace gradmesh {
namespace {

void CheckDense(const DenseData& d) {
  if (!d.present) return;
  int64_t first = -1;
  for (int64_t i = 0; i < d.bytes / 4 && first < 0; ++i) {
    if (!std::isfinite(d.data()[i])) first = i;
  }
  FUZZ_CHECK(d.first_nonfinite == first,
             absl::StrCat("first_nonfinite ", d.first_nonfinite, ", scan says ", first));
}

void Restore(const DenseChunks& dense, PushRequest* r) {
  if (dense.empty()) return;  // Parsed whole by protobuf (an encoded chunk), or no chunks.
  FUZZ_CHECK(dense.size() == static_cast<size_t>(r->chunks_size()),
             absl::StrCat(dense.size(), " dense entries for ", r->chunks_size(), " chunks"));
  for (int i = 0; i < r->chunks_size(); ++i) {
    CheckDense(dense[i]);
    if (!dense[i].present) continue;
    FUZZ_CHECK(r->chunks(i).data().empty(), "a raw chunk's data stayed in the message");
    r->mutable_chunks(i)->set_data(
        std::string(reinterpret_cast<const char*>(dense[i].data()), dense[i].bytes));
  }
}

// `decode` (which puts the raw data back into the message it decodes) against protobuf's
// parser on the same bytes: a refusal is DATA_LOSS, leaves nothing behind and is protobuf's
// too; what both parse is the same message.
template <typename Message, typename Decode>
void CheckAgainstProtobuf(const std::string& bytes, Decode decode) {
  Message got, want;
  DenseChunks dense;
  const absl::Status st = decode(&got, &dense);
  if (!st.ok()) {
    FUZZ_CHECK(st.code() == absl::StatusCode::kDataLoss, st.ToString());
    FUZZ_CHECK(dense.empty() && got.ByteSizeLong() == 0, "a refusal left a result behind");
    FUZZ_CHECK(!want.ParseFromString(bytes), "protobuf parses what the decoder refused");
    return;
  }
  if (!want.ParseFromString(bytes)) return;
  FUZZ_CHECK(
      got.SerializeAsString() == want.SerializeAsString(),
      absl::StrCat("the decoded ", Message::descriptor()->name(), " differs from protobuf's"));
}

}  // namespace
}  // namespace gradmesh

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradmesh;
  FuzzInput in(data, size);
  const uint8_t mode = in.Byte();
  const uint8_t cuts = in.Byte();
  const std::string bytes(in.Rest());
  const grpc::ByteBuffer buffer = SlicedBuffer(bytes, {static_cast<size_t>(mode >> 1), cuts});
  if (mode & 1) {
    // Both ways: copied, and referenced where it lies in a scanned private copy, in one slice
    // (as a shared-memory channel's shard decodes; CheckDense checks its first_nonfinite).
    std::unique_ptr<float[]> copy(new float[bytes.size() / 4 + 1]);
    ScannedCopy scanned;
    CopyAndScan(bytes.data(), reinterpret_cast<char*>(copy.get()), bytes.size(), &scanned);
    grpc::Slice in_place(scanned.base, bytes.size(), grpc::Slice::STATIC_SLICE);
    const grpc::ByteBuffer scanned_buffer(&in_place, 1);
    for (const bool reference : {false, true}) {
      CheckAgainstProtobuf<StreamRequest>(bytes, [&](StreamRequest* got, DenseChunks* dense) {
        const absl::Status st =
            reference ? DecodeStreamRequest(scanned_buffer, got, dense, kNoChunkLimit, &scanned)
                      : DecodeStreamRequest(buffer, got, dense);
        if (st.ok() && got->has_push()) Restore(*dense, got->mutable_push());
        if (st.ok() && !got->has_push()) FUZZ_CHECK(dense->empty(), "dense data without a push");
        return st;
      });
    }
  } else {
    CheckAgainstProtobuf<PushRequest>(bytes, [&](PushRequest* got, DenseChunks* dense) {
      const absl::Status st = DecodePushRequest(buffer, got, dense);
      if (st.ok()) Restore(*dense, got);
      return st;
    });
  }
  return 0;
}
