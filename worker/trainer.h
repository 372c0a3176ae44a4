// Trainer: runs one worker's part of a JobSpec.
//
// Create() checks the options (rank, names, codecs, dataset), parses the mode once and makes
// it from the registry it is given (worker/modes.h binds the built-in modes to this process's
// services); Run() runs the one training loop (worker/training_loop.h) with that mode. The same
// Trainer runs a job given by flags (gradmesh_worker --job=...) or placed by the coordinator.
//
// The header is free of LibTorch and gRPC on purpose (LibTorch is slow to compile): the model
// and tensors exist only inside the loop.
//
// Thread safety: Run() is called once, from one thread. RequestStop() and SetGroup() may be
// called from any thread (e.g. a signal-handling thread) while Run() is in progress.
#ifndef GRADMESH_WORKER_TRAINER_H_
#define GRADMESH_WORKER_TRAINER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/core/train_util.h"
#include "worker/core/training_mode.h"

namespace gradmesh {

class Trainer {
 public:
  // INVALID_ARGUMENT for options that cannot run (rank out of range, unknown model, dataset,
  // mode or codec, missing peers, a mode whose service or client is missing); nothing started.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(TrainerOptions options,
                                                         const TrainingModeRegistry& modes);
  ~Trainer();

  absl::StatusOr<TrainResult> Run();
  void RequestStop() {
    stop_requested_.store(true);
    mode_->OnStopRequested();  // E.g. a gossip rank lingering after its final leaves.
  }

  // The run is over at once (TrainingMode::Abort): an allreduce rank whose ranks the
  // coordinator restarts. Also a stop request.
  void Abort() {
    RequestStop();
    mode_->Abort();
  }

  // A sync job's barrier group was re-formed by the coordinator while this rank runs: the
  // ranks still in it (empty: all) and whether this rank evaluates at the end (the lowest
  // rank of the group). Used by the final wait.
  void SetGroup(std::vector<int32_t> active_ranks, bool evaluate) {
    mode_->SetGroup(std::move(active_ranks), evaluate);
  }

  // A peer rank moved, or lost its node (address ""): see TrainingMode::SetPeers.
  void SetPeers(std::vector<std::string> peers) { mode_->SetPeers(std::move(peers)); }

 private:
  explicit Trainer(TrainerOptions options) : options_(std::move(options)) {}

  const TrainerOptions options_;
  std::unique_ptr<TrainingMode> mode_;  // Set by Create; refers to options_.
  std::atomic<bool> stop_requested_{false};
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_TRAINER_H_
