// MetricsHttpServer: a minimal HTTP/1.1 endpoint for Prometheus scrapes, on its own port
// (`--metrics_port` of every daemon), beside the daemon's gRPC port.
//
//   GET /metrics   200, Content-Type: text/plain; version=0.0.4 (MetricsRegistry::Scrape())
//   GET /healthz   200, "ok"
//   paths of the HttpHandlers given to Start (e.g. the coordinator's dashboard): their answer
//   other paths    404; other methods 405; a malformed request 400; a request head over
//   MetricsHttpOptions::max_request_bytes 431; no complete head within the deadline 408
// HEAD answers as GET without the body. The query string is ignored.
//
// Connections are served concurrently, each on its own thread, at most
// MetricsHttpOptions::max_connections at a time. One more makes the oldest connection still
// waiting for its request head close (idle or trickling clients holding every slot cannot
// keep a liveness probe out); when every slot is answering, it is closed at once, with a 503
// when its request has arrived. Each
// connection has a deadline for its request head and one for sending the response
// (request_timeout each); every response closes the connection. /metrics and the HttpHandlers run
// one request at a time (under one mutex); /healthz never waits for them.
//
// Thread safety: the server runs on its own threads; Start and the destructor from one thread.
#ifndef GRADMESH_RUNTIME_METRICS_HTTP_H_
#define GRADMESH_RUNTIME_METRICS_HTTP_H_

#include <atomic>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
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
// Answers GET `path` (without the query string). Called on a connection's thread, one request
// at a time (the server serialises handlers and /metrics); it must return within a second or
// so (scrapes wait behind it).
using HttpHandler = std::function<HttpResponse(const std::string& path)>;
// Extra paths by exact path; a key ending in '/' (other than "/") also serves every path
// under it (e.g. "/job/" serves "/job/x"), the longest such key winning. /metrics and
// /healthz are always the built-in ones.
using HttpHandlers = std::map<std::string, HttpHandler>;

// Limits of one MetricsHttpServer. Defaults suit every daemon; tests shorten the deadline.
struct MetricsHttpOptions {
  // Connections served at once; one more closes the oldest still waiting for its request
  // head, or is closed at once (503 if its request has arrived) when none is. Default 64.
  int max_connections = 64;
  // Time allowed to receive a complete request head (408 after it), and separately to send
  // the response (the connection is closed after it). Default 5 s.
  absl::Duration request_timeout = absl::Seconds(5);
  // Largest request head (request line + headers + the blank line) in bytes; a longer one is
  // answered 431. Default 8 KiB.
  size_t max_request_bytes = 8 << 10;
};

// A parsed request head. Only what the endpoint uses is kept.
struct HttpRequest {
  std::string method;     // As sent: a token of letters (e.g. "GET").
  std::string path;       // The target without its query string; starts with '/'.
  int minor_version = 1;  // HTTP/1.<minor_version>, 0 or 1.
};

// Parses one request head: the bytes up to and including the first "\r\n\r\n" (anything
// after it is ignored), or up to the end of `head` if it has none. Pure; never reads outside
// `head`. INVALID_ARGUMENT naming what is wrong for: no request line, a request line that is
// not `METHOD SP TARGET SP HTTP/1.0|1.1`, a method that is not 1-16 upper-case letters, a
// target that does not start with '/' or holds a control character, a header line without
// a name and ':' or with a control character (other than tab) anywhere, more than 100 header
// lines.
absl::StatusOr<HttpRequest> ParseHttpRequestHead(absl::string_view head);

class MetricsHttpServer {
 public:
  // Listens on host:port (port 0: a free one; see port()) and serves `registry` (not owned;
  // must outlive the server) and `handlers` (whatever they capture must outlive the server).
  // UNAVAILABLE naming the address if it cannot listen; INVALID_ARGUMENT for options out of
  // range (max_connections < 1, request_timeout <= 0, max_request_bytes < 64).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host, int port, MetricsRegistry* registry, HttpHandlers handlers = {},
      const MetricsHttpOptions& options = {});
  // Stops accepting, wakes every connection (each ends within ~0.2 s, or after the response
  // it is computing) and joins the threads.
  ~MetricsHttpServer();

  int port() const { return port_; }
  // Connections being served now (for tests and logs).
  int active_connections() const;

 private:
  struct Conn;
  MetricsHttpServer(Fd listen_fd, Fd wake_fd, int port, MetricsRegistry* registry,
                    HttpHandlers handlers, const MetricsHttpOptions& options);
  void Loop();
  void Admit(Fd conn);
  void ReapFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(conns_mu_);
  void Serve(int fd, std::atomic<bool>* reading);  // Clears *reading once the head is in.
  std::string Answer(const std::string& head);

  const Fd listen_fd_;
  const Fd wake_fd_;  // eventfd: written by the destructor to stop Loop() and the connections.
  const int port_;
  MetricsRegistry* const registry_;
  const HttpHandlers handlers_;
  const MetricsHttpOptions options_;
  std::thread thread_;  // Loop(): accepts and starts a thread per connection.

  mutable absl::Mutex conns_mu_;
  std::list<std::unique_ptr<Conn>> conns_ ABSL_GUARDED_BY(conns_mu_);
  int active_ ABSL_GUARDED_BY(conns_mu_) = 0;
  int evicted_ ABSL_GUARDED_BY(conns_mu_) = 0;  // Of active_: shut down by Admit, ending.

  absl::Mutex respond_mu_;  // Serialises /metrics and the handlers.
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
// status line, headers and body. 400 when ParseHttpRequestHead refuses the head. Calls the
// handlers and `registry` on the calling thread. Exposed for tests.
std::string MetricsHttpResponse(const std::string& request_head, MetricsRegistry* registry,
                                const HttpHandlers& handlers = {});

}  // namespace gradmesh

#endif  // GRADMESH_RUNTIME_METRICS_HTTP_H_
