// Worker ranks as metrics (see worker_metrics.h).
#include "worker/worker_metrics.h"

#include <map>

#include "absl/strings/str_cat.h"

namespace gradmesh {

void CollectWorkerMetrics(const std::vector<TaskReport>& reports, MetricsWriter* w) {
  std::map<std::string, int> by_state = {{"running", 0}};
  for (const TaskReport& r : reports) ++by_state[r.state()];
  for (const auto& [state, count] : by_state) {
    w->Gauge("gradmesh_worker_ranks", "Ranks on this worker daemon, by state.", {{"state", state}},
             count);
  }
  for (const TaskReport& r : reports) {
    const MetricLabels l = {{"job_id", r.job_id()}, {"rank", absl::StrCat(r.index())}};
    // A run that does not know its step yet (restoring), or has trained none, has no such
    // figures: no sample rather than a 0 (a restart is not a fall to step 0).
    if (r.has_step()) {
      w->Gauge("gradmesh_worker_step", "Steps the rank has done (resumed ones included).", l,
               static_cast<double>(r.step()));
    }
    w->Gauge("gradmesh_worker_total_steps", "Steps of the rank in the whole job.", l,
             static_cast<double>(r.total_steps()));
    if (r.has_loss()) {
      w->Gauge("gradmesh_worker_loss", "Mean training loss over the last log window.", l, r.loss());
    }
    if (r.has_samples_per_s()) {
      w->Gauge("gradmesh_worker_samples_per_second", "Samples per second, last log window.", l,
               r.samples_per_s());
    }
    w->Gauge("gradmesh_worker_checkpoint_step", "Step of the latest checkpoint (-1: none).", l,
             static_cast<double>(r.checkpoint_step()));
    if (r.accuracy() >= 0) {
      w->Gauge("gradmesh_worker_accuracy", "Test accuracy once evaluated.", l, r.accuracy());
    }
    // Only jobs that clip (0 is a report from before this field existed, or a zero norm).
    if (r.grad_norm() > 0 || r.clipped_fraction() > 0) {
      w->Gauge("gradmesh_worker_grad_norm", "Mean pre-clip gradient norm, last log window.", l,
               r.grad_norm());
      w->Gauge("gradmesh_worker_clipped_fraction", "Fraction of steps clipped, last log window.", l,
               r.clipped_fraction());
    }
    // Only jobs with dynamic loss scaling (a scale is > 0).
    if (r.loss_scale() > 0) {
      w->Gauge("gradmesh_worker_loss_scale", "Current dynamic loss scale.", l, r.loss_scale());
      w->Gauge("gradmesh_worker_skipped_steps",
               "Steps skipped for a non-finite gradient (loss scaling), this run.", l,
               static_cast<double>(r.skipped_steps()));
    }
  }
}

TaskReport ReportFromProgress(const std::string& job, int32_t rank, const std::string& state,
                              const TrainProgress& progress) {
  TaskReport r;
  r.set_job_id(job);
  r.set_index(rank);
  r.set_state(state);
  r.set_step(progress.step);
  r.set_total_steps(progress.total_steps);
  r.set_epoch(progress.epoch);
  r.set_loss(progress.loss);
  r.set_accuracy(progress.accuracy);
  r.set_samples_per_s(progress.samples_per_s);
  r.set_checkpoint_step(progress.checkpoint_step);
  r.set_grad_norm(progress.grad_norm);
  r.set_clipped_fraction(progress.clipped_fraction);
  r.set_skipped_steps(progress.skipped_steps);
  r.set_loss_scale(progress.loss_scale);
  return r;
}

}  // namespace gradmesh
