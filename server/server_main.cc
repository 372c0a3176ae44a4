// gradmesh_server: one parameter-server shard.
//
//   gradmesh_server --port=7001 [--host=0.0.0.0] [--port_file=F] [--max_message_mb=256]
//
// With --data_dir, jobs that ask for durability keep their state in RocksDB there, and a
// restart on the same directory restores them (see server/shard.h).
//
// Serves ParameterService until SIGTERM/SIGINT, then stops accepting calls, lets calls in
// flight finish (up to --shutdown_grace_s) and exits 0.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/daemon.h"
#include "common/job_name.h"
#include "common/job_spec.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "rpc/auth.h"
#include "rpc/rpc_options.h"
#include "rpc/tls.h"
#include "runtime/daemon_main.h"
#include "runtime/node_agent.h"
#include "server/parameter_service.h"
#include "server/shard.h"
#include "server/shard_metrics.h"
#include "server/shard_store.h"

ABSL_FLAG(std::string, host, "0.0.0.0", "Address to listen on.");
ABSL_FLAG(int, port, 7001, "Port to listen on (0 = pick a free one; see --port_file).");
ABSL_FLAG(std::string, port_file, "", "If set, the bound port is written to this file.");
ABSL_FLAG(int64_t, max_message_mb, 256, "Largest gRPC message sent or received, MiB.");
ABSL_FLAG(int64_t, http2_window_kb, 0,
          "HTTP/2 flow control window, KiB: 0 = gRPC's own (windows sized by probing the link), "
          "N = a fixed window of N KiB per stream, no probing (64 to 1048576; see README, "
          "Performance: faster for messages over 1 MiB, slower for 256 KiB-1 MiB ones).");
ABSL_FLAG(int, metrics_port, -1,
          "Port of the Prometheus endpoint (HTTP GET /metrics, /healthz) on --host: 0 = pick a "
          "free one (see --metrics_port_file), -1 = none.");
ABSL_FLAG(std::string, metrics_port_file, "",
          "If set, the metrics endpoint's bound port is written to this file.");
ABSL_FLAG(std::string, node, "",
          "Node name: in logs, and in service mode this daemon's identity in the coordinator "
          "(keep it across restarts, with --data_dir; default: the advertised host:port).");
ABSL_FLAG(int, shutdown_grace_s, 5, "Seconds to let calls in flight finish on shutdown.");
ABSL_FLAG(int64_t, dedupe_window, 4096, "Push request ids remembered per worker.");
ABSL_FLAG(std::string, data_dir, "",
          "RocksDB directory for durable job state (jobs with durability periodic or "
          "every_update). Empty: memory only. A restarted shard restores every job found here.");
ABSL_FLAG(std::string, node_token_store, "",
          "Service mode: file keeping this node's coordinator-issued token across restarts, so "
          "a restarted daemon registers again at once instead of after the coordinator's "
          "heartbeat timeout. Default: <data_dir>/node-<node>.token (none without "
          "--data_dir); none: memory only.");
ABSL_FLAG(std::string, coordinator, "",
          "Service mode: host:port of gradmesh_coordinator to register with. Jobs' shards are "
          "then placed here by the coordinator, and only its tasks' job tokens are accepted.");
ABSL_FLAG(std::string, auth_token_file, "",
          "Service mode: file holding the token the coordinator takes from daemons (its "
          "--node_token_file, or its API token when it has none).");
ABSL_FLAG(std::string, advertise, "",
          "host:port the coordinator hands to workers (default: --host, or this host's name "
          "when --host is 0.0.0.0, with the bound port).");
ABSL_FLAG(int, slots, 16, "Service mode: shards (of distinct jobs) this server accepts.");
ABSL_FLAG(int64_t, max_memory_bytes, 0,
          "Budget for job state on this shard (values, optimizer slots, sync barrier copies, "
          "snapshot buffers, request ledgers, bookkeeping, 'changes' pull caches); an InitJob "
          "beyond it is RESOURCE_EXHAUSTED. 0 = 80% of physical memory.");
