// Text rendering for the `gradmesh` CLI (see format.h).
#include "cli/format.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace gradmesh {
namespace cli {
namespace {

std::string Loss(const JobProgress& p) {
  return p.step() > 0 ? absl::StrFormat("%.4f", p.loss()) : "-";
}

std::string Accuracy(double acc) { return acc >= 0 ? absl::StrFormat("%.4f", acc) : "-"; }

std::string StepOfTotal(const JobProgress& p) {
  return p.total_steps() > 0 ? absl::StrCat(p.step(), "/", p.total_steps())
                             : absl::StrCat(p.step(), "/-");
}

std::string Plural(int64_t n, const char* word) {
  return absl::StrCat(n, " ", word, n == 1 ? "" : "s");
}

}  // namespace

std::string StateName(JobState state) {
  if (JobState_IsValid(state)) return JobState_Name(state);
  return absl::StrCat("UNKNOWN(", static_cast<int>(state), ")");
}

bool IsFinalState(JobState state) {
  return state == SUCCEEDED || state == FAILED || state == CANCELLED;
}

std::string FormatRate(double per_s) {
  if (!(per_s >= 0)) return "-";
  if (per_s < 1000) return absl::StrFormat("%.0f", per_s);
  if (per_s < 1e6) return absl::StrFormat("%.1fk", per_s / 1e3);
  return absl::StrFormat("%.1fM", per_s / 1e6);
}

std::string FormatClock(double seconds) {
  if (!(seconds >= 0)) return "-";
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  if (s >= 3600) return absl::StrFormat("%d:%02d:%02d", s / 3600, (s / 60) % 60, s % 60);
  return absl::StrFormat("%d:%02d", s / 60, s % 60);
}

std::string FormatAge(absl::Duration age) {
  const int64_t s = std::max<int64_t>(0, absl::ToInt64Seconds(age));
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrCat(s / 60, "m");
  if (s < 86400) return absl::StrCat(s / 3600, "h");
  return absl::StrCat(s / 86400, "d");
}

int PercentDone(const JobProgress& p) {
  if (p.total_steps() <= 0 || p.step() <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(100, p.step() * 100 / p.total_steps()));
}

std::string ProgressBar(const JobProgress& p, int width) {
  int filled = 0;
  if (p.total_steps() > 0 && p.step() > 0) {
    filled = static_cast<int>(
        std::min<int64_t>(width, p.step() * static_cast<int64_t>(width) / p.total_steps()));
  }
  return absl::StrFormat("[%s%s] %3d%%", std::string(filled, '#'), std::string(width - filled, '.'),
                         PercentDone(p));
}

std::string ProgressText(const JobProgress& p) {
  // Jobs sized in steps have no epoch count.
  const std::string epoch =
      p.epochs() > 0 ? absl::StrCat(p.epoch(), "/", p.epochs()) : absl::StrCat(p.epoch());
  return absl::StrCat("step ", StepOfTotal(p), " epoch ", epoch, " loss ", Loss(p), " acc ",
                      Accuracy(p.accuracy()), " ", FormatRate(p.samples_per_s()), " samples/s ETA ",
                      FormatClock(p.eta_s()));
}

std::string FormatTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) {
      out += row[c];
      if (c + 1 < row.size()) out += std::string(width[c] - row[c].size() + 2, ' ');
    }
    out += "\n";
  }
  return out;
}

std::string FormatJobTable(const std::vector<JobStatus>& jobs, absl::Time now) {
  if (jobs.empty()) return "No jobs.\n";
  std::vector<std::vector<std::string>> rows = {
      {"JOB", "STATE", "MODE", "WORKERS", "STEP/TOTAL", "LOSS", "ACC", "AGE"}};
  for (const JobStatus& j : jobs) {
    std::string workers = absl::StrCat(j.spec().num_workers());
    if (j.active_workers() > 0 && j.active_workers() < j.spec().num_workers()) {
      workers = absl::StrCat(j.active_workers(), "/", j.spec().num_workers());
    }
    rows.push_back(
        {j.job_id(), StateName(j.state()), j.spec().mode().empty() ? "-" : j.spec().mode(), workers,
         StepOfTotal(j.progress()), Loss(j.progress()), Accuracy(j.progress().accuracy()),
         FormatAge(now - absl::FromUnixMillis(j.created_ms()))});
  }
  return FormatTable(rows);
}

std::string FormatPlacement(const JobStatus& job) {
  std::string out;
  if (job.shards_size() > 0) {
    std::vector<std::string> parts;
    for (const ShardPlacement& s : job.shards()) {
      parts.push_back(absl::StrCat(s.shard(), "->", s.node(), " (", s.address(), ")"));
    }
    absl::StrAppend(&out, "  shards:  ", absl::StrJoin(parts, ", "), "\n");
  }
  if (job.workers_size() > 0) {
    std::vector<std::string> parts;
    for (const WorkerPlacement& w : job.workers()) {
      parts.push_back(absl::StrCat(w.rank(), "->", w.node().empty() ? "(unplaced)" : w.node()));
    }
    absl::StrAppend(&out, "  workers: ", absl::StrJoin(parts, ", "), "\n");
  }
  return out;
}

