// Tokens never travel in plaintext to another machine (rpc/token_transport.h), and the
// clients that hold tokens apply the rule before sending anything: the parameter client (job
// token), the CLI (API token; job token for export).
#include "rpc/token_transport.h"

#include <sstream>

#include "cli/cli.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"
#include "worker/ps/parameter_client.h"

namespace gradmesh {
namespace {

TEST(IsLoopbackAddressTest, LoopbackForms) {
  for (const char* a : {"127.0.0.1:7000", "127.1.2.3:1", "localhost:7000", "LOCALHOST:1",
                        "[::1]:7000", "::1", "dns:///localhost:7000", "ipv4:127.0.0.1:7000",
                        "ipv6:[::1]:7000", "unix:/tmp/sock", "[::ffff:127.0.0.1]:1", "127.0.0.1"}) {
    EXPECT_TRUE(IsLoopbackAddress(a)) << a;
  }
  for (const char* a :
       {"10.0.0.5:7000", "0.0.0.0:7000", "192.0.2.1:1", "[::]:7000", "[2001:db8::1]:1",
        "example.com:7000", "localhost.example.com:1", "128.0.0.1:1", "dns:///10.0.0.1:1", "",
        "[::ffff:10.0.0.1]:1", "myhost", "a.localhost:1"}) {
    EXPECT_FALSE(IsLoopbackAddress(a)) << a;
  }
}

TEST(CheckTokenTransportTest, RefusesATokenInPlaintextToAnotherMachine) {
  TlsOptions plain;
  EXPECT_STATUS_MSG(CheckTokenTransport("10.0.0.5:7000", plain, "t", "API token"),
                    absl::StatusCode::kFailedPrecondition,
                    "refusing to send the API token in plaintext to 10.0.0.5:7000");
  EXPECT_STATUS_MSG(CheckTokenTransport("example.com:7000", plain, "t", "job token"),
                    absl::StatusCode::kFailedPrecondition, "--allow_insecure");
  // Loopback, no token, TLS on, or --allow_insecure: fine.
  EXPECT_OK(CheckTokenTransport("127.0.0.1:7000", plain, "t", "API token"));
  EXPECT_OK(CheckTokenTransport("10.0.0.5:7000", plain, "", "API token"));
  TlsOptions tls;
  tls.ca_file = "/ca.pem";
  EXPECT_OK(CheckTokenTransport("10.0.0.5:7000", tls, "t", "API token"));
  TlsOptions allowed;
  allowed.allow_insecure = true;
  EXPECT_OK(CheckTokenTransport("10.0.0.5:7000", allowed, "t", "API token"));
}

TEST(CheckTokenTransportTest, ParameterClientRefusesAJobTokenToARemoteShard) {
  JobLayout layout;
  layout.job = "j";
  layout.num_workers = 1;
  layout.chunk_elems = 4;
  TensorSpec t;
  t.set_name("w");
  t.add_shape(8);
  layout.tensors.push_back(t);
  GrpcParameterClientOptions o;
  o.servers = {"127.0.0.1:1", "192.0.2.1:7001"};
  o.job_token = "secret";
  EXPECT_STATUS_MSG(NewGrpcParameterClient(layout, o).status(),
                    absl::StatusCode::kFailedPrecondition,
                    "refusing to send the job token in plaintext to 192.0.2.1:7001");
  o.rpc.tls.allow_insecure = true;
  EXPECT_OK(NewGrpcParameterClient(layout, o).status());
  o.rpc.tls.allow_insecure = false;
  o.job_token.clear();
  EXPECT_OK(NewGrpcParameterClient(layout, o).status());
}

// The CLI refuses before sending anything (exit 2), unless --allow_insecure (then it tries,
// and cannot reach the TEST-NET address: exit 3).
TEST(CheckTokenTransportTest, CliRefusesTheApiTokenToARemoteCoordinatorWithoutTls) {
  ASSERT_OK_AND_ASSIGN(std::string dir, testutil::MakeUniqueTestDir("cli"));
  ASSERT_OK(testutil::WriteFile(dir + "/token", "s3cret\n"));
  cli::CliOptions options;
  options.rpc_deadline = absl::Milliseconds(300);
  std::ostringstream out, err;
  cli::CliIo io{&out, &err, false};
  EXPECT_EQ(
      cli::RunCli({"--coordinator=192.0.2.1:7000", "--auth_token_file=" + dir + "/token", "list"},
                  options, io),
      cli::kExitUsage);
  EXPECT_NE(err.str().find("FAILED_PRECONDITION: refusing to send the API token in plaintext "
                           "to 192.0.2.1:7000"),
            std::string::npos)
      << err.str();
  err.str("");
  EXPECT_EQ(cli::RunCli({"--coordinator=192.0.2.1:7000", "--auth_token_file=" + dir + "/token",
                         "--allow_insecure", "list"},
                        options, io),
            cli::kExitUnreachable)
      << err.str();
  // Without a token nothing secret would be sent: allowed (and unreachable).
  err.str("");
  EXPECT_EQ(cli::RunCli({"--coordinator=192.0.2.1:7000", "list"}, options, io),
            cli::kExitUnreachable)
      << err.str();
  // A TLS flag naming a missing file is a usage error.
  err.str("");
  EXPECT_EQ(cli::RunCli({"--coordinator=127.0.0.1:1", "--tls_ca_file=" + dir + "/none.pem", "list"},
                        options, io),
            cli::kExitUsage);
  EXPECT_NE(err.str().find("--tls_ca_file: cannot read"), std::string::npos) << err.str();
}

}  // namespace
}  // namespace gradmesh
