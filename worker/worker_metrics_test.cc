// CollectWorkerMetrics / ReportFromProgress: exact samples for known reports.
#include "worker/worker_metrics.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(WorkerMetricsTest, RanksByStateAndPerRankFigures) {
  TrainProgress p;
  p.step = 120;
  p.total_steps = 938;
  p.epoch = 1;
  p.loss = 0.5;
  p.samples_per_s = 8000;
  p.checkpoint_step = 100;
  TaskReport running = ReportFromProgress("mnist", 1, "running", p);
  EXPECT_EQ(running.job_id(), "mnist");
  EXPECT_EQ(running.index(), 1);
  EXPECT_EQ(running.step(), 120);
  p.accuracy = 0.975;
  p.grad_norm = 2.5;
  p.clipped_fraction = 0.25;
  TaskReport done = ReportFromProgress("other", 0, "succeeded", p);
  MetricsWriter w;
  CollectWorkerMetrics({running, done}, &w);
  const std::string text = w.Render();
  for (const char* line : {
           "gradmesh_worker_ranks{state=\"running\"} 1\n",
           "gradmesh_worker_ranks{state=\"succeeded\"} 1\n",
           "gradmesh_worker_step{job_id=\"mnist\",rank=\"1\"} 120\n",
           "gradmesh_worker_total_steps{job_id=\"mnist\",rank=\"1\"} 938\n",
           "gradmesh_worker_loss{job_id=\"mnist\",rank=\"1\"} 0.5\n",
           "gradmesh_worker_samples_per_second{job_id=\"mnist\",rank=\"1\"} 8000\n",
           "gradmesh_worker_checkpoint_step{job_id=\"mnist\",rank=\"1\"} 100\n",
           "gradmesh_worker_accuracy{job_id=\"other\",rank=\"0\"} 0.97499999999999998\n",
           "gradmesh_worker_grad_norm{job_id=\"other\",rank=\"0\"} 2.5\n",
           "gradmesh_worker_clipped_fraction{job_id=\"other\",rank=\"0\"} 0.25\n",
       }) {
    EXPECT_TRUE(absl::StrContains(text, line)) << line << "\nin:\n" << text;
  }
  EXPECT_FALSE(absl::StrContains(text, "gradmesh_worker_accuracy{job_id=\"mnist\"")) << text;
  // A job that does not clip has no clipping gauges.
  EXPECT_FALSE(absl::StrContains(text, "gradmesh_worker_grad_norm{job_id=\"mnist\"")) << text;
  // A restarting rank that has not restored yet (no step, loss or rate reported) has no such
  // samples rather than zeros.
  TaskReport restarting;
  restarting.set_job_id("restarting");
  restarting.set_state("running");
  MetricsWriter r;
  CollectWorkerMetrics({restarting}, &r);
  for (const char* name :
       {"gradmesh_worker_step{", "gradmesh_worker_loss{", "gradmesh_worker_samples_per_second{"}) {
    EXPECT_FALSE(absl::StrContains(r.Render(), name)) << name << "\n" << r.Render();
  }
  EXPECT_TRUE(absl::StrContains(r.Render(), "gradmesh_worker_total_steps{job_id=\"restarting\""));
  // No ranks: the running count is still there (0), so dashboards see the daemon.
  MetricsWriter empty;
  CollectWorkerMetrics({}, &empty);
  EXPECT_TRUE(absl::StrContains(empty.Render(), "gradmesh_worker_ranks{state=\"running\"} 0\n"));
}

}  // namespace
}  // namespace gradmesh
