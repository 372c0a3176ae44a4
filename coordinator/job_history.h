// A job's progress history for the dashboard: a bounded series of HistoryPoints
// (coordinator/state.proto) kept in the job's record, so it is persisted with it and restored
// after a coordinator restart.
//
// Downsampling: each offered point gets the next index (JobHistory.offered). The history holds
// the points whose index is a multiple of `stride` (1 at first), followed by the latest offered
// point when its index is not one (the "tail", replaced by the next offer). When the points
// exceed `capacity`, `stride` doubles and the points off the new stride are dropped (the tail
// is kept), until they fit. So the history spans the job's whole life at a uniform spacing of
// `stride` offers, always ends with the latest point, and holds at most `capacity` points.
//
// An offer with the same step as the latest point updates that point in place (loss, accuracy,
// t_ms; samples_per_s only if > 0: finished ranks report no rate) instead of adding one.
//
// Thread safety: plain functions on a proto the caller owns (the coordinator holds its mutex).
#ifndef GRADMESH_COORDINATOR_JOB_HISTORY_H_
#define GRADMESH_COORDINATOR_JOB_HISTORY_H_

#include "coordinator/state.pb.h"

namespace gradmesh {

// Default bound on a job's history points (about 10 KB per job in memory and in its record).
inline constexpr int kDefaultHistoryCapacity = 240;

// Offers `point` (its index is assigned here) to `history`, keeping at most `capacity` points
// (values below 2 are taken as 2).
void AddHistoryPoint(coordinator_state::HistoryPoint point, int capacity,
                     coordinator_state::JobHistory* history);

}  // namespace gradmesh

#endif  // GRADMESH_COORDINATOR_JOB_HISTORY_H_
