// The daemons and the CLI under mutual TLS, end to end, as real processes on 127.0.0.1:
// gradmesh_coordinator, one gradmesh_server shard and one gradmesh_worker in service mode, all
// with --tls_cert_file/--tls_key_file/--tls_ca_file/--tls_client_auth and an API token,
// certificates made by deploy/tls/make_certs.sh. A job submitted with the CLI (client
// certificate) trains 40 steps of the MNIST MLP and succeeds; a CLI without a certificate,
// with another CA, or in plaintext cannot reach the coordinator. Standalone gossip and
// allreduce ranks train over mutually authenticated peer channels. Daemons and the CLI refuse to
// send a token in plaintext to a non-loopback address (exit 2, nothing sent).
#include <signal.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/security/certs.h"
#include "tests/testing/subprocess.h"

namespace gradmesh {
namespace e2e {
namespace {

using testutil::MakeTestCerts;
using testutil::ReadFile;
using testutil::RunfilePath;
using testutil::TestCerts;
using testutil::WaitForPortFile;

struct CliResult {
  int code = -1;
  std::string out;
};

class MtlsE2eTest : public E2eHarness {
 protected:
  void SetUp() override {
    E2eHarness::SetUp();
    ASSERT_OK_AND_ASSIGN(coordinator_bin_, RunfilePath("coordinator/gradmesh_coordinator"));
    ASSERT_OK_AND_ASSIGN(cli_bin_, RunfilePath("cli/gradmesh"));
    ASSERT_OK_AND_ASSIGN(certs_, MakeTestCerts("e2e"));
    token_file_ = dir_ + "/token";
    std::ofstream(token_file_) << "e2e-token\n";
  }

  std::vector<std::string> NodeTlsFlags() const {
    return {"--tls_cert_file=" + certs_.node_cert(), "--tls_key_file=" + certs_.node_key(),
            "--tls_ca_file=" + certs_.ca(), "--tls_client_auth"};
  }

  // Starts `argv` (plus the node TLS flags) writing its port to a new port file; waits for it.
  std::unique_ptr<Subprocess> StartDaemon(const std::string& name, std::vector<std::string> argv,
                                          int* port) {
    const std::string pf = absl::StrCat(dir_, "/", name, ".port");
    argv.push_back("--port_file=" + pf);
    for (const std::string& f : NodeTlsFlags()) argv.push_back(f);
    auto p = Subprocess::Start(argv, ChildEnv(), NewLog(name));
    EXPECT_OK(p.status());
    if (!p.ok()) return nullptr;
    auto bound = WaitForPortFile(pf, absl::Seconds(60), p->get());
    EXPECT_OK(bound.status()) << name;
    if (bound.ok()) *port = *bound;
    return std::move(p).value();
  }

  // The CLI with `args` against the coordinator (token included), `tls` flags first.
  CliResult Cli(const std::vector<std::string>& tls, const std::vector<std::string>& args,
                absl::Duration timeout = absl::Seconds(60)) {
    std::vector<std::string> argv = {cli_bin_, "--coordinator=" + coordinator_,
                                     "--auth_token_file=" + token_file_};
    argv.insert(argv.end(), tls.begin(), tls.end());
    argv.insert(argv.end(), args.begin(), args.end());
    const std::string log = absl::StrCat(dir_, "/cli", cli_runs_++, ".out");
    CliResult r;
    auto p = Subprocess::Start(argv, ChildEnv(), log);
    EXPECT_OK(p.status());
    if (!p.ok()) return r;
    auto code = (*p)->Wait(timeout);
    EXPECT_OK(code.status());
    r.code = code.ok() ? *code : -1000;
    r.out = ReadFile(log);
    return r;
  }

  std::vector<std::string> ClientTls() const {
    return {"--tls_ca_file=" + certs_.ca(), "--tls_cert_file=" + certs_.client_cert(),
            "--tls_key_file=" + certs_.client_key()};
  }

  // Runs `argv` and expects exit 2 (bad arguments) within 30 s with `needle` in its output.
  void ExpectRefused(const std::string& name, const std::vector<std::string>& argv,
                     const std::string& needle) {
    auto p = Subprocess::Start(argv, ChildEnv(), NewLog(name));
    ASSERT_OK(p.status());
    ASSERT_OK_AND_ASSIGN(int code, (*p)->Wait(absl::Seconds(30)));
    const std::string log = ReadFile((*p)->log_path());
    EXPECT_EQ(code, 2) << name << ": " << log;
    EXPECT_TRUE(absl::StrContains(log, needle)) << name << ": " << log;
  }

