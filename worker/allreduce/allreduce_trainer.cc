#include "worker/allreduce/allreduce_trainer.h"

namespace gradmesh {

absl::StatusOr<TrainResult> RunAllreduce(const TrainerOptions&, CollectiveServiceImpl*,
                                         const std::atomic<bool>&) {
  return absl::UnimplementedError("allreduce mode is not implemented yet");
}

}  // namespace gradmesh
