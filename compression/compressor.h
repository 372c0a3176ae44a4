// Gradient compression codecs.
//
// A Compressor turns a float32 vector into a self-describing byte payload (layout:
// compression/payload.h) and back. Codecs are created by spec string from a
// CompressorRegistry value:
//
//   spec   := codec | sparsifier '+' values
//   identity             float32 as is (validated; the baseline)
//   fp16, bf16           16-bit floats, round to nearest even, clamped to the format's largest
//                        finite value (compression/float16.h)
//   topk:<ratio>         the k = SparseCount(n, ratio) largest magnitudes, exactly; ties go to
//                        the lower index (compression/select.h)
//   topk_approx:<ratio>  every element above a threshold estimated from a seeded sample:
//                        about k (relative sd ~6%), never more than 2k, never a zero; exact
//                        top-k on small inputs (compression/select.h)
//   randomk:<ratio>      k distinct uniformly random indices (seeded), values scaled by n/k,
//                        so E[decode] = input (unbiased)
//   qsgd:<bits>          QSGD (Alistarh et al. 2017): each element becomes sign and a level
//                        l in [0, s], s = 2^bits - 1, rounded stochastically (seeded) so that
//                        E[l] = s |x| / ||x||_2; decode is sign * ||x||_2 * l / s (unbiased, up
//                        to float32 rounding of s|x|/||x|| and 2^-24 of a level); ||x||_2 is
//                        sent as float32 (rounded up); bits in [1, 8]
//   sparsifier+values    a sparsifier (topk, topk_approx, randomk) whose selected values are
//                        sent as fp16 or bf16, e.g. "topk:0.01+fp16"
// <ratio> is a decimal in (0, 1]. Sparse payloads carry the indices as delta varints or a
// bitmap, whichever is smaller (none when all elements are sent).
//
// Contracts shared by every codec:
//   * Encode requires finite input (NaN/Inf -> InvalidArgument naming the first bad element)
//     and replaces *out (reusing its buffer: keep the string between steps to avoid
//     reallocating); on error *out is unspecified. Sparse codecs handle at most 2^32 - 1
//     elements.
//   * Decode validates the whole payload (header, codec, element count == out.size(), lengths,
//     indices, every value finite) and returns InvalidArgument with a message naming the
//     problem otherwise; it never reads outside `in` nor writes outside `out`. On success it
//     writes every element of out (zero where a sparse codec sent nothing); on error the
//     contents of out are unspecified.
//   * DecodeAdd adds the decoded vector to out (a sparse codec touches only the elements it
//     sent) and leaves out unchanged on error (it validates before it writes).
//   * Stochastic codecs (randomk, qsgd, topk_approx's sample) take all randomness from the
//     `seed` argument: the payload is a function of (codec, input, seed). Give each
//     (tensor, step, worker) its own seed, e.g. from Rng::Mix(job_seed, ...)
//     (compression/rng.h); deterministic codecs ignore it.
//   * A payload can be decoded by any Compressor of the same kind (same codec id and value
//     type) whatever its ratio or bit count: a receiver does not need to know the sender's
//     warm-up density.
//   * Speed (one thread, 25M floats; tests/bench/compression.cc): fp16/bf16/identity run at
//     memory speed, topk ~25x and topk_approx ~20-30x faster than torch.topk.
//
// Thread safety: Compressor methods are const and safe to call concurrently.
// CompressorRegistry is not thread-safe while being modified; Create() is const.
#ifndef GRADMESH_COMPRESSION_COMPRESSOR_H_
#define GRADMESH_COMPRESSION_COMPRESSOR_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/registry.h"

namespace gradmesh {

class Compressor {
 public:
  virtual ~Compressor() = default;

  // The canonical spec, e.g. "topk:0.01+fp16"; CompressorRegistry::Create(name()) makes an
  // equivalent codec.
  virtual std::string name() const = 0;

  // True when E[decode(encode(x))] != x, i.e. the codec needs error feedback (topk,
  // topk_approx, fp16, bf16 and compositions); false for identity, randomk and qsgd.
  virtual bool biased() const = 0;

  // True when Encode's result depends on `seed`.
  virtual bool stochastic() const = 0;

  // Fraction of the elements a sparsifier sends (its ratio); 1 for dense codecs.
  virtual double density() const { return 1.0; }

  // Encodes `in` into *out (see the contracts above; `seed` only matters if stochastic()).
  virtual absl::Status Encode(absl::Span<const float> in, uint64_t seed,
                              std::string* out) const = 0;

  // Writes the decoded payload to out, which must have the original length.
  virtual absl::Status Decode(absl::string_view in, absl::Span<float> out) const = 0;

  // out += the decoded payload; all-or-nothing.
  virtual absl::Status DecodeAdd(absl::string_view in, absl::Span<float> out) const = 0;

  // The payload's elements as sent: ascending indices and their decoded values, validated
  // like Decode (n is the original length; replaces both vectors). Dense codecs list every
  // index. Lets a consumer of a sparse payload work in O(k) instead of O(n) (ErrorFeedback
  // does). The default decodes densely; at most 2^32 - 1 elements.
  virtual absl::Status DecodeSparse(absl::string_view in, size_t n, std::vector<uint32_t>* indices,
                                    std::vector<float>* values) const;

  // An upper bound of the payload size for n elements (exact for dense codecs and qsgd).
  virtual size_t MaxEncodedSize(size_t n) const = 0;

  // The same codec with another density (sparsifiers only; e.g. for DGC warm-up, see
  // compression/error_feedback.h). InvalidArgument for dense codecs or a density outside
  // (0, 1].
  virtual absl::StatusOr<std::unique_ptr<Compressor>> WithDensity(double density) const;

  // This codec with its values sent by `values` (the '+' of specs). Sparsifiers accept
  // fp16 and bf16; everything else is InvalidArgument.
  virtual absl::StatusOr<std::unique_ptr<Compressor>> ComposeWith(const Compressor& values) const;
};

// k = max(1, ceil(ratio * n)), at most n (0 when n == 0). ratio * n is rounded to the nearest
// integer first when it is within 1e-9 of one, so that e.g. 0.07 * 100 gives 7, not 8.
int64_t SparseCount(int64_t n, double ratio);

class CompressorRegistry {
 public:
  // Makes a codec from the text after "name:" (empty when the spec has no ':').
  using Factory =
      std::function<absl::StatusOr<std::unique_ptr<Compressor>>(absl::string_view param)>;

  // A registry holding identity, fp16, bf16, topk, topk_approx, randomk and qsgd.
  static CompressorRegistry WithBuiltins();

  // Adds or replaces a factory.
  void Register(const std::string& name, Factory factory);

  // Parses a spec (see the top of this file). InvalidArgument for an unknown name ("unknown
  // codec \"x\" (known: bf16, fp16, ...)"), a bad parameter, or an invalid composition.
  absl::StatusOr<std::unique_ptr<Compressor>> Create(absl::string_view spec) const;

  std::vector<std::string> names() const;

 private:
  NamedRegistry<Factory> factories_{"codec"};
};

// A job spec's compression.push checked against the built-in codecs (ValidateJobSpec, in
// common/, cannot link them): OK for "" (dense) and "auto" (the worker's choice), otherwise
// InvalidArgument "job spec: compression.push: \"<spec>\" <why>" when Create refuses it. The
// CLI checks it before submitting, the coordinator when it takes the job.
absl::Status ValidatePushCodec(const std::string& push);

}  // namespace gradmesh

#endif  // GRADMESH_COMPRESSION_COMPRESSOR_H_
