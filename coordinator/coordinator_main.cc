// gradmesh_coordinator: the control plane daemon (JobService for the CLI, NodeService for
// server and worker daemons started with --coordinator). See coordinator/coordinator.h.
//
//   gradmesh_coordinator --data_dir=DIR [--host=127.0.0.1] [--port=7000] [--port_file=F]
//                        [--auth_token_file=F [--node_token_file=G]]
//                        [--heartbeat_interval_ms=500] [--heartbeat_timeout_ms=3000]
//                        [--node=NAME] [--metrics_port=-1]
//
// Jobs and nodes live in RocksDB under --data_dir; a restart on the same directory knows every
// job. With --auth_token_file every call must carry `authorization: Bearer <token>`; with
// --node_token_file too, NodeService (daemons) takes that token and JobService (users) only
// the API token.
// SIGTERM/SIGINT: stops accepting calls, ends watches, writes pending progress, exits 0.
// Exit codes: 0 after a signal, 2 for bad flags, 1 if it cannot start.
#include <chrono>
#include <memory>
#include <string>

#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "common/daemon.h"
#include "common/grpc_util.h"
#include "common/logging.h"
#include "common/metrics_http.h"
#include "coordinator/clock.h"
#include "coordinator/coordinator.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/coordinator_store.h"
#include "coordinator/service.h"

ABSL_FLAG(std::string, host, "127.0.0.1", "Address to listen on.");
ABSL_FLAG(int, port, 7000, "Port to listen on (0 = pick a free one; see --port_file).");
ABSL_FLAG(std::string, port_file, "", "If set, the bound port is written to this file.");
ABSL_FLAG(int, metrics_port, -1,
          "Port of the Prometheus endpoint (HTTP GET /metrics, /healthz) on --host: 0 = pick a "
          "free one (see --metrics_port_file), -1 = none. Unauthenticated: job names and "
          "progress are readable by whoever reaches it.");
ABSL_FLAG(std::string, metrics_port_file, "",
          "If set, the metrics endpoint's bound port is written to this file.");
ABSL_FLAG(std::string, data_dir, "", "RocksDB directory of the job and node tables (required).");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding the API token every call must present (empty: no authentication). "
          "With --node_token_file, only JobService calls (users, the CLI).");
ABSL_FLAG(std::string, node_token_file, "",
          "File holding the node token NodeService calls (server and worker daemons) must "
          "present instead of the API token, so daemons cannot call JobService (and read other "
          "jobs' tokens). Empty: the API token serves both.");
ABSL_FLAG(int64_t, heartbeat_interval_ms, 500, "Heartbeat interval daemons are told to use, ms.");
ABSL_FLAG(int64_t, heartbeat_timeout_ms, 3000,
          "A node without heartbeats for this long is dead and its ranks are moved, ms.");
ABSL_FLAG(std::string, node, "", "Node name in logs (default: host name).");
ABSL_FLAG(int, shutdown_grace_s, 2, "Seconds to let calls in flight finish on shutdown.");

