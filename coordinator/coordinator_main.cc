// gradmesh_coordinator: the control plane daemon (JobService for the CLI, NodeService for
// server and worker daemons started with --coordinator). See coordinator/coordinator.h.
//
//   gradmesh_coordinator --data_dir=DIR [--host=127.0.0.1] [--port=7000] [--port_file=F]
//                        [--auth_token_file=F [--node_token_file=G]]
//                        [--heartbeat_interval_ms=500] [--heartbeat_timeout_ms=3000]
//                        [--restart_grace_ms=15000]
//                        [--finished_job_retention_s=86400] [--max_finished_jobs=1000]
//                        [--node_identity_from_certificate]
//                        [--node=NAME] [--metrics_port=-1]
//
// With --metrics_port the same HTTP port serves /metrics, /healthz and the web dashboard
// (/, /job/NAME, /api/jobs; coordinator/dashboard.h).
// Jobs and nodes live in RocksDB under --data_dir; a restart on the same directory knows every
// job. With --auth_token_file every call must carry `authorization: Bearer <token>`; with
// --node_token_file too, NodeService (daemons) takes that token and JobService (users) only
// the API token.
// SIGTERM/SIGINT: stops accepting calls, ends watches, writes pending progress, exits 0.
// Exit codes: 0 after a signal, 2 for bad flags, 1 if it cannot start.
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "coordinator/clock.h"
#include "coordinator/coordinator.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/coordinator_store.h"
#include "coordinator/dashboard.h"
#include "coordinator/service.h"
#include "rpc/auth.h"
#include "rpc/tls.h"
#include "runtime/daemon_main.h"

ABSL_FLAG(std::string, host, "127.0.0.1", "Address to listen on.");
ABSL_FLAG(int, port, 7000, "Port to listen on (0 = pick a free one; see --port_file).");
ABSL_FLAG(std::string, port_file, "", "If set, the bound port is written to this file.");
ABSL_FLAG(int, metrics_port, -1,
          "Port of the Prometheus endpoint (HTTP GET /metrics, /healthz) and the web dashboard "
          "(/, /job/NAME, /api/jobs) on --host: 0 = pick a free one (see --metrics_port_file), "
          "-1 = none. Unauthenticated: job names, progress and placement are readable by "
          "whoever reaches it.");
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
ABSL_FLAG(int64_t, restart_grace_ms, 15000,
          "After a restart, nodes that were alive keep their work this long while they "
          "reconnect, ms (at least --heartbeat_timeout_ms).");
ABSL_FLAG(std::string, node, "", "Node name in logs (default: host name).");
ABSL_FLAG(int, shutdown_grace_s, 2, "Seconds to let calls in flight finish on shutdown.");
ABSL_FLAG(int64_t, finished_job_retention_s, 86400,
          "A finished job (succeeded, failed, cancelled) is removed from memory and the tables "
          "this many seconds after it ended (GetJob and export work until then). 0 = no limit.");
ABSL_FLAG(int64_t, max_finished_jobs, 1000,
          "At most this many finished jobs are kept; the oldest ended are removed first. "
          "0 = no limit.");
