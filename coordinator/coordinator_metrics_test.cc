// CollectCoordinatorMetrics: exact samples for a known set of jobs and nodes.
#include "coordinator/coordinator_metrics.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

JobStatus Job(const std::string& id, JobState state, int64_t step, int workers) {
  JobStatus j;
  j.set_job_id(id);
  j.set_state(state);
  j.mutable_spec()->set_num_workers(workers);
  j.mutable_progress()->set_step(step);
  j.mutable_progress()->set_total_steps(938);
  j.mutable_progress()->set_loss(0.25);
  j.mutable_progress()->set_samples_per_s(16000.5);
  j.mutable_progress()->set_eta_s(-1);
  j.mutable_progress()->set_checkpoint_step(-1);
  j.mutable_progress()->set_accuracy(-1);
  return j;
}

coordinator_state::NodeRecord Node(NodeRole role, bool alive) {
  coordinator_state::NodeRecord n;
  n.mutable_info()->set_role(role);
  n.set_alive(alive);
  return n;
}

TEST(CoordinatorMetricsTest, CountsJobsAndNodesAndDetailsOnlyLiveJobs) {
  JobStatus done = Job("old", SUCCEEDED, 938, 2);
  done.mutable_progress()->set_accuracy(0.98);
  JobStatus paused = Job("p", PAUSED, 7, 3);
  paused.set_active_workers(2);
  MetricsWriter w;
  CollectCoordinatorMetrics(
      {Job("run", RUNNING, 410, 2), paused, done},
      {Node(SERVER, true), Node(WORKER, true), Node(WORKER, true), Node(WORKER, false)}, &w);
  const std::string text = w.Render();
  for (const char* line : {
           "gradmesh_coordinator_jobs{state=\"pending\"} 0\n",
           "gradmesh_coordinator_jobs{state=\"running\"} 1\n",
           "gradmesh_coordinator_jobs{state=\"paused\"} 1\n",
           "gradmesh_coordinator_jobs{state=\"succeeded\"} 1\n",
           "gradmesh_coordinator_jobs{state=\"failed\"} 0\n",
           "gradmesh_coordinator_jobs{state=\"cancelled\"} 0\n",
           "gradmesh_coordinator_nodes{role=\"server\",alive=\"true\"} 1\n",
           "gradmesh_coordinator_nodes{role=\"server\",alive=\"false\"} 0\n",
           "gradmesh_coordinator_nodes{role=\"worker\",alive=\"false\"} 1\n",
           "gradmesh_coordinator_nodes{role=\"worker\",alive=\"true\"} 2\n",
           "gradmesh_job_step{job_id=\"run\"} 410\n",
           "gradmesh_job_total_steps{job_id=\"run\"} 938\n",
           "gradmesh_job_loss{job_id=\"run\"} 0.25\n",
           "gradmesh_job_samples_per_second{job_id=\"run\"} 16000.5\n",
           "gradmesh_job_workers{job_id=\"run\"} 2\n",
           "gradmesh_job_workers{job_id=\"p\"} 2\n",
           "gradmesh_job_paused{job_id=\"p\"} 1\n",
           "gradmesh_job_paused{job_id=\"run\"} 0\n",
       }) {
    EXPECT_TRUE(absl::StrContains(text, line)) << line << "\nin:\n" << text;
  }
  // The ended job is only counted; no live job has an accuracy yet.
  EXPECT_FALSE(absl::StrContains(text, "job_id=\"old\"")) << text;
  EXPECT_FALSE(absl::StrContains(text, "gradmesh_job_accuracy")) << text;
}

}  // namespace
}  // namespace gradmesh
