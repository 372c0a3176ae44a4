#include "common/partitioner.h"

#include <algorithm>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace gradmesh {

int64_t AutoChunkElems(const std::vector<int64_t>& tensor_numels, int32_t num_shards) {
  if (num_shards <= 1) return kMaxAutoChunkElems;
  int64_t total = 0;
  for (int64_t n : tensor_numels) total += std::max<int64_t>(n, 0);
  const int64_t chunks = int64_t{8} * num_shards;
  int64_t elems = (total + chunks - 1) / chunks;
  elems = (elems + 1023) / 1024 * 1024;
  return std::clamp(elems, kMinAutoChunkElems, kMaxAutoChunkElems);
}

namespace {

// kGreedy: largest first onto the least loaded shard. Fills each chunk's shard.
void PlaceGreedy(int32_t num_shards, std::vector<ChunkInfo>* chunks) {
  // Largest first; stable on (tensor, chunk) because chunks are already in that order.
  std::vector<int64_t> order(chunks->size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [chunks](int64_t a, int64_t b) {
    return (*chunks)[a].numel > (*chunks)[b].numel;
  });
  std::vector<int64_t> load(num_shards, 0);
  for (int64_t i : order) {
    int32_t best = 0;
    for (int32_t s = 1; s < num_shards; ++s) {
      if (load[s] < load[best]) best = s;
    }
    (*chunks)[i].shard = best;
    load[best] += (*chunks)[i].numel;
  }
}

// kOrdered: the shard whose 1/S of the model holds the chunk's middle.
void PlaceOrdered(int32_t num_shards, std::vector<ChunkInfo>* chunks) {
  int64_t total = 0;
  for (const ChunkInfo& c : *chunks) total += c.numel;
  // Doubled to keep the middle an integer; 128-bit so that 2 * E * S cannot overflow.
  int64_t start = 0;
  for (ChunkInfo& c : *chunks) {
    const __int128 middle2 = static_cast<__int128>(2) * start + c.numel;
    const __int128 shard = middle2 * num_shards / (static_cast<__int128>(2) * total);
    c.shard = static_cast<int32_t>(std::min<__int128>(shard, num_shards - 1));
    start += c.numel;
  }
}

}  // namespace

absl::StatusOr<Partition> Partition::Create(const std::vector<int64_t>& tensor_numels,
                                            int64_t chunk_elems, int32_t num_shards,
                                            ChunkPlacement placement) {
  if (chunk_elems <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("chunk_elems must be > 0, got ", chunk_elems));
  }
  if (num_shards <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_shards must be > 0, got ", num_shards));
  }
  Partition p;
  p.num_shards_ = num_shards;
  p.chunk_elems_ = chunk_elems;
  p.tensor_numels_ = tensor_numels;
  for (size_t t = 0; t < tensor_numels.size(); ++t) {
    const int64_t n = tensor_numels[t];
    if (n < 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", t, " has negative size ", n));
    }
    const int64_t num_chunks = (n + chunk_elems - 1) / chunk_elems;
    if (num_chunks > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", t, " needs ", num_chunks, " chunks; raise chunk_elems"));
    }
    p.first_chunk_.push_back(static_cast<int64_t>(p.chunks_.size()));
    for (int64_t c = 0; c < num_chunks; ++c) {
      ChunkInfo info;
      info.tensor = static_cast<int32_t>(t);
      info.chunk = static_cast<int32_t>(c);
      info.offset = c * chunk_elems;
      info.numel = std::min(chunk_elems, n - info.offset);
      p.chunks_.push_back(info);
    }
  }
  if (placement == ChunkPlacement::kOrdered) {
    PlaceOrdered(num_shards, &p.chunks_);
  } else {
    PlaceGreedy(num_shards, &p.chunks_);
  }
  p.shard_elements_.assign(num_shards, 0);
  p.shard_chunks_.assign(num_shards, {});
  for (size_t i = 0; i < p.chunks_.size(); ++i) {
    p.shard_elements_[p.chunks_[i].shard] += p.chunks_[i].numel;
    p.shard_chunks_[p.chunks_[i].shard].push_back(static_cast<int64_t>(i));
  }
  return p;
}

int32_t Partition::num_chunks(int32_t tensor) const {
  const int64_t end =
      tensor + 1 < num_tensors() ? first_chunk_[tensor + 1] : static_cast<int64_t>(chunks_.size());
  return static_cast<int32_t>(end - first_chunk_[tensor]);
}

int64_t Partition::Find(int32_t tensor, int32_t chunk) const {
  if (tensor < 0 || tensor >= num_tensors() || chunk < 0 || chunk >= num_chunks(tensor)) {
    return -1;
  }
  return first_chunk_[tensor] + chunk;
}

}  // namespace gradmesh
