// Metrics in the Prometheus text exposition format (version 0.0.4), pulled at scrape time.
//
// Nothing is counted twice: every daemon already keeps its statistics (a shard's per-job
// counters, a worker's progress reports, the coordinator's job table). A Collector reads them
// when /metrics is scraped and writes samples into a MetricsWriter, which groups them by
// family (one # HELP / # TYPE block each) and renders the text:
//
//   # HELP gradmesh_shard_pushes_applied_total Pushes applied (duplicates excluded).
//   # TYPE gradmesh_shard_pushes_applied_total counter
//   gradmesh_shard_pushes_applied_total{job="mnist",shard="0"} 1234
//
// A MetricsRegistry is a plain value owned by a daemon's main() (no process-wide registry);
// MetricsHttpServer (metrics_http.h) serves it.
//
// Thread safety: MetricsWriter is used by one thread. MetricsRegistry's methods may be
// called from any thread; collectors run on the scraping thread, one scrape at a time.
#ifndef GRADMESH_COMMON_METRICS_H_
#define GRADMESH_COMMON_METRICS_H_

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace gradmesh {

enum class MetricType { kCounter, kGauge };

// Label name -> value, rendered in the given order.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class MetricsWriter {
 public:
  // Adds one sample of family `name` (a valid Prometheus metric name; counters end in
  // _total). The first sample of a family fixes its help and type; a later sample of the
  // same family with another type is dropped (a collector bug must not crash a daemon).
  void Add(absl::string_view name, MetricType type, absl::string_view help,
           const MetricLabels& labels, double value);
  void Counter(absl::string_view name, absl::string_view help, const MetricLabels& labels,
               double value) {
    Add(name, MetricType::kCounter, help, labels, value);
  }
  void Gauge(absl::string_view name, absl::string_view help, const MetricLabels& labels,
             double value) {
    Add(name, MetricType::kGauge, help, labels, value);
  }

  // The text format: families in the order first added, samples in the order added. Label
  // values are escaped (\\, \", \n); values are printed with up to 17 significant digits,
  // NaN and infinities as NaN, +Inf, -Inf.
  std::string Render() const;

 private:
  struct Family {
    MetricType type;
    std::string help;
    std::vector<std::string> lines;  // Rendered samples.
  };
  std::vector<std::string> order_;
  std::map<std::string, Family> families_;
};

class MetricsRegistry {
 public:
  using Collector = std::function<void(MetricsWriter*)>;

  MetricsRegistry();  // Records the start time (the daemon's start).

  // Adds a collector, run on every scrape after those added before it.
  void AddCollector(Collector collector) ABSL_LOCKS_EXCLUDED(mu_);

  // Runs every collector and renders their samples, plus gradmesh_process_start_time_seconds
  // (a gauge: when the registry was made, i.e. the daemon's start-up) and
  // gradmesh_scrapes_total.
  std::string Scrape() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  std::vector<Collector> collectors_ ABSL_GUARDED_BY(mu_);
  const double start_time_;
  int64_t scrapes_ ABSL_GUARDED_BY(mu_) = 0;
};

// Label value escaping of the text format.
std::string EscapeLabelValue(absl::string_view v);

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_METRICS_H_
