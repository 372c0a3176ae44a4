#include "runtime/daemon_main.h"

#include <chrono>
#include <thread>
#include <utility>

#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/daemon.h"
#include "common/job_name.h"

namespace gradmesh {

void InitDaemonProcess(int argc, char** argv, const ProcessOptions& options) {
  BlockTerminationSignals();
  DisableMutexDeadlockDetection();
  if (options.tune_allocator_for_large_messages) TuneAllocatorForLargeMessages();
  absl::ParseCommandLine(argc, argv);
}

std::string NodeNameOrHostName(const std::string& node_flag) {
  return node_flag.empty() ? NameFromHost(HostName()) : node_flag;
}

std::string AdvertisedHost(const std::string& listen_host) {
  return listen_host == "0.0.0.0" ? HostName() : listen_host;
}

void StartTerminationSignalThread(std::function<void(const std::string& signal)> on_signal) {
  std::thread([on_signal = std::move(on_signal)] {
    on_signal(WaitForTerminationSignal());
  }).detach();
}

Daemon::Daemon(DaemonOptions options, const Logger* logger)
    : options_(std::move(options)), logger_(logger) {}

Daemon::~Daemon() {
  StopServer();
  metrics_server_.reset();
}

absl::Status Daemon::Serve(const std::vector<grpc::Service*>& services) {
  if (server_ != nullptr) return absl::FailedPreconditionError("Daemon::Serve called twice");
  absl::StatusOr<std::unique_ptr<grpc::Server>> started =
      StartGrpcServer(options_.address, services, options_.rpc, options_.port_file, &port_);
  if (!started.ok()) return started.status();
  server_ = std::move(started).value();
  return absl::OkStatus();
}

std::string Daemon::host() const { return options_.address.substr(0, options_.address.rfind(':')); }

std::string Daemon::ListenAddress() const { return absl::StrCat(host(), ":", port_); }

absl::Status Daemon::StartMetrics(MetricsRegistry* registry, HttpHandlers handlers) {
  if (metrics_server_ != nullptr) {
    return absl::FailedPreconditionError("Daemon::StartMetrics called twice");
  }
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> started =
      StartMetricsEndpoint(options_.metrics, registry, logger_, std::move(handlers));
  if (!started.ok()) {
    LogError(logger_, "listen_failed", {Kv("error", started.status().ToString())});
    return started.status();
  }
  metrics_server_ = std::move(started).value();
  return absl::OkStatus();
}

void Daemon::StopServer() {
  if (server_ == nullptr) return;
  // Refuses new calls at once; calls in flight (and watch streams) are cancelled at the
  // deadline. Wait() returns once every handler has returned.
  server_->Shutdown(absl::ToChronoTime(absl::Now() + options_.shutdown_grace));
  server_->Wait();
  server_.reset();
}

void Daemon::Shutdown(const ShutdownSteps& steps) {
  if (shut_down_) return;
  shut_down_ = true;
  if (steps.before_server_stop) steps.before_server_stop();
  StopServer();
  metrics_server_.reset();  // Before the state its collectors read.
  if (steps.after_server_stop) steps.after_server_stop();
}

int Daemon::WaitForSignalAndShutdown(const ShutdownSteps& steps) {
  const std::string sig = WaitForTerminationSignal();
  LogInfo(logger_, "shutting_down", {Kv("signal", sig)});
  Shutdown(steps);
  LogInfo(logger_, "stopped");
  return kExitOk;
}

}  // namespace gradmesh
