// The coordinator's jobs and nodes as metrics (see coordinator_metrics.h).
#include "coordinator/coordinator_metrics.h"

#include <map>

#include "absl/strings/ascii.h"

namespace gradmesh {

void CollectCoordinatorMetrics(const std::vector<JobStatus>& jobs,
                               const std::vector<coordinator_state::NodeRecord>& nodes,
                               MetricsWriter* w) {
  std::map<JobState, int> by_state;
  for (int s = PENDING; s <= CANCELLED; ++s) by_state[static_cast<JobState>(s)] = 0;
  for (const JobStatus& j : jobs) ++by_state[j.state()];
  for (const auto& [state, count] : by_state) {
    w->Gauge("gradmesh_coordinator_jobs", "Jobs known to the coordinator, by state.",
             {{"state", absl::AsciiStrToLower(JobState_Name(state))}}, count);
  }
  std::map<std::pair<std::string, bool>, int> node_counts;
  for (const char* role : {"server", "worker"}) {
    node_counts[{role, true}] = 0;  // Every combination, so a series drops to 0, not away.
    node_counts[{role, false}] = 0;
  }
  for (const coordinator_state::NodeRecord& n : nodes) {
    ++node_counts[{absl::AsciiStrToLower(NodeRole_Name(n.info().role())), n.alive()}];
  }
  for (const auto& [key, count] : node_counts) {
    w->Gauge("gradmesh_coordinator_nodes", "Registered daemons by role and liveness.",
             {{"role", key.first}, {"alive", key.second ? "true" : "false"}}, count);
  }
  for (const JobStatus& j : jobs) {
    if (j.state() != PENDING && j.state() != RUNNING && j.state() != PAUSED) continue;
    const MetricLabels l = {{"job_id", j.job_id()}};
    const JobProgress& p = j.progress();
    w->Gauge("gradmesh_job_step", "Steps done by the job's slowest rank.", l,
             static_cast<double>(p.step()));
    w->Gauge("gradmesh_job_total_steps", "Steps per rank in the whole job.", l,
             static_cast<double>(p.total_steps()));
    w->Gauge("gradmesh_job_loss", "Mean training loss over the last log window.", l, p.loss());
    w->Gauge("gradmesh_job_samples_per_second", "Training samples per second, all ranks.", l,
             p.samples_per_s());
    w->Gauge("gradmesh_job_eta_seconds", "Estimated seconds to the last step (-1: unknown).", l,
             p.eta_s());
    w->Gauge("gradmesh_job_checkpoint_step", "Step of the latest checkpoint (-1: none).", l,
             static_cast<double>(p.checkpoint_step()));
    w->Gauge(
        "gradmesh_job_workers", "Workers of the job (sync: still in the barrier group).", l,
        static_cast<double>(j.active_workers() > 0 ? j.active_workers() : j.spec().num_workers()));
    w->Gauge("gradmesh_job_paused", "1 while the job waits for a shard to return.", l,
             j.state() == PAUSED ? 1 : 0);
    if (p.accuracy() >= 0) {
      w->Gauge("gradmesh_job_accuracy", "Test accuracy once evaluated.", l, p.accuracy());
    }
  }
}

}  // namespace gradmesh
