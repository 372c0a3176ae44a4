// Shard statistics as metrics (see shard_metrics.h).
#include "server/shard_metrics.h"

#include "absl/strings/str_cat.h"

namespace gradmesh {

void CollectShardMetrics(Shard* shard, MetricsWriter* w) {
  const std::vector<std::string> names = shard->JobNames();
  w->Gauge("gradmesh_shard_jobs", "Jobs held by this shard.", {},
           static_cast<double>(names.size()));
  for (const std::string& name : names) {
    JobInfoRequest req;
    req.set_job(name);
    absl::StatusOr<JobInfoResponse> info = shard->GetJobInfo(req);
    if (!info.ok()) continue;
    const MetricLabels l = {{"job_id", name}, {"shard", absl::StrCat(info->shard_index())}};
    // The job's own totals, restored with the job: gauges, since a shard restored from a
    // periodic snapshot may report less than it did before its crash.
    w->Gauge("gradmesh_shard_pushes_applied",
             "Pushes applied to the job on this shard (retried duplicates excluded).", l,
             static_cast<double>(info->pushes_applied()));
    w->Gauge("gradmesh_shard_duplicate_pushes",
             "Retried pushes recognised by their request id and not applied again.", l,
             static_cast<double>(info->duplicates_dropped()));
    w->Gauge("gradmesh_shard_updates_applied", "Optimizer updates applied (sync: steps completed).",
             l, static_cast<double>(info->updates_applied()));
    w->Gauge("gradmesh_shard_owned_elements", "Parameters of the job stored on this shard.", l,
             static_cast<double>(info->owned_elements()));
    w->Counter("gradmesh_shard_barrier_wait_seconds_total",
               "Seconds pushes and pulls waited for other workers (sync, ssp).", l,
               info->barrier_wait_s());
    w->Counter("gradmesh_shard_snapshots_total", "Durable snapshots written since start.", l,
               static_cast<double>(info->snapshots()));
    w->Gauge("gradmesh_shard_last_snapshot_seconds", "Duration of the last snapshot.", l,
             info->last_snapshot_s());
    w->Gauge("gradmesh_shard_last_snapshot_bytes", "Size of the last snapshot.", l,
             static_cast<double>(info->last_snapshot_bytes()));
    w->Gauge("gradmesh_shard_replayed_updates",
             "Updates replayed from the log when the shard restored the job at start-up.", l,
             static_cast<double>(info->replayed_updates()));
    for (const WorkerState& ws : info->workers()) {
      MetricLabels wl = l;
      wl.emplace_back("worker", absl::StrCat(ws.worker()));
      w->Gauge("gradmesh_shard_worker_last_step", "Highest step the worker pushed (-1: none).", wl,
               static_cast<double>(ws.last_step()));
      w->Gauge("gradmesh_shard_worker_pushes_applied",
               "Pushes of the worker applied (retried duplicates excluded).", wl,
               static_cast<double>(ws.pushes_applied()));
    }
  }
}

}  // namespace gradmesh
