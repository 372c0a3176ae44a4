// A worker daemon's ranks as Prometheus metrics (common/metrics.h), from the same reports its
// heartbeats carry (TaskReport; a standalone worker builds one from its trainer's progress):
//
//   gradmesh_worker_ranks{state}                       ranks by state (running, succeeded, ...)
//   per rank (labels job, rank):
//   gradmesh_worker_step / gradmesh_worker_total_steps steps done / in the whole job
//   gradmesh_worker_loss                               mean loss over the last log window
//   gradmesh_worker_samples_per_second                 over the last log window
//   gradmesh_worker_checkpoint_step                    latest checkpoint (-1: none)
//   gradmesh_worker_accuracy                           once evaluated
//   gradmesh_worker_grad_norm / _clipped_fraction      jobs that clip: last log window
//   gradmesh_worker_loss_scale / _skipped_steps        jobs with dynamic loss scaling
#ifndef GRADMESH_WORKER_WORKER_METRICS_H_
#define GRADMESH_WORKER_WORKER_METRICS_H_

#include <string>
#include <vector>

#include "common/metrics.h"
#include "proto/coordinator.pb.h"
#include "worker/core/train_util.h"

namespace gradmesh {

void CollectWorkerMetrics(const std::vector<TaskReport>& reports, MetricsWriter* w);

// The report of a standalone rank of `job` with the latest `progress` in `state`.
TaskReport ReportFromProgress(const std::string& job, int32_t rank, const std::string& state,
                              const TrainProgress& progress);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_WORKER_METRICS_H_
