// PullEncoder: how one job's chunks are encoded for Pull: dense float32 (PullRequest.codec
// ""), narrowed to fp16 / bf16, or "changes" (compression/changes.h): per chunk and worker it
// remembers the values it last sent that worker and their version (in memory only); when the
// worker names that version, only the entries that differ are sent, else (first pull, a lost
// response, a shard restart, or when changes are not smaller) the chunk goes dense and becomes
// what the worker holds.
//
// Memory: the copies remembered for "changes" are reserved from the shard's MemoryBudget as
// they are first made (one chunk for one worker at a time) and released with the encoder. When
// the budget has no room, the chunk is sent dense and not remembered, so that worker keeps
// getting it dense: correct, only larger.
//
// Thread safety: Encode may be called concurrently for any chunks and workers; each chunk's
// record of what was sent has its own mutex. Callers hold the chunk's lock (Chunk::mu) while
// encoding it, so the values and version cannot change meanwhile: lock order Chunk::mu, then
// the record's mutex (a leaf).
#ifndef GRADMESH_SERVER_PULL_ENCODER_H_
#define GRADMESH_SERVER_PULL_ENCODER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "compression/compressor.h"
#include "proto/gradmesh.pb.h"
#include "server/push_decoding.h"
#include "server/shard_limits.h"

namespace gradmesh {

// The encoding one Pull asked for.
struct PullFormat {
  enum class Kind { kDense, kNarrow, kChanges };
  Kind kind = Kind::kDense;
  std::string codec;                             // PullRequest.codec.
  std::shared_ptr<const Compressor> compressor;  // kNarrow: the fp16/bf16 codec.
};

// Thread safety: Encode may be called concurrently; the caller holds the chunk's Chunk::mu,
// Encode then takes that chunk's record lock (a leaf). One job's pull encodings.
class PullEncoder {
 public:
  // Chunks are the partition indices of the chunks the job owns on this shard. `budget` (not
  // owned, may be null: no limit) must outlive the encoder.
  PullEncoder(int32_t num_workers, absl::Span<const int64_t> chunks,
              MemoryBudget* budget = nullptr);
  ~PullEncoder();

  PullEncoder(const PullEncoder&) = delete;
  PullEncoder& operator=(const PullEncoder&) = delete;

  // The format of PullRequest.codec `codec` of job `job`: "" dense, "fp16" / "bf16" (from
  // `codecs`), "changes"; anything else (parameters are never sparsified or randomised) is
  // InvalidArgument "Pull: job J codec \"X\" is not one of \"\", fp16, bf16, changes".
  static absl::StatusOr<PullFormat> ParseFormat(const std::string& job, const std::string& codec,
                                                CodecCache& codecs);

  // Writes the values of owned chunk `chunk` (at `version`) for `worker`, who holds version
  // `held_version` of it (-1: unknown), into out->data() and sets out->codec() ("" dense,
  // the narrow codec's name, "changes"). Only the codec's error for kNarrow.
  absl::Status Encode(const PullFormat& format, int64_t chunk, int32_t worker, int64_t held_version,
                      absl::Span<const float> values, int64_t version, ChunkData* out);

 private:
  // What one chunk was last sent to each worker (allocated on its first "changes" pull).
  struct Sent {
    absl::Mutex mu;
    std::vector<std::vector<float>> values ABSL_GUARDED_BY(mu);  // Per worker.
    std::vector<int64_t> version ABSL_GUARDED_BY(mu);            // Per worker; -1: none.
  };
  void EncodeChanges(Sent* sent, int32_t worker, int64_t held_version,
                     absl::Span<const float> values, int64_t version, ChunkData* out);

  const int32_t num_workers_;
  MemoryBudget* const budget_;
  std::atomic<int64_t> reserved_{0};  // Bytes of remembered copies reserved from budget_.
  // Keyed by partition index; the map is immutable after construction.
  absl::flat_hash_map<int64_t, std::unique_ptr<Sent>> sent_;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_PULL_ENCODER_H_
