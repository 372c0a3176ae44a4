// BackwardOverlap: a ps step's exchange started during backward (JobSpec.overlap: 1).
//
// Backward produces gradients from the last layer to the first. Each shard's part of the
// step (its chunks' push, fused with their pull: ParameterClient::PushPullShards) leaves on a
// background thread as soon as backward has produced every gradient that shard holds, while
// backward goes on with the earlier layers (the buffers' deltas come before backward, after
// the step's last forward); the shards that are not ready by then (the one holding the first
// layer) go from the training thread when backward is done, in parallel with those in
// flight. The shards' ledgers see one push per worker, step and shard, as without overlap.
// With placement "ordered" (contiguous ranges of the model, common/partitioner.h) the last
// shards hold the last layers and are ready first; with "greedy" every shard usually holds
// part of the first layer, and nothing leaves early.
//
// Pulled values land in a staging copy of the model (backward may still read the
// parameters) and are copied into the model once every shard answered. The staging copy is
// what the client last pulled, as "changes" pulls need.
//
// Deferred (JobSpec overlap: 2, BytePS's priority scheduling): Finish sends the rest on a
// second thread and returns at once, so the next step's forward can start while the later
// layers' answers are still on their way. AwaitEntries (the forward, layer by layer, first
// layers first) waits only for the shards holding the entries it names and copies those
// entries into the model; Settle waits for the whole step. Every entry is copied once per
// step, before anything reads it.
//
// Per step: BeginStep (before backward), OnGradient for every parameter (during backward, in
// any order, each once), then Finish or Abort; deferred, then AwaitEntries (any number) and
// Settle (BeginStep, Abort and the destructor settle a step left open).
//
// Thread safety: one step at a time; OnGradient may run on LibTorch's autograd thread while
// the training thread waits in backward. The background thread reads the gradient copies of
// the shards it sends and writes their chunks of the staging copy; the training thread, the
// other chunks.
#ifndef GRADMESH_WORKER_PS_BACKWARD_OVERLAP_H_
#define GRADMESH_WORKER_PS_BACKWARD_OVERLAP_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/background_task.h"
#include "worker/core/parameter_client_interface.h"
#include "worker/core/training_mode.h"

namespace gradmesh {

class BackwardOverlap {
 public:
  // What the steps so far did (the timeline of the progress lines).
  struct Totals {
    int64_t steps = 0;
    // Shards holding chunks: sent by the background thread (as backward produced their
    // gradients, or just after it, before the exchange began), and all.
    int64_t shards_early = 0;
    int64_t shards_total = 0;
    // Sends in flight while backward still ran (deferred: the step's exchange, from its
    // first send to its last answer, less exposed_s).
    double hidden_s = 0;
    // From the end of backward to the step's last answer (deferred: the time AwaitEntries and
    // Settle waited for answers).
    double exposed_s = 0;
  };

  // `client` and `model` outlive this object; `model` holds the values the client last
  // pulled (the staging copy starts from them). `deferred`: see above.
  BackwardOverlap(ParameterClient* client, ModelView* model, bool deferred = false);
  ~BackwardOverlap();
  BackwardOverlap(const BackwardOverlap&) = delete;
  BackwardOverlap& operator=(const BackwardOverlap&) = delete;

  // Before backward of `step`.
  absl::Status BeginStep(int64_t step);

  // Entry `param`'s gradient (a parameter's, or a buffer's delta; copied); starts the sends
  // of the shards it completes. Once per entry and step (a repeat is ignored).
  void OnGradient(int param, absl::Span<const float> grad);

  // After backward: sends the shards not sent yet, from the same copies as the others (an
  // entry never produced is taken from `grads`, every entry of the model: parameters, then
  // buffer deltas), waits for all, and copies the pulled values into the model. The
  // first error of any send (then the model is not written, and after a failed background
  // send the shards not sent yet are not sent). A step that fails part-way may have been
  // applied on some shards only, as a failed PushPull may: a retry of the step (a resumed
  // worker) is a duplicate there and applied on the others.
  // Deferred: starts those sends and returns without waiting (the error of a background
  // send that already failed; later ones come from AwaitEntries and Settle).
  absl::Status Finish(absl::Span<const absl::Span<const float>> grads);

