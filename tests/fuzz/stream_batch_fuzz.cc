// Fuzz target: batches on ParameterService.Stream (rpc/tensor_wire.h), which a shard reads from
// any client (SplitStreamBatch, then DecodeStreamRequest per element) and a worker reads from
// its shards (SplitStreamBatch, then SplitStreamResponse per element).
//
// Input: byte 0 cuts the rest into up to 4 slices (as gRPC may deliver them), byte 1 is the
// element limit (1-256), the rest is one Stream message. Checked: a batch is recognised by its
// first byte alone; refusals are DATA_LOSS; the elements are at most the limit, hold no more
// bytes than the message, and, when protobuf parses the message as a StreamResponse, there are
// as many as protobuf's `batch` has, each parsing to the same element, and each element's head
// (call, code, message, which response) as protobuf reads it; a batch as protobuf writes it
// is never refused.
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

std::string Flat(const grpc::ByteBuffer& bb) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (bb.Length() > 0 && bb.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices)
      out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

// Each element as a StreamResponse: SplitStreamResponse agrees with protobuf's parse of it.
void CheckResponses(const std::string& bytes, const std::vector<grpc::ByteBuffer>& parts) {
  StreamResponse whole;
  if (!whole.ParseFromString(bytes)) return;
  FUZZ_CHECK(static_cast<size_t>(whole.batch_size()) == parts.size(),
             absl::StrCat(parts.size(), " elements, protobuf has ", whole.batch_size()));
  for (size_t i = 0; i < parts.size(); ++i) {
    const StreamResponse& want = whole.batch(static_cast<int>(i));
    StreamResponse got;
    FUZZ_CHECK(got.ParseFromString(Flat(parts[i])), absl::StrCat("element ", i, " does not parse"));
    FUZZ_CHECK(got.SerializeAsString() == want.SerializeAsString(),
               absl::StrCat("element ", i, " differs from protobuf's"));
    StreamResponseHead head;
    grpc::ByteBuffer body;
    if (!SplitStreamResponse(parts[i], &head, &body).ok()) continue;  // e.g. a nested batch.
    FUZZ_CHECK(want.batch_size() == 0, "a nested batch was accepted");
    FUZZ_CHECK(
        head.call == want.call() && head.code == want.code() && head.message == want.message(),
        absl::StrCat("element ", i, " head differs: ", want.ShortDebugString()));
    const int32_t op = want.has_push() ? 4 : want.has_pull() ? 5 : 0;
    FUZZ_CHECK(head.op == op, absl::StrCat("element ", i, " op ", head.op, ", protobuf ", op));
  }
}

}  // namespace
}  // namespace gradmesh

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradmesh;
  FuzzInput in(data, size);
  const uint8_t cuts = in.Byte();
  const size_t max_parts = 1 + in.Byte() % kMaxStreamBatch;
  const std::string bytes(in.Rest());
  const grpc::ByteBuffer buffer = SlicedByByte(bytes, cuts, 5);
  std::vector<grpc::ByteBuffer> parts;
  bool is_batch = false;
  const absl::Status st = SplitStreamBatch(buffer, max_parts, &parts, &is_batch);
  FUZZ_CHECK(is_batch == (!bytes.empty() && bytes[0] == '\x7a'),
             "batch not told by its first byte");
  // A batch as protobuf writes it (canonical bytes, nothing but elements, within the limit)
  // is always taken apart.
  StreamResponse canonical;
  if (canonical.ParseFromString(bytes) && canonical.batch_size() > 0 &&
      static_cast<size_t>(canonical.batch_size()) <= max_parts &&
      canonical.SerializeAsString() == bytes) {
    StreamResponse rest = canonical;
    rest.clear_batch();
    if (rest.ByteSizeLong() == 0) {
      FUZZ_CHECK(st.ok(), absl::StrCat("a well-formed batch refused: ", st.ToString()));
    }
  }
  if (!st.ok()) {
    FUZZ_CHECK(st.code() == absl::StatusCode::kDataLoss, st.ToString());
    return 0;
  }
  if (!is_batch) {
    FUZZ_CHECK(parts.empty(), "elements of a message that is not a batch");
    return 0;
  }
  FUZZ_CHECK(parts.size() <= max_parts, absl::StrCat(parts.size(), " elements over ", max_parts));
  size_t total = 0;
  for (const grpc::ByteBuffer& p : parts) total += p.Length();
  FUZZ_CHECK(total + 2 * parts.size() <= bytes.size(), "elements longer than the message");
  CheckResponses(bytes, parts);
  // The shard's side: each element decodes (or is refused) without harm.
  for (const grpc::ByteBuffer& p : parts) {
    StreamRequest request;
    DenseChunks dense;
    const absl::Status decoded = DecodeStreamRequest(p, &request, &dense);
    FUZZ_CHECK(decoded.ok() || decoded.code() == absl::StatusCode::kDataLoss, decoded.ToString());
  }
  return 0;
}