ABSL_FLAG(int32_t, max_tensors_per_job, 65536, "Most tensors in one job's layout.");
ABSL_FLAG(int64_t, max_elements_per_tensor, int64_t{1} << 34,
          "Most elements in one tensor (default 2^34).");
ABSL_FLAG(int64_t, max_chunks_per_job, int64_t{1} << 18,
          "Most chunks in one job's layout, over all its shards (default 2^18).");
ABSL_FLAG(int32_t, max_num_shards, 1024, "Largest num_shards of a job.");
ABSL_FLAG(int32_t, max_num_workers, 4096, "Largest num_workers of a job.");
ABSL_FLAG(int32_t, max_jobs, 1024, "Most jobs this shard holds at once.");
ABSL_FLAG(int32_t, max_waiting_pushes, 4096,
          "Most pushes (sync barrier) and pulls (ssp) waiting on this shard at once.");
ABSL_FLAG(int32_t, shm_channels, 64,
          "Shared-memory channels (ParameterService.OpenShm) open at once, for workers on this "
          "machine run with --ps_transport=shm; 0 refuses them (they keep the Stream).");
ABSL_FLAG(int64_t, shm_spin_us, 0,
          "A shared-memory channel's thread waiting for its worker's next request first spins "
          "(yielding the CPU) for up to this many us while recent gaps were under half of it: "
          "for many small back-to-back operations with cores to spare; 0 = always block.");
ABSL_FLAG(bool, fsync, false,
          "Sync RocksDB's WAL on every write (survive machine crashes, not just process "
          "crashes); costs an fsync per update.");

ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain this daemon presents (TLS on with it or --tls_ca_file).");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(std::string, tls_ca_file, "", "PEM CA bundle peers' certificates are verified against.");
ABSL_FLAG(bool, tls_client_auth, false,
          "Require and verify client certificates (mutual TLS; needs --tls_ca_file).");
ABSL_FLAG(bool, allow_insecure, false,
          "Allow tokens over plaintext to non-loopback addresses (no TLS).");

namespace gradmesh {
namespace {

struct ServerMainOptions {
  DaemonOptions daemon;     // address, port_file, rpc, shutdown_grace, metrics.
  std::string coordinator;  // Service mode when set.
  std::string auth_token;
  std::string advertise;
  int slots = 16;
  std::string node;       // Name in logs.
  std::string node_flag;  // --node as given ("" = default).
  std::string data_dir;
  std::string node_token_store;  // --node_token_store.
  bool fsync = false;
  ShardOptions shard;
  ShmChannelOptions shm;  // Its logger is set in Run.
};

// Service mode: applies the coordinator's task list (job tokens, sync barrier groups) to the
// shard and reports the tasks back. Thread safety: Reconcile and Reports run on the node
// agent's thread (one at a time); the mutex also makes them safe from any thread.
class ServerTasks {
 public:
  // `shard`, `tokens` and `logger` are not owned and must outlive this object.
  ServerTasks(Shard* shard, JobTokens* tokens, const Logger* logger)
      : shard_(shard), tokens_(tokens), logger_(logger) {}

  void Reconcile(const std::vector<Task>& desired) {
    absl::MutexLock lock(&mu_);
    for (const Task& t : desired) ApplyLocked(t);
    // Withdrawn (cancelled or failed job): its workers are stopped; refuse its calls.
    for (const Task& old : tasks_) {
      bool kept = false;
      for (const Task& t : desired) kept |= t.job_id() == old.job_id();
      if (!kept) {
        tokens_->Remove(old.job_id());
        logger_->Info("shard_withdrawn", {Kv("job", old.job_id()), Kv("shard", old.index())});
      }
    }
    tasks_ = desired;
  }

