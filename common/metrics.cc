// Prometheus text format (see metrics.h).
#include "common/metrics.h"

#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace gradmesh {
namespace {

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

// Backslash and newline escaped, and double quotes too if `quotes` (label values; HELP text
// keeps them).
std::string Escape(absl::string_view v, bool quotes) {
  std::string out;
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quotes) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

std::string EscapeHelp(absl::string_view h) { return Escape(h, /*quotes=*/false); }

}  // namespace

std::string EscapeLabelValue(absl::string_view v) { return Escape(v, /*quotes=*/true); }

void MetricsWriter::Add(absl::string_view name, MetricType type, absl::string_view help,
                        const MetricLabels& labels, double value) {
  auto it = families_.find(std::string(name));
  if (it == families_.end()) {
    it = families_.emplace(std::string(name), Family{type, std::string(help), {}}).first;
    order_.push_back(std::string(name));
  } else if (it->second.type != type) {
    return;  // A family has one type; a collector that disagrees loses this sample.
  }
  std::string line(name);
  if (!labels.empty()) {
    line += '{';
    for (size_t i = 0; i < labels.size(); ++i) {
      if (i > 0) line += ',';
      absl::StrAppend(&line, labels[i].first, "=\"", EscapeLabelValue(labels[i].second), "\"");
    }
    line += '}';
  }
  absl::StrAppend(&line, " ", FormatValue(value));
  it->second.lines.push_back(std::move(line));
}

std::string MetricsWriter::Render() const {
  std::string out;
  for (const std::string& name : order_) {
    const Family& f = families_.at(name);
    absl::StrAppend(&out, "# HELP ", name, " ", EscapeHelp(f.help), "\n# TYPE ", name, " ",
                    f.type == MetricType::kCounter ? "counter" : "gauge", "\n");
    for (const std::string& line : f.lines) absl::StrAppend(&out, line, "\n");
  }
  return out;
}

MetricsRegistry::MetricsRegistry()
    : start_time_(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch())) {}

void MetricsRegistry::AddCollector(Collector collector) {
  absl::MutexLock lock(&mu_);
  collectors_.push_back(std::move(collector));
}

std::string MetricsRegistry::Scrape() {
  absl::MutexLock lock(&mu_);  // One scrape at a time; collectors run in order.
  ++scrapes_;
  MetricsWriter w;
  for (const Collector& c : collectors_) c(&w);
  w.Gauge("gradmesh_process_start_time_seconds",
          "When this process started, Unix seconds (a restart resets the counters).", {},
          start_time_);
  w.Counter("gradmesh_scrapes_total", "Scrapes of /metrics served by this process.", {},
            static_cast<double>(scrapes_));
  return w.Render();
}

}  // namespace gradmesh
