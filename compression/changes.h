// "changes" payloads: the exact-overwrite encoding of a pulled chunk (PullRequest.codec
// "changes"). A shard remembers, per chunk and worker, the values it last sent; when the
// worker still holds them, only the entries that differ are sent, as their new values (an
// exact overwrite, not a float difference). Proto- and gRPC-free: spans in, bytes out.
//
// Payload (all varints are LEB128, at most 10 bytes, as protobuf writes uint64):
//   varint count
//   count varint gaps: the first changed index, then index - previous index - 1
//   count float32 values, little-endian, in index order
// An unchanged chunk is the single byte 0x00.
//
// Thread safety: pure functions; concurrent calls on disjoint buffers are safe.
#ifndef GRADMESH_COMPRESSION_CHANGES_H_
#define GRADMESH_COMPRESSION_CHANGES_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace gradmesh {

// Compares `now` with `held` bit for bit (equal sizes), writes the payload of the differing
// entries to *out and copies them into `held`. Returns false, changing neither `held` nor
// *out, when the payload would not be smaller than `max_bytes` or a changed value is not
// finite: the caller then sends the chunk dense.
bool EncodeChanges(absl::Span<const float> now, absl::Span<float> held, int64_t max_bytes,
                   std::string* out);

// Applies a payload to `values` (the entries the receiver holds). All-or-nothing: DataLoss
// naming the problem (bad count, truncated or bad index, index out of range, wrong number of
// value bytes, non-finite value) leaves `values` unchanged.
absl::Status DecodeChanges(absl::string_view payload, absl::Span<float> values);

}  // namespace gradmesh

#endif  // GRADMESH_COMPRESSION_CHANGES_H_