ABSL_FLAG(int64_t, max_model_bytes, int64_t{2} << 30,
          "Most bytes of one model a gossip/allreduce job's rank 0 publishes (header and float32 "
          "values, or a TorchScript module file); larger publishes are refused with "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(bool, node_identity_from_certificate, false,
          "Mutual TLS: a daemon's verified client certificate names its node (CN = its --node "
          "name), so it can act only as that node without a per-node token (needs "
          "--tls_client_auth). Default: per-node tokens issued at registration.");

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

struct CoordinatorMainOptions {
  DaemonOptions daemon;  // address, port_file, shutdown_grace, metrics.
  std::string data_dir;
  std::string auth_token_file;
  std::string node_token_file;
  std::string node;
  int64_t heartbeat_interval_ms = 500;
  int64_t heartbeat_timeout_ms = 3000;
  int64_t restart_grace_ms = 15000;
  int64_t finished_job_retention_s = 86400;     // 0 = no limit.
  int64_t max_finished_jobs = 1000;             // 0 = no limit.
  int64_t max_model_bytes = int64_t{2} << 30;   // Per published model.
  bool node_identity_from_certificate = false;  // Needs daemon.rpc.tls.client_auth.
};

struct Tokens {
  std::string api;   // "" = no authentication.
  std::string node;  // NodeService's token: the API token unless --node_token_file.
};

// Checks the flags and reads the token files. Errors are INVALID_ARGUMENT whose message is
// what bad_arguments logs (a token file's error as its full status text).
absl::StatusOr<Tokens> CheckArguments(const CoordinatorMainOptions& options) {
  if (options.data_dir.empty()) return absl::InvalidArgumentError("--data_dir is required");
  if (options.heartbeat_interval_ms <= 0 ||
      options.heartbeat_timeout_ms <= options.heartbeat_interval_ms) {
    return absl::InvalidArgumentError("need 0 < --heartbeat_interval_ms < --heartbeat_timeout_ms");
  }
  if (options.finished_job_retention_s < 0 ||
      options.finished_job_retention_s > 100LL * 365 * 86400 || options.max_finished_jobs < 0) {
    return absl::InvalidArgumentError(
        "--finished_job_retention_s (at most 100 years) and --max_finished_jobs must be >= 0 "
        "(0: no limit)");
  }
  if (options.max_model_bytes <= 0) {
    return absl::InvalidArgumentError("--max_model_bytes must be > 0");
  }
  if (options.node_identity_from_certificate && !options.daemon.rpc.tls.client_auth) {
    return absl::InvalidArgumentError(
        "--node_identity_from_certificate needs --tls_client_auth (verified client certificates)");
  }
  Tokens tokens;
  if (!options.auth_token_file.empty()) {
    absl::StatusOr<std::string> t = ReadTokenFile(options.auth_token_file);
    if (!t.ok()) return absl::InvalidArgumentError(t.status().ToString());
    tokens.api = *t;
  }
  tokens.node = tokens.api;
  if (!options.node_token_file.empty()) {
    if (tokens.api.empty()) {
      return absl::InvalidArgumentError(
          "--node_token_file needs --auth_token_file (the API token)");
    }
    absl::StatusOr<std::string> t = ReadTokenFile(options.node_token_file);
    if (!t.ok()) return absl::InvalidArgumentError(t.status().ToString());
    if (*t == tokens.api) {
      return absl::InvalidArgumentError(
          "--node_token_file holds the API token; use a different secret");
    }
    tokens.node = *t;
  }
  return tokens;
}

// Opens the tables and creates the core; logs the failure (exit code 1).
absl::StatusOr<std::unique_ptr<Coordinator>> OpenCoordinator(const CoordinatorMainOptions& options,
                                                             const Clock* clock,
                                                             const Logger* logger) {
  auto store = CoordinatorStore::Open(options.data_dir, CoordinatorStore::Options());
  if (!store.ok()) {
    logger->Error("store_open_failed", {Kv("error", store.status().ToString())});
    return store.status();
  }
  Coordinator::Options co;
  co.store = std::move(store).value();
  co.clock = clock;
  co.logger = logger;
  co.heartbeat_interval_ms = options.heartbeat_interval_ms;
  co.heartbeat_timeout_ms = options.heartbeat_timeout_ms;
  co.restart_grace_ms = options.restart_grace_ms;
  co.finished_job_retention_ms = options.finished_job_retention_s * 1000;
  co.max_finished_jobs = options.max_finished_jobs;
  co.max_model_bytes = options.max_model_bytes;
  auto coordinator = Coordinator::Create(std::move(co));
  if (!coordinator.ok()) {
    logger->Error("start_failed", {Kv("error", coordinator.status().ToString())});
  }
  return coordinator;
}

// What the dashboard shows, read from the core now.
DashboardData ReadDashboard(Coordinator* core, const Clock* clock) {
  DashboardData data;
  data.jobs = core->ListJobs();
  for (const JobStatus& job : data.jobs) {
    absl::StatusOr<coordinator_state::JobHistory> h = core->GetJobHistory(job.job_id());
    if (h.ok()) data.history[job.job_id()] = *std::move(h);
  }
  data.nodes = core->ListNodes();
  data.now_ms = clock->NowMs();
  return data;
}

// The built-in dashboard on the metrics port (coordinator/dashboard.h).
HttpHandlers DashboardHandlers(Coordinator* core, const Clock* clock) {
  HttpHandlers h;
  h["/"] = [core, clock](const std::string&) {
    return HttpResponse{200, "text/html; charset=utf-8", DashboardPage(ReadDashboard(core, clock))};
  };
  h["/job/"] = [core, clock](const std::string& path) {
    const std::string id = path.substr(std::string("/job/").size());
    std::string page = JobPage(ReadDashboard(core, clock), id);
    if (page.empty()) {
      return HttpResponse{
          404, "text/html; charset=utf-8",
          absl::StrCat("<!DOCTYPE html><html><body>job &quot;", HtmlEscape(id),
                       "&quot; not found. <a href=\"/\">all jobs</a></body></html>\n")};
    }
    return HttpResponse{200, "text/html; charset=utf-8", std::move(page)};
  };
  h["/api/jobs"] = [core, clock](const std::string&) {
    return HttpResponse{200, "application/json", JobsJson(ReadDashboard(core, clock))};
  };
  return h;
}

int Run(const CoordinatorMainOptions& options) {
  Logger logger({Kv("node", options.node), Kv("role", "coordinator")});
  absl::StatusOr<Tokens> tokens = CheckArguments(options);
  if (!tokens.ok()) {
    logger.Error("bad_arguments", {Kv("error", tokens.status().message())});
    return kExitBadArguments;
  }
  SystemClock clock;
  auto coordinator = OpenCoordinator(options, &clock, &logger);
  if (!coordinator.ok()) return kExitFailed;
  TokenChecker auth(tokens->api);
  TokenChecker node_auth(tokens->node,
                         options.node_token_file.empty() ? "API token" : "node token");
  JobServiceImpl job_service(coordinator->get(), &auth);
  NodeServiceImpl node_service(
      coordinator->get(), &node_auth,
      options.node_identity_from_certificate ? NodeIdentityFn(CertificateNodeName) : nullptr);
  MetricsRegistry metrics;
  Coordinator* const core = coordinator->get();
  metrics.AddCollector([core](MetricsWriter* w) {
    CollectCoordinatorMetrics(core->ListJobs(), core->ListNodes(), w);
  });
  Daemon daemon(options.daemon, &logger);
  if (absl::Status st = daemon.Serve({&job_service, &node_service}); !st.ok()) {
    logger.Error("listen_failed",
                 {Kv("address", options.daemon.address), Kv("error", st.ToString())});
    return kExitFailed;
  }
  logger.Info("listening", {Kv("address", daemon.ListenAddress()), Kv("port", daemon.port()),
                            Kv("auth", !auth.enabled()                   ? "none"
                                       : options.node_token_file.empty() ? "token"
                                                                         : "api+node"),
                            Kv("data_dir", options.data_dir)});
  LogListenSecurity(daemon.ListenAddress(), options.daemon.rpc.tls, &logger);
  if (!daemon.StartMetrics(&metrics, DashboardHandlers(core, &clock)).ok()) return kExitFailed;
  // The server's shutdown cancels open watches (their loops see IsCancelled within one poll
  // interval); then the endpoint, whose collector reads the coordinator, stops.
  ShutdownSteps steps;
  steps.after_server_stop = [&coordinator] {
    coordinator->reset();  // Stops the monitor thread and writes pending progress.
  };
  return daemon.WaitForSignalAndShutdown(steps);
}

}  // namespace
}  // namespace gradmesh