namespace gradmesh {
namespace {

struct CoordinatorMainOptions {
  std::string address;
  std::string port_file;
  std::string data_dir;
  std::string auth_token_file;
  std::string node_token_file;
  std::string node;
  int64_t heartbeat_interval_ms = 500;
  int64_t heartbeat_timeout_ms = 3000;
  int shutdown_grace_s = 2;
  MetricsEndpointOptions metrics;
};

int Run(const CoordinatorMainOptions& options) {
  Logger logger({Kv("node", options.node), Kv("role", "coordinator")});
  if (options.data_dir.empty()) {
    logger.Error("bad_arguments", {Kv("error", "--data_dir is required")});
    return 2;
  }
  if (options.heartbeat_interval_ms <= 0 ||
      options.heartbeat_timeout_ms <= options.heartbeat_interval_ms) {
    logger.Error("bad_arguments",
                 {Kv("error", "need 0 < --heartbeat_interval_ms < --heartbeat_timeout_ms")});
    return 2;
  }
  std::string token;
  if (!options.auth_token_file.empty()) {
    absl::StatusOr<std::string> t = ReadTokenFile(options.auth_token_file);
    if (!t.ok()) {
      logger.Error("bad_arguments", {Kv("error", t.status().ToString())});
      return 2;
    }
    token = *t;
  }
  std::string node_token = token;
  if (!options.node_token_file.empty()) {
    if (token.empty()) {
      logger.Error("bad_arguments",
                   {Kv("error", "--node_token_file needs --auth_token_file (the API token)")});
      return 2;
    }
    absl::StatusOr<std::string> t = ReadTokenFile(options.node_token_file);
    if (!t.ok()) {
      logger.Error("bad_arguments", {Kv("error", t.status().ToString())});
      return 2;
    }
    if (*t == token) {
      logger.Error("bad_arguments",
                   {Kv("error", "--node_token_file holds the API token; use a different secret")});
      return 2;
    }
    node_token = *t;
  }
  auto store = CoordinatorStore::Open(options.data_dir, CoordinatorStore::Options());
  if (!store.ok()) {
    logger.Error("store_open_failed", {Kv("error", store.status().ToString())});
    return 1;
  }
  SystemClock clock;
  Coordinator::Options co;
  co.store = std::move(store).value();
  co.clock = &clock;
  co.logger = &logger;
  co.heartbeat_interval_ms = options.heartbeat_interval_ms;
  co.heartbeat_timeout_ms = options.heartbeat_timeout_ms;
  auto coordinator = Coordinator::Create(std::move(co));
  if (!coordinator.ok()) {
    logger.Error("start_failed", {Kv("error", coordinator.status().ToString())});
    return 1;
  }
  TokenChecker auth(token);
  TokenChecker node_auth(node_token, options.node_token_file.empty() ? "API token" : "node token");
  JobServiceImpl job_service(coordinator->get(), &auth);
  NodeServiceImpl node_service(coordinator->get(), &node_auth);
  int port = 0;
  auto started = StartGrpcServer(options.address, {&job_service, &node_service}, RpcOptions(),
                                 options.port_file, &port);
  if (!started.ok()) {
    logger.Error("listen_failed",
                 {Kv("address", options.address), Kv("error", started.status().ToString())});
    return 1;
  }
  std::unique_ptr<grpc::Server> server = std::move(started).value();
  const std::string host = options.address.substr(0, options.address.rfind(':'));
  logger.Info("listening", {Kv("address", absl::StrCat(host, ":", port)), Kv("port", port),
                            Kv("auth", !auth.enabled()                      ? "none"
                                       : options.node_token_file.empty() ? "token"
                                                                         : "api+node"),
                            Kv("data_dir", options.data_dir)});
  MetricsRegistry metrics;
  Coordinator* const core = coordinator->get();
  metrics.AddCollector([core](MetricsWriter* w) {
    CollectCoordinatorMetrics(core->ListJobs(), core->ListNodes(), w);
  });
  auto metrics_server = StartMetricsEndpoint(options.metrics, &metrics, &logger);
  if (!metrics_server.ok()) {
    logger.Error("listen_failed", {Kv("error", metrics_server.status().ToString())});
    return 1;
  }
  const std::string sig = WaitForTerminationSignal();
  logger.Info("shutting_down", {Kv("signal", sig)});
  // Shutdown cancels open watches (their loops see IsCancelled within one poll interval).
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::seconds(options.shutdown_grace_s));
  server->Wait();
  metrics_server->reset();  // Its collector reads the coordinator.
  coordinator->reset();  // Stops the monitor thread and writes pending progress.
  logger.Info("stopped");
  return 0;
}

}  // namespace
}  // namespace gradmesh

int main(int argc, char** argv) {
  gradmesh::BlockTerminationSignals();
  absl::ParseCommandLine(argc, argv);
  gradmesh::CoordinatorMainOptions options;
  options.address = absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_port));
  options.port_file = absl::GetFlag(FLAGS_port_file);
  options.metrics.host = absl::GetFlag(FLAGS_host);
  options.metrics.port = absl::GetFlag(FLAGS_metrics_port);
  options.metrics.port_file = absl::GetFlag(FLAGS_metrics_port_file);
  options.data_dir = absl::GetFlag(FLAGS_data_dir);
  options.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  options.node_token_file = absl::GetFlag(FLAGS_node_token_file);
  options.node =
      absl::GetFlag(FLAGS_node).empty() ? gradmesh::HostName() : absl::GetFlag(FLAGS_node);
  options.heartbeat_interval_ms = absl::GetFlag(FLAGS_heartbeat_interval_ms);
  options.heartbeat_timeout_ms = absl::GetFlag(FLAGS_heartbeat_timeout_ms);
  options.shutdown_grace_s = absl::GetFlag(FLAGS_shutdown_grace_s);
  return gradmesh::Run(options);
}