  std::vector<TaskReport> Reports() {
    absl::MutexLock lock(&mu_);
    std::vector<TaskReport> reports;
    for (const Task& t : tasks_) {
      TaskReport r;
      r.set_job_id(t.job_id());
      r.set_index(t.index());
      r.set_state("running");
      r.set_generation(t.generation());
      reports.push_back(std::move(r));
    }
    return reports;
  }

 private:
  void ApplyLocked(const Task& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    bool known = false;
    for (const Task& old : tasks_) {
      known |= old.job_id() == t.job_id() && old.job_token() == t.job_token();
    }
    if (!known) logger_->Info("shard_placed", {Kv("job", t.job_id()), Kv("shard", t.index())});
    tokens_->Set(t.job_id(), t.job_token());
    // Elastic sync: the coordinator sends the barrier group on every heartbeat, and
    // SetSyncGroup is idempotent, so it is simply applied each time. NOT_FOUND: the workers
    // have not called InitJob yet; the next heartbeat (500 ms) retries.
    if (!UsesSyncBarrier(SpecMode(t.spec()))) return;
    const std::vector<int32_t> active(t.active_ranks().begin(), t.active_ranks().end());
    const double lr_scale = t.lr_scale() == 0 ? 1.0 : t.lr_scale();  // 0: unset.
    const absl::Status st = shard_->SetSyncGroup(t.job_id(), active, lr_scale);
    if (st.ok() || absl::IsNotFound(st)) {
      group_errors_.erase(t.job_id());
    } else if (std::string& last = group_errors_[t.job_id()]; last != st.ToString()) {
      last = st.ToString();
      logger_->Error("sync_group_failed", {Kv("job", t.job_id()), Kv("error", last)});
    }
  }

