// Transport security for the gRPC layer: TLS options parsed from the daemons' and the CLI's
// flags and the gRPC credentials they make (the rule that tokens never travel in plaintext to
// another machine is rpc/token_transport.h, free of gRPC).
//
// Flags (defined in each main file, the same everywhere) go through MakeTlsOptions once:
//   --tls_cert_file, --tls_key_file   this process's certificate chain and key (PEM)
//   --tls_ca_file                     CA bundle peers are verified against (PEM)
//   --tls_client_auth                 servers require and verify client certificates
//   --allow_insecure                  allow tokens over plaintext to non-loopback addresses
//
// Credentials come from gRPC's FileWatcherCertificateProvider: the files are re-read every
// TlsOptions::refresh_interval_s (10 s), so renewed certificates are used by new connections
// (and new handshakes) without a restart; connections already up keep their session.
//
// Thread safety: pure functions.
#ifndef GRADMESH_RPC_TLS_H_
#define GRADMESH_RPC_TLS_H_

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/logging.h"
#include "rpc/rpc_options.h"
#include "rpc/token_transport.h"

namespace gradmesh {

// The flags' values as TlsOptions, checked once: cert and key go together; client_auth needs
// a CA and a certificate; every file named must be readable and look like PEM.
// InvalidArgument naming the flag and the file otherwise.
absl::StatusOr<TlsOptions> MakeTlsOptions(const std::string& cert_file, const std::string& key_file,
                                          const std::string& ca_file, bool client_auth,
                                          bool allow_insecure);

// Channel credentials for `tls`: TLS (server verified against ca_file, host name included;
// own certificate presented when set) when tls.enabled(), else plaintext.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsFor(const TlsOptions& tls);

// Server credentials for `tls`: TLS with cert_file/key_file (client certificates required and
// verified against ca_file with client_auth) when tls.enabled(), else plaintext.
// InvalidArgument if TLS is on without cert_file and key_file.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const TlsOptions& tls);

// Logs event=insecure_listen (a warning: anyone on the network can read and inject this
// server's traffic) when a server listens on a non-loopback address without TLS, and
// event=tls with the files otherwise when TLS is on. `logger` may be null.
void LogListenSecurity(absl::string_view address, const TlsOptions& tls, const Logger* logger);

}  // namespace gradmesh

#endif  // GRADMESH_RPC_TLS_H_
