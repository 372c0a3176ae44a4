// The coordinator's view as Prometheus metrics (common/metrics.h), read at scrape time:
//
//   gradmesh_coordinator_jobs{state}              jobs by state (every state, 0 included)
//   gradmesh_coordinator_nodes{role,alive}        registered daemons
//   per job that has not ended (PENDING, RUNNING, PAUSED), label job:
//   gradmesh_job_step / gradmesh_job_total_steps  minimum step over the ranks / steps per rank
//   gradmesh_job_loss, gradmesh_job_samples_per_second, gradmesh_job_eta_seconds,
//   gradmesh_job_checkpoint_step, gradmesh_job_workers, gradmesh_job_paused (1 while PAUSED)
//   gradmesh_job_accuracy once evaluated.
// Ended jobs are counted by state only, so the series of a long-lived coordinator stay few.
#ifndef GRADMESH_COORDINATOR_COORDINATOR_METRICS_H_
#define GRADMESH_COORDINATOR_COORDINATOR_METRICS_H_

#include <vector>

#include "common/metrics.h"
#include "coordinator/state.pb.h"
#include "proto/coordinator.pb.h"

namespace gradmesh {

void CollectCoordinatorMetrics(const std::vector<JobStatus>& jobs,
                               const std::vector<coordinator_state::NodeRecord>& nodes,
                               MetricsWriter* w);

}  // namespace gradmesh

#endif  // GRADMESH_COORDINATOR_COORDINATOR_METRICS_H_
