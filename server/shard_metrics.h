// The shard's statistics as Prometheus metrics (common/metrics.h), read from Shard at scrape
// time: per job (labels job, shard = the job's shard index), and per worker of a job.
//
//   gradmesh_shard_jobs                           jobs held
//   gradmesh_shard_pushes_applied_total           pushes applied (duplicates excluded)
//   gradmesh_shard_duplicate_pushes_total         retried pushes recognised and dropped
//   gradmesh_shard_updates_applied_total          optimizer updates (sync: steps)
//   gradmesh_shard_owned_elements                 parameters stored here
//   gradmesh_shard_barrier_wait_seconds_total     sync/ssp waiting
//   gradmesh_shard_snapshots_total                durable snapshots written
//   gradmesh_shard_last_snapshot_seconds / _bytes the last snapshot
//   gradmesh_shard_replayed_updates               updates replayed from the log at restore
//   gradmesh_shard_worker_last_step{worker}       highest step each worker pushed (-1: none)
//   gradmesh_shard_worker_pushes_applied_total{worker}
//
// Counters restart from the restored state's values when a shard restarts (they are the
// shard's own statistics, which restore with the job where the job is durable).
#ifndef GRADMESH_SERVER_SHARD_METRICS_H_
#define GRADMESH_SERVER_SHARD_METRICS_H_

#include "common/metrics.h"
#include "server/shard.h"

namespace gradmesh {

// Writes the metrics above for every job of `shard`. A job removed during the scrape is
// skipped.
void CollectShardMetrics(Shard* shard, MetricsWriter* w);

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_SHARD_METRICS_H_
