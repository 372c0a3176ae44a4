// Deterministic partitioning of a job's tensors into chunks and of chunks onto shards.
//
// Every tensor is cut into chunks of `chunk_elems` elements (the last one may be shorter).
// Chunks are then placed on shards by one of two placements:
//   kGreedy  largest first (ties: tensor index, then chunk index), each on the shard holding
//            the fewest elements so far (ties: lowest shard index). The most and least loaded
//            shards differ by at most one chunk (<= chunk_elems elements).
//   kOrdered in (tensor, chunk) order, as contiguous ranges: a chunk whose elements start at
//            offset o of the model's E elements (all tensors laid end to end) and end at
//            o + n goes to shard floor((o + n/2) * S / E), the shard whose 1/S of the model
//            holds the chunk's middle. Shard indices never decrease along the model, and each
//            shard holds its 1/S to within one chunk. Backward produces the last layers'
//            gradients first, so the last shards get all of theirs early (JobSpec.overlap).
// The result depends only on (tensor sizes, chunk_elems, num_shards, placement), so workers
// and servers that build a Partition from the same layout agree on every chunk's owner.
//
// Thread safety: immutable after Create(); safe to share.
#ifndef GRADMESH_COMMON_PARTITIONER_H_
#define GRADMESH_COMMON_PARTITIONER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace gradmesh {

struct ChunkInfo {
  int32_t tensor = 0;  // Index of the tensor in the layout.
  int32_t chunk = 0;   // Index of the chunk within the tensor.
  int64_t offset = 0;  // First element of the chunk within the tensor.
  int64_t numel = 0;   // Elements in the chunk (> 0).
  int32_t shard = 0;   // Owning shard.
};

// Bounds of AutoChunkElems, in float32 elements (64 KiB and 1 MiB).
inline constexpr int64_t kMinAutoChunkElems = int64_t{1} << 14;
inline constexpr int64_t kMaxAutoChunkElems = int64_t{1} << 18;

// The chunk size a job gets when its spec leaves chunk_bytes at 0 (auto): with one shard,
// kMaxAutoChunkElems (1 MiB, the fixed default before auto existed); otherwise the total size
// over 8 chunks per shard, rounded up to a multiple of 1024 elements and clamped to
// [kMinAutoChunkElems, kMaxAutoChunkElems]. Greedy placement then keeps every shard within one
// chunk (about 1/8 of its share, or 1 MiB for large jobs) of the others, where one chunk per
// large tensor could leave e.g. a 784-256-256-10 MLP 75/25 across 2 shards. Depends only on
// the sizes and the shard count, so every worker derives the same value.
int64_t AutoChunkElems(const std::vector<int64_t>& tensor_numels, int32_t num_shards);

// Values as the proto's Placement (PLACEMENT_GREEDY = 0, PLACEMENT_ORDERED = 1).
enum class ChunkPlacement { kGreedy = 0, kOrdered = 1 };

class Partition {
 public:
  // InvalidArgument if chunk_elems <= 0, num_shards <= 0, a size is negative, or a tensor
  // would need more than 2^31 chunks.
  static absl::StatusOr<Partition> Create(const std::vector<int64_t>& tensor_numels,
                                          int64_t chunk_elems, int32_t num_shards,
                                          ChunkPlacement placement = ChunkPlacement::kGreedy);

  int32_t num_shards() const { return num_shards_; }
  int64_t chunk_elems() const { return chunk_elems_; }
  int32_t num_tensors() const { return static_cast<int32_t>(first_chunk_.size()); }
  int64_t tensor_numel(int32_t t) const { return tensor_numels_[t]; }
  int32_t num_chunks(int32_t tensor) const;

  // All chunks, ordered by (tensor, chunk).
  const std::vector<ChunkInfo>& chunks() const { return chunks_; }
  // Index into chunks() of (tensor, chunk), or -1 if there is no such chunk.
  int64_t Find(int32_t tensor, int32_t chunk) const;
  // Indices into chunks() of the chunks owned by `shard`, ordered by (tensor, chunk).
  const std::vector<int64_t>& shard_chunks(int32_t shard) const { return shard_chunks_[shard]; }
  // Elements owned by `shard`.
  int64_t shard_elements(int32_t shard) const { return shard_elements_[shard]; }

 private:
  Partition() = default;

  int32_t num_shards_ = 0;
  int64_t chunk_elems_ = 0;
  std::vector<int64_t> tensor_numels_;
  std::vector<int64_t> first_chunk_;  // Index in chunks_ of each tensor's chunk 0.
  std::vector<ChunkInfo> chunks_;
  std::vector<std::vector<int64_t>> shard_chunks_;
  std::vector<int64_t> shard_elements_;
};

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_PARTITIONER_H_