  std::string coordinator_bin_, cli_bin_, token_file_, coordinator_;
  TestCerts certs_;
  int cli_runs_ = 0;
};

TEST_F(MtlsE2eTest, ClusterUnderMutualTlsTrainsAJobSubmittedWithTheCli) {
  ASSERT_TRUE(HaveMnist()) << "MNIST is needed under " << DataDir()
                           << "/mnist (deploy/setup.sh installs it)";
  int coordinator_port = 0, server_port = 0, worker_port = 0;
  auto coordinator = StartDaemon(
      "coordinator",
      {coordinator_bin_, "--host=127.0.0.1", "--port=0", "--data_dir=" + dir_ + "/coord",
       "--auth_token_file=" + token_file_, "--heartbeat_interval_ms=300",
       "--heartbeat_timeout_ms=2000", "--node=coordinator"},
      &coordinator_port);
  ASSERT_NE(coordinator, nullptr);
  coordinator_ = absl::StrCat("127.0.0.1:", coordinator_port);
  auto server = StartDaemon("s0",
                            {server_bin_, "--host=127.0.0.1", "--port=0", "--node=s0",
                             "--coordinator=" + coordinator_, "--auth_token_file=" + token_file_},
                            &server_port);
  auto worker = StartDaemon("w0",
                            {worker_bin_, "--host=127.0.0.1", "--peer_port=0", "--node=w0",
                             "--coordinator=" + coordinator_, "--auth_token_file=" + token_file_,
                             "--data_dir=" + DataDir(), "--checkpoint_dir=" + dir_ + "/ckpt"},
                            &worker_port);
  ASSERT_NE(server, nullptr);
  ASSERT_NE(worker, nullptr);

  // Refused at the handshake (exit 3, unreachable): no client certificate, another CA,
  // plaintext.
  ASSERT_OK_AND_ASSIGN(TestCerts other, MakeTestCerts("other"));
  CliResult r = Cli({"--tls_ca_file=" + certs_.ca()}, {"list"}, absl::Seconds(60));
  EXPECT_EQ(r.code, 3) << r.out;
  r = Cli({"--tls_ca_file=" + other.ca(), "--tls_cert_file=" + other.client_cert(),
           "--tls_key_file=" + other.client_key()},
          {"list"});
  EXPECT_EQ(r.code, 3) << r.out;
  r = Cli({}, {"list"});
  EXPECT_EQ(r.code, 3) << r.out;

  const std::string spec = WriteYaml("tls-job", R"(name: tls-job
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: adam, lr: 0.001}
batch_size: 32
steps: 40
mode: async
num_workers: 1
num_shards: 1
seed: 1
log_every: 10
)");
  // The daemons register within a heartbeat or two; submit once the job can be placed.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  do {
    r = Cli(ClientTls(), {"submit", spec});
    if (r.code == 0) break;
    absl::SleepFor(absl::Milliseconds(300));
  } while (absl::Now() < deadline);
  ASSERT_EQ(r.code, 0) << r.out;
  r = Cli(ClientTls(), {"watch", "tls-job"}, absl::Seconds(120));
  EXPECT_EQ(r.code, 0) << r.out;
  r = Cli(ClientTls(), {"status", "tls-job"});
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(absl::StrContains(r.out, "SUCCEEDED")) << r.out;

