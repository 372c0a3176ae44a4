// MetricsHttpServer: a minimal HTTP/1.1 endpoint for Prometheus scrapes, on its own port
// (`--metrics_port` of every daemon), beside the daemon's gRPC port.
//
//   GET /metrics   200, Content-Type: text/plain; version=0.0.4 (MetricsRegistry::Scrape())
//   GET /healthz   200, "ok"
//   paths of the HttpHandlers given to Start (e.g. the coordinator's dashboard): their answer
//   other paths    404; other methods 405; an unreadable request 400
// HEAD answers as GET without the body. The query string is ignored.
//
// One connection at a time on one thread (scrapes are seconds apart); every response closes
// the connection. A client that sends no complete request head (8 KiB at most) within 2 s
// gets 400 and is closed, so a stalled client delays the next scrape by at most that.
//
// Thread safety: the server runs on its own thread; Start and the destructor from one thread.
#ifndef GRADMESH_RUNTIME_METRICS_HTTP_H_
#define GRADMESH_RUNTIME_METRICS_HTTP_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/fd.h"
#include "common/logging.h"
#include "common/metrics.h"

namespace gradmesh {

// One answer of an HttpHandler.
struct HttpResponse {
  int code = 200;  // 200, 404 or 500 (other codes are sent as 500).
  std::string content_type = "text/html; charset=utf-8";
  std::string body;
};
// Answers GET `path` (without the query string). Called on the server's thread, one request
// at a time; it must return within a second or so (a scrape waits behind it).
using HttpHandler = std::function<HttpResponse(const std::string& path)>;
// Extra paths by exact path; a key ending in '/' (other than "/") also serves every path
// under it (e.g. "/job/" serves "/job/x"), the longest such key winning. /metrics and
// /healthz are always the built-in ones.
using HttpHandlers = std::map<std::string, HttpHandler>;

class MetricsHttpServer {
 public:
  // Listens on host:port (port 0: a free one; see port()) and serves `registry` (not owned;
  // must outlive the server) and `handlers` (whatever they capture must outlive the server).
  // UNAVAILABLE naming the address if it cannot listen.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& host, int port,
                                                                  MetricsRegistry* registry,
                                                                  HttpHandlers handlers = {});
  // Stops accepting, finishes the request in progress (at most ~2 s) and joins the thread.
  ~MetricsHttpServer();

  int port() const { return port_; }

 private:
  MetricsHttpServer(Fd listen_fd, Fd wake_fd, int port, MetricsRegistry* registry,
                    HttpHandlers handlers);
  void Loop();
  void Serve(int fd);

  const Fd listen_fd_;
  const Fd wake_fd_;  // eventfd: written by the destructor to stop Loop().
  const int port_;
  MetricsRegistry* const registry_;
  const HttpHandlers handlers_;
  std::thread thread_;
};

// How a daemon's main() starts its endpoint (from --metrics_port / --metrics_port_file).
struct MetricsEndpointOptions {
  std::string host;       // As the daemon's --host.
  int port = -1;          // -1: no endpoint; 0: a free port.
  std::string port_file;  // If set, the bound port is written here (common/daemon.h).
};

// Starts the endpoint and logs event=metrics_listening port=N to `logger` (may be null);
// null (and OK) when options.port < 0. Errors: Start's, or the port file's.
absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsEndpoint(
    const MetricsEndpointOptions& options, MetricsRegistry* registry, const Logger* logger,
    HttpHandlers handlers = {});

// The response to one request head (request line + headers, without the body), as sent:
// status line, headers and body. Exposed for tests.
std::string MetricsHttpResponse(const std::string& request_head, MetricsRegistry* registry,
                                const HttpHandlers& handlers = {});

}  // namespace gradmesh

#endif  // GRADMESH_RUNTIME_METRICS_HTTP_H_
