// gradmesh_server: one parameter-server shard.
//
//   gradmesh_server --port=7001 [--host=0.0.0.0] [--port_file=F] [--max_message_mb=256]
//
// With --data_dir, jobs that ask for durability keep their state in RocksDB there, and a
// restart on the same directory restores them (see server/shard.h).
//
// Serves ParameterService until SIGTERM/SIGINT, then stops accepting calls, lets calls in
// flight finish (up to --shutdown_grace_s) and exits 0.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <unistd.h>


#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/daemon.h"
#include "common/grpc_util.h"
#include "common/logging.h"
#include "common/node_agent.h"
#include "common/metrics_http.h"
#include "server/parameter_service.h"
#include "server/shard.h"
#include "server/shard_metrics.h"
#include "server/shard_store.h"

ABSL_FLAG(std::string, host, "0.0.0.0", "Address to listen on.");
ABSL_FLAG(int, port, 7001, "Port to listen on (0 = pick a free one; see --port_file).");
ABSL_FLAG(std::string, port_file, "", "If set, the bound port is written to this file.");
ABSL_FLAG(int64_t, max_message_mb, 256, "Largest gRPC message sent or received, MiB.");
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
ABSL_FLAG(bool, fsync, false,
          "Sync RocksDB's WAL on every write (survive machine crashes, not just process "
          "crashes); costs an fsync per update.");

namespace gradmesh {
namespace {

struct ServerMainOptions {
  std::string address;
  std::string coordinator;  // Service mode when set.
  std::string auth_token;
  std::string advertise;
  int slots = 16;
  std::string port_file;
  MetricsEndpointOptions metrics;
  std::string node;       // Name in logs.
  std::string node_flag;  // --node as given ("" = default).
  std::string data_dir;
  bool fsync = false;
  int shutdown_grace_s = 5;
  RpcOptions rpc;
  ShardOptions shard;
};

int Run(ServerMainOptions options) {
  Logger logger({Kv("node", options.node), Kv("role", "server")});
  options.shard.logger = &logger;
  if (!options.data_dir.empty()) {
    ShardStore::Options so;
    so.fsync = options.fsync;
    auto store = ShardStore::Open(options.data_dir, so);
    if (!store.ok()) {
      logger.Error("store_open_failed", {Kv("error", store.status().ToString())});
      return 1;
    }
    options.shard.store = std::move(store).value();
  }
  const absl::Time restore_start = absl::Now();
  auto shard = Shard::Create(options.shard);
  if (!shard.ok()) {
    logger.Error("start_failed", {Kv("error", shard.status().ToString())});
    return shard.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  if (!options.data_dir.empty()) {
    logger.Info("state_loaded", {Kv("dir", options.data_dir),
                                 Kv("ms", absl::ToInt64Milliseconds(absl::Now() - restore_start))});
  }
  // Service mode: the coordinator's tasks say which jobs (and tokens) this server serves.
  JobTokens tokens(/*required=*/true);
  ParameterServiceImpl service(shard->get(), options.coordinator.empty() ? nullptr : &tokens);
  int port = 0;
  auto started = StartGrpcServer(options.address, {&service}, options.rpc, options.port_file, &port);
  if (!started.ok()) {
    logger.Error("listen_failed",
                 {Kv("address", options.address), Kv("error", started.status().ToString())});
    return 1;
  }
  std::unique_ptr<grpc::Server> server = std::move(started).value();
  const std::string host = options.address.substr(0, options.address.rfind(':'));
  logger.Info("listening", {Kv("address", absl::StrCat(host, ":", port)), Kv("port", port)});
  MetricsRegistry metrics;
  Shard* const shard_ptr = shard->get();
  metrics.AddCollector([shard_ptr](MetricsWriter* w) { CollectShardMetrics(shard_ptr, w); });
  auto metrics_server = StartMetricsEndpoint(options.metrics, &metrics, &logger);
  if (!metrics_server.ok()) {
    logger.Error("listen_failed", {Kv("error", metrics_server.status().ToString())});
    return 1;
  }
  std::unique_ptr<NodeAgent> agent;
  absl::Mutex tasks_mu;
  std::vector<Task> tasks;  // Guarded by tasks_mu: the coordinator's latest list.
  if (!options.coordinator.empty()) {
    NodeAgentOptions ao;
    ao.coordinator = options.coordinator;
    ao.auth_token = options.auth_token;
    ao.logger = &logger;
    // The node name is the daemon's identity in the coordinator: by default the advertised
    // address (a host name alone would collide with a worker daemon on the same host).
    ao.node.set_address(options.advertise.empty()
                            ? absl::StrCat(host == "0.0.0.0" ? HostName() : host, ":", port)
                            : options.advertise);
    ao.node.set_name(options.node_flag.empty() ? ao.node.address() : options.node_flag);
    ao.node.set_role(SERVER);
    ao.node.set_cores(static_cast<int>(std::thread::hardware_concurrency()));
    ao.node.set_slots(options.slots);
    ao.node.set_host(HostName());
    agent = std::make_unique<NodeAgent>(
        ao,
        // `group_errors`: the last SetSyncGroup error logged per job (callbacks run one at a
        // time on the agent's thread), so a bad task is logged once, not every heartbeat.
        [&, group_errors = absl::flat_hash_map<std::string, std::string>()](
            const std::vector<Task>& desired) mutable {
          absl::MutexLock lock(&tasks_mu);
          for (const Task& t : desired) {
            bool known = false;
            for (const Task& old : tasks) {
              known |= old.job_id() == t.job_id() && old.job_token() == t.job_token();
            }
            if (!known) {
              logger.Info("shard_placed", {Kv("job", t.job_id()), Kv("shard", t.index())});
            }
            tokens.Set(t.job_id(), t.job_token());
            // Elastic sync: the coordinator sends the barrier group on every heartbeat, and
            // SetSyncGroup is idempotent, so it is simply applied each time. NOT_FOUND: the
            // workers have not called InitJob yet; the next heartbeat (500 ms) retries.
            if (t.spec().mode() != "sync") continue;
            const std::vector<int32_t> active(t.active_ranks().begin(), t.active_ranks().end());
            const double lr_scale = t.lr_scale() == 0 ? 1.0 : t.lr_scale();  // 0: unset.
            const absl::Status st = (*shard)->SetSyncGroup(t.job_id(), active, lr_scale);
            if (st.ok() || absl::IsNotFound(st)) {
              group_errors.erase(t.job_id());
            } else if (std::string& last = group_errors[t.job_id()]; last != st.ToString()) {
              last = st.ToString();
              logger.Error("sync_group_failed", {Kv("job", t.job_id()), Kv("error", last)});
            }
          }
          // Withdrawn (cancelled or failed job): its workers are stopped; refuse its calls.
          for (const Task& old : tasks) {
            bool kept = false;
            for (const Task& t : desired) kept |= t.job_id() == old.job_id();
            if (!kept) {
              tokens.Remove(old.job_id());
              logger.Info("shard_withdrawn", {Kv("job", old.job_id()), Kv("shard", old.index())});
            }
          }
          tasks = desired;
        },
        [&] {
          absl::MutexLock lock(&tasks_mu);
          std::vector<TaskReport> reports;
          for (const Task& t : tasks) {
            TaskReport r;
            r.set_job_id(t.job_id());
            r.set_index(t.index());
            r.set_state("running");
            r.set_generation(t.generation());
            reports.push_back(std::move(r));
          }
          return reports;
        });
    agent->Start();
  }
  const std::string sig = WaitForTerminationSignal();
  logger.Info("shutting_down", {Kv("signal", sig)});
  if (agent != nullptr) agent->Stop(/*leaving=*/true);
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::seconds(options.shutdown_grace_s));
  server->Wait();
  logger.Info("stopped");
  return 0;
}

}  // namespace
}  // namespace gradmesh

