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
#include "worker/train_util.h"

namespace gradmesh {

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