  Shard* const shard_;
  JobTokens* const tokens_;
  const Logger* const logger_;
  absl::Mutex mu_;
  std::vector<Task> tasks_ ABSL_GUARDED_BY(mu_);  // The coordinator's latest list.
  // The last SetSyncGroup error logged per job, so a bad task is logged once, not every
  // heartbeat.
  absl::flat_hash_map<std::string, std::string> group_errors_ ABSL_GUARDED_BY(mu_);
};

// Opens the store (with --data_dir) and creates the shard, restoring stored jobs. Logs the
// failure and sets *exit_code when it returns null.
std::unique_ptr<Shard> OpenShard(ServerMainOptions& options, const Logger& logger, int* exit_code) {
  options.shard.logger = &logger;
  if (!options.data_dir.empty()) {
    ShardStore::Options so;
    so.fsync = options.fsync;
    auto store = ShardStore::Open(options.data_dir, so);
    if (!store.ok()) {
      logger.Error("store_open_failed", {Kv("error", store.status().ToString())});
      *exit_code = kExitFailed;
      return nullptr;
    }
    options.shard.store = std::move(store).value();
  }
  const absl::Time restore_start = absl::Now();
  auto shard = Shard::Create(options.shard);
  if (!shard.ok()) {
    logger.Error("start_failed", {Kv("error", shard.status().ToString())});
    *exit_code = shard.status().code() == absl::StatusCode::kInvalidArgument ? kExitBadArguments
                                                                             : kExitFailed;
    return nullptr;
  }
  if (!options.data_dir.empty()) {
    logger.Info("state_loaded", {Kv("dir", options.data_dir),
                                 Kv("ms", absl::ToInt64Milliseconds(absl::Now() - restore_start))});
  }
  return std::move(shard).value();
}

// Service mode: the node's identity in the coordinator.
NodeAgentOptions AgentOptions(const ServerMainOptions& options, const Daemon& daemon,
                              const Logger* logger) {
  NodeAgentOptions ao;
  ao.coordinator = options.coordinator;
  ao.auth_token = options.auth_token;
  ao.rpc = options.daemon.rpc;
  ao.logger = logger;
  // The node name is the daemon's identity in the coordinator: by default the advertised
  // address (a host name alone would collide with a worker daemon on the same host).
  ao.node.set_address(options.advertise.empty()
                          ? absl::StrCat(AdvertisedHost(daemon.host()), ":", daemon.port())
                          : options.advertise);
  ao.node.set_name(options.node_flag.empty() ? ao.node.address() : options.node_flag);
  ao.node.set_role(SERVER);
  ao.node.set_cores(static_cast<int>(std::thread::hardware_concurrency()));
  ao.node.set_slots(options.slots);
  ao.node.set_host(HostName());
  ao.token_store =
      OpenNodeTokenStore(options.node_token_store, options.data_dir, ao.node.name(), logger);
  return ao;
}

int Run(ServerMainOptions options) {
  Logger logger({Kv("node", options.node), Kv("role", "server")});
  int exit_code = kExitOk;
  std::unique_ptr<Shard> shard = OpenShard(options, logger, &exit_code);
  if (shard == nullptr) return exit_code;
  const ShardLimits& limits = options.shard.limits;
  logger.Info(
      "shard_limits",
      {Kv("max_memory_bytes", limits.max_memory_bytes),
       Kv("memory_reserved", shard->memory_reserved()), Kv("max_jobs", limits.max_jobs),
       Kv("max_num_workers", limits.max_num_workers), Kv("max_num_shards", limits.max_num_shards),
       Kv("max_tensors_per_job", limits.max_tensors_per_job),
       Kv("max_elements_per_tensor", limits.max_elements_per_tensor),
       Kv("max_chunks_per_job", limits.max_chunks_per_job),
       Kv("max_waiting_pushes", limits.max_waiting_pushes)});
  // Service mode: the coordinator's tasks say which jobs (and tokens) this server serves.
  JobTokens tokens(/*required=*/true);
  options.shm.logger = &logger;
  ParameterServiceImpl service(shard.get(), options.coordinator.empty() ? nullptr : &tokens,
                               options.shm);
  MetricsRegistry metrics;
  Shard* const shard_ptr = shard.get();
  metrics.AddCollector([shard_ptr](MetricsWriter* w) { CollectShardMetrics(shard_ptr, w); });
  ServerTasks tasks(shard.get(), &tokens, &logger);
  std::unique_ptr<NodeAgent> agent;
  Daemon daemon(options.daemon, &logger);
  if (absl::Status st = daemon.Serve({&service}); !st.ok()) {
    logger.Error("listen_failed",
                 {Kv("address", options.daemon.address), Kv("error", st.ToString())});
    return kExitFailed;
  }
  logger.Info("listening", {Kv("address", daemon.ListenAddress()), Kv("port", daemon.port()),
                            Kv("malloc", MallocName())});
  LogListenSecurity(daemon.ListenAddress(), options.daemon.rpc.tls, &logger);
  if (!daemon.StartMetrics(&metrics).ok()) return kExitFailed;
  if (!options.coordinator.empty()) {
    agent = std::make_unique<NodeAgent>(
        AgentOptions(options, daemon, &logger),
        [&tasks](const std::vector<Task>& desired) { tasks.Reconcile(desired); },
        [&tasks] { return tasks.Reports(); });
    agent->Start();
  }
  ShutdownSteps steps;
  steps.before_server_stop = [&agent] {
    if (agent != nullptr) agent->Stop(/*leaving=*/true);
  };
  return daemon.WaitForSignalAndShutdown(steps);
}

}  // namespace
}  // namespace gradmesh

