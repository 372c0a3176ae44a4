// The coordinator's built-in web dashboard, served on its metrics endpoint (--metrics_port):
//
//   GET /             every job (state, progress, ETA, loss, accuracy, samples/s), the curves
//                     of the newest kMaxCurveJobs jobs, their placement, and node health
//   GET /job/<name>   one job: figures, curves, placement (404 for an unknown job)
//   GET /api/jobs     the same data as JSON: {"jobs": [{..., "history": {...}}], "nodes": [...]}
//
// Pages are self-contained HTML (inline CSS, charts as inline SVG drawn here; no scripts, no
// external fonts or files), sized for a laptop screen. Every value that comes from outside
// (job names, messages, node names, addresses) is HTML-escaped (JSON-escaped in the JSON).
//
// Curves: one SVG per metric (loss, accuracy, samples/s) with the job's history points
// (coordinator/job_history.h) against their step. Each curve is a
//   <polyline class="curve" data-job="J" data-metric="loss" data-n="N" data-values="v1 v2 ..."
//             points="x1,y1 x2,y2 ...">
// with one point per history point that has the metric (accuracy: only points >= 0), values
// as %.17g (the JSON's numbers use the same format, so tests compare them as text).
//
// Thread safety: pure functions of their arguments.
#ifndef GRADMESH_COORDINATOR_DASHBOARD_H_
#define GRADMESH_COORDINATOR_DASHBOARD_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "coordinator/state.pb.h"
#include "proto/coordinator.pb.h"

namespace gradmesh {

// Jobs whose curves the overview page draws (newest first); the others link to /job/<name>.
inline constexpr int kMaxCurveJobs = 8;

// What a page shows, as read from the Coordinator at one moment.
struct DashboardData {
  std::vector<JobStatus> jobs;  // Newest first (Coordinator::ListJobs).
  std::map<std::string, coordinator_state::JobHistory> history;  // By job id; may miss some.
  std::vector<coordinator_state::NodeRecord> nodes;
  int64_t now_ms = 0;  // Unix ms, for "updated" and ages.
};

// The overview page (GET /).
std::string DashboardPage(const DashboardData& data);
// One job's page; "" for an id not in data.jobs.
std::string JobPage(const DashboardData& data, const std::string& job_id);
// GET /api/jobs.
std::string JobsJson(const DashboardData& data);

// Text with & < > " ' replaced by entities.
std::string HtmlEscape(const std::string& text);

}  // namespace gradmesh

#endif  // GRADMESH_COORDINATOR_DASHBOARD_H_
