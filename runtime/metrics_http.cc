// The /metrics HTTP endpoint (see metrics_http.h).
#include "runtime/metrics_http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/daemon.h"
#include "common/fd.h"

namespace gradmesh {
namespace {

constexpr size_t kMaxHead = 8 << 10;
constexpr absl::Duration kRequestTimeout = absl::Seconds(2);

std::string Response(int code, absl::string_view reason, absl::string_view content_type,
                     absl::string_view body, bool head_only = false) {
  return absl::StrCat("HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n",
                      head_only ? "" : body);
}

// The handler for `path`: its exact key, else the longest key ending in '/' (not "/") that
// is a prefix of it; null if none.
const HttpHandler* FindHandler(const HttpHandlers& handlers, const std::string& path) {
  if (auto it = handlers.find(path); it != handlers.end()) return &it->second;
  const HttpHandler* best = nullptr;
  size_t best_len = 0;
  for (const auto& [key, handler] : handlers) {
    if (key.size() > 1 && key.back() == '/' && absl::StartsWith(path, key) &&
        key.size() > best_len) {
      best = &handler;
      best_len = key.size();
    }
  }
  return best;
}

std::string HandlerResponse(const HttpHandler& handler, const std::string& path, bool head) {
  const HttpResponse r = handler(path);
  switch (r.code) {
    case 200:
      return Response(200, "OK", r.content_type, r.body, head);
    case 404:
      return Response(404, "Not Found", r.content_type, r.body, head);
    default:
      return Response(500, "Internal Server Error", r.content_type, r.body, head);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsEndpoint(
    const MetricsEndpointOptions& options, MetricsRegistry* registry, const Logger* logger,
    HttpHandlers handlers) {
  if (options.port < 0) return std::unique_ptr<MetricsHttpServer>();
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start(options.host, options.port, registry, std::move(handlers));
  if (!server.ok()) return server;
  if (!options.port_file.empty()) {
    if (absl::Status st = WritePortFile(options.port_file, (*server)->port()); !st.ok()) {
      return st;
    }
  }
  if (logger != nullptr) logger->Info("metrics_listening", {Kv("port", (*server)->port())});
  return server;
}

std::string MetricsHttpResponse(const std::string& request_head, MetricsRegistry* registry,
                                const HttpHandlers& handlers) {
  const size_t eol = request_head.find("\r\n");
  const std::vector<std::string> parts =
      absl::StrSplit(request_head.substr(0, eol), ' ', absl::SkipEmpty());
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/1.")) {
    return Response(400, "Bad Request", "text/plain; charset=utf-8", "bad request\n");
  }
  const std::string& method = parts[0];
  std::string path = parts[1];
  if (const size_t q = path.find('?'); q != std::string::npos) path.resize(q);
  if (method != "GET" && method != "HEAD") {
    return Response(405, "Method Not Allowed", "text/plain; charset=utf-8", "only GET and HEAD\n");
  }
  const bool head = method == "HEAD";
  if (path == "/metrics") {
    return Response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", registry->Scrape(),
                    head);
  }
  if (path == "/healthz") return Response(200, "OK", "text/plain; charset=utf-8", "ok\n", head);
  if (const HttpHandler* handler = FindHandler(handlers, path); handler != nullptr) {
    return HandlerResponse(*handler, path, head);
  }
  return Response(404, "Not Found", "text/plain; charset=utf-8",
                  "not found (try /metrics or /healthz)\n", head);
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, MetricsRegistry* registry, HttpHandlers handlers) {
  const std::string where = absl::StrCat("metrics endpoint ", host, ":", port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port_str = absl::StrCat(port);
  const int gai =
      getaddrinfo(host.empty() ? nullptr : host.c_str(), port_str.c_str(), &hints, &res);
  if (gai != 0) {
    return absl::UnavailableError(absl::StrCat(where, ": ", gai_strerror(gai)));
  }
  Fd fd;
  std::string last = "no address";
  for (addrinfo* ai = res; ai != nullptr && fd.get() < 0; ai = ai->ai_next) {
    // Non-blocking: a connection that vanishes between poll and accept must not block the
    // loop (the destructor could not wake it).
    fd.reset(
        socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (fd.get() < 0) {
      last = std::strerror(errno);
      continue;
    }
    const int one = 1;
    (void)setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd.get(), 16) != 0) {
      last = std::strerror(errno);
      fd.reset();
    }
  }
  freeaddrinfo(res);
  if (fd.get() < 0) return absl::UnavailableError(absl::StrCat(where, ": ", last));
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
  const int bound = ss.ss_family == AF_INET6
                        ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                        : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  Fd wake(eventfd(0, EFD_CLOEXEC));
  if (wake.get() < 0) {
    return absl::UnavailableError(absl::StrCat(where, ": eventfd: ", std::strerror(errno)));
  }
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(std::move(fd), std::move(wake), bound, registry, std::move(handlers)));
}

MetricsHttpServer::MetricsHttpServer(Fd listen_fd, Fd wake_fd, int port, MetricsRegistry* registry,
                                     HttpHandlers handlers)
    : listen_fd_(std::move(listen_fd)),
      wake_fd_(std::move(wake_fd)),
      port_(port),
      registry_(registry),
      handlers_(std::move(handlers)) {
  thread_ = std::thread([this] { Loop(); });
}

MetricsHttpServer::~MetricsHttpServer() {
  const uint64_t one = 1;
  (void)!write(wake_fd_.get(), &one, sizeof(one));
  thread_.join();
}

void MetricsHttpServer::Loop() {
  while (true) {
    pollfd p[2] = {{listen_fd_.get(), POLLIN, 0}, {wake_fd_.get(), POLLIN, 0}};
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (p[1].revents != 0) return;
    Fd conn(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    const int fd = conn.get();
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    Serve(fd);
    // Unread input (a body, an oversized head) would make close() send a reset that can cut
    // the response short: end our side, then drain briefly.
    shutdown(fd, SHUT_WR);
    const absl::Time drain_until = absl::Now() + absl::Milliseconds(200);
    char sink[4096];
    pollfd drain{fd, POLLIN, 0};
    while (poll(&drain, 1, PollTimeoutMs(drain_until)) > 0 && recv(fd, sink, sizeof(sink), 0) > 0) {
    }
  }
}

void MetricsHttpServer::Serve(int fd) {
  const absl::Time deadline = absl::Now() + kRequestTimeout;
  std::string head;
  char buf[1024];
  bool complete = false;
  while (!complete && head.size() < kMaxHead) {
    pollfd p[2] = {{fd, POLLIN, 0}, {wake_fd_.get(), POLLIN, 0}};
    const int rc = poll(p, 2, PollTimeoutMs(deadline));
    if (rc == 0 || p[1].revents != 0) break;  // Timed out, or the server is stopping.
    if (rc < 0) {
      if (errno == EINTR) continue;
      break;
    }
    const ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r == 0) break;
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      break;
    }
    head.append(buf, static_cast<size_t>(r));
    complete = head.find("\r\n\r\n") != std::string::npos;
  }
  const std::string out =
      complete ? MetricsHttpResponse(head, registry_, handlers_)
               : Response(400, "Bad Request", "text/plain; charset=utf-8", "incomplete request\n");
  const absl::Time send_deadline = absl::Now() + kRequestTimeout;
  size_t sent = 0;
  while (sent < out.size()) {
    const ssize_t w = send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (w > 0) {
      sent += static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      pollfd p{fd, POLLOUT, 0};
      if (poll(&p, 1, PollTimeoutMs(send_deadline)) <= 0) return;
      continue;
    }
    return;
  }
}

}  // namespace gradmesh