  // The worker trained every step through the TLS channel to the shard.
  const std::string worker_log = ReadFile(dir_ + "/w0.log");
  std::vector<std::string> ends = testutil::LinesWith(worker_log, "event=task_end");
  ASSERT_EQ(ends.size(), 1u) << worker_log;
  EXPECT_EQ(testutil::LogField(ends[0], "steps").value_or(""), "40") << ends[0];
  // Every daemon served TLS, none plaintext on the network.
  for (const std::string& name : {"coordinator", "s0", "w0"}) {
    const std::string log = ReadFile(absl::StrCat(dir_, "/", name, ".log"));
    EXPECT_TRUE(absl::StrContains(log, "event=tls ")) << name << ": " << log;
    EXPECT_TRUE(absl::StrContains(log, "client_auth=true")) << name;
    EXPECT_FALSE(absl::StrContains(log, "insecure_listen")) << name;
  }
  for (Subprocess* p : {worker.get(), server.get(), coordinator.get()}) {
    ASSERT_OK(p->Signal(SIGTERM));
    ASSERT_OK_AND_ASSIGN(int code, p->Wait(absl::Seconds(30)));
    EXPECT_EQ(code, 0) << p->name();
  }
}

// Standalone gossip and allreduce ranks (with a job token) whose peer services and peer
// channels use mutual TLS: gossip; allreduce on the gRPC ring (TLS throughout) and on the TCP
// ring (set up over TLS; each rank warns that the links themselves are plaintext).
TEST_F(MtlsE2eTest, PeerPlaneUnderMutualTls) {
  ASSERT_TRUE(HaveMnist()) << "MNIST is needed under " << DataDir() << "/mnist";
  struct Case {
    std::string name, mode_lines;
    bool tcp_warning;
  };
  const std::vector<Case> cases = {
      {"gossip", "mode: gossip\n", false},
      {"ar-grpc", "mode: allreduce\nallreduce: {transport: grpc}\n", false},
      {"ar-tcp", "mode: allreduce\nallreduce: {transport: tcp}\n", true},
  };
  const std::string job_token = dir_ + "/job.token";
  std::ofstream(job_token) << "peer-secret\n";
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> peers;
    for (int r = 0; r < 2; ++r) {
      ASSERT_OK_AND_ASSIGN(int port, PickFreePort());
      peers.push_back(absl::StrCat("127.0.0.1:", port));
    }
    const std::string job = WriteYaml(c.name, absl::StrCat("name: tls-", c.name, R"(
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: sgd, lr: 0.05}
batch_size: 32
steps: 20
num_workers: 2
log_every: 10
)",
                                                           c.mode_lines));
    std::vector<std::unique_ptr<Subprocess>> ranks;
    for (int r = 0; r < 2; ++r) {
      std::vector<std::string> args = {"--job=" + job,
                                       "--peers=" + peers[0] + "," + peers[1],
                                       absl::StrCat("--rank=", r),
                                       "--data_dir=" + DataDir(),
                                       "--checkpoint_dir=" + dir_ + "/ckpt-" + c.name,
                                       "--job_token_file=" + job_token};
      for (const std::string& f : NodeTlsFlags()) args.push_back(f);
      ranks.push_back(StartWorker(absl::StrCat(c.name, r), args));
      ASSERT_NE(ranks.back(), nullptr);
    }
    std::vector<int> codes = WaitAll(testutil::Ptrs(ranks), absl::Seconds(120));
    for (int r = 0; r < 2; ++r) {
      const std::string log = ReadFile(ranks[r]->log_path());
      EXPECT_EQ(codes[r], 0) << log;
      EXPECT_EQ(testutil::LogField(DoneLine(log), "steps").value_or(""), "20") << log;
      EXPECT_TRUE(absl::StrContains(log, "event=tls ")) << log;
      EXPECT_EQ(absl::StrContains(log, "event=tcp_ring_plaintext"), c.tcp_warning) << log;
    }
  }
}

TEST_F(MtlsE2eTest, DaemonsRefuseATokenInPlaintextToARemoteCoordinator) {
  // 192.0.2.1 (TEST-NET-1) is never dialled: the check runs before anything is sent.
  ExpectRefused("server-plain",
                {server_bin_, "--host=127.0.0.1", "--port=0", "--coordinator=192.0.2.1:7000",
                 "--auth_token_file=" + token_file_},
                "FAILED_PRECONDITION: refusing to send the node token in plaintext to "
                "192.0.2.1:7000");
  ExpectRefused("worker-plain",
                {worker_bin_, "--host=127.0.0.1", "--peer_port=0", "--coordinator=192.0.2.1:7000",
                 "--auth_token_file=" + token_file_},
                "refusing to send the node token in plaintext");
  ExpectRefused(
      "cli-plain",
      {cli_bin_, "--coordinator=192.0.2.1:7000", "--auth_token_file=" + token_file_, "list"},
      "refusing to send the API token in plaintext");
  // Bad TLS flags are bad arguments too.
  ExpectRefused("coordinator-no-ca",
                {coordinator_bin_, "--host=127.0.0.1", "--port=0", "--data_dir=" + dir_ + "/c",
                 "--tls_cert_file=" + certs_.node_cert(), "--tls_key_file=" + certs_.node_key(),
                 "--tls_client_auth"},
                "--tls_client_auth needs --tls_ca_file");
  ExpectRefused(
      "server-no-key",
      {server_bin_, "--host=127.0.0.1", "--port=0", "--tls_cert_file=" + certs_.node_cert()},
      "must be given together");
  // So are node names that break the name rule (the worker checks --node too).
  ExpectRefused("server-bad-node", {server_bin_, "--host=127.0.0.1", "--port=0", "--node=a.b"},
                "INVALID_ARGUMENT: --node \"a.b\" is not a valid name");
  // And an HTTP/2 window out of range.
  ExpectRefused("server-bad-window",
                {server_bin_, "--host=127.0.0.1", "--port=0", "--http2_window_kb=2000000"},
                "INVALID_ARGUMENT: --http2_window_kb must be 0 (gRPC's own) or 64 to 1048576, "
                "got 2000000");
  ExpectRefused("worker-bad-node",
                {worker_bin_, "--host=127.0.0.1", "--peer_port=0", "--coordinator=127.0.0.1:1",
                 "--node=../x"},
                "is not a valid name: 1-63 characters");
}

}  // namespace
}  // namespace e2e
}  // namespace gradmesh
