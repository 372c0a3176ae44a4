#include "rpc/token_transport.h"

#include <arpa/inet.h>

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace gradmesh {
namespace {

// The host part of a gRPC target, without scheme, brackets or port; "" for a unix socket.
std::string TargetHost(absl::string_view address, bool* is_unix) {
  *is_unix = absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:");
  if (*is_unix) return "";
  for (absl::string_view scheme : {"dns:///", "dns:", "ipv4:", "ipv6:"}) {
    if (absl::ConsumePrefix(&address, scheme)) break;
  }
  if (absl::StartsWith(address, "[")) {
    const size_t end = address.find(']');
    return std::string(address.substr(1, end == absl::string_view::npos ? end : end - 1));
  }
  const size_t first = address.find(':');
  if (first != absl::string_view::npos && address.find(':', first + 1) != absl::string_view::npos) {
    return std::string(address);  // A bare IPv6 address without a port.
  }
  return std::string(address.substr(0, first));
}

}  // namespace

bool IsLoopbackAddress(absl::string_view address) {
  bool is_unix = false;
  const std::string host = absl::AsciiStrToLower(TargetHost(address, &is_unix));
  if (is_unix) return true;
  // Only the name itself: "x.localhost" may be resolved through DNS to anywhere.
  if (host == "localhost") return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

absl::Status CheckTokenTransport(absl::string_view address, const TlsOptions& tls,
                                 absl::string_view token, absl::string_view what) {
  if (token.empty() || tls.enabled() || tls.allow_insecure || IsLoopbackAddress(address)) {
    return absl::OkStatus();
  }
  if (address.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no address to send the ", what, " to (a peer without an address)"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "refusing to send the ", what, " in plaintext to ", address,
      " (not a loopback address): use TLS (--tls_ca_file, and --tls_cert_file/--tls_key_file "
      "for mutual TLS) or pass --allow_insecure"));
}

}  // namespace gradmesh
