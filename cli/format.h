// Text rendering of coordinator data for the `gradmesh` CLI: job tables, status pages,
// progress bars and the final line of `watch`. Pure functions of their inputs (the current
// time is passed in), so tests compare exact strings.
//
// Conventions: unknown or not-yet-measured figures print as "-" (accuracy < 0, loss before
// the first step, eta < 0); rates use k/M suffixes ("11.2k"); durations print as M:SS or
// H:MM:SS; ages like kubectl ("45s", "12m", "3h", "2d").
//
// Thread safety: pure functions.
#ifndef GRADMESH_CLI_FORMAT_H_
#define GRADMESH_CLI_FORMAT_H_

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "proto/coordinator.pb.h"

namespace gradmesh {
namespace cli {

// "RUNNING", ... ("UNKNOWN(n)" for values this build does not know).
std::string StateName(JobState state);

// SUCCEEDED, FAILED or CANCELLED.
bool IsFinalState(JobState state);

// 950 -> "950", 11230 -> "11.2k", 2.5e6 -> "2.5M".
std::string FormatRate(double per_s);

// Seconds as "M:SS" or "H:MM:SS" (rounded); "-" if negative.
std::string FormatClock(double seconds);

// "45s", "12m", "3h", "2d" (truncated); "0s" for negative durations.
std::string FormatAge(absl::Duration age);

// Percentage of total steps done, in [0, 100] (0 when total is unknown).
int PercentDone(const JobProgress& p);

// "[#####...............]  25%": `width` cells, '#' for the fraction done (rounded down).
std::string ProgressBar(const JobProgress& p, int width = 20);

// "step 410/938 epoch 1/1 loss 0.3121 acc - 11.2k samples/s ETA 0:35" ("epoch 1" when the
// job is sized in steps, epochs == 0).
std::string ProgressText(const JobProgress& p);

// The `list` table: JOB, STATE, MODE, WORKERS, STEP/TOTAL, LOSS, ACC, AGE, one row per job,
// columns padded to their widest cell. "No jobs.\n" when empty.
std::string FormatJobTable(const std::vector<JobStatus>& jobs, absl::Time now);

// The `status` page: state, message, spec summary, progress, shard and worker placement.
std::string FormatJobStatus(const JobStatus& job, absl::Time now);

// What `submit` prints after the job id: where the shards and workers were placed.
std::string FormatPlacement(const JobStatus& job);

// The last line of `watch` for a job in a final state, e.g.
//   "job mnist SUCCEEDED accuracy=0.9812 loss=0.0712 steps=938/938
//    samples_per_s(all workers)=11.2k time=0:35" (one line; the rate is the job's total over
//   all its workers, JobProgress.samples_per_s)
//   "job mnist FAILED at step 410/938: worker 1 ..."
std::string FinalLine(const JobStatus& job);

// Pads cells to a table (two spaces between columns; the last column unpadded).
std::string FormatTable(const std::vector<std::vector<std::string>>& rows);

}  // namespace cli
}  // namespace gradmesh

#endif  // GRADMESH_CLI_FORMAT_H_