int main(int argc, char** argv) {
  gradmesh::ProcessOptions process;
  process.tune_allocator_for_large_messages = true;
  gradmesh::InitDaemonProcess(argc, argv, process);
  gradmesh::ServerMainOptions options;
  options.daemon.address = absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_port));
  options.daemon.port_file = absl::GetFlag(FLAGS_port_file);
  options.daemon.metrics.host = absl::GetFlag(FLAGS_host);
  options.daemon.metrics.port = absl::GetFlag(FLAGS_metrics_port);
  options.daemon.metrics.port_file = absl::GetFlag(FLAGS_metrics_port_file);
  options.daemon.shutdown_grace = absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s));
  options.daemon.rpc.max_message_bytes = absl::GetFlag(FLAGS_max_message_mb) << 20;
  options.node = gradmesh::NodeNameOrHostName(absl::GetFlag(FLAGS_node));
  options.node_flag = absl::GetFlag(FLAGS_node);
  options.shard.dedupe_window = absl::GetFlag(FLAGS_dedupe_window);
  gradmesh::ShardLimits& limits = options.shard.limits;
  limits.max_memory_bytes = absl::GetFlag(FLAGS_max_memory_bytes) == 0
                                ? gradmesh::DefaultMaxMemoryBytes()
                                : absl::GetFlag(FLAGS_max_memory_bytes);
  limits.max_tensors_per_job = absl::GetFlag(FLAGS_max_tensors_per_job);
  limits.max_elements_per_tensor = absl::GetFlag(FLAGS_max_elements_per_tensor);
  limits.max_chunks_per_job = absl::GetFlag(FLAGS_max_chunks_per_job);
  limits.max_num_shards = absl::GetFlag(FLAGS_max_num_shards);
  limits.max_num_workers = absl::GetFlag(FLAGS_max_num_workers);
  limits.max_jobs = absl::GetFlag(FLAGS_max_jobs);
  limits.max_waiting_pushes = absl::GetFlag(FLAGS_max_waiting_pushes);
  options.data_dir = absl::GetFlag(FLAGS_data_dir);
  options.node_token_store = absl::GetFlag(FLAGS_node_token_store);
  options.fsync = absl::GetFlag(FLAGS_fsync);
  options.shm.max_channels = std::max(0, absl::GetFlag(FLAGS_shm_channels));
  options.shm.spin = absl::Microseconds(std::max<int64_t>(0, absl::GetFlag(FLAGS_shm_spin_us)));
  options.shm.max_area_bytes = std::min(
      options.shm.max_area_bytes, std::max<int64_t>(options.daemon.rpc.max_message_bytes, 4096));
  options.coordinator = absl::GetFlag(FLAGS_coordinator);
  options.advertise = absl::GetFlag(FLAGS_advertise);
  options.slots = absl::GetFlag(FLAGS_slots);
  if (!absl::GetFlag(FLAGS_auth_token_file).empty()) {
    auto token = gradmesh::ReadTokenFile(absl::GetFlag(FLAGS_auth_token_file));
    if (!token.ok()) {
      std::fprintf(stderr, "event=bad_arguments role=server error=\"%s\"\n",
                   token.status().ToString().c_str());
      return gradmesh::kExitBadArguments;
    }
    options.auth_token = *token;
  }
  absl::StatusOr<gradmesh::TlsOptions> tls = gradmesh::MakeTlsOptions(
      absl::GetFlag(FLAGS_tls_cert_file), absl::GetFlag(FLAGS_tls_key_file),
      absl::GetFlag(FLAGS_tls_ca_file), absl::GetFlag(FLAGS_tls_client_auth),
      absl::GetFlag(FLAGS_allow_insecure));
  absl::Status transport = tls.ok()
                               ? gradmesh::CheckTokenTransport(options.coordinator, *tls,
                                                               options.auth_token, "node token")
                               : tls.status();
  if (transport.ok()) transport = gradmesh::CheckName("--node", options.node);
  absl::StatusOr<int64_t> window =
      gradmesh::Http2WindowBytesFromKb(absl::GetFlag(FLAGS_http2_window_kb));
  if (transport.ok()) transport = window.status();
  if (!transport.ok()) {
    std::fprintf(stderr, "event=bad_arguments role=server error=\"%s\"\n",
                 transport.ToString().c_str());
    return gradmesh::kExitBadArguments;
  }
  options.daemon.rpc.tls = *tls;
  options.daemon.rpc.http2_window_bytes = *window;
  return gradmesh::Run(std::move(options));
}
