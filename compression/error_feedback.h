// Error feedback for biased codecs, with the two tricks of Deep Gradient Compression
// (Lin et al., ICLR 2018): momentum correction (with momentum factor masking) and an
// exponential warm-up of the density.
//
// One ErrorFeedback per compressed tensor (or chunk), kept by the worker across steps. Each
// step, Compress(codec, grad, seed, &payload):
//   plain (options.momentum == 0):
//     acc = grad + residual
//     payload = codec.Encode(acc, seed)
//     residual = acc - codec.Decode(payload)
//   momentum correction (options.momentum = m > 0; DGC Algorithm 1 with Eq. (6)):
//     u = m * u + grad          (the local momentum)
//     acc = residual + u        (DGC's v: the accumulated, not yet sent velocity)
//     payload = codec.Encode(acc, seed)
//     residual = acc - codec.Decode(payload)
//     and with options.momentum_masking (default): u[i] = 0 wherever the decoded payload is
//     non-zero (the "sent" coordinates; DGC's momentum factor masking). Note that a dense
//     codec, or a density of 1, then clears u everywhere: momentum only survives in the
//     coordinates that are not sent.
//     The momentum is applied here, so the shards must run plain SGD (momentum 0) on what
//     they receive.
// The payload is what the worker sends; the receiver decodes it with the same codec. Cost:
// one pass to accumulate, the encoding, then O(k) for a sparsifier (only the sent elements'
// residual changes) or a decode and one more pass for a dense codec.
//
// Mass conservation: residual = acc - decoded, and decoded[i] + residual[i] == acc[i] holds
// exactly in float arithmetic (IEEE ==, so a zero's sign may differ) whenever that
// subtraction is exact, which is the case when decoded[i] is 0, acc[i] itself, or acc[i]
// rounded to a narrower float format (Sterbenz's lemma). So nothing is lost or created, only
// delayed, for topk and topk_approx (also +fp16/+bf16), fp16 and bf16, with one exception:
// fp16 clamps |acc| > 65504 to 65504, and for |acc| >= 2^29 (5.4e8) acc - 65504 can round
// (for about 1 in 220 such values); then decoded + residual is one ulp of acc off and no
// float32 residual would do better. For codecs whose decoded value can be far from acc
// (randomk's scaled values, also with +fp16/+bf16, and qsgd; the unbiased ones need no error
// feedback) the difference rounds more often. last_inexact() counts the elements of the last
// step where decoded + residual != acc. (randomk with error feedback is unstable anyway: the
// residual of a sent element is -(n/k - 1) times its value.)

// Failure: Compress returns the codec's error (e.g. InvalidArgument for a NaN/Inf gradient,
// or a size mismatch) and then leaves the state unchanged.
//
// Warm-up: WarmupDensity(target, schedule, step) gives the density to use at each step (see
// below); for a sparsifier, codec.WithDensity(d) makes the codec for that step (cache it:
// the density changes only at stage boundaries). A receiver decodes payloads of any density
// with the codec of the target density (compression/compressor.h).
//
//   ErrorFeedbackOptions options;
//   options.momentum = 0.9f;
//   ErrorFeedback ef(chunk_elems, options);
//   std::unique_ptr<Compressor> step_codec = codec->WithDensity(codec->density()).value();
//   for (int64_t t = 0; ...; ++t) {
//     const double d = WarmupDensity(codec->density(), warmup, t);
//     if (d != step_codec->density()) step_codec = codec->WithDensity(d).value();
//     RETURN_IF_ERROR(ef.Compress(*step_codec, grad, Rng::Mix(seed, t), &payload));
//     ... send payload ...
//   }
//
// Thread safety: an ErrorFeedback is not thread-safe (one per tensor, used by one thread).
// WarmupDensity is pure.
#ifndef GRADMESH_COMPRESSION_ERROR_FEEDBACK_H_
#define GRADMESH_COMPRESSION_ERROR_FEEDBACK_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "compression/compressor.h"

namespace gradmesh {

struct ErrorFeedbackOptions {
  // DGC momentum correction coefficient m in [0, 1); 0 = plain error feedback.
  float momentum = 0.0f;
  // DGC momentum factor masking: clear the momentum of the coordinates that were sent.
  // Only used when momentum > 0.
  bool momentum_masking = true;
};

class ErrorFeedback {
 public:
  // For a tensor of `size` elements; residual (and momentum) start at zero. Check options
  // with ValidateErrorFeedbackOptions first (a bad momentum is treated as 0).
  explicit ErrorFeedback(size_t size, ErrorFeedbackOptions options = ErrorFeedbackOptions());

  // One step (see the top of this file). grad.size() must equal size(). *out receives the
  // payload.
  absl::Status Compress(const Compressor& codec, absl::Span<const float> grad, uint64_t seed,
                        std::string* out);

  size_t size() const { return residual_.size(); }
  const ErrorFeedbackOptions& options() const { return options_; }

  // What has been accumulated but not sent yet (DGC's v).
  absl::Span<const float> residual() const { return residual_; }
  // The momentum u (empty unless options.momentum > 0).
  absl::Span<const float> momentum() const { return momentum_; }
  // Elements of the last successful Compress where decoded + residual != acc in float
  // arithmetic (0 for topk, topk_approx, fp16, bf16 and their compositions unless fp16
  // clamped a value >= 2^29; see above).
  int64_t last_inexact() const { return last_inexact_; }

  // Zeroes the residual and momentum (e.g. after the model was reloaded).
  void Reset();

 private:
  ErrorFeedbackOptions options_;
  std::vector<float> residual_;
  std::vector<float> momentum_;
  // Scratch reused across steps: the accumulated vector, the next momentum, the decoding
  // (dense codecs) or the sent elements (sparsifiers).
  std::vector<float> acc_;
  std::vector<float> next_momentum_;
  std::vector<float> decoded_;
  std::vector<uint32_t> sent_indices_;
  std::vector<float> sent_values_;
  int64_t last_inexact_ = 0;
};

// InvalidArgument unless momentum is in [0, 1).
absl::Status ValidateErrorFeedbackOptions(const ErrorFeedbackOptions& options);

// DGC warm-up: `steps` W warm-up steps split into `stages` S stages of (nearly) equal length:
// step t < W is in stage j = floor(t * S / W). During stage j the density is
// target^((j + 1) / (S + 1)),
// so it falls exponentially from dense towards the target; from step W on it is the target.
// E.g. target 0.25^5 (~0.098%), S = 4: 25%, 6.25%, 1.5625%, 0.39%, then 0.098% (DGC's
// schedule over its first four epochs); target 0.001: 25.1%, 6.3%, 1.58%, 0.40%, then 0.1%.
struct WarmupSchedule {
  int64_t steps = 0;  // W; 0 = no warm-up
  int stages = 4;     // S >= 1
};

// The density at 0-based `step` for a codec whose density is `target` (in (0, 1]). Never
// below target. A schedule with steps <= 0 or stages < 1 means no warm-up.
double WarmupDensity(double target, const WarmupSchedule& schedule, int64_t step);

}  // namespace gradmesh

#endif  // GRADMESH_COMPRESSION_ERROR_FEEDBACK_H_
