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

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/daemon.h"
#include "common/fd.h"

namespace gradmesh {
namespace {

constexpr size_t kMaxHeaderLines = 100;
constexpr absl::string_view kTextPlain = "text/plain; charset=utf-8";

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

bool IsControl(char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; }

bool IsTokenChar(char c) {
  return !IsControl(c) && static_cast<unsigned char>(c) < 0x80 &&
         absl::string_view("()<>@,;:\\\"/[]?={} \t").find(c) == absl::string_view::npos;
}

absl::Status CheckHeaderLine(absl::string_view line, size_t number) {
  const size_t colon = line.find(':');
  if (colon == absl::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("header line ", number, " has no name: field"));
  }
  for (size_t i = 0; i < colon; ++i) {
    if (!IsTokenChar(line[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("header line ", number, ": bad character in the field name"));
    }
  }
  for (size_t i = colon + 1; i < line.size(); ++i) {
    if (IsControl(line[i]) && line[i] != '\t') {
      return absl::InvalidArgumentError(
          absl::StrCat("header line ", number, ": control character in the value"));
    }
  }
  return absl::OkStatus();
}

// The response to a parsed request (see metrics_http.h for the table).
std::string Respond(const HttpRequest& request, MetricsRegistry* registry,
                    const HttpHandlers& handlers) {
  const std::string& path = request.path;
  if (request.method != "GET" && request.method != "HEAD") {
    return Response(405, "Method Not Allowed", kTextPlain, "only GET and HEAD\n");
  }
  const bool head = request.method == "HEAD";
  if (path == "/metrics") {
    return Response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", registry->Scrape(),
                    head);
  }
  if (path == "/healthz") return Response(200, "OK", kTextPlain, "ok\n", head);
  if (const HttpHandler* handler = FindHandler(handlers, path); handler != nullptr) {
    return HandlerResponse(*handler, path, head);
  }
  return Response(404, "Not Found", kTextPlain, "not found (try /metrics or /healthz)\n", head);
}

// Sends all of `out` on the non-blocking `fd` until `deadline`; gives up on an error or when
// `wake_fd` becomes readable (the server is stopping).
void SendAll(int fd, int wake_fd, const std::string& out, absl::Time deadline) {
  size_t sent = 0;
  while (sent < out.size()) {
    const ssize_t w = send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (w > 0) {
      sent += static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      pollfd p[2] = {{fd, POLLOUT, 0}, {wake_fd, POLLIN, 0}};
      if (poll(p, 2, PollTimeoutMs(deadline)) <= 0 || p[1].revents != 0) return;
      continue;
    }
    return;
  }
}

std::string BadRequest(const absl::Status& status) {
  return Response(400, "Bad Request", kTextPlain,
                  absl::StrCat("bad request: ", status.message(), "\n"));
}

}  // namespace

