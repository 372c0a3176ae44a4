// Tests of the Prometheus text rendering (metrics.h) and the /metrics endpoint
// (metrics_http.h) over a real socket on 127.0.0.1.
#include "common/metrics.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "runtime/metrics_http.h"

namespace gradmesh {
namespace {

TEST(MetricsWriterTest, RendersFamiliesOnceWithEscapedLabelsAndExactValues) {
  MetricsWriter w;
  w.Counter("a_total", "Things.\nMore", {{"job", "x\"y\\z\nw"}, {"shard", "0"}}, 3);
  w.Gauge("b", "B.", {}, 0.25);
  w.Counter("a_total", "ignored help", {{"job", "j2"}, {"shard", "1"}}, 12345678901234);
  w.Gauge("a_total", "wrong type: dropped", {}, 1);
  w.Gauge("c", "C.", {{"k", "v"}}, std::numeric_limits<double>::quiet_NaN());
  w.Gauge("c", "C.", {{"k", "p"}}, std::numeric_limits<double>::infinity());
  w.Gauge("c", "C.", {{"k", "m"}}, -std::numeric_limits<double>::infinity());
  w.Gauge("d", "D.", {}, 1.0 / 3);
  EXPECT_EQ(w.Render(),
            "# HELP a_total Things.\\nMore\n"
            "# TYPE a_total counter\n"
            "a_total{job=\"x\\\"y\\\\z\\nw\",shard=\"0\"} 3\n"
            "a_total{job=\"j2\",shard=\"1\"} 12345678901234\n"
            "# HELP b B.\n"
            "# TYPE b gauge\n"
            "b 0.25\n"
            "# HELP c C.\n"
            "# TYPE c gauge\n"
            "c{k=\"v\"} NaN\n"
            "c{k=\"p\"} +Inf\n"
            "c{k=\"m\"} -Inf\n"
            "# HELP d D.\n"
            "# TYPE d gauge\n"
            "d 0.33333333333333331\n");
}

TEST(MetricsRegistryTest, ScrapeRunsEveryCollectorInOrderAndCountsScrapes) {
  MetricsRegistry r;
  int calls = 0;
  r.AddCollector([&](MetricsWriter* w) { w->Gauge("first", "F.", {}, ++calls); });
  r.AddCollector([&](MetricsWriter* w) { w->Gauge("second", "S.", {}, 7); });
  const std::string one = r.Scrape();
  EXPECT_LT(one.find("first 1\n"), one.find("second 7\n"));
  EXPECT_TRUE(absl::StrContains(one, "gradmesh_scrapes_total 1\n")) << one;
  EXPECT_TRUE(absl::StrContains(one, "# TYPE gradmesh_process_start_time_seconds gauge\n"));
  const std::string two = r.Scrape();
  EXPECT_TRUE(absl::StrContains(two, "first 2\n")) << two;
  EXPECT_TRUE(absl::StrContains(two, "gradmesh_scrapes_total 2\n")) << two;
}

TEST(MetricsHttpResponseTest, AnswersByMethodAndPath) {
  MetricsRegistry r;
  r.AddCollector([](MetricsWriter* w) { w->Gauge("g", "G.", {}, 5); });
  const std::string ok = MetricsHttpResponse("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", &r);
  EXPECT_TRUE(absl::StartsWith(ok, "HTTP/1.1 200 OK\r\n")) << ok;
  EXPECT_TRUE(absl::StrContains(ok, "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"));
  EXPECT_TRUE(absl::StrContains(ok, "\r\n\r\n# HELP g G.\n# TYPE g gauge\ng 5\n")) << ok;
  const std::string body = ok.substr(ok.find("\r\n\r\n") + 4);
  EXPECT_TRUE(absl::StrContains(ok, absl::StrCat("Content-Length: ", body.size(), "\r\n")));
  EXPECT_TRUE(absl::StartsWith(MetricsHttpResponse("GET /metrics?x=1 HTTP/1.0\r\n\r\n", &r),
                               "HTTP/1.1 200 OK"));
  const std::string head = MetricsHttpResponse("HEAD /metrics HTTP/1.1\r\n\r\n", &r);
  EXPECT_TRUE(absl::StartsWith(head, "HTTP/1.1 200 OK"));
  EXPECT_TRUE(absl::EndsWith(head, "\r\n\r\n")) << head;  // No body.
  EXPECT_TRUE(
      absl::StrContains(MetricsHttpResponse("GET /healthz HTTP/1.1\r\n\r\n", &r), "\r\n\r\nok\n"));
  EXPECT_TRUE(absl::StartsWith(MetricsHttpResponse("GET /x HTTP/1.1\r\n\r\n", &r),
                               "HTTP/1.1 404 Not Found"));
  EXPECT_TRUE(absl::StartsWith(MetricsHttpResponse("POST /metrics HTTP/1.1\r\n\r\n", &r),
                               "HTTP/1.1 405 Method Not Allowed"));
  EXPECT_TRUE(
      absl::StartsWith(MetricsHttpResponse("hello\r\n\r\n", &r), "HTTP/1.1 400 Bad Request"));
}

TEST(MetricsHttpResponseTest, ExtraHandlersByPathAndPrefix) {
  MetricsRegistry r;
  r.AddCollector([](MetricsWriter* w) { w->Gauge("g", "G.", {}, 5); });
  HttpHandlers handlers;
  handlers["/"] = [](const std::string& path) { return HttpResponse{200, "text/html", "home"}; };
  handlers["/job/"] = [](const std::string& path) {
    if (path == "/job/missing") return HttpResponse{404, "text/plain", "no such job"};
    return HttpResponse{200, "text/html", "page of " + path};
  };
  handlers["/boom"] = [](const std::string&) { return HttpResponse{503, "text/plain", "x"}; };
  // The built-in paths cannot be taken over.
  handlers["/metrics"] = [](const std::string&) { return HttpResponse{200, "text/plain", "no"}; };
  EXPECT_EQ(MetricsHttpResponse("GET /?refresh=1 HTTP/1.1\r\n\r\n", &r, handlers),
            "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 4\r\n"
            "Connection: close\r\n\r\nhome");
  EXPECT_EQ(MetricsHttpResponse("GET /job/a.b HTTP/1.1\r\n\r\n", &r, handlers),
            "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 16\r\n"
            "Connection: close\r\n\r\npage of /job/a.b");
  EXPECT_EQ(MetricsHttpResponse("HEAD /job/missing HTTP/1.1\r\n\r\n", &r, handlers),
            "HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: 11\r\n"
            "Connection: close\r\n\r\n");
  EXPECT_TRUE(absl::StartsWith(MetricsHttpResponse("GET /boom HTTP/1.1\r\n\r\n", &r, handlers),
                               "HTTP/1.1 500 Internal Server Error\r\n"));
  // "/" serves only "/": other paths are still 404.
  EXPECT_TRUE(absl::StartsWith(MetricsHttpResponse("GET /x HTTP/1.1\r\n\r\n", &r, handlers),
                               "HTTP/1.1 404 Not Found"));
  EXPECT_TRUE(absl::StrContains(MetricsHttpResponse("GET /metrics HTTP/1.1\r\n\r\n", &r, handlers),
                                "\r\n\r\n# HELP g G.\n"));
  EXPECT_TRUE(absl::StrContains(MetricsHttpResponse("GET /healthz HTTP/1.1\r\n\r\n", &r, handlers),
                                "\r\n\r\nok\n"));
}

// Sends `request` to 127.0.0.1:port and returns everything the server answers.
std::string Fetch(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return "connect failed";
  }
  if (!request.empty()) (void)!write(fd, request.data(), request.size());
  std::string out;
  char buf[4096];
  ssize_t r;
  while ((r = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(r));
  close(fd);
  return out;
}

TEST(MetricsHttpServerTest, ServesScrapesOverTcpAndSurvivesBadClients) {
  MetricsRegistry r;
  r.AddCollector([](MetricsWriter* w) { w->Counter("hits_total", "H.", {{"a", "b"}}, 42); });
  MetricsHttpOptions options;
  options.request_timeout = absl::Seconds(2);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MetricsHttpServer> server,
                       MetricsHttpServer::Start("127.0.0.1", 0, &r, {}, options));
  ASSERT_GT(server->port(), 0);
  const std::string got = Fetch(server->port(), "GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n");
  EXPECT_TRUE(absl::StartsWith(got, "HTTP/1.1 200 OK\r\n")) << got;
  EXPECT_TRUE(absl::StrContains(got, "hits_total{a=\"b\"} 42\n")) << got;
  // A client that sends half a request and goes quiet gets 408 after the deadline (2 s here);
  // the next scrape is served after it.
  const absl::Time start = absl::Now();
  EXPECT_TRUE(absl::StartsWith(Fetch(server->port(), "GET /metr"), "HTTP/1.1 408")) << "stall";
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  EXPECT_TRUE(absl::StrContains(Fetch(server->port(), "GET /healthz HTTP/1.1\r\n\r\n"), "ok\n"));
  // A request head over 8 KiB is refused with 431, with or without its blank line.
  EXPECT_TRUE(absl::StartsWith(
      Fetch(server->port(), "GET /metrics HTTP/1.1\r\nX: " + std::string(9000, 'x')),
      "HTTP/1.1 431 Request Header Fields Too Large\r\n"));
  EXPECT_TRUE(absl::StartsWith(
      Fetch(server->port(), "GET /metrics HTTP/1.1\r\nX: " + std::string(9000, 'x') + "\r\n\r\n"),
      "HTTP/1.1 431 "));
  // The port is taken while it runs.
  EXPECT_STATUS_MSG(MetricsHttpServer::Start("127.0.0.1", server->port(), &r).status(),
                    absl::StatusCode::kUnavailable, "metrics endpoint 127.0.0.1:");
  const int port = server->port();
  const absl::Time stop = absl::Now();
  server.reset();
  EXPECT_LT(absl::Now() - stop, absl::Seconds(1));  // Stops promptly when idle.
  EXPECT_EQ(Fetch(port, "GET /metrics HTTP/1.1\r\n\r\n"), "connect failed");
}

TEST(ParseHttpRequestHeadTest, AcceptsWellFormedHeadsAndNamesWhatIsWrong) {
  ASSERT_OK_AND_ASSIGN(
      HttpRequest get,
      ParseHttpRequestHead("GET /job/a?x=1 HTTP/1.0\r\nHost: h\r\nA:\tb\r\n\r\nbody"));
  EXPECT_EQ(get.method, "GET");
  EXPECT_EQ(get.path, "/job/a");
  EXPECT_EQ(get.minor_version, 0);
  ASSERT_OK_AND_ASSIGN(HttpRequest head, ParseHttpRequestHead("HEAD / HTTP/1.1"));
  EXPECT_EQ(head.method, "HEAD");
  EXPECT_EQ(head.path, "/");
  EXPECT_EQ(head.minor_version, 1);
  const std::pair<std::string, std::string> bad[] = {
      {"", "no request line"},
      {"\r\n\r\n", "no request line"},
      {"GET /x\r\n\r\n", "not METHOD TARGET HTTP/1.x"},
      {"GET  /x HTTP/1.1\r\n\r\n", "not METHOD TARGET HTTP/1.x"},
      {"GET /x HTTP/1.1 \r\n\r\n", "not METHOD TARGET HTTP/1.x"},
      {"get /x HTTP/1.1\r\n\r\n", "method is not 1-16 upper-case letters"},
      {"ABCDEFGHIJKLMNOPQ /x HTTP/1.1\r\n\r\n", "method is not 1-16 upper-case letters"},
      {"GET x HTTP/1.1\r\n\r\n", "target does not start with '/'"},
      {std::string("GET /a\x01 HTTP/1.1\r\n\r\n"), "control character"},
      {"GET /x HTTP/2.0\r\n\r\n", "version is not HTTP/1.0 or HTTP/1.1"},
      {"GET /x HTTP/1.1\r\nno colon\r\n\r\n", "header line 1 has no name: field"},
      {"GET /x HTTP/1.1\r\nA: b\r\n: v\r\n\r\n", "header line 2 has no name: field"},
      {"GET /x HTTP/1.1\r\nA b: c\r\n\r\n", "header line 1: bad character in the field name"},
      {"GET /x HTTP/1.1\r\nA: b\nc\r\n\r\n", "header line 1: control character in the value"},
      {std::string("GET /x HTTP/1.1\r\nA: b\0c\r\n\r\n", 26),
       "header line 1: control character in the value"},
  };
  for (const auto& [text, message] : bad) {
    EXPECT_STATUS_MSG(ParseHttpRequestHead(text).status(), absl::StatusCode::kInvalidArgument,
                      message)
        << absl::CEscape(text);
  }
  std::string many = "GET /x HTTP/1.1\r\n";
  for (int i = 0; i < 101; ++i) many += "A: b\r\n";
  EXPECT_STATUS_MSG(ParseHttpRequestHead(many + "\r\n").status(),
                    absl::StatusCode::kInvalidArgument, "more than 100 header lines");
  // The response names the reason.
  MetricsRegistry r;
  EXPECT_TRUE(absl::StartsWith(MetricsHttpResponse("GET x HTTP/1.1\r\n\r\n", &r),
                               "HTTP/1.1 400 Bad Request\r\n"));
  EXPECT_TRUE(absl::StrContains(MetricsHttpResponse("GET x HTTP/1.1\r\n\r\n", &r),
                                "bad request: target does not start with '/'"));
}

// Opens a TCP connection to 127.0.0.1:port that sends nothing; -1 on failure.
int ConnectIdle(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

TEST(MetricsHttpServerTest, IdleConnectionsDoNotDelayHealthz) {
  MetricsRegistry r;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MetricsHttpServer> server,
                       MetricsHttpServer::Start("127.0.0.1", 0, &r));  // Default: 5 s deadline.
  std::vector<int> idle;
  for (int i = 0; i < 50; ++i) {
    const int fd = ConnectIdle(server->port());
    ASSERT_GE(fd, 0);
    idle.push_back(fd);
  }
  // Every idle connection is being served (waiting for its head) before the probe.
  const absl::Time wait_until = absl::Now() + absl::Seconds(3);
  while (server->active_connections() < 50 && absl::Now() < wait_until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(server->active_connections(), 50);
  for (int i = 0; i < 5; ++i) {
    const absl::Time start = absl::Now();
    const std::string got = Fetch(server->port(), "GET /healthz HTTP/1.1\r\n\r\n");
    const absl::Duration took = absl::Now() - start;
    EXPECT_TRUE(absl::StartsWith(got, "HTTP/1.1 200 OK\r\n")) << got;
    EXPECT_LT(took, absl::Milliseconds(200)) << "probe " << i;
  }
  EXPECT_TRUE(absl::StrContains(Fetch(server->port(), "GET /metrics HTTP/1.1\r\n\r\n"),
                                "gradmesh_scrapes_total 1\n"));
  for (int fd : idle) close(fd);
  const absl::Time stop = absl::Now();
  server.reset();  // Wakes the connections' threads, which are still waiting.
  EXPECT_LT(absl::Now() - stop, absl::Seconds(1));
}

TEST(MetricsHttpServerTest, SlowLorisIsCutOffIdleOnesMakeRoomAndBusyOnesGet503) {
  MetricsRegistry r;
  MetricsHttpOptions options;
  options.request_timeout = absl::Milliseconds(600);
  options.max_connections = 2;
  HttpHandlers handlers;
  handlers["/slow"] = [](const std::string&) {
    absl::SleepFor(absl::Milliseconds(300));
    return HttpResponse{200, "text/plain", "slow"};
  };
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MetricsHttpServer> server,
                       MetricsHttpServer::Start("127.0.0.1", 0, &r, handlers, options));
  // One byte every 100 ms: the deadline is for the whole head, so trickling does not extend it.
  const int loris = ConnectIdle(server->port());
  ASSERT_GE(loris, 0);
  const absl::Time start = absl::Now();
  const std::string request = "GET /metrics HTTP/1.1\r\nX-Slow: ";
  std::string got;
  char buf[4096];
  for (size_t i = 0; got.empty() && absl::Now() - start < absl::Seconds(5); ++i) {
    (void)!send(loris, request.data() + (i % request.size()), 1, MSG_NOSIGNAL);
    absl::SleepFor(absl::Milliseconds(100));
    const ssize_t n = recv(loris, buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) got.assign(buf, static_cast<size_t>(n));
  }
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(absl::StartsWith(got, "HTTP/1.1 408 Request Timeout\r\n")) << got;
  EXPECT_GE(took, absl::Milliseconds(550));
  EXPECT_LT(took, absl::Milliseconds(1500));
  // Then the server closes it: reads reach end of stream.
  ssize_t n;
  const absl::Time closing = absl::Now();
  while ((n = read(loris, buf, sizeof(buf))) > 0) {
  }
  EXPECT_EQ(n, 0);
  EXPECT_LT(absl::Now() - closing, absl::Seconds(1));
  close(loris);
  // At the cap (2 idle connections held), a probe makes the older idle one close and is
  // answered at once.
  while (server->active_connections() > 0) absl::SleepFor(absl::Milliseconds(5));
  const int a = ConnectIdle(server->port());
  while (server->active_connections() < 1) absl::SleepFor(absl::Milliseconds(5));
  const int b = ConnectIdle(server->port());
  while (server->active_connections() < 2) absl::SleepFor(absl::Milliseconds(5));
  for (int i = 0; i < 3; ++i) {
    const absl::Time probed = absl::Now();
    EXPECT_TRUE(absl::StartsWith(Fetch(server->port(), "GET /healthz HTTP/1.1\r\n\r\n"),
                                 "HTTP/1.1 200 OK\r\n"))
        << i;
    EXPECT_LT(absl::Now() - probed, absl::Milliseconds(300)) << i;
  }
  // `a`, the older, was closed to make room: end of stream, no answer.
  EXPECT_EQ(read(a, buf, sizeof(buf)), 0);
  close(a);
  close(b);
  while (server->active_connections() > 0) absl::SleepFor(absl::Milliseconds(5));

  // When every slot is answering (two slow /slow requests), one more is refused with 503.
  std::thread slow1([&] { Fetch(server->port(), "GET /slow HTTP/1.1\r\n\r\n"); });
  std::thread slow2([&] { Fetch(server->port(), "GET /slow HTTP/1.1\r\n\r\n"); });
  while (server->active_connections() < 2) absl::SleepFor(absl::Milliseconds(5));
  absl::SleepFor(absl::Milliseconds(50));  // Both heads are in: answering.
  const std::string busy = Fetch(server->port(), "GET /healthz HTTP/1.1\r\n\r\n");
  EXPECT_TRUE(busy.empty() || absl::StartsWith(busy, "HTTP/1.1 503 Service Unavailable\r\n"))
      << busy;
  slow1.join();
  slow2.join();
}

TEST(MetricsHttpServerTest, RefusesOptionsOutOfRange) {
  MetricsRegistry r;
  MetricsHttpOptions none;
  none.max_connections = 0;
  EXPECT_STATUS_MSG(MetricsHttpServer::Start("127.0.0.1", 0, &r, {}, none).status(),
                    absl::StatusCode::kInvalidArgument, "max_connections must be >= 1");
  MetricsHttpOptions zero;
  zero.request_timeout = absl::ZeroDuration();
  EXPECT_EQ(MetricsHttpServer::Start("127.0.0.1", 0, &r, {}, zero).status().code(),
            absl::StatusCode::kInvalidArgument);
  MetricsHttpOptions tiny;
  tiny.max_request_bytes = 10;
  EXPECT_EQ(MetricsHttpServer::Start("127.0.0.1", 0, &r, {}, tiny).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace gradmesh
