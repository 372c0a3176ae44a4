// Dashboard pages and JSON: escaping, curves drawn from the history points, exact JSON.
#include "coordinator/dashboard.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

DashboardData Data() {
  DashboardData d;
  d.now_ms = 1'700'000'000'000;
  JobStatus j;
  j.set_job_id("j1");
  j.set_state(RUNNING);
  j.set_message("rank 1 on node <w1>: \"boom\" & more");
  j.mutable_spec()->set_mode("async");
  j.mutable_progress()->set_step(30);
  j.mutable_progress()->set_total_steps(100);
  j.mutable_progress()->set_loss(0.5);
  j.mutable_progress()->set_accuracy(-1);
  j.mutable_progress()->set_samples_per_s(2500);
  j.mutable_progress()->set_eta_s(65);
  WorkerPlacement* w = j.add_workers();
  w->set_rank(0);
  w->set_node("<img src=x>");
  w->set_state("running");
  d.jobs.push_back(j);
  coordinator_state::JobHistory& h = d.history["j1"];
  h.set_stride(1);
  h.set_offered(3);
  const double loss[] = {2.0, 1.0, 0.5};
  for (int i = 0; i < 3; ++i) {
    coordinator_state::HistoryPoint* p = h.add_points();
    p->set_index(i);
    p->set_t_ms(1000 * (i + 1));
    p->set_step(10 * (i + 1));
    p->set_loss(loss[i]);
    p->set_accuracy(i == 2 ? 0.875 : -1);
    p->set_samples_per_s(1000 * (i + 1));
  }
  coordinator_state::NodeRecord n;
  n.mutable_info()->set_name("w'1");
  n.mutable_info()->set_role(WORKER);
  n.mutable_info()->set_address("127.0.0.1:1");
  n.set_alive(false);
  d.nodes.push_back(n);
  return d;
}

TEST(DashboardTest, HtmlEscapeEscapesEverySpecialCharacter) {
  EXPECT_EQ(HtmlEscape("a<b>&\"c'"), "a&lt;b&gt;&amp;&quot;c&#39;");
  EXPECT_EQ(HtmlEscape("plain-job_1.2"), "plain-job_1.2");
}

TEST(DashboardTest, PageDrawsCurvesFromTheHistoryAndEscapesValues) {
  const std::string page = DashboardPage(Data());
  EXPECT_TRUE(absl::StartsWith(page, "<!DOCTYPE html>"));
  EXPECT_FALSE(absl::StrContains(page, "<script"));
  EXPECT_FALSE(absl::StrContains(page, "http://") &&
               !absl::StrContains(page, "xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_TRUE(absl::StrContains(page, "rank 1 on node &lt;w1&gt;: &quot;boom&quot; &amp; more"));
  EXPECT_TRUE(absl::StrContains(page, "&lt;img src=x&gt;"));
  EXPECT_FALSE(absl::StrContains(page, "<img"));
  EXPECT_TRUE(absl::StrContains(page, "w&#39;1"));
  EXPECT_TRUE(absl::StrContains(
      page, "data-job=\"j1\" data-metric=\"loss\" data-n=\"3\" data-values=\"2 1 0.5\""));
  EXPECT_TRUE(absl::StrContains(page,
                                "data-job=\"j1\" data-metric=\"samples_per_s\" data-n=\"3\" "
                                "data-values=\"1000 2000 3000\""));
  // Accuracy: only the evaluated point.
  EXPECT_TRUE(absl::StrContains(
      page, "data-job=\"j1\" data-metric=\"accuracy\" data-n=\"1\" data-values=\"0.875\""));
  // Loss from 2 (top) to 0.5 (bottom) over steps 10..30: x 58..368, y 22..144.
  EXPECT_TRUE(absl::StrContains(page, "points=\"58.0,22.0 213.0,103.3 368.0,144.0\""));
  EXPECT_TRUE(absl::StrContains(page, "<td class=\"n\">1:05</td>"));  // ETA.
  EXPECT_TRUE(absl::StrContains(page, "<td class=\"dead\">dead</td>"));
}

TEST(DashboardTest, JobPageAndUnknownJob) {
  EXPECT_TRUE(absl::StrContains(JobPage(Data(), "j1"), "data-metric=\"loss\" data-n=\"3\""));
  EXPECT_EQ(JobPage(Data(), "nope"), "");
}

TEST(DashboardTest, JsonHasTheHistoryPoints) {
  EXPECT_EQ(JobsJson(Data()),
            "{\"now_ms\":1700000000000,\"jobs\":[{\"job_id\":\"j1\",\"state\":\"RUNNING\","
            "\"message\":\"rank 1 on node <w1>: \\\"boom\\\" & more\",\"mode\":\"async\","
            "\"step\":30,\"total_steps\":100,\"eta_s\":65,\"loss\":0.5,\"accuracy\":-1,"
            "\"samples_per_s\":2500,\"history\":{\"stride\":1,\"offered\":3,\"points\":["
            "{\"index\":0,\"t_ms\":1000,\"step\":10,\"loss\":2,\"accuracy\":-1,\"samples_per_s\":"
            "1000},{\"index\":1,\"t_ms\":2000,\"step\":20,\"loss\":1,\"accuracy\":-1,"
            "\"samples_per_s\":2000},{\"index\":2,\"t_ms\":3000,\"step\":30,\"loss\":0.5,"
            "\"accuracy\":0.875,\"samples_per_s\":3000}]}}],\"nodes\":[{\"name\":\"w'1\","
            "\"role\":\"WORKER\",\"address\":\"127.0.0.1:1\",\"alive\":false}]}\n");
}

}  // namespace
}  // namespace gradmesh
