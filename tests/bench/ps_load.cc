// Load generator for the parameter service: many simulated workers against 1-8 real shards.
//
//   bazel run -c opt //tests/bench:ps_load [-- --shards=1,2,4,8 --workers=1,2,4,8,16,32,64
//                                             --params=1000000 --step_rate=0 --seconds=3]
//
// For each shard count it starts that many gradmesh_server processes on 127.0.0.1 (the
// binary from the runfiles, or --server_binary), registers one async job through the
// ParameterClient as a worker does (InitJob; --layers weight/bias tensor pairs, --params
// float32 parameters in all, cut into --chunk_bytes chunks), and then, for each worker count,
// runs that many simulated workers: threads, each with its own ParameterClient (own gRPC
// connections), doing training steps without training. A step pushes a gradient for the whole
// model (one fused message per shard) and then pulls the whole model: one PushPull call, the
// push carrying its pull as an async worker's exchange does (--fused=false: a Push, then a
// Pull, as before PushRequest.pull), paced to --step_rate
// steps/s per worker (0 = back to back; a worker that falls behind does not catch up in a
// burst). After --warmup_s the window of --seconds is measured:
//
//   steps_per_s        steps completed in the window, all workers together
//   updates_per_s      pushes applied by the shards (sum of the shards' pushes_applied, read
//                      with GetJobInfo before and after; one push to one shard = one update)
//   step_p50/p99_ms    latency of a step (push + pull), and of its push and its pull (fused:
//                      push = the whole step, pull = 0)
//   shard_cpu_*        utime+stime of the shard processes (/proc/<pid>/stat) over the window:
//                      cores busy, us per update (the update's push apply plus the pull that
//                      goes with it), us per MB of payload (pushed + pulled, 1e6 bytes)
//   client_cpu_*       the same for this process (all simulated workers), from getrusage
//
// One JSON object per (shards, workers) line. Latency is measured from the moment a step
// actually starts (not from when the pacing wanted it), so with --step_rate it understates
// queueing once workers fall behind; steps_per_s then shows the shortfall.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/daemon.h"
#include "rpc/grpc_util.h"
#include "tests/testing/subprocess.h"
#include "worker/ps/parameter_client.h"

ABSL_FLAG(std::string, shards, "1,2,4,8", "Shard counts to measure (comma-separated).");
ABSL_FLAG(std::string, workers, "1,2,4,8,16,32,64",
          "Simulated worker counts to measure for each shard count (comma-separated).");
ABSL_FLAG(int64_t, params, 1000000, "Model size: float32 parameters over all tensors.");
ABSL_FLAG(int, layers, 4,
          "The model is this many layers, each a weight tensor and a bias tensor (1/250 of "
          "the layer, at most 1024 elements).");
ABSL_FLAG(int64_t, chunk_bytes, 65536, "Chunk size of the job's layout, bytes of float32.");
ABSL_FLAG(bool, fused, true,
          "A step is one PushPull (the push carries its pull); false: Push, then Pull.");
ABSL_FLAG(double, step_rate, 0, "Steps/s per simulated worker; 0 = as fast as possible.");
ABSL_FLAG(double, seconds, 3.0, "Measurement window per configuration.");
ABSL_FLAG(double, warmup_s, 1.0, "Unmeasured seconds before each window.");
ABSL_FLAG(std::string, server_binary, "",
          "gradmesh_server to start (default: from the runfiles, or bazel-bin).");
ABSL_FLAG(std::string, log_dir, "",
          "Where the shards' logs go (default: a new /tmp directory, removed after a run that "
          "succeeded).");

