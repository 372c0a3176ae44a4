// Gradient buckets and their overlapped all-reduce, as PyTorch DDP does it.
//
// AssignBuckets fuses parameters into buckets of about bucket_bytes in REVERSE parameter order
// (backward produces the last layers' gradients first). BucketReducer owns one flat float
// buffer per bucket and a communication thread: during backward the trainer hands each
// parameter's gradient to ParamReady (from a LibTorch gradient hook), which copies it into
// its bucket; a bucket whose gradients are all in is all-reduced on the communication thread
// at once, while backward goes on. Buckets are reduced in bucket order on every rank (so the
// collectives line up), each is then scaled by 1/n (the average). FinishStep zero-fills the
// gradients of parameters backward did not reach, launches what is left and waits.
//
// Per step the last bucket also carries `extras` (two floats the trainer sets before
// backward: a stop vote and the loss), summed but not scaled, so every rank learns whether
// any rank wants to stop and the mean loss, without an extra round trip.
//
// Thread safety: StartStep, ParamReady and FinishStep are called from the training thread
// (ParamReady from inside backward); the communication thread is internal. Gradients and
// extras are read only after FinishStep returned OK and before the next StartStep.
// Not LibTorch-dependent on purpose.
#ifndef GRADMESH_WORKER_ALLREDUCE_BUCKET_REDUCER_H_
#define GRADMESH_WORKER_ALLREDUCE_BUCKET_REDUCER_H_

#include <array>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "worker/allreduce/collective.h"

namespace gradmesh {

struct GradBucket {
  std::vector<int> params;  // Parameter indices, in the order they sit in the bucket.
  int64_t elements = 0;     // Sum of their sizes.
};

// Buckets of consecutive parameters taken from the last to the first; a bucket is closed
// once it holds >= bucket_bytes (so one large parameter makes a bucket of its own).
// bucket_bytes <= 0 puts everything in one bucket. Every parameter is in exactly one bucket.
std::vector<GradBucket> AssignBuckets(const std::vector<int64_t>& numels, int64_t bucket_bytes);

class BucketReducer {
 public:
  static constexpr int kExtras = 2;

  // `collective` (not owned) must outlive the reducer. Starts the communication thread.
  BucketReducer(Collective* collective, const std::vector<int64_t>& numels,
                int64_t bucket_bytes);
  ~BucketReducer();  // Stops the thread (after the bucket in flight, if any).
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;

  // Begins a step: every parameter becomes pending; `extras` ride on the last bucket.
  void StartStep(std::array<float, kExtras> extras);

  // Copies parameter `param`'s gradient (`n` floats, its numel) into its bucket; launches the
  // bucket when complete. A second call for the same parameter in one step adds to the
  // first (a parameter used twice).
  void ParamReady(int param, const float* grad, int64_t n);

  // Launches the rest (zeros for parameters without a gradient), waits for every bucket.
  // Returns the collective's first error (annotated with the bucket).
  absl::Status FinishStep();

  // After FinishStep: the averaged gradient of `param`, and the summed extras.
  absl::Span<const float> grad(int param) const;
  std::array<float, kExtras> extras() const;

  const std::vector<GradBucket>& buckets() const { return buckets_; }
  double comm_seconds() const;  // Time the communication thread spent in collectives.

 private:
  void CommLoop();

  Collective* const collective_;
  std::vector<GradBucket> buckets_;
  std::vector<std::vector<float>> flat_;  // Per bucket (+ kExtras floats for the last).
  std::vector<int> bucket_of_;            // Per parameter.
  std::vector<int64_t> offset_;           // Per parameter, within its bucket.
  std::vector<int64_t> numel_;

  // Training thread only.
  std::vector<bool> seen_;
  std::vector<int> missing_;  // Per bucket: parameters still to come.

  mutable absl::Mutex mu_;
  int launched_ ABSL_GUARDED_BY(mu_) = 0;  // Buckets [0, launched_) may be reduced.
  int reduced_ ABSL_GUARDED_BY(mu_) = 0;   // Buckets [0, reduced_) are done.
  std::vector<bool> ready_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  double comm_s_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_BUCKET_REDUCER_H_
