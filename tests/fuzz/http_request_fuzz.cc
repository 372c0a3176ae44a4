// Fuzz target: the metrics endpoint's request parsing (runtime/metrics_http.h), the only bytes
// every daemon takes from anyone who can reach its --metrics_port.
//
// Input: a request head as a client would send it. Checked: ParseHttpRequestHead accepts
// only a method of upper-case letters and a path starting with '/' without control
// characters; MetricsHttpResponse always answers one well-formed status line, 400 exactly
// when the parser refuses the head, with a Content-Length equal to the body's size.
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "runtime/metrics_http.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradmesh;
  static MetricsRegistry* registry = [] {
    auto* r = new MetricsRegistry;
    r->AddCollector([](MetricsWriter* w) { w->Gauge("fuzz", "F.", {{"a", "b"}}, 1); });
    return r;
  }();
  static const HttpHandlers* handlers =
      new HttpHandlers{{"/",
                        [](const std::string&) {
                          return HttpResponse{200, "text/html", "home"};
                        }},
                       {"/job/", [](const std::string& p) {
                          return HttpResponse{404, "text/plain", p};
                        }}};
  const std::string head(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<HttpRequest> request = ParseHttpRequestHead(head);
  if (request.ok()) {
    FUZZ_CHECK(!request->method.empty() && request->method.size() <= 16, request->method);
    for (char c : request->method) FUZZ_CHECK(c >= 'A' && c <= 'Z', request->method);
    FUZZ_CHECK(!request->path.empty() && request->path[0] == '/', request->path);
    for (char c : request->path) {
      FUZZ_CHECK(static_cast<unsigned char>(c) > 0x20 && c != 0x7f && c != '?', request->path);
    }
    FUZZ_CHECK(request->minor_version == 0 || request->minor_version == 1, "version");
  } else {
    FUZZ_CHECK(request.status().code() == absl::StatusCode::kInvalidArgument,
               request.status().ToString());
  }
  const std::string out = MetricsHttpResponse(head, registry, *handlers);
  FUZZ_CHECK(absl::StartsWith(out, "HTTP/1.1 ") && out.size() > 12, out.substr(0, 40));
  int code = 0;
  FUZZ_CHECK(absl::SimpleAtoi(out.substr(9, 3), &code) && code >= 200 && code < 600,
             out.substr(0, 40));
  FUZZ_CHECK((code == 400) == !request.ok(), absl::StrCat("code ", code, " for ", head));
  const size_t body = out.find("\r\n\r\n");
  FUZZ_CHECK(body != std::string::npos, "no end of head");
  const bool head_only = request.ok() && request->method == "HEAD";
  const size_t len_at = out.find("Content-Length: ");
  size_t length = 0;
  FUZZ_CHECK(len_at != std::string::npos &&
                 absl::SimpleAtoi(out.substr(len_at + 16, out.find("\r\n", len_at) - len_at - 16),
                                  &length),
             "Content-Length");
  FUZZ_CHECK(head_only ? out.size() == body + 4 : out.size() - body - 4 == length,
             absl::StrCat("body of ", out.size() - body - 4, " bytes, Content-Length ", length));
  return 0;
}
