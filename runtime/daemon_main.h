// The serving skeleton shared by the daemons' main() functions (gradmesh_server,
// gradmesh_coordinator, gradmesh_worker): process set-up, the gRPC server and its port file,
// the metrics endpoint, and the graceful shutdown on SIGTERM/SIGINT in one fixed order.
//
//   int main(int argc, char** argv) {
//     ProcessOptions process;
//     process.tune_allocator_for_large_messages = true;
//     InitDaemonProcess(argc, argv, process);
//     ... flags -> Options struct (flags stay in the main file) ...
//   }
//   int Run(const Options& options) {
//     Logger logger(...);
//     ... build the core and its gRPC services ...
//     Daemon daemon(DaemonOptions{...}, &logger);
//     if (absl::Status st = daemon.Serve({&service}); !st.ok()) { log; return kExitFailed; }
//     if (!daemon.StartMetrics(&registry).ok()) return kExitFailed;  // Logged.
//     ShutdownSteps steps;
//     steps.after_server_stop = [&] { core.reset(); };
//     return daemon.WaitForSignalAndShutdown(steps);
//   }
//
// Shutdown order (Shutdown(), and WaitForSignalAndShutdown() after the signal):
//   1. steps.before_server_stop   (e.g. tell the coordinator the node is leaving, stop tasks)
//   2. the gRPC server: no new calls; calls in flight get up to `shutdown_grace` to finish,
//      then are cancelled (watch streams end); waits until every handler has returned
//   3. the metrics endpoint (before the state its collectors read)
//   4. steps.after_server_stop    (e.g. destroy the core: flush state, join its threads)
//
// Thread safety: a Daemon is used from one thread (main's). InitDaemonProcess must run before
// any thread is started, so that every thread inherits the blocked termination signals.
#ifndef GRADMESH_RUNTIME_DAEMON_MAIN_H_
#define GRADMESH_RUNTIME_DAEMON_MAIN_H_

#include <grpcpp/server.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "rpc/grpc_util.h"
#include "runtime/metrics_http.h"

namespace gradmesh {

// Exit codes of every daemon.
inline constexpr int kExitOk = 0;            // Stopped by a signal (or finished).
inline constexpr int kExitFailed = 1;        // Could not start (listen, store, ...) or failed.
inline constexpr int kExitBadArguments = 2;  // Bad flags or files named by flags.

struct ProcessOptions {
  // TuneAllocatorForLargeMessages() (common/daemon.h): daemons that carry tensors.
  bool tune_allocator_for_large_messages = false;
};

// The start of main(): blocks SIGTERM/SIGINT for every thread started later (they are taken
// synchronously by WaitForTerminationSignal), turns off absl::Mutex deadlock detection
// (DisableMutexDeadlockDetection, common/daemon.h), optionally tunes the allocator, then parses
// the command line (absl flags; the flags themselves are defined in the main file). Exits
// the process with absl's usage message on an unknown flag, as absl::ParseCommandLine does.
void InitDaemonProcess(int argc, char** argv, const ProcessOptions& options = {});

// `node_flag`, or a valid name made from this host's name when it is empty
// (common/job_name.h NameFromHost): the node's name in log lines and at the coordinator.
std::string NodeNameOrHostName(const std::string& node_flag);

// The host name others should dial for a daemon listening on `listen_host`: `listen_host`
// itself, or this host's name for the wildcard address 0.0.0.0.
std::string AdvertisedHost(const std::string& listen_host);

// Starts a thread, detached, that waits for SIGTERM or SIGINT and calls `on_signal` with the
// signal's name ("SIGTERM", "SIGINT") once. For daemons that stop work on a signal and exit
// on their own (a standalone worker). `on_signal` must own (or share ownership of) what it
// touches: the thread may run while the process exits.
void StartTerminationSignalThread(std::function<void(const std::string& signal)> on_signal);

struct DaemonOptions {
  // gRPC server: "host:port" (port 0 = a free one) and, if set, the file the bound port is
  // written to (atomically, common/daemon.h).
  std::string address;
  std::string port_file;
  RpcOptions rpc;
  // How long calls in flight may take to finish on shutdown before they are cancelled.
  absl::Duration shutdown_grace = absl::Seconds(5);
  // --metrics_port / --metrics_port_file (port -1: no endpoint).
  MetricsEndpointOptions metrics;
};

// What a daemon's shutdown does around the skeleton's own steps (see the header comment).
// Either may be empty. They run on the calling thread.
struct ShutdownSteps {
  std::function<void()> before_server_stop;
  std::function<void()> after_server_stop;
};

class Daemon {
 public:
  // `logger` (not owned, may be null) receives the skeleton's lines: metrics_listening,
  // listen_failed (metrics endpoint), shutting_down, stopped.
  Daemon(DaemonOptions options, const Logger* logger);
  // Stops what is still running (gRPC server with the grace, metrics endpoint); runs no
  // ShutdownSteps (what they touch may already be gone).
  ~Daemon();

  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Lines logged from now on go to `logger` (not owned, may be null): for a daemon whose
  // node name is known only once it is bound.
  void set_logger(const Logger* logger) { logger_ = logger; }

  // Starts the gRPC server on options.address serving `services` (not owned; they must
  // outlive the Daemon or its Shutdown) and writes the port file. Logs nothing: callers log
  // their own `listening`/`listen_failed` line. UNAVAILABLE if the address cannot be bound;
  // the port file's error if it cannot be written. At most once.
  absl::Status Serve(const std::vector<grpc::Service*>& services);
  // The bound port (0 before Serve succeeded) and the host part of options.address.
  int port() const { return port_; }
  std::string host() const;
  // host():port(), the address a `listening` line shows.
  std::string ListenAddress() const;

  // Starts the metrics endpoint (nothing when options.metrics.port < 0) serving `registry`
  // (not owned; must outlive the Daemon or its Shutdown) and `handlers` (extra paths, e.g. the
  // coordinator's dashboard; runtime/metrics_http.h), which logs metrics_listening. On
  // error logs `listen_failed error=...` and returns the error. At most once.
  absl::Status StartMetrics(MetricsRegistry* registry, HttpHandlers handlers = {});

  // Runs the shutdown sequence now (steps 1-4 of the header comment), without logging.
  // Idempotent: a second call runs nothing.
  void Shutdown(const ShutdownSteps& steps = {});

  // Blocks until SIGTERM or SIGINT, logs `shutting_down signal=...`, runs Shutdown(steps),
  // logs `stopped` and returns kExitOk (what main returns).
  int WaitForSignalAndShutdown(const ShutdownSteps& steps = {});

 private:
  void StopServer();

  const DaemonOptions options_;
  const Logger* logger_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsHttpServer> metrics_server_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace gradmesh

#endif  // GRADMESH_RUNTIME_DAEMON_MAIN_H_