absl::StatusOr<HttpRequest> ParseHttpRequestHead(absl::string_view head) {
  if (const size_t end = head.find("\r\n\r\n"); end != absl::string_view::npos) {
    head = head.substr(0, end);
  }
  const size_t eol = head.find("\r\n");
  const absl::string_view line = head.substr(0, eol);
  if (line.empty()) return absl::InvalidArgumentError("no request line");
  const std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 3 || parts[0].empty() || parts[1].empty()) {
    return absl::InvalidArgumentError("request line is not METHOD TARGET HTTP/1.x");
  }
  HttpRequest request;
  if (parts[0].size() > 16 ||
      !std::all_of(parts[0].begin(), parts[0].end(), [](char c) { return c >= 'A' && c <= 'Z'; })) {
    return absl::InvalidArgumentError("method is not 1-16 upper-case letters");
  }
  request.method = std::string(parts[0]);
  if (parts[1][0] != '/' || std::any_of(parts[1].begin(), parts[1].end(), IsControl)) {
    return absl::InvalidArgumentError("target does not start with '/' or has a control character");
  }
  request.path = std::string(parts[1].substr(0, parts[1].find('?')));
  if (parts[2] == "HTTP/1.1") {
    request.minor_version = 1;
  } else if (parts[2] == "HTTP/1.0") {
    request.minor_version = 0;
  } else {
    return absl::InvalidArgumentError("version is not HTTP/1.0 or HTTP/1.1");
  }
  if (eol == absl::string_view::npos) return request;
  const std::vector<absl::string_view> lines = absl::StrSplit(head.substr(eol + 2), "\r\n");
  if (lines.size() > kMaxHeaderLines) {
    return absl::InvalidArgumentError(absl::StrCat("more than ", kMaxHeaderLines, " header lines"));
  }
  for (size_t i = 0; i < lines.size(); ++i) {
    if (absl::Status st = CheckHeaderLine(lines[i], i + 1); !st.ok()) return st;
  }
  return request;
}

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
  absl::StatusOr<HttpRequest> request = ParseHttpRequestHead(request_head);
  if (!request.ok()) return BadRequest(request.status());
  return Respond(*request, registry, handlers);
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, MetricsRegistry* registry, HttpHandlers handlers,
    const MetricsHttpOptions& options) {
  const std::string where = absl::StrCat("metrics endpoint ", host, ":", port);
  if (options.max_connections < 1 || options.request_timeout <= absl::ZeroDuration() ||
      options.max_request_bytes < 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": max_connections must be >= 1, request_timeout > 0, max_request_bytes >= 64"));
  }
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
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(
      std::move(fd), std::move(wake), bound, registry, std::move(handlers), options));
}

struct MetricsHttpServer::Conn {
  Fd fd;  // Reset under conns_mu_ (Admit may shut it down meanwhile).
  std::thread thread;
  bool done = false;     // Guarded by conns_mu_: set by the thread as its last step.
  bool evicted = false;  // Guarded by conns_mu_: shut down to make room.
  // Still waiting for its request head (no answer started): what Admit may evict.
  std::atomic<bool> reading{true};
};

MetricsHttpServer::MetricsHttpServer(Fd listen_fd, Fd wake_fd, int port, MetricsRegistry* registry,
                                     HttpHandlers handlers, const MetricsHttpOptions& options)
    : listen_fd_(std::move(listen_fd)),
      wake_fd_(std::move(wake_fd)),
      port_(port),
      registry_(registry),
      handlers_(std::move(handlers)),
      options_(options) {
  thread_ = std::thread([this] { Loop(); });
}

MetricsHttpServer::~MetricsHttpServer() {
  const uint64_t one = 1;
  (void)!write(wake_fd_.get(), &one, sizeof(one));  // Level-triggered: wakes every poll.
  thread_.join();
  std::list<std::unique_ptr<Conn>> conns;
  {
    absl::MutexLock lock(&conns_mu_);
    conns.swap(conns_);
  }
  for (auto& c : conns) c->thread.join();
}

int MetricsHttpServer::active_connections() const {
  absl::MutexLock lock(&conns_mu_);
  return active_;
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
    if (conn.get() < 0) {
      if (errno == EMFILE || errno == ENFILE) absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    Admit(std::move(conn));
  }
}

void MetricsHttpServer::ReapFinished() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    if (!(*it)->done) {
      ++it;
      continue;
    }
    (*it)->thread.join();  // It has only to return.
    it = conns_.erase(it);
  }
}