int main(int argc, char** argv) {
  gradmesh::InitDaemonProcess(argc, argv);
  gradmesh::CoordinatorMainOptions options;
  options.daemon.address = absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_port));
  options.daemon.port_file = absl::GetFlag(FLAGS_port_file);
  options.daemon.metrics.host = absl::GetFlag(FLAGS_host);
  options.daemon.metrics.port = absl::GetFlag(FLAGS_metrics_port);
  options.daemon.metrics.port_file = absl::GetFlag(FLAGS_metrics_port_file);
  options.daemon.shutdown_grace = absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s));
  options.data_dir = absl::GetFlag(FLAGS_data_dir);
  options.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  options.node_token_file = absl::GetFlag(FLAGS_node_token_file);
  options.node = gradmesh::NodeNameOrHostName(absl::GetFlag(FLAGS_node));
  options.heartbeat_interval_ms = absl::GetFlag(FLAGS_heartbeat_interval_ms);
  options.heartbeat_timeout_ms = absl::GetFlag(FLAGS_heartbeat_timeout_ms);
  options.restart_grace_ms = absl::GetFlag(FLAGS_restart_grace_ms);
  options.finished_job_retention_s = absl::GetFlag(FLAGS_finished_job_retention_s);
  options.max_finished_jobs = absl::GetFlag(FLAGS_max_finished_jobs);
  options.max_model_bytes = absl::GetFlag(FLAGS_max_model_bytes);
  options.node_identity_from_certificate = absl::GetFlag(FLAGS_node_identity_from_certificate);
  absl::StatusOr<gradmesh::TlsOptions> tls = gradmesh::MakeTlsOptions(
      absl::GetFlag(FLAGS_tls_cert_file), absl::GetFlag(FLAGS_tls_key_file),
      absl::GetFlag(FLAGS_tls_ca_file), absl::GetFlag(FLAGS_tls_client_auth),
      absl::GetFlag(FLAGS_allow_insecure));
  if (!tls.ok()) {
    gradmesh::Logger({gradmesh::Kv("node", options.node), gradmesh::Kv("role", "coordinator")})
        .Error("bad_arguments", {gradmesh::Kv("error", tls.status().message())});
    return gradmesh::kExitBadArguments;
  }
  options.daemon.rpc.tls = *tls;
  return gradmesh::Run(options);
}
