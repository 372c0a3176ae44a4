// A fuzz input's bytes as gRPC delivers a message: cut into slices. Shared by the fuzz targets
// of the decoders that read grpc::ByteBuffers (tensor_wire_fuzz, push_request_fuzz).
//
// Thread safety: a pure function.
#ifndef GRADMESH_TESTS_FUZZ_FUZZ_SLICES_H_
#define GRADMESH_TESTS_FUZZ_FUZZ_SLICES_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <string>
#include <vector>

namespace gradmesh {

// `bytes` in slices of the given lengths (a length of 0 makes no slice; the last slices may be
// shorter when the bytes run out), then one slice with the rest, if any.
inline grpc::ByteBuffer SlicedBuffer(const std::string& bytes, const std::vector<size_t>& lengths) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t want : lengths) {
    const size_t len = std::min(bytes.size() - at, want);
    if (len == 0) continue;
    slices.emplace_back(bytes.data() + at, len);
    at += len;
  }
  if (at < bytes.size()) slices.emplace_back(bytes.data() + at, bytes.size() - at);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// `bytes` cut as a fuzz input's byte `cuts` says: slices of (cuts & 3), ((cuts >> 2) & 3) and
// ((cuts >> 4) & 3) times `unit` bytes, then the rest (SlicedBuffer).
inline grpc::ByteBuffer SlicedByByte(const std::string& bytes, uint8_t cuts, size_t unit) {
  return SlicedBuffer(
      bytes, {static_cast<size_t>(cuts & 3) * unit, static_cast<size_t>((cuts >> 2) & 3) * unit,
              static_cast<size_t>((cuts >> 4) & 3) * unit});
}

}  // namespace gradmesh

#endif  // GRADMESH_TESTS_FUZZ_FUZZ_SLICES_H_