void MetricsHttpServer::Admit(Fd conn) {
  absl::MutexLock lock(&conns_mu_);
  ReapFinished();
  if (active_ - evicted_ >= options_.max_connections && active_ < 2 * options_.max_connections) {
    // At the cap: the oldest connection still waiting for its request head makes room
    // (shut down, its thread ends at once), so that idle or trickling clients holding every
    // slot cannot keep a liveness probe out. Past twice the cap (evictions still ending),
    // the new one is refused below.
    for (const std::unique_ptr<Conn>& c : conns_) {
      if (c->done || c->evicted || !c->reading.load() || c->fd.get() < 0) continue;
      c->evicted = true;
      shutdown(c->fd.get(), SHUT_RDWR);
      ++evicted_;
      break;
    }
  }
  if (active_ - evicted_ >= options_.max_connections) {
    // Best effort, never blocking the accept loop: the answer fits in the socket buffer. What
    // the client has sent so far is read first (unread input makes close() send a reset that
    // can discard the answer); a request still in flight may still meet a reset.
    char sink[4096];
    while (recv(conn.get(), sink, sizeof(sink), MSG_DONTWAIT) > 0) {
    }
    const std::string busy =
        Response(503, "Service Unavailable", kTextPlain, "too many connections\n");
    (void)!send(conn.get(), busy.data(), busy.size(), MSG_NOSIGNAL);
    shutdown(conn.get(), SHUT_WR);
    return;
  }
  ++active_;
  conns_.push_back(std::make_unique<Conn>());
  Conn* c = conns_.back().get();
  c->fd = std::move(conn);
  c->thread = std::thread([this, c] {
    const int fd = c->fd.get();
    Serve(fd, &c->reading);
    // Unread input (a body, an oversized head) would make close() send a reset that can cut
    // the response short: end our side, then drain briefly.
    shutdown(fd, SHUT_WR);
    const absl::Time drain_until = absl::Now() + absl::Milliseconds(200);
    char sink[4096];
    while (true) {
      pollfd p[2] = {{fd, POLLIN, 0}, {wake_fd_.get(), POLLIN, 0}};
      if (poll(p, 2, PollTimeoutMs(drain_until)) <= 0 || p[1].revents != 0) break;
      if (recv(fd, sink, sizeof(sink), 0) <= 0) break;
    }
    absl::MutexLock lock(&conns_mu_);
    c->fd.reset();
    --active_;
    if (c->evicted) --evicted_;
    c->done = true;
  });
}

std::string MetricsHttpServer::Answer(const std::string& head) {
  absl::StatusOr<HttpRequest> request = ParseHttpRequestHead(head);
  if (!request.ok()) return BadRequest(request.status());
  if (request->path == "/healthz") return Respond(*request, registry_, handlers_);
  absl::MutexLock lock(&respond_mu_);
  return Respond(*request, registry_, handlers_);
}

void MetricsHttpServer::Serve(int fd, std::atomic<bool>* reading) {
  const absl::Time deadline = absl::Now() + options_.request_timeout;
  const size_t max = options_.max_request_bytes;
  std::string head;
  char buf[1024];
  enum { kReading, kComplete, kTooLarge, kTimedOut, kClosed, kStopping } state = kReading;
  while (state == kReading) {
    pollfd p[2] = {{fd, POLLIN, 0}, {wake_fd_.get(), POLLIN, 0}};
    const int rc = poll(p, 2, PollTimeoutMs(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0 || p[1].revents != 0) return;  // The server is stopping.
    if (rc == 0) {
      state = kTimedOut;
      break;
    }
    const ssize_t r = recv(fd, buf, std::min(sizeof(buf), max + 1 - head.size()), 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    if (r <= 0) {
      state = kClosed;
      break;
    }
    head.append(buf, static_cast<size_t>(r));
    const size_t end = head.find("\r\n\r\n");
    if (end != std::string::npos) {
      state = end + 4 <= max ? kComplete : kTooLarge;
    } else if (head.size() > max) {
      state = kTooLarge;
    }
  }
  reading->store(false);
  std::string out;
  switch (state) {
    case kComplete:
      out = Answer(head);
      break;
    case kTooLarge:
      out = Response(431, "Request Header Fields Too Large", kTextPlain,
                     absl::StrCat("request head over ", max, " bytes\n"));
      break;
    case kTimedOut:
      out = Response(408, "Request Timeout", kTextPlain,
                     absl::StrCat("no complete request within ",
                                  absl::FormatDuration(options_.request_timeout), "\n"));
      break;
    default:  // The client closed its side before a complete head: nothing to answer.
      return;
  }
  SendAll(fd, wake_fd_.get(), out, absl::Now() + options_.request_timeout);
}

}  // namespace gradmesh
