#include "tests/security/certs.h"

#include "absl/strings/str_cat.h"
#include "tests/testing/subprocess.h"

namespace gradmesh {
namespace testutil {

TlsOptions TestCerts::NodeTls(bool client_auth) const {
  TlsOptions tls;
  tls.cert_file = node_cert();
  tls.key_file = node_key();
  tls.ca_file = ca();
  tls.client_auth = client_auth;
  return tls;
}

TlsOptions TestCerts::ClientTls(bool with_cert) const {
  TlsOptions tls;
  if (with_cert) {
    tls.cert_file = client_cert();
    tls.key_file = client_key();
  }
  tls.ca_file = ca();
  return tls;
}

absl::StatusOr<TestCerts> MakeTestCerts(const std::string& name) {
  absl::StatusOr<std::string> script = RunfilePath("deploy/tls/make_certs.sh");
  if (!script.ok()) return script.status();
  absl::StatusOr<std::string> dir = MakeUniqueTestDir("certs-" + name);
  if (!dir.ok()) return dir.status();
  const std::string log = *dir + "/make_certs.log";
  absl::StatusOr<std::unique_ptr<Subprocess>> p = Subprocess::Start(
      {"/bin/bash", *script, *dir},
      {{"CA_CN", name + "-ca"}, {"NODE_CN", name + "-node"}, {"CLIENT_CN", name + "-client"}}, log);
  if (!p.ok()) return p.status();
  absl::StatusOr<int> code = (*p)->Wait(absl::Seconds(60));
  if (!code.ok()) return code.status();
  if (*code != 0) {
    return absl::InternalError(
        absl::StrCat("make_certs.sh exited ", *code, ": ", LastLines(ReadFile(log), 10)));
  }
  return TestCerts{*dir};
}

}  // namespace testutil
}  // namespace gradmesh
