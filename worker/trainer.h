// Trainer: runs one worker's part of a JobSpec.
//
// The same Trainer runs a job given by flags (gradmesh_worker --job=...) or, later, placed by
// the coordinator. Each step: take this rank's next batch (prefetched by BatchLoader),
// forward/backward in LibTorch, push every gradient to its shards in parallel, pull fresh
// parameters. At the end the worker tells the shards it finished; rank 0 (or whoever has
// `evaluate` set) then waits for the other workers, pulls the final parameters, evaluates on
// the test set and saves the model if the spec names an output.
//
// Resume: if the shards already hold the job (InitJob finds it, e.g. after every process was
// stopped and durable shards restarted), the worker continues after the last step the shards
// recorded for its rank (the minimum over shards), with the data it would have seen then.
//
// The header is free of LibTorch on purpose (it is slow to compile): the model and tensors
// exist only inside Run().
//
// Thread safety: Run() is called once, from one thread. RequestStop() may be called from any
// thread (e.g. a signal-handling thread) while Run() is in progress.
#ifndef GRADMESH_WORKER_TRAINER_H_
#define GRADMESH_WORKER_TRAINER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "proto/gradmesh.pb.h"
#include "worker/parameter_client.h"

namespace gradmesh {

struct TrainerOptions {
  JobSpec spec;                // Defaults applied and validated by the caller.
  int32_t rank = 0;            // In [0, spec.num_workers()).
  std::string data_dir;        // Parent of <dataset name>/ when spec.dataset.path is empty.
  bool evaluate = true;        // Wait for all workers, evaluate and save at the end.
  int32_t intra_op_threads = 1;  // torch::set_num_threads; 1 avoids oversubscription.
  absl::Duration wait_for_workers = absl::Minutes(30);  // Bound on the final wait.
  // Fault injection for tests: sleep this long before every step (a slow worker).
  absl::Duration step_delay = absl::ZeroDuration();
  const Logger* logger = nullptr;  // Not owned; may be null.
};

struct TrainResult {
  int64_t steps = 0;            // Steps this worker ran.
  int64_t samples = 0;          // Training samples this worker processed.
  double wall_s = 0;            // Seconds from the first step to the last push/pull.
  double samples_per_s = 0;     // samples / wall_s.
  double final_loss = 0;        // Mean training loss over the last log window.
  double test_accuracy = -1;    // In [0, 1]; -1 if this worker did not evaluate.
  double data_s = 0, compute_s = 0, comm_s = 0;  // Time split of the steps.
  int64_t bytes_pushed = 0, bytes_pulled = 0;          // On the wire (compressed).
  int64_t raw_bytes_pushed = 0, raw_bytes_pulled = 0;  // As float32.
  double codec_s = 0;                                   // Encoding pushes, decoding pulls.
  bool stopped_early = false;   // RequestStop() ended the run before the last step.
  int64_t first_step = 0;       // > 0 when the run resumed from the shards' progress.
};

class Trainer {
 public:
  // `client_factory` makes the ParameterClient once the model (and so the layout) is known.
  using ClientFactory =
      std::function<absl::StatusOr<std::unique_ptr<ParameterClient>>(JobLayout layout)>;

  static absl::StatusOr<std::unique_ptr<Trainer>> Create(TrainerOptions options,
                                                         ClientFactory client_factory);
  ~Trainer();

  absl::StatusOr<TrainResult> Run();
  void RequestStop() { stop_requested_.store(true); }

 private:
  Trainer(TrainerOptions options, ClientFactory client_factory);

  const TrainerOptions options_;
  const ClientFactory client_factory_;
  std::atomic<bool> stop_requested_{false};
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_TRAINER_H_