std::string FormatJobStatus(const JobStatus& job, absl::Time now) {
  const JobSpec& spec = job.spec();
  std::vector<std::vector<std::string>> head;
  head.push_back({"Job:", job.job_id()});
  head.push_back({"State:", StateName(job.state())});
  if (!job.message().empty()) head.push_back({"Message:", job.message()});
  std::string mode = absl::StrCat(spec.mode(), ", ", Plural(spec.num_workers(), "worker"));
  if (job.active_workers() > 0 && job.active_workers() < spec.num_workers()) {
    absl::StrAppend(&mode, " (", job.active_workers(), " active)");
  }
  if (job.shards_size() > 0) absl::StrAppend(&mode, ", ", Plural(job.shards_size(), "shard"));
  head.push_back({"Mode:", mode});
  std::string model = absl::StrCat(spec.model().name(), " on ", spec.dataset().name(), ", ",
                                   spec.optimizer().name(), " lr=", spec.optimizer().lr(),
                                   ", batch ", spec.batch_size(), ", ");
  if (spec.steps() > 0) {
    absl::StrAppend(&model, Plural(spec.steps(), "step"));
  } else {
    absl::StrAppend(&model, Plural(spec.epochs(), "epoch"));
  }
  head.push_back({"Model:", model});
  if (!spec.output().empty()) head.push_back({"Output:", spec.output()});
  const absl::Time created = absl::FromUnixMillis(job.created_ms());
  head.push_back({"Created:", absl::StrCat(absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", created,
                                                            absl::UTCTimeZone()),
                                           " (", FormatAge(now - created), " ago)")});
  head.push_back(
      {"Progress:", absl::StrCat(ProgressBar(job.progress()), " ", ProgressText(job.progress()))});
  if (job.progress().checkpoint_step() > 0) {
    head.push_back({"Checkpoint:", absl::StrCat("step ", job.progress().checkpoint_step())});
  }
  std::string out = FormatTable(head);
  if (job.shards_size() > 0) {
    std::vector<std::vector<std::string>> rows = {{"SHARD", "NODE", "ADDRESS", "ALIVE"}};
    for (const ShardPlacement& s : job.shards()) {
      rows.push_back({absl::StrCat(s.shard()), s.node().empty() ? "-" : s.node(),
                      s.address().empty() ? "-" : s.address(), s.alive() ? "yes" : "no"});
    }
    out += "Shards:\n";
    for (const auto& line : absl::StrSplit(FormatTable(rows), '\n', absl::SkipEmpty())) {
      absl::StrAppend(&out, "  ", line, "\n");
    }
  }
  if (job.workers_size() > 0) {
    std::vector<std::vector<std::string>> rows = {
        {"RANK", "NODE", "ADDRESS", "STATE", "STEP", "MOVED"}};
    for (const WorkerPlacement& w : job.workers()) {
      rows.push_back({absl::StrCat(w.rank()), w.node().empty() ? "-" : w.node(),
                      w.address().empty() ? "-" : w.address(), w.state().empty() ? "-" : w.state(),
                      absl::StrCat(w.step()), absl::StrCat(w.reassignments())});
    }
    out += "Workers:\n";
    for (const auto& line : absl::StrSplit(FormatTable(rows), '\n', absl::SkipEmpty())) {
      absl::StrAppend(&out, "  ", line, "\n");
    }
  }
  return out;
}

std::string FinalLine(const JobStatus& job) {
  const JobProgress& p = job.progress();
  if (job.state() == SUCCEEDED) {
    const double wall_s = (job.updated_ms() - job.created_ms()) / 1e3;
    // Evaluated test loss and perplexity when known (0 or -1: not reported).
    std::string test;
    if (p.test_loss() > 0)
      absl::StrAppend(&test, " test_loss=", absl::StrFormat("%.4f", p.test_loss()));
    if (p.perplexity() > 0)
      absl::StrAppend(&test, " perplexity=", absl::StrFormat("%.3f", p.perplexity()));
    return absl::StrCat("job ", job.job_id(), " SUCCEEDED accuracy=", Accuracy(p.accuracy()), test,
                        " loss=", Loss(p), " steps=", StepOfTotal(p),
                        " samples_per_s(all workers)=", FormatRate(p.samples_per_s()),
                        " time=", FormatClock(wall_s));
  }
  std::string out =
      absl::StrCat("job ", job.job_id(), " ", StateName(job.state()), " at step ", StepOfTotal(p));
  if (!job.message().empty()) absl::StrAppend(&out, ": ", job.message());
  return out;
}

}  // namespace cli
}  // namespace gradmesh