namespace gradmesh {
namespace {

using testutil::Subprocess;

std::vector<int> ParseInts(const std::string& s) {
  std::vector<int> out;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int v;
    if (absl::SimpleAtoi(p, &v) && v > 0) out.push_back(v);
  }
  return out;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

// utime + stime of process `pid`, seconds (fields 14 and 15 of /proc/<pid>/stat).
absl::StatusOr<double> ProcessCpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(in, line)) return absl::NotFoundError(absl::StrCat("no stat for ", pid));
  // The command name (field 2) is in parentheses and may hold spaces: count from its end.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return absl::InternalError("bad /proc stat line");
  std::vector<std::string> f = absl::StrSplit(line.substr(close + 2), ' ');
  // f[0] is field 3 (state), so utime (14) and stime (15) are f[11] and f[12].
  int64_t utime = 0, stime = 0;
  if (f.size() < 13 || !absl::SimpleAtoi(f[11], &utime) || !absl::SimpleAtoi(f[12], &stime)) {
    return absl::InternalError("bad /proc stat fields");
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double SelfCpuSeconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

double LoadAverage1() {
  double load[1] = {0};
  return getloadavg(load, 1) == 1 ? load[0] : -1;
}

std::string FindServerBinary(const char* argv0) {
  if (!absl::GetFlag(FLAGS_server_binary).empty()) return absl::GetFlag(FLAGS_server_binary);
  const std::string rel = "server/gradmesh_server";
  std::vector<std::string> candidates;
  if (const char* d = std::getenv("RUNFILES_DIR")) {
    candidates.push_back(absl::StrCat(d, "/gradmesh/", rel));
  }
  candidates.push_back(absl::StrCat(argv0, ".runfiles/gradmesh/", rel));
  if (const char* w = std::getenv("BUILD_WORKSPACE_DIRECTORY")) {
    candidates.push_back(absl::StrCat(w, "/bazel-bin/", rel));
  }
  candidates.push_back(absl::StrCat("bazel-bin/", rel));
  for (const auto& c : candidates) {
    if (access(c.c_str(), X_OK) == 0) return c;
  }
  return rel;
}

// The shards of one shard count: real gradmesh_server processes on 127.0.0.1.
struct Fleet {
  std::vector<std::unique_ptr<Subprocess>> procs;
  std::vector<std::string> addresses;

  absl::StatusOr<double> CpuSeconds() const {
    double total = 0;
    for (const auto& p : procs) {
      absl::StatusOr<double> s = ProcessCpuSeconds(p->pid());
      if (!s.ok()) return s.status();
      total += *s;
    }
    return total;
  }

  void Stop() {
    for (auto& p : procs) (void)p->Signal(SIGTERM);
    for (auto& p : procs) {
      if (!p->Wait(absl::Seconds(10)).ok()) (void)p->Signal(SIGKILL);
    }
    procs.clear();
    addresses.clear();
  }
};

absl::StatusOr<Fleet> StartFleet(const std::string& binary, const std::string& dir, int n) {
  Fleet fleet;
  for (int s = 0; s < n; ++s) {
    const std::string port_file = absl::StrCat(dir, "/shard", n, "_", s, ".port");
    unlink(port_file.c_str());
    absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(
        {binary, "--host=127.0.0.1", "--port=0", absl::StrCat("--port_file=", port_file),
         absl::StrCat("--node=load-shard", s)},
        {}, absl::StrCat(dir, "/shard", n, "_", s, ".log"));
    if (!proc.ok()) return proc.status();
    fleet.procs.push_back(std::move(proc).value());
  }
  for (int s = 0; s < n; ++s) {
    const std::string port_file = absl::StrCat(dir, "/shard", n, "_", s, ".port");
    absl::StatusOr<int> port =
        testutil::WaitForPortFile(port_file, absl::Seconds(30), fleet.procs[s].get());
    if (!port.ok()) return port.status();
    fleet.addresses.push_back(absl::StrCat("127.0.0.1:", *port));
  }
  return fleet;
}

// A model-like layout: --layers (weight, bias) pairs holding `params` float32 in all.
JobLayout MakeLayout(const std::string& job, int64_t params, int layers, int num_workers) {
  JobLayout layout;
  layout.job = job;
  const int64_t per_layer = std::max<int64_t>(2, params / layers);
  const int64_t bias = std::clamp<int64_t>(per_layer / 250, 1, 1024);
  for (int l = 0; l < layers; ++l) {
    // The last layer takes the remainder, so the tensors hold exactly `params`.
    const int64_t layer = l + 1 < layers ? per_layer : params - per_layer * (layers - 1);
    TensorSpec w;
    w.set_name(absl::StrCat("layer", l, ".weight"));
    w.add_shape(layer - bias);
    TensorSpec b;
    b.set_name(absl::StrCat("layer", l, ".bias"));
    b.add_shape(bias);
    layout.tensors.push_back(w);
    layout.tensors.push_back(b);
  }
  layout.chunk_elems = std::max<int64_t>(1, absl::GetFlag(FLAGS_chunk_bytes) / 4);
  layout.optimizer.set_name("sgd");
  layout.optimizer.set_lr(1e-6);
  layout.consistency = "async";
  layout.num_workers = num_workers;
  return layout;
}

int64_t Numel(const TensorSpec& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  return n;
}

// What the simulated workers record; each worker thread fills its own.
struct WorkerRecord {
  std::vector<double> step_us, push_us, pull_us;  // Steps completed inside the window.
};

// The window's start and end, set by the measuring thread while the workers run.
class Window {
 public:
  void Open(absl::Time t) {
    absl::MutexLock lock(&mu_);
    start_ = t;
  }
  void Close(absl::Time t) {
    absl::MutexLock lock(&mu_);
    end_ = t;
  }
  bool Contains(absl::Time t) const {
    absl::MutexLock lock(&mu_);
    return t >= start_ && t < end_;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time start_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time end_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
};

struct Snapshot {
  absl::Time time;
  double shard_cpu = 0;
  double client_cpu = 0;
  int64_t updates = 0;
  int64_t bytes = 0;  // Payload pushed + pulled by all clients.
};

absl::StatusOr<Snapshot> TakeSnapshot(const Fleet& fleet, ParameterClient* info_client,
                                      const std::vector<std::unique_ptr<ParameterClient>>& c) {
  Snapshot s;
  absl::StatusOr<std::vector<JobInfoResponse>> infos = info_client->GetJobInfo();
  if (!infos.ok()) return infos.status();
  for (const JobInfoResponse& info : *infos) s.updates += info.pushes_applied();
  for (const auto& client : c) s.bytes += client->bytes_pushed() + client->bytes_pulled();
  absl::StatusOr<double> cpu = fleet.CpuSeconds();
  if (!cpu.ok()) return cpu.status();
  s.shard_cpu = *cpu;
  s.client_cpu = SelfCpuSeconds();
  s.time = absl::Now();
  return s;
}

// What every simulated worker of one configuration shares.
struct WorkerShared {
  const JobLayout* layout = nullptr;
  absl::Span<const float> grad;  // At least as long as the largest tensor.
  int num_workers = 1;
  double step_rate = 0;
  bool fused = true;
  // Shards take a worker's steps in increasing order only (a lower step is a duplicate), so
  // each configuration's workers number their steps from here.
  int64_t first_step = 0;
  const Window* window = nullptr;
  const std::atomic<bool>* stop = nullptr;
  std::atomic<bool>* failed = nullptr;
};

// One simulated worker: paced push+pull steps until `stop`.
void WorkerLoop(const WorkerShared& sh, ParameterClient* client, int rank, WorkerRecord* rec) {
  const JobLayout& layout = *sh.layout;
  const absl::Span<const float> grad = sh.grad;
  const int num_workers = sh.num_workers;
  const Window& window = *sh.window;
  std::vector<std::vector<float>> params;
  std::vector<absl::Span<float>> pull_spans;
  std::vector<absl::Span<const float>> push_spans;
  for (const TensorSpec& t : layout.tensors) {
    params.emplace_back(Numel(t));
    pull_spans.emplace_back(params.back());
    push_spans.push_back(grad.subspan(0, Numel(t)));
  }
  const double rate = sh.step_rate;
  const absl::Duration period = rate > 0 ? absl::Seconds(1.0 / rate) : absl::ZeroDuration();
  // Workers start spread over one period, as real workers drift apart.
  absl::Time next = absl::Now() + period * rank / num_workers;
  for (int64_t step = sh.first_step; !sh.stop->load(std::memory_order_relaxed); ++step) {
    if (rate > 0) {
      absl::SleepFor(next - absl::Now());
      next += period;
      // Fell behind by more than a period: skip ahead instead of bursting.
      if (next < absl::Now() - period) next = absl::Now();
    }
    const absl::Time t0 = absl::Now();
    absl::Status st = sh.fused ? client->PushPull(step, push_spans, pull_spans, nullptr)
                               : client->Push(step, push_spans);
    const absl::Time t1 = absl::Now();
    if (st.ok() && !sh.fused) st = client->Pull(pull_spans);
    const absl::Time t2 = absl::Now();
    if (!st.ok()) {
      std::fprintf(stderr, "event=step_failed worker=%d error=\"%s\"\n", rank,
                   st.ToString().c_str());
      sh.failed->store(true);
      return;
    }
    if (window.Contains(t2)) {
      rec->step_us.push_back(absl::ToDoubleMicroseconds(t2 - t0));
      rec->push_us.push_back(absl::ToDoubleMicroseconds(t1 - t0));
      rec->pull_us.push_back(absl::ToDoubleMicroseconds(t2 - t1));
    }
  }
}

struct Config {
  int shards = 1;
  int workers = 1;
  int64_t params = 0;
  int64_t first_step = 0;
};

void PrintResult(const Config& cfg, const Snapshot& a, const Snapshot& b,
                 const std::vector<WorkerRecord>& recs) {
  WorkerRecord all;
  for (const WorkerRecord& r : recs) {
    all.step_us.insert(all.step_us.end(), r.step_us.begin(), r.step_us.end());
    all.push_us.insert(all.push_us.end(), r.push_us.begin(), r.push_us.end());
    all.pull_us.insert(all.pull_us.end(), r.pull_us.begin(), r.pull_us.end());
  }
  const double wall = absl::ToDoubleSeconds(b.time - a.time);
  const int64_t steps = static_cast<int64_t>(all.step_us.size());
  const int64_t updates = b.updates - a.updates;
  const double shard_cpu = b.shard_cpu - a.shard_cpu;
  const double client_cpu = b.client_cpu - a.client_cpu;
  const double mb = static_cast<double>(b.bytes - a.bytes) / 1e6;
  const double per_update = updates > 0 ? shard_cpu / static_cast<double>(updates) * 1e6 : 0;
  std::printf(
      "{\"fused\":%s,\"shards\":%d,\"workers\":%d,\"params\":%lld,\"bytes_per_update\":%lld,"
      "\"step_rate\":%g,\"seconds\":%.2f,\"steps\":%lld,\"steps_per_s\":%.1f,"
      "\"updates\":%lld,\"updates_per_s\":%.1f,\"payload_mb_per_s\":%.1f,"
      "\"step_p50_ms\":%.2f,\"step_p99_ms\":%.2f,\"push_p50_ms\":%.2f,\"push_p99_ms\":%.2f,"
      "\"pull_p50_ms\":%.2f,\"pull_p99_ms\":%.2f,"
      "\"shard_cpu_s\":%.2f,\"shard_cores\":%.2f,\"shard_cpu_us_per_update\":%.1f,"
      "\"shard_cpu_us_per_mb\":%.1f,\"client_cpu_s\":%.2f,\"client_cores\":%.2f,"
      "\"client_cpu_us_per_step\":%.1f,\"cores\":%u,\"loadavg\":%.2f}\n",
      absl::GetFlag(FLAGS_fused) ? "true" : "false", cfg.shards, cfg.workers,
      static_cast<long long>(cfg.params), static_cast<long long>(cfg.params * 4 / cfg.shards),
      absl::GetFlag(FLAGS_step_rate), wall, static_cast<long long>(steps),
      static_cast<double>(steps) / wall, static_cast<long long>(updates),
      static_cast<double>(updates) / wall, mb / wall, Percentile(all.step_us, 0.5) / 1e3,
      Percentile(all.step_us, 0.99) / 1e3, Percentile(all.push_us, 0.5) / 1e3,
      Percentile(all.push_us, 0.99) / 1e3, Percentile(all.pull_us, 0.5) / 1e3,
      Percentile(all.pull_us, 0.99) / 1e3, shard_cpu, shard_cpu / wall, per_update,
      mb > 0 ? shard_cpu / mb * 1e6 : 0, client_cpu, client_cpu / wall,
      steps > 0 ? client_cpu / static_cast<double>(steps) * 1e6 : 0,
      std::thread::hardware_concurrency(), LoadAverage1());
  std::fflush(stdout);
}

// Runs `cfg.workers` simulated workers against the fleet's job and prints their line.
absl::Status RunConfig(const Fleet& fleet, const JobLayout& layout, const Config& cfg,
                       ParameterClient* info_client, absl::Span<const float> grad) {
  std::vector<std::unique_ptr<ParameterClient>> clients;
  for (int w = 0; w < cfg.workers; ++w) {
    GrpcParameterClientOptions co;
    co.servers = fleet.addresses;
    co.worker = w;
    absl::StatusOr<std::unique_ptr<ParameterClient>> c = NewGrpcParameterClient(layout, co);
    if (!c.ok()) return c.status();
    clients.push_back(std::move(c).value());
  }
  Window window;
  std::atomic<bool> stop{false}, failed{false};
  std::vector<WorkerRecord> recs(cfg.workers);
  WorkerShared sh;
  sh.layout = &layout;
  sh.grad = grad;
  sh.num_workers = cfg.workers;
  sh.step_rate = absl::GetFlag(FLAGS_step_rate);
  sh.fused = absl::GetFlag(FLAGS_fused);
  sh.first_step = cfg.first_step;
  sh.window = &window;
  sh.stop = &stop;
  sh.failed = &failed;
  std::vector<std::thread> threads;
  for (int w = 0; w < cfg.workers; ++w) {
    threads.emplace_back(
        [&sh, &clients, &recs, w] { WorkerLoop(sh, clients[w].get(), w, &recs[w]); });
  }
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_warmup_s)));
  absl::StatusOr<Snapshot> a = TakeSnapshot(fleet, info_client, clients);
  if (a.ok()) window.Open(a->time);
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_seconds)));
  absl::StatusOr<Snapshot> b = TakeSnapshot(fleet, info_client, clients);
  if (b.ok()) window.Close(b->time);
  stop = true;
  for (auto& t : threads) t.join();
  if (!a.ok()) return a.status();
  if (!b.ok()) return b.status();
  if (failed) return absl::InternalError("a simulated worker's step failed (see stderr)");
  PrintResult(cfg, *a, *b, recs);
  return absl::OkStatus();
}

