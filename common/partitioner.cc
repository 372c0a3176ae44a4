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

absl::StatusOr<Partition> Partition::Create(const std::vector<int64_t>& tensor_numels,
                                            int64_t chunk_elems, int32_t num_shards) {
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
  // Largest first; stable on (tensor, chunk) because chunks_ is already in that order.
  std::vector<int64_t> order(p.chunks_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&p](int64_t a, int64_t b) { return p.chunks_[a].numel > p.chunks_[b].numel; });
  p.shard_elements_.assign(num_shards, 0);
  for (int64_t i : order) {
    int32_t best = 0;
    for (int32_t s = 1; s < num_shards; ++s) {
      if (p.shard_elements_[s] < p.shard_elements_[best]) best = s;
    }
    p.chunks_[i].shard = best;
    p.shard_elements_[best] += p.chunks_[i].numel;
  }
  p.shard_chunks_.assign(num_shards, {});
  for (size_t i = 0; i < p.chunks_.size(); ++i) {
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
