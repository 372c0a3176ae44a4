// Tests of the CLI's text rendering: rates, clocks, ages, percentages and bars at their
// edges, unknown states, tables, and the final watch lines.
#include "cli/format.h"

#include "gtest/gtest.h"

namespace gradmesh {
namespace cli {
namespace {

JobProgress Progress(int64_t step, int64_t total) {
  JobProgress p;
  p.set_step(step);
  p.set_total_steps(total);
  return p;
}

TEST(FormatTest, Rates) {
  EXPECT_EQ(FormatRate(0), "0");
  EXPECT_EQ(FormatRate(999.4), "999");
  EXPECT_EQ(FormatRate(11234), "11.2k");
  EXPECT_EQ(FormatRate(2.5e6), "2.5M");
  EXPECT_EQ(FormatRate(-1), "-");
}

TEST(FormatTest, ClocksAndAges) {
  EXPECT_EQ(FormatClock(0), "0:00");
  EXPECT_EQ(FormatClock(35.4), "0:35");
  EXPECT_EQ(FormatClock(59.6), "1:00");
  EXPECT_EQ(FormatClock(3725), "1:02:05");
  EXPECT_EQ(FormatClock(-1), "-");
  EXPECT_EQ(FormatAge(absl::Seconds(-5)), "0s");
  EXPECT_EQ(FormatAge(absl::Seconds(59)), "59s");
  EXPECT_EQ(FormatAge(absl::Seconds(60)), "1m");
  EXPECT_EQ(FormatAge(absl::Minutes(119)), "1h");
  EXPECT_EQ(FormatAge(absl::Hours(49)), "2d");
}

TEST(FormatTest, PercentAndBar) {
  EXPECT_EQ(PercentDone(Progress(0, 0)), 0);
  EXPECT_EQ(PercentDone(Progress(410, 938)), 43);
  EXPECT_EQ(PercentDone(Progress(1000, 938)), 100);  // Clamped.
  EXPECT_EQ(ProgressBar(Progress(0, 938), 10), "[..........]   0%");
  EXPECT_EQ(ProgressBar(Progress(469, 938), 10), "[#####.....]  50%");
  EXPECT_EQ(ProgressBar(Progress(938, 938), 10), "[##########] 100%");
  EXPECT_EQ(ProgressBar(Progress(5, 0), 4), "[....]   0%");
}

TEST(FormatTest, ProgressTextUnknownFigures) {
  JobProgress p = Progress(0, 0);
  p.set_accuracy(-1);
  p.set_eta_s(-1);
  EXPECT_EQ(ProgressText(p), "step 0/- epoch 0 loss - acc - 0 samples/s ETA -");
  p = Progress(60, 300);
  p.set_epoch(1);
  p.set_epochs(2);
  p.set_loss(0.41236);
  p.set_accuracy(0.5);
  p.set_samples_per_s(11100);
  p.set_eta_s(61);
  EXPECT_EQ(ProgressText(p),
            "step 60/300 epoch 1/2 loss 0.4124 acc 0.5000 11.1k samples/s ETA 1:01");
}

TEST(FormatTest, States) {
  EXPECT_EQ(StateName(RUNNING), "RUNNING");
  EXPECT_EQ(StateName(static_cast<JobState>(42)), "UNKNOWN(42)");
  EXPECT_TRUE(IsFinalState(SUCCEEDED));
  EXPECT_TRUE(IsFinalState(FAILED));
  EXPECT_TRUE(IsFinalState(CANCELLED));
  EXPECT_FALSE(IsFinalState(PAUSED));
  EXPECT_FALSE(IsFinalState(JOB_STATE_UNSPECIFIED));
}

TEST(FormatTest, TablePadsAllButTheLastColumn) {
  EXPECT_EQ(FormatTable({{"A", "BB", "C"}, {"long", "x", "yyyy"}}),
            "A     BB  C\n"
            "long  x   yyyy\n");
}

TEST(FormatTest, FinalLines) {
  JobStatus j;
  j.set_job_id("j");
  j.set_state(SUCCEEDED);
  j.set_created_ms(1000);
  j.set_updated_ms(3726000);
  *j.mutable_progress() = Progress(938, 938);
  j.mutable_progress()->set_accuracy(0.98125);
  j.mutable_progress()->set_loss(0.07123);
  j.mutable_progress()->set_samples_per_s(17380);
  EXPECT_EQ(
      FinalLine(j),
      "job j SUCCEEDED accuracy=0.9812 loss=0.0712 steps=938/938 samples_per_s(all workers)=17.4k "
      "time=1:02:05");
  // A sequence model's evaluation adds its test loss and perplexity; accuracy is the token
  // accuracy.
  j.mutable_progress()->set_test_loss(1.7754);
  j.mutable_progress()->set_perplexity(5.90259);
  EXPECT_EQ(FinalLine(j),
            "job j SUCCEEDED accuracy=0.9812 test_loss=1.7754 perplexity=5.903 loss=0.0712 "
            "steps=938/938 samples_per_s(all workers)=17.4k time=1:02:05");
  // Not evaluated: -1.
  j.mutable_progress()->set_test_loss(-1);
  j.mutable_progress()->set_perplexity(-1);
  EXPECT_EQ(
      FinalLine(j),
      "job j SUCCEEDED accuracy=0.9812 loss=0.0712 steps=938/938 samples_per_s(all workers)=17.4k "
      "time=1:02:05");
  j.set_state(FAILED);
  EXPECT_EQ(FinalLine(j), "job j FAILED at step 938/938");
  j.set_message("boom");
  EXPECT_EQ(FinalLine(j), "job j FAILED at step 938/938: boom");
}

}  // namespace
}  // namespace cli
}  // namespace gradmesh
