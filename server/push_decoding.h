// Decoding and validation of the tensor data a shard receives (pushed gradients, InitJob's
// initial values), and the shard's cache of codecs by spec.
//
// Thread safety: the free functions are pure. CodecCache may be used from many threads at
// once (one internal mutex, a leaf lock: nothing is called while it is held except the
// cache's own map operations).
#ifndef GRADMESH_SERVER_PUSH_DECODING_H_
#define GRADMESH_SERVER_PUSH_DECODING_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/dense_data.h"
#include "compression/compressor.h"
#include "proto/gradmesh.pb.h"

namespace gradmesh {

// Thread safety: Get may be called concurrently (one leaf mutex).
// Codecs by spec ("fp16", "topk:0.01+bf16", ...), created from a registry on first use and
// kept (at most 64, so clients cannot grow it without bound with ever new specs).
class CodecCache {
 public:
  explicit CodecCache(const CompressorRegistry* registry) : registry_(registry) {}
  // The codec for `spec`; the registry's InvalidArgument if it is unknown.
  absl::StatusOr<std::shared_ptr<const Compressor>> Get(const std::string& spec)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const CompressorRegistry* const registry_;  // Not owned.
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Compressor>> codecs_ ABSL_GUARDED_BY(mu_);
};

// Checks that `c` holds exactly `numel` finite float32 values, raw (dtype FLOAT32 or unset, no
// codec); with `allow_infinite`, +-inf too (a buffer's initial values: a causal mask of -inf),
// never NaN. InvalidArgument prefixed by `where`.
absl::Status CheckDenseFloats(const ChunkData& c, int64_t numel, const std::string& where,
                              bool allow_infinite = false);

// Float view of validated raw float32 bytes (copied into `scratch` only if misaligned).
const float* FloatView(const std::string& data, std::vector<float>* scratch);

// The dense float32 gradient of a pushed chunk: its raw data (in `dense` when the transport
// decoded it there, which may be null; else in `c.data()`), or its payload decoded by the codec
// named in `c.codec()` into `scratch`; validated (dtype, length, codec, finiteness), with the
// same errors whichever holds the data. InvalidArgument prefixed by `where`.
absl::StatusOr<const float*> DecodePushedChunk(CodecCache& codecs, const ChunkData& c,
                                               const DenseData* dense, int64_t numel,
                                               const std::string& where,
                                               std::vector<float>* scratch);

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_PUSH_DECODING_H_