int main(int argc, char** argv) {
  gradmesh::BlockTerminationSignals();
  gradmesh::TuneAllocatorForLargeMessages();
  absl::ParseCommandLine(argc, argv);
  gradmesh::ServerMainOptions options;
  options.address = absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_port));
  options.port_file = absl::GetFlag(FLAGS_port_file);
  options.metrics.host = absl::GetFlag(FLAGS_host);
  options.metrics.port = absl::GetFlag(FLAGS_metrics_port);
  options.metrics.port_file = absl::GetFlag(FLAGS_metrics_port_file);
  options.node = absl::GetFlag(FLAGS_node).empty() ? gradmesh::HostName() : absl::GetFlag(FLAGS_node);
  options.node_flag = absl::GetFlag(FLAGS_node);
  options.shutdown_grace_s = absl::GetFlag(FLAGS_shutdown_grace_s);
  options.rpc.max_message_bytes = absl::GetFlag(FLAGS_max_message_mb) << 20;
  options.shard.dedupe_window = absl::GetFlag(FLAGS_dedupe_window);
  options.data_dir = absl::GetFlag(FLAGS_data_dir);
  options.fsync = absl::GetFlag(FLAGS_fsync);
  options.coordinator = absl::GetFlag(FLAGS_coordinator);
  options.advertise = absl::GetFlag(FLAGS_advertise);
  options.slots = absl::GetFlag(FLAGS_slots);
  if (!absl::GetFlag(FLAGS_auth_token_file).empty()) {
    auto token = gradmesh::ReadTokenFile(absl::GetFlag(FLAGS_auth_token_file));
    if (!token.ok()) {
      std::fprintf(stderr, "event=bad_arguments role=server error=\"%s\"\n",
                   token.status().ToString().c_str());
      return 2;
    }
    options.auth_token = *token;
  }
  return gradmesh::Run(std::move(options));
}
