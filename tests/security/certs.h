// Test certificates made at test time with deploy/tls/make_certs.sh (openssl): a CA and the
// node (server + client) and CLI (client) certificates under it.
//
//   ASSERT_OK_AND_ASSIGN(TestCerts a, MakeTestCerts("a"));   // CA "a-ca", CNs a-node, a-client
//   RpcOptions rpc; rpc.tls = a.NodeTls(/*client_auth=*/true);
//
// Thread safety: MakeTestCerts runs a subprocess; call it from the test's main thread.
#ifndef GRADMESH_TESTS_SECURITY_CERTS_H_
#define GRADMESH_TESTS_SECURITY_CERTS_H_

#include <string>

#include "absl/status/statusor.h"
#include "rpc/rpc_options.h"

namespace gradmesh {
namespace testutil {

struct TestCerts {
  std::string dir;  // Holds ca.pem/key, node.pem/key, client.pem/key.
  std::string ca() const { return dir + "/ca.pem"; }
  std::string node_cert() const { return dir + "/node.pem"; }
  std::string node_key() const { return dir + "/node.key"; }
  std::string client_cert() const { return dir + "/client.pem"; }
  std::string client_key() const { return dir + "/client.key"; }

  // A daemon's options: node certificate, this CA, client_auth as given.
  TlsOptions NodeTls(bool client_auth) const;
  // The CLI's options: client certificate (when `with_cert`) and this CA.
  TlsOptions ClientTls(bool with_cert) const;
};

// Makes a new CA named "<name>-ca" with node certificate CN "<name>-node" (SANs localhost,
// 127.0.0.1, ::1) and client certificate CN "<name>-client" in a fresh directory under
// $TEST_TMPDIR. Internal with the script's output if it fails.
absl::StatusOr<TestCerts> MakeTestCerts(const std::string& name);

}  // namespace testutil
}  // namespace gradmesh

#endif  // GRADMESH_TESTS_SECURITY_CERTS_H_