  // Deferred: waits until every shard holding a chunk of entries [begin, end) answered the
  // step, copies those entries' pulled values into the model (each once per step), and
  // returns OK, or the first error of the step's sends (then nothing more is copied; the
  // run is over). OK at once when no step is open. Clamped to the model's entries.
  absl::Status AwaitEntries(int begin, int end);

  // Waits for every send of an open step and copies what AwaitEntries has not; the first
  // error of its sends. OK at once when no step is open (overlap: 1 never leaves one).
  absl::Status Settle();

  // Backward failed: waits for the sends in flight and discards the step.
  void Abort();

  Totals totals() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return totals_;
  }

 private:
  // The background half: sends batches of ready shards until the step is closed.
  absl::Status SendReady();
  // Sends `shards` (one call), then records the send and its answers.
  absl::Status Send(int64_t step, std::vector<int32_t> shards) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether every shard holding entries [begin, end) answered, or a send failed.
  bool AnsweredLocked(int begin, int end) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds the closed step to totals_ (`waited_s`: the training thread's wait for it).
  void CountStepLocked(absl::Time closed_at, double waited_s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  ParameterClient* const client_;
  ModelView* const model_;
  const bool deferred_;
  const int num_shards_;
  const int num_entries_;                            // Parameters and buffers.
  std::vector<std::vector<int32_t>> tensor_shards_;  // Shards holding each entry's chunks.
  std::vector<int32_t> shard_tensors_;               // Entries each shard holds (counts).
  int64_t held_shards_ = 0;                          // Shards holding any entry.
  std::vector<std::vector<float>> grads_;            // Copies of the entries' gradients.
  std::vector<std::vector<float>> staging_;          // The pull target.

  mutable absl::Mutex mu_;
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int32_t> waiting_ ABSL_GUARDED_BY(mu_);  // Per shard: entries not produced.
  std::vector<bool> produced_ ABSL_GUARDED_BY(mu_);    // Per entry: OnGradient came.
  std::vector<int32_t> ready_ ABSL_GUARDED_BY(mu_);    // Complete, not yet taken.
  std::vector<bool> taken_ ABSL_GUARDED_BY(mu_);       // Per shard: sent (or being sent).
  bool closed_ ABSL_GUARDED_BY(mu_) = false;           // Finish/Abort took the rest.
  bool failed_ ABSL_GUARDED_BY(mu_) = false;           // A send failed.
  absl::Status failure_ ABSL_GUARDED_BY(mu_);          // The first failed send's status.
  std::vector<bool> answered_ ABSL_GUARDED_BY(mu_);    // Per shard: its send succeeded.
  absl::CondVar answer_cv_;                            // answered_ or failed_ changed.
  // The background sends of the step: (start, end) of each.
  std::vector<std::pair<absl::Time, absl::Time>> sends_ ABSL_GUARDED_BY(mu_);
  int64_t early_ ABSL_GUARDED_BY(mu_) = 0;

  Totals totals_ ABSL_GUARDED_BY(mu_);

  // Deferred, training thread only: a step is open (Finish returned, Settle not yet), when
  // Finish closed it, how long the training thread waited for it, and the entries copied.
  bool open_ = false;
  absl::Time closed_at_;
  double waited_s_ = 0;
  std::vector<bool> copied_;
  int copied_count_ = 0;

  // Last: destroyed (waiting for a running send) before the buffers they use. background_
  // sends during backward; rest_ the shards left at Finish (deferred).
  std::unique_ptr<BackgroundTask> background_;
  std::unique_ptr<BackgroundTask> rest_;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_PS_BACKWARD_OVERLAP_H_