// One shard count: starts the shards, registers the job, runs every worker count.
absl::Status RunShards(const std::string& binary, const std::string& dir, int num_shards,
                       const std::vector<int>& worker_counts) {
  absl::StatusOr<Fleet> fleet = StartFleet(binary, dir, num_shards);
  if (!fleet.ok()) return fleet.status();
  const int64_t params = absl::GetFlag(FLAGS_params);
  const int max_workers = *std::max_element(worker_counts.begin(), worker_counts.end());
  const JobLayout layout = MakeLayout(absl::StrCat("load", num_shards), params,
                                      std::max(1, absl::GetFlag(FLAGS_layers)), max_workers);
  GrpcParameterClientOptions co;
  co.servers = fleet->addresses;
  absl::StatusOr<std::unique_ptr<ParameterClient>> init = NewGrpcParameterClient(layout, co);
  if (!init.ok()) return init.status();
  int64_t largest = 0;
  std::vector<std::vector<float>> initial;
  std::vector<absl::Span<const float>> spans;
  for (const TensorSpec& t : layout.tensors) {
    initial.emplace_back(Numel(t), 0.01f);
    largest = std::max(largest, Numel(t));
  }
  for (const auto& v : initial) spans.emplace_back(v);
  absl::Status st = (*init)->InitJob(spans);
  // One gradient buffer, read by every worker (a push only reads it).
  const std::vector<float> grad(largest, 1e-3f);
  int64_t first_step = 0;
  for (int w : worker_counts) {
    if (!st.ok()) break;
    st = RunConfig(*fleet, layout, Config{num_shards, w, params, first_step}, init->get(), grad);
    first_step += int64_t{1} << 40;
  }
  fleet->Stop();
  return st;
}

