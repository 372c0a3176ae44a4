// The coordinator's web dashboard (see dashboard.h).
#include "coordinator/dashboard.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"

namespace gradmesh {
namespace {

// Chart geometry (SVG user units = CSS px).
constexpr int kChartW = 380;
constexpr int kChartH = 170;
constexpr int kPadL = 58;
constexpr int kPadR = 12;
constexpr int kPadT = 22;
constexpr int kPadB = 26;

constexpr char kCss[] = R"css(
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:16px 24px;
color:#1d2330;background:#f5f6f8;font-size:14px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:18px 0 6px}
h3{font-size:14px;margin:10px 0 4px;color:#444}
.sub{color:#667;margin-bottom:12px}
table{border-collapse:collapse;background:#fff;margin-bottom:8px}
th,td{padding:4px 10px;border-bottom:1px solid #e3e5ea;text-align:left;white-space:nowrap}
th{background:#eceef2;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.job{background:#fff;border:1px solid #dde0e6;border-radius:6px;padding:10px 14px;margin:12px 0}
.charts{display:flex;flex-wrap:wrap;gap:10px}
.charts svg{background:#fbfbfd;border:1px solid #e3e5ea;border-radius:4px}
.bar{display:inline-block;width:90px;height:9px;background:#e3e5ea;border-radius:4px;
vertical-align:middle;margin-right:6px}.bar>span{display:block;height:9px;background:#3b7ddd;
border-radius:4px}
.s-RUNNING{color:#1a7f37;font-weight:600}.s-SUCCEEDED{color:#0b5cad;font-weight:600}
.s-FAILED{color:#c62828;font-weight:600}.s-PAUSED,.s-PENDING{color:#b26a00;font-weight:600}
.s-CANCELLED{color:#666;font-weight:600}.dead{color:#c62828;font-weight:600}
.alive{color:#1a7f37}.msg{color:#8a1c1c}a{color:#0b5cad}
.flex{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start}
)css";

std::string Num(double v) { return absl::StrFormat("%.17g", v); }

std::string JsonNum(double v) { return std::isfinite(v) ? Num(v) : "null"; }

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      absl::StrAppend(&out, "\\", std::string(1, static_cast<char>(c)));
    } else if (c < 0x20) {
      absl::StrAppend(&out, absl::StrFormat("\\u%04x", c));
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out + "\"";
}

std::string StateText(JobState s) {
  return JobState_IsValid(s) ? JobState_Name(s) : absl::StrCat("STATE_", static_cast<int>(s));
}

std::string Rate(double per_s) {
  if (!(per_s > 0)) return "-";
  if (per_s >= 1000) return absl::StrFormat("%.1fk", per_s / 1000);
  return absl::StrFormat("%.0f", per_s);
}

std::string Clock(double s) {
  if (s < 0 || !std::isfinite(s)) return "-";
  const int64_t t = static_cast<int64_t>(std::llround(s));
  if (t >= 3600) return absl::StrFormat("%d:%02d:%02d", t / 3600, t / 60 % 60, t % 60);
  return absl::StrFormat("%d:%02d", t / 60, t % 60);
}

int Percent(const JobProgress& p) {
  if (p.total_steps() <= 0 || p.step() <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(100, p.step() * 100 / p.total_steps()));
}

std::string Fixed(double v, bool valid) { return valid ? absl::StrFormat("%.4f", v) : "-"; }

// A short axis label.
std::string AxisText(double v) {
  if (std::fabs(v) >= 1e6) return absl::StrFormat("%.3gM", v / 1e6);
  if (std::fabs(v) >= 1000) return absl::StrFormat("%.3gk", v / 1000);
  return absl::StrFormat("%.3g", v);
}

struct Series {
  std::vector<int64_t> steps;
  std::vector<double> values;
};

Series MetricSeries(const coordinator_state::JobHistory& h, const std::string& metric) {
  Series s;
  for (const auto& p : h.points()) {
    const double v = metric == "loss"       ? p.loss()
                     : metric == "accuracy" ? p.accuracy()
                                            : p.samples_per_s();
    if (metric == "accuracy" && v < 0) continue;
    if (!std::isfinite(v)) continue;
    s.steps.push_back(p.step());
    s.values.push_back(v);
  }
  return s;
}

// One metric's chart as inline SVG (see dashboard.h for the polyline's attributes).
std::string Chart(const std::string& job_id, const std::string& metric, const std::string& title,
                  const Series& s, const char* color) {
  std::string out = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
      "role=\"img\" aria-label=\"%s\">",
      kChartW, kChartH, kChartW, kChartH, HtmlEscape(title));
  absl::StrAppend(&out, "<text x=\"", kPadL, "\" y=\"15\" font-size=\"13\" font-weight=\"600\">",
                  HtmlEscape(title), "</text>");
  const int w = kChartW - kPadL - kPadR, h = kChartH - kPadT - kPadB;
  absl::StrAppend(&out, "<rect x=\"", kPadL, "\" y=\"", kPadT, "\" width=\"", w, "\" height=\"", h,
                  "\" fill=\"none\" stroke=\"#c9cdd6\"/>");
  if (s.values.empty()) {
    absl::StrAppend(&out, "<text x=\"", kPadL + w / 2, "\" y=\"", kPadT + h / 2,
                    "\" font-size=\"12\" fill=\"#889\" text-anchor=\"middle\">no data yet</text>",
                    "</svg>");
    return out;
  }
  double lo = *std::min_element(s.values.begin(), s.values.end());
  double hi = *std::max_element(s.values.begin(), s.values.end());
  if (hi - lo < 1e-12) {
    lo -= std::max(std::fabs(lo) * 0.05, 1e-6);
    hi += std::max(std::fabs(hi) * 0.05, 1e-6);
  }
  const int64_t x0 = s.steps.front(), x1 = std::max(s.steps.back(), x0 + 1);
  std::vector<std::string> pts, vals;
  for (size_t i = 0; i < s.values.size(); ++i) {
    const double x = s.values.size() == 1
                         ? kPadL + w / 2.0
                         : kPadL + static_cast<double>(s.steps[i] - x0) / (x1 - x0) * w;
    const double y = kPadT + (1 - (s.values[i] - lo) / (hi - lo)) * h;
    pts.push_back(absl::StrFormat("%.1f,%.1f", x, y));
    vals.push_back(Num(s.values[i]));
  }
  absl::StrAppend(&out, "<text x=\"", kPadL - 4, "\" y=\"", kPadT + 9,
                  "\" font-size=\"11\" text-anchor=\"end\">", AxisText(hi), "</text>");
  absl::StrAppend(&out, "<text x=\"", kPadL - 4, "\" y=\"", kPadT + h,
                  "\" font-size=\"11\" text-anchor=\"end\">", AxisText(lo), "</text>");
  absl::StrAppend(&out, "<text x=\"", kPadL, "\" y=\"", kChartH - 8, "\" font-size=\"11\">step ",
                  x0, "</text><text x=\"", kPadL + w, "\" y=\"", kChartH - 8,
                  "\" font-size=\"11\" text-anchor=\"end\">step ", s.steps.back(), "</text>");
  absl::StrAppend(&out, "<polyline class=\"curve\" data-job=\"", HtmlEscape(job_id),
                  "\" data-metric=\"", metric, "\" data-n=\"", s.values.size(), "\" data-values=\"",
                  absl::StrJoin(vals, " "), "\" fill=\"none\" stroke=\"", color,
                  "\" stroke-width=\"2\" points=\"", absl::StrJoin(pts, " "), "\"/>");
  if (s.values.size() == 1) {
    const std::string cx = pts[0].substr(0, pts[0].find(','));
    const std::string cy = pts[0].substr(pts[0].find(',') + 1);
    absl::StrAppend(&out, "<circle cx=\"", cx, "\" cy=\"", cy, "\" r=\"4\" fill=\"", color,
                    "\"/><text x=\"", cx, "\" y=\"", cy,
                    "\" dy=\"-8\" font-size=\"12\" text-anchor=\"middle\">",
                    absl::StrFormat("%.4g", s.values[0]), "</text>");
  }
  return out + "</svg>";
}

std::string Charts(const JobStatus& job, const coordinator_state::JobHistory& h) {
  const std::string& id = job.job_id();
  return absl::StrCat(
      "<div class=\"charts\">",
      Chart(id, "loss", "loss (mean over ranks)", MetricSeries(h, "loss"), "#d9480f"),
      Chart(id, "accuracy", "accuracy (rank 0)", MetricSeries(h, "accuracy"), "#1a7f37"),
      Chart(id, "samples_per_s", "samples/s (all workers)", MetricSeries(h, "samples_per_s"),
            "#3b7ddd"),
      "</div>");
}

std::string Placement(const JobStatus& job) {
  std::string out = "<div class=\"flex\">";
  if (job.shards_size() > 0) {
    absl::StrAppend(&out, "<table><tr><th>shard</th><th>node</th><th>address</th><th>health</th>",
                    "</tr>");
    for (const ShardPlacement& s : job.shards()) {
      absl::StrAppend(&out, "<tr><td class=\"n\">", s.shard(), "</td><td>", HtmlEscape(s.node()),
                      "</td><td>", HtmlEscape(s.address()), "</td><td class=\"",
                      s.alive() ? "alive\">alive" : "dead\">down", "</td></tr>");
    }
    out += "</table>";
  }
  absl::StrAppend(&out, "<table><tr><th>rank</th><th>node</th><th>address</th><th>state</th>",
                  "<th>step</th><th>moved</th></tr>");
  for (const WorkerPlacement& w : job.workers()) {
    absl::StrAppend(&out, "<tr><td class=\"n\">", w.rank(), "</td><td>",
                    w.node().empty() ? "-" : HtmlEscape(w.node()), "</td><td>",
                    HtmlEscape(w.address()), "</td><td>", HtmlEscape(w.state()),
                    "</td><td class=\"n\">", w.step(), "</td><td class=\"n\">", w.reassignments(),
                    "</td></tr>");
  }
  return out + "</table></div>";
}

std::string JobsTable(const std::vector<JobStatus>& jobs) {
  std::string out =
      "<table><tr><th>job</th><th>state</th><th>mode</th><th>progress</th><th>ETA</th>"
      "<th>loss</th><th>accuracy</th><th>samples/s (all workers)</th><th>workers</th></tr>";
  for (const JobStatus& j : jobs) {
    const JobProgress& p = j.progress();
    const std::string id = HtmlEscape(j.job_id());
    const std::string total = p.total_steps() > 0 ? absl::StrCat(p.total_steps()) : "-";
    absl::StrAppend(
        &out, "<tr><td><a href=\"/job/", id, "\">", id, "</a></td><td class=\"s-",
        StateText(j.state()), "\">", StateText(j.state()), "</td><td>", HtmlEscape(j.spec().mode()),
        "</td><td><span class=\"bar\"><span style=\"width:", Percent(p), "%\"></span></span>",
        Percent(p), "% (", p.step(), "/", total, ")</td><td class=\"n\">", Clock(p.eta_s()),
        "</td><td class=\"n\">", Fixed(p.loss(), p.step() > 0), "</td><td class=\"n\">",
        Fixed(p.accuracy(), p.accuracy() >= 0), "</td><td class=\"n\">", Rate(p.samples_per_s()),
        "</td><td class=\"n\">", j.workers_size(), "</td></tr>");
  }
  if (jobs.empty()) out += "<tr><td colspan=\"9\">no jobs yet (gradmesh submit JOB.yaml)</td></tr>";
  return out + "</table>";
}

std::string NodesTable(const std::vector<coordinator_state::NodeRecord>& nodes) {
  std::string out =
      "<table><tr><th>node</th><th>role</th><th>address</th><th>host</th><th>slots</th>"
      "<th>health</th></tr>";
  for (const auto& n : nodes) {
    const NodeInfo& i = n.info();
    absl::StrAppend(&out, "<tr><td>", HtmlEscape(i.name()), "</td><td>",
                    i.role() == SERVER   ? "server"
                    : i.role() == WORKER ? "worker"
                                         : "?",
                    "</td><td>", HtmlEscape(i.address()), "</td><td>", HtmlEscape(i.host()),
                    "</td><td class=\"n\">", i.slots(), "</td><td class=\"",
                    n.alive() ? "alive\">alive" : "dead\">dead", "</td></tr>");
  }
  if (nodes.empty()) out += "<tr><td colspan=\"6\">no nodes registered</td></tr>";
  return out + "</table>";
}

std::string JobSection(const DashboardData& data, const JobStatus& job) {
  const std::string id = HtmlEscape(job.job_id());
  auto it = data.history.find(job.job_id());
  const coordinator_state::JobHistory empty;
  const JobProgress& p = job.progress();
  std::string out =
      absl::StrCat("<div class=\"job\" id=\"job-", id, "\"><h2><a href=\"/job/", id, "\">", id,
                   "</a> <span class=\"s-", StateText(job.state()), "\">", StateText(job.state()),
                   "</span></h2><div class=\"sub\">", HtmlEscape(job.spec().model().name()), " on ",
                   HtmlEscape(job.spec().dataset().name()), ", ", HtmlEscape(job.spec().mode()),
                   ", ", job.workers_size(), " workers, ", job.shards_size(), " shards; step ",
                   p.step(), "/", p.total_steps(), ", ETA ", Clock(p.eta_s()),
                   ", samples/s (all workers) ", Rate(p.samples_per_s()), "</div>");
  if (!job.message().empty()) {
    absl::StrAppend(&out, "<div class=\"msg\">", HtmlEscape(job.message()), "</div>");
  }
  absl::StrAppend(&out, Charts(job, it == data.history.end() ? empty : it->second),
                  "<h3>placement</h3>", Placement(job), "</div>");
  return out;
}

std::string Page(const std::string& title, const DashboardData& data, const std::string& body) {
  return absl::StrCat(
      "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" "
      "content=\"width=device-width,initial-scale=1\"><title>",
      HtmlEscape(title), "</title><style>", kCss, "</style></head><body><h1>", HtmlEscape(title),
      "</h1><div class=\"sub\">gradmesh coordinator &middot; ",
      absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::FromUnixMillis(data.now_ms),
                       absl::UTCTimeZone()),
      " &middot; <a href=\"/\">all jobs</a> &middot; <a href=\"/api/jobs\">/api/jobs</a> &middot; "
      "<a href=\"/metrics\">/metrics</a> &middot; reload for fresh figures</div>",
      body, "</body></html>\n");
}

}  // namespace

std::string HtmlEscape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

std::string DashboardPage(const DashboardData& data) {
  std::string body = absl::StrCat("<h2>jobs</h2>", JobsTable(data.jobs));
  int shown = 0;
  for (const JobStatus& job : data.jobs) {
    if (shown++ == kMaxCurveJobs) break;
    absl::StrAppend(&body, JobSection(data, job));
  }
  absl::StrAppend(&body, "<h2>nodes</h2>", NodesTable(data.nodes));
  return Page("gradmesh dashboard", data, body);
}

std::string JobPage(const DashboardData& data, const std::string& job_id) {
  for (const JobStatus& job : data.jobs) {
    if (job.job_id() != job_id) continue;
    return Page(absl::StrCat("gradmesh job ", job_id), data,
                absl::StrCat(JobsTable({job}), JobSection(data, job)));
  }
  return "";
}

std::string JobsJson(const DashboardData& data) {
  std::vector<std::string> jobs;
  for (const JobStatus& j : data.jobs) {
    const JobProgress& p = j.progress();
    std::vector<std::string> points;
    auto it = data.history.find(j.job_id());
    int64_t stride = 1, offered = 0;
    if (it != data.history.end()) {
      stride = std::max<int64_t>(it->second.stride(), 1);
      offered = it->second.offered();
      for (const auto& h : it->second.points()) {
        points.push_back(absl::StrCat("{\"index\":", h.index(), ",\"t_ms\":", h.t_ms(),
                                      ",\"step\":", h.step(), ",\"loss\":", JsonNum(h.loss()),
                                      ",\"accuracy\":", JsonNum(h.accuracy()),
                                      ",\"samples_per_s\":", JsonNum(h.samples_per_s()), "}"));
      }
    }
    jobs.push_back(absl::StrCat(
        "{\"job_id\":", JsonString(j.job_id()), ",\"state\":", JsonString(StateText(j.state())),
        ",\"message\":", JsonString(j.message()), ",\"mode\":", JsonString(j.spec().mode()),
        ",\"step\":", p.step(), ",\"total_steps\":", p.total_steps(),
        ",\"eta_s\":", JsonNum(p.eta_s()), ",\"loss\":", JsonNum(p.loss()),
        ",\"accuracy\":", JsonNum(p.accuracy()), ",\"samples_per_s\":", JsonNum(p.samples_per_s()),
        ",\"history\":{\"stride\":", stride, ",\"offered\":", offered, ",\"points\":[",
        absl::StrJoin(points, ","), "]}}"));
  }
  std::vector<std::string> nodes;
  for (const auto& n : data.nodes) {
    nodes.push_back(absl::StrCat("{\"name\":", JsonString(n.info().name()),
                                 ",\"role\":", JsonString(NodeRole_Name(n.info().role())),
                                 ",\"address\":", JsonString(n.info().address()),
                                 ",\"alive\":", n.alive() ? "true" : "false", "}"));
  }
  return absl::StrCat("{\"now_ms\":", data.now_ms, ",\"jobs\":[", absl::StrJoin(jobs, ","),
                      "],\"nodes\":[", absl::StrJoin(nodes, ","), "]}\n");
}

}  // namespace gradmesh
