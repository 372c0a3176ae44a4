// DenseData: the raw float32 data of one chunk of a received push, decoded outside protobuf
// (rpc/tensor_wire.h DecodePushRequest) so that it is copied once, straight out of the
// transport's buffers into aligned memory, and scanned for non-finite values as it lands. The
// chunk's ChunkData.data is then left empty and the shard reads the values here
// (server/push_decoding.h). A decoder told that its input stays unchanged and alive for as long
// as the DenseData (a shared-memory channel's private copy of a request) may instead point at
// the data where it lies, when it is float-aligned there: scanned, not copied.
//
// Thread safety: a plain value; not synchronised.
#ifndef GRADMESH_COMMON_DENSE_DATA_H_
#define GRADMESH_COMMON_DENSE_DATA_H_

#include <cstdint>
#include <memory>
#include <vector>

namespace gradmesh {

struct DenseData {
  // Whether the chunk's data is here (a chunk with a codec keeps its payload in the message).
  bool present = false;
  int64_t bytes = 0;                // Length of ChunkData.data.
  std::unique_ptr<float[]> values;  // ceil(bytes / 4) floats: the bytes, then zero padding.
  const float* view = nullptr;      // Or, instead of `values`, bytes / 4 floats in the input.
  int64_t first_nonfinite = -1;     // Index of the first NaN/Inf among the whole floats, or -1.

  const float* data() const { return view != nullptr ? view : values.get(); }
};

// Indexed like PushRequest.chunks.
using DenseChunks = std::vector<DenseData>;

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_DENSE_DATA_H_