int Run(const char* argv0) {
  const std::string binary = FindServerBinary(argv0);
  std::string dir = absl::GetFlag(FLAGS_log_dir);
  const bool own_dir = dir.empty();  // Removed after a successful run; kept on failure.
  if (own_dir) {
    std::string tmpl = "/tmp/gradmesh-ps-load.XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) {
      std::fprintf(stderr, "event=mkdtemp_failed\n");
      return 1;
    }
    dir = tmpl;
  }
  const std::vector<int> shard_counts = ParseInts(absl::GetFlag(FLAGS_shards));
  const std::vector<int> worker_counts = ParseInts(absl::GetFlag(FLAGS_workers));
  if (shard_counts.empty() || worker_counts.empty() || absl::GetFlag(FLAGS_params) < 2) {
    std::fprintf(stderr, "event=bad_arguments error=\"need --shards, --workers, --params>=2\"\n");
    return 2;
  }
  std::fprintf(stderr, "event=ps_load_start server=%s logs=%s\n", binary.c_str(), dir.c_str());
  for (int s : shard_counts) {
    const absl::Status st = RunShards(binary, dir, s, worker_counts);
    if (!st.ok()) {
      std::fprintf(stderr, "event=ps_load_failed shards=%d error=\"%s\" logs=%s\n", s,
                   st.ToString().c_str(), dir.c_str());
      return 1;
    }
  }
  if (own_dir) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  return 0;
}

}  // namespace
}  // namespace gradmesh

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  gradmesh::TuneAllocatorForLargeMessages();  // As the daemons do.
  return gradmesh::Run(argv[0]);
}
