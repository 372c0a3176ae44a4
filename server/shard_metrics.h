// The shard's statistics as Prometheus metrics (common/metrics.h), read from Shard at scrape
// time: per job (labels job_id, shard = the job's shard index), and per worker of a job.
//
//   gradmesh_shard_jobs                           jobs held
//   gradmesh_shard_pushes_applied                 pushes applied (duplicates excluded)
//   gradmesh_shard_duplicate_pushes               retried pushes recognised and dropped
//   gradmesh_shard_updates_applied                optimizer updates (sync: steps)
//   gradmesh_shard_owned_elements                 parameters stored here
//   gradmesh_shard_barrier_wait_seconds_total     sync/ssp waiting
//   gradmesh_shard_snapshots_total                durable snapshots written
//   gradmesh_shard_last_snapshot_seconds / _bytes the last snapshot
//   gradmesh_shard_replayed_updates               updates replayed from the log at restore
//   gradmesh_shard_worker_last_step{worker}       highest step each worker pushed (-1: none)
//   gradmesh_shard_worker_pushes_applied{worker}
//
// The push and update figures are the job's own totals, which restore with a durable job:
// gauges, not counters, because a shard restored from a periodic snapshot can report less
// than before its crash (a counter going down would read as a reset). The snapshot and
// barrier-wait figures count since the process started (counters).
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
