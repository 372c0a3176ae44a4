// Gradient buckets and their overlapped all-reduce, as PyTorch DDP does it.
//
// AssignBuckets fuses parameters into buckets of about bucket_bytes in REVERSE parameter order
// (backward produces the last layers' gradients first). BucketReducer owns one flat float
// buffer per bucket and a communication thread: during backward the trainer hands each
// parameter's gradient to ParamReady (from a LibTorch gradient hook), which copies it into
// its bucket; a bucket whose gradients are all in is all-reduced on the communication thread
// at once, while backward goes on. Buckets are reduced in bucket order on every rank (so the
// collectives line up) and averaged (scaled by 1/n). FinishStep zero-fills the gradients of
// parameters backward did not reach, launches what is left and waits. Its streaming form
// hands the averaged gradient over piece by piece as soon as each piece is final (a ring
// segment of a bucket, cut at parameter boundaries), so the trainer applies the optimizer to
// one piece while the next is still on the wire: the update overlaps the communication, and
// with it the last bucket's all-reduce (the first layer's gradient, which backward produces
// last) is no longer followed by a full optimizer pass.
//
// Buffers (BatchNorm running statistics, ...; see ModelView) ride along: entries
// [num_params, size) of `numels` are the buffers' per-step deltas, which the trainer hands to
// ParamReady after backward (in Exchange). They get bucket(s) of their own AFTER every
// parameter bucket, so a buffer never holds back a parameter bucket: the parameters' buckets
// still overlap backward, and the buffers' all-reduce follows the last of them.
//
// Per step the last bucket also carries `extras` (two floats the trainer sets before
// backward: a stop vote and the loss), summed but not scaled, so every rank learns whether
// any rank wants to stop and the mean loss, without an extra round trip.
//
// Thread safety: StartStep, ParamReady and FinishStep are called from the training thread
// (ParamReady from inside backward); the communication thread is internal, and the streaming
// FinishStep's callback runs on the training thread. Gradients and extras are read only
// after FinishStep returned OK and before the next StartStep.
// Not LibTorch-dependent on purpose.
#ifndef GRADMESH_WORKER_ALLREDUCE_BUCKET_REDUCER_H_
#define GRADMESH_WORKER_ALLREDUCE_BUCKET_REDUCER_H_

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "worker/allreduce/collective.h"

namespace gradmesh {

struct GradBucket {
  std::vector<int> params;  // Entry indices, in the order they sit in the bucket.
  int64_t elements = 0;     // Sum of their sizes.
};

// Buckets of consecutive parameters [0, num_params) taken from the last to the first; a
// bucket is closed once it holds >= bucket_bytes (so one large parameter makes a bucket of its
// own). Then the buffers [num_params, numels.size()), first to last, in buckets of their own
// formed by the same rule. bucket_bytes <= 0 puts all parameters in one bucket (and all
// buffers in one more). num_params < 0 or > numels.size(): every entry is a parameter.
// Every entry is in exactly one bucket.
std::vector<GradBucket> AssignBuckets(const std::vector<int64_t>& numels, int64_t bucket_bytes,
                                      int num_params = -1);

class BucketReducer {
 public:
  static constexpr int kExtras = 2;

  // `collective` (not owned) must outlive the reducer. `numels`: every entry's size, the
  // parameters [0, num_params) then the buffers (num_params < 0: no buffers). Starts the
  // communication thread.
  BucketReducer(Collective* collective, const std::vector<int64_t>& numels, int64_t bucket_bytes,
                int num_params = -1);
  ~BucketReducer();  // Stop().

  // Stops the communication thread after the bucket in flight, if any; no collective is
  // started afterwards. Idempotent. Lets the owner close the collective (whose transport may
  // still reference the buckets after a failed all-reduce) before the buckets are freed.
  void Stop();
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;

  // Begins a step: every parameter becomes pending; `extras` ride on the last bucket.
  void StartStep(std::array<float, kExtras> extras);

  // Copies entry `param`'s gradient (`n` floats, its numel; for a buffer: its delta) into its
  // bucket; launches the bucket when complete. A second call for the same entry in one step
  // adds to the first (a parameter used twice).
  void ParamReady(int param, const float* grad, int64_t n);

  // Launches the rest (zeros for parameters without a gradient), waits for every bucket.
  // Returns the collective's first error (annotated with the bucket).
  absl::Status FinishStep();

  // Elements [begin, begin + grad.size()) of parameter `param`'s averaged gradient. `grad`
  // is valid only during the call.
  using PieceFn = std::function<void(int param, int64_t begin, absl::Span<const float> grad)>;

  // Like FinishStep, but calls `on_piece` (on this thread) for each piece of the averaged
  // gradient as soon as it is final, while later pieces are still being reduced. If it
  // returns OK, every element of every parameter was handed over exactly once (in no
  // particular order); after an error some were not. grad() is not valid after this form
  // (the buckets hold sums); extras() is.
  absl::Status FinishStep(const PieceFn& on_piece);

  // After FinishStep(): the averaged gradient of `param`. After either form: the summed
  // extras.
  absl::Span<const float> grad(int param) const;
  std::array<float, kExtras> extras() const;

  const std::vector<GradBucket>& buckets() const { return buckets_; }
  double comm_seconds() const;  // Time the communication thread spent in collectives.

 private:
  void CommLoop();
  // Launches every bucket not launched yet (zeros for parameters without a gradient).
  void LaunchRest();
  // Hands bucket `b`'s final elements [begin, end) to `on_piece`, parameter by parameter,
  // averaged through scratch_.
  void DeliverPiece(int b, int64_t begin, int64_t end, const PieceFn& on_piece);

  struct FinalRange {
    int bucket;
    int64_t begin, end;
  };

  Collective* const collective_;
  std::vector<GradBucket> buckets_;
  std::vector<std::vector<float>> flat_;  // Per bucket (+ kExtras floats for the last).
  std::vector<int> bucket_of_;            // Per parameter.
  std::vector<int64_t> offset_;           // Per parameter, within its bucket.
  std::vector<int64_t> numel_;

  // Training thread only.
  std::vector<bool> seen_;
  std::vector<int> missing_;    // Per bucket: parameters still to come.
  std::vector<float> scratch_;  // Averaged piece handed to a PieceFn.

  mutable absl::Mutex mu_;
  int launched_ ABSL_GUARDED_BY(mu_) = 0;  // Buckets [0, launched_) may be reduced.
  int reduced_ ABSL_GUARDED_BY(mu_) = 0;   // Buckets [0, reduced_) are done.
  std::vector<bool> ready_ ABSL_GUARDED_BY(mu_);
  std::deque<FinalRange> final_ ABSL_GUARDED_BY(mu_);  // Reduced, not yet handed over.
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  double comm_s_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_BUCKET_REDUCER_H_
