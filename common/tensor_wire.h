// Copy-avoiding encoding of the tensor-carrying messages of proto/gradmesh.proto.
//
// Protobuf would copy a gradient twice on the way out (into the message's `bytes` field, then
// into gRPC's buffer) and a pulled chunk twice on the way in (into a std::string, then into
// the model). These functions produce and consume exactly the same wire bytes as the
// generated code (checked against it in tensor_wire_test.cc) while:
//   * EncodePushRequest: referencing the caller's float arrays from the grpc::ByteBuffer
//     (static slices, no copy). The arrays must stay alive and unchanged until the RPC that
//     sends the buffer has completed.
//   * DecodePullResponse: copying each chunk's data straight from gRPC's slices into memory
//     chosen by the caller.
//
// Thread safety: pure functions.
#ifndef GRADMESH_COMMON_TENSOR_WIRE_H_
#define GRADMESH_COMMON_TENSOR_WIRE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace gradmesh {

// One chunk of a push: dense float32 values at `data` (numel elements), or, when `codec` is
// not empty, the encoded payload `encoded` (referenced too: it must outlive the RPC).
struct PushChunkRef {
  int32_t tensor = 0;
  int32_t chunk = 0;
  int64_t version = 0;
  const float* data = nullptr;
  int64_t numel = 0;
  std::string codec;
  absl::string_view encoded;
};

// Encodes PushRequest{job, worker, step, request_id, chunks (dtype FLOAT32, codec "")}.
grpc::ByteBuffer EncodePushRequest(const std::string& job, int32_t worker, int64_t step,
                                   uint64_t request_id, const std::vector<PushChunkRef>& chunks);

// Called for each chunk of a PullResponse once its header is known (tensor, chunk, version,
// dtype, codec and the data size in bytes). Returns where to copy the data (exactly `bytes`
// bytes), or an error to abort decoding.
using PullChunkSink = std::function<absl::StatusOr<char*>(
    int32_t tensor, int32_t chunk, int64_t version, int32_t dtype, absl::string_view codec,
    int64_t bytes)>;

// Decodes a PullResponse. Chunks must serialise (tensor, chunk, version, dtype, codec) before
// data, as protobuf's encoder does (fields in number order); otherwise, or on any malformed
// input, returns DataLoss naming the problem.
absl::Status DecodePullResponse(const grpc::ByteBuffer& buffer, const PullChunkSink& sink);

// "changes" pull payloads: the entries of a chunk that differ from what the receiver holds,
// sent as new values (an exact overwrite, not a float difference).
//   varint count, count varint gaps (first index; then index - previous - 1), count float32.
// EncodeChanges compares `now` with `held` bit for bit, writes the payload of the differing
// entries and copies them into `held`. Returns false (and changes nothing) when the payload
// would not be smaller than `max_bytes`, or a changed value is not finite: the caller then
// sends the chunk dense.
bool EncodeChanges(const float* now, float* held, int64_t n, int64_t max_bytes, std::string* out);

// Applies a "changes" payload to `values` (the n entries the receiver holds). All-or-nothing:
// DataLoss naming the problem (truncated, trailing bytes, index out of range or not
// increasing, non-finite value) leaves `values` unchanged.
absl::Status DecodeChanges(absl::string_view payload, absl::Span<float> values);

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_TENSOR_WIRE_H_
