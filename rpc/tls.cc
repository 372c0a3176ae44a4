#include "rpc/tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace gradmesh {
namespace {

// InvalidArgument unless `path` is readable and holds a PEM block ("-----BEGIN ").
absl::Status CheckPemFile(absl::string_view flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read ", path));
  std::stringstream content;
  content << in.rdbuf();
  if (content.str().find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", path, " holds no PEM data"));
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> Provider(
    const TlsOptions& tls) {
  const unsigned interval = tls.refresh_interval_s > 0 ? tls.refresh_interval_s : 1;
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      tls.key_file, tls.cert_file, tls.ca_file, interval);
}

}  // namespace

absl::StatusOr<TlsOptions> MakeTlsOptions(const std::string& cert_file, const std::string& key_file,
                                          const std::string& ca_file, bool client_auth,
                                          bool allow_insecure) {
  TlsOptions tls;
  tls.cert_file = cert_file;
  tls.key_file = key_file;
  tls.ca_file = ca_file;
  tls.client_auth = client_auth;
  tls.allow_insecure = allow_insecure;
  if (cert_file.empty() != key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert_file and --tls_key_file must be given together (a certificate and its key)");
  }
  if (client_auth && (ca_file.empty() || cert_file.empty())) {
    return absl::InvalidArgumentError(
        "--tls_client_auth needs --tls_ca_file (to verify clients) and --tls_cert_file/"
        "--tls_key_file (this process's own certificate)");
  }
  if (!cert_file.empty()) {
    if (absl::Status st = CheckPemFile("tls_cert_file", cert_file); !st.ok()) return st;
    if (absl::Status st = CheckPemFile("tls_key_file", key_file); !st.ok()) return st;
  }
  if (!ca_file.empty()) {
    if (absl::Status st = CheckPemFile("tls_ca_file", ca_file); !st.ok()) return st;
  }
  return tls;
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsFor(const TlsOptions& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(Provider(tls));
  if (!tls.ca_file.empty()) options.watch_root_certs();  // Else the system roots.
  if (!tls.cert_file.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  return grpc::experimental::TlsCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const TlsOptions& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  if (tls.cert_file.empty() || tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "a TLS server needs --tls_cert_file and --tls_key_file (--tls_ca_file alone only "
        "makes a TLS client)");
  }
  grpc::experimental::TlsServerCredentialsOptions options(Provider(tls));
  options.watch_identity_key_cert_pairs();
  if (!tls.ca_file.empty()) options.watch_root_certs();
  options.set_cert_request_type(tls.client_auth
                                    ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                    : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  return grpc::experimental::TlsServerCredentials(options);
}

void LogListenSecurity(absl::string_view address, const TlsOptions& tls, const Logger* logger) {
  if (tls.enabled()) {
    LogInfo(logger, "tls",
            {Kv("address", std::string(address)), Kv("cert", tls.cert_file), Kv("ca", tls.ca_file),
             Kv("client_auth", tls.client_auth ? "true" : "false"),
             Kv("refresh_s", tls.refresh_interval_s)});
    return;
  }
  if (IsLoopbackAddress(address)) return;
  LogWarning(logger, "insecure_listen",
             {Kv("address", std::string(address)),
              Kv("warning",
                 "plaintext gRPC on a network address: tokens and tensors can be "
                 "read and altered on the network; use --tls_cert_file/--tls_key_file")});
}

}  // namespace gradmesh
