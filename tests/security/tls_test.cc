// TLS and mutual TLS through rpc/grpc_util.h (StartGrpcServer, MakeChannel) with certificates
// made by deploy/tls/make_certs.sh at test time: two CAs, "a" and "b". A real gRPC server on
// 127.0.0.1 serves ParameterService.GetJobInfo, answering with the client certificate's CN in
// trailing metadata; the client reads the server certificate's CN from its auth context.
#include "rpc/tls.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/auth_context.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "proto/gradmesh.grpc.pb.h"
#include "rpc/grpc_util.h"
#include "tests/security/certs.h"
#include "tests/testing/subprocess.h"

namespace gradmesh {
namespace {

using testutil::MakeTestCerts;
using testutil::TestCerts;

// The first value of `property` in `ctx` ("" if none).
std::string Property(const grpc::AuthContext* ctx, const std::string& property) {
  if (ctx == nullptr) return "";
  std::vector<grpc::string_ref> v = ctx->FindPropertyValues(property);
  return v.empty() ? "" : std::string(v[0].data(), v[0].size());
}

// Answers GetJobInfo with the caller's certificate CN as trailing metadata "client-cn", and
// counts the calls that reached it.
class EchoService final : public ParameterService::Service {
 public:
  grpc::Status GetJobInfo(grpc::ServerContext* ctx, const JobInfoRequest* req,
                          JobInfoResponse* resp) override {
    const std::string cn = Property(ctx->auth_context().get(), "x509_common_name");
    ctx->AddTrailingMetadata("client-cn", cn.empty() ? "-" : cn);
    resp->set_job(req->job());
    absl::MutexLock lock(&mu_);
    ++calls_;
    return grpc::Status::OK;
  }
  int calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  absl::Mutex mu_;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
};

struct CallResult {
  grpc::StatusCode code = grpc::StatusCode::UNKNOWN;
  std::string message;
  std::string server_cn;  // From the client's view of the handshake.
  std::string client_cn;  // As the server saw it ("-": no certificate).
};

// One GetJobInfo on a new channel to `address` with `tls` (3 s deadline).
CallResult Call(const std::string& address, const TlsOptions& tls) {
  RpcOptions rpc;
  rpc.tls = tls;
  auto stub = ParameterService::NewStub(MakeChannel(address, rpc));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  JobInfoRequest req;
  req.set_job("j");
  JobInfoResponse resp;
  const grpc::Status st = stub->GetJobInfo(&ctx, req, &resp);
  CallResult r;
  r.code = st.error_code();
  r.message = st.error_message();
  r.server_cn = Property(ctx.auth_context().get(), "x509_common_name");
  auto it = ctx.GetServerTrailingMetadata().find("client-cn");
  if (it != ctx.GetServerTrailingMetadata().end()) {
    r.client_cn = std::string(it->second.data(), it->second.size());
  }
  return r;
}

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto a = MakeTestCerts("a");
    auto b = MakeTestCerts("b");
    ASSERT_OK(a.status());
    ASSERT_OK(b.status());
    a_ = new TestCerts(*a);
    b_ = new TestCerts(*b);
  }
  static void TearDownTestSuite() {
    delete a_;
    delete b_;
  }

  // Starts the echo service on 127.0.0.1 (or `host`) with `tls`; returns "127.0.0.1:port".
  std::string Serve(const TlsOptions& tls, const std::string& host = "127.0.0.1") {
    RpcOptions rpc;
    rpc.tls = tls;
    int port = 0;
    auto server = StartGrpcServer(host + ":0", {&service_}, rpc, "", &port);
    EXPECT_OK(server.status());
    if (!server.ok()) return "";
    server_ = std::move(server).value();
    return absl::StrCat("127.0.0.1:", port);
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  static TestCerts* a_;
  static TestCerts* b_;
  EchoService service_;
  std::unique_ptr<grpc::Server> server_;
};

TestCerts* TlsTest::a_ = nullptr;
TestCerts* TlsTest::b_ = nullptr;

TEST_F(TlsTest, MutualTlsWorksAndEachSideSeesTheOthersCertificate) {
  const std::string address = Serve(a_->NodeTls(/*client_auth=*/true));
  CallResult r = Call(address, a_->ClientTls(/*with_cert=*/true));
  ASSERT_EQ(r.code, grpc::StatusCode::OK) << r.message;
  EXPECT_EQ(r.server_cn, "a-node");
  EXPECT_EQ(r.client_cn, "a-client");
  // A daemon dialling another daemon presents its node certificate.
  r = Call(address, a_->NodeTls(/*client_auth=*/false));
  ASSERT_EQ(r.code, grpc::StatusCode::OK) << r.message;
  EXPECT_EQ(r.client_cn, "a-node");
  // "localhost" is in the certificate's SANs as well.
  int port = 0;
  ASSERT_EQ(std::sscanf(address.c_str(), "127.0.0.1:%d", &port), 1);
  r = Call(absl::StrCat("localhost:", port), a_->ClientTls(true));
  EXPECT_EQ(r.code, grpc::StatusCode::OK) << r.message;
  EXPECT_EQ(service_.calls(), 3);
}

TEST_F(TlsTest, ServerWithoutClientAuthTakesAClientWithoutCertificate) {
  const std::string address = Serve(a_->NodeTls(/*client_auth=*/false));
  CallResult r = Call(address, a_->ClientTls(/*with_cert=*/false));
  ASSERT_EQ(r.code, grpc::StatusCode::OK) << r.message;
  EXPECT_EQ(r.server_cn, "a-node");
  EXPECT_EQ(r.client_cn, "-");
}

TEST_F(TlsTest, ClientWithoutCertificateIsRefusedWhenClientAuthIsRequired) {
  const std::string address = Serve(a_->NodeTls(/*client_auth=*/true));
  CallResult r = Call(address, a_->ClientTls(/*with_cert=*/false));
  EXPECT_EQ(r.code, grpc::StatusCode::UNAVAILABLE) << r.message;
  EXPECT_EQ(service_.calls(), 0);
}

TEST_F(TlsTest, ClientCertificateFromAnotherCaIsRefused) {
  const std::string address = Serve(a_->NodeTls(/*client_auth=*/true));
  // Trusts the right CA but presents b's certificate.
  TlsOptions tls = b_->ClientTls(/*with_cert=*/true);
  tls.ca_file = a_->ca();
  CallResult r = Call(address, tls);
  EXPECT_EQ(r.code, grpc::StatusCode::UNAVAILABLE) << r.message;
  EXPECT_EQ(service_.calls(), 0);
}

TEST_F(TlsTest, ClientTrustingAnotherCaRefusesTheServer) {
  const std::string address = Serve(a_->NodeTls(/*client_auth=*/false));
  CallResult r = Call(address, b_->ClientTls(/*with_cert=*/false));
  EXPECT_EQ(r.code, grpc::StatusCode::UNAVAILABLE) << r.message;
  EXPECT_EQ(service_.calls(), 0);
}

TEST_F(TlsTest, ServerCertificateFromAnotherCaIsRefused) {
  // The server presents b's node certificate (and would verify clients against a).
  TlsOptions server = b_->NodeTls(/*client_auth=*/true);
  server.ca_file = a_->ca();
  const std::string address = Serve(server);
  CallResult r = Call(address, a_->ClientTls(/*with_cert=*/true));
  EXPECT_EQ(r.code, grpc::StatusCode::UNAVAILABLE) << r.message;
  EXPECT_EQ(service_.calls(), 0);
}

TEST_F(TlsTest, ServerCertificateMustNameTheHostDialled) {
  // 127.0.0.2 reaches this machine but is not in the certificate's SANs.
  const std::string address = Serve(a_->NodeTls(/*client_auth=*/false), "0.0.0.0");
  int port = 0;
  ASSERT_EQ(std::sscanf(address.c_str(), "127.0.0.1:%d", &port), 1);
  CallResult r = Call(absl::StrCat("127.0.0.2:", port), a_->ClientTls(false));
  EXPECT_EQ(r.code, grpc::StatusCode::UNAVAILABLE) << r.message;
  r = Call(absl::StrCat("127.0.0.1:", port), a_->ClientTls(false));
  EXPECT_EQ(r.code, grpc::StatusCode::OK) << r.message;
  EXPECT_EQ(service_.calls(), 1);
}

TEST_F(TlsTest, PlaintextAndTlsDoNotMix) {
  const std::string tls_address = Serve(a_->NodeTls(/*client_auth=*/false));
  EXPECT_EQ(Call(tls_address, TlsOptions()).code, grpc::StatusCode::UNAVAILABLE);
  EchoService plain_service;
  RpcOptions plain;
  int port = 0;
  ASSERT_OK_AND_ASSIGN(auto plain_server,
                       StartGrpcServer("127.0.0.1:0", {&plain_service}, plain, "", &port));
  EXPECT_EQ(Call(absl::StrCat("127.0.0.1:", port), a_->ClientTls(false)).code,
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Call(absl::StrCat("127.0.0.1:", port), TlsOptions()).code, grpc::StatusCode::OK);
  plain_server->Shutdown();
  EXPECT_EQ(service_.calls(), 0);
  EXPECT_EQ(plain_service.calls(), 1);
}

// Copies `from` over `to` atomically (write beside, rename), as deploy/tls/make_certs.sh does.
void Replace(const std::string& from, const std::string& to) {
  ASSERT_OK(testutil::WriteFile(to + ".new", testutil::ReadFile(from)));
  ASSERT_EQ(std::rename((to + ".new").c_str(), to.c_str()), 0) << to;
}

TEST_F(TlsTest, ReplacedCertificateFilesAreUsedByNewConnectionsWithoutRestart) {
  // The server's files start as a's node certificate; clients trust b only.
  ASSERT_OK_AND_ASSIGN(std::string dir, testutil::MakeUniqueTestDir("reload"));
  TlsOptions server;
  server.cert_file = dir + "/node.pem";
  server.key_file = dir + "/node.key";
  Replace(a_->node_cert(), server.cert_file);
  Replace(a_->node_key(), server.key_file);
  server.refresh_interval_s = 1;
  const std::string address = Serve(server);
  CallResult r = Call(address, b_->ClientTls(false));
  ASSERT_EQ(r.code, grpc::StatusCode::UNAVAILABLE) << "b must not trust a's certificate";
  ASSERT_EQ(Call(address, a_->ClientTls(false)).server_cn, "a-node");

  // Renewal: b's certificate and key replace the files. Within a few refresh intervals a
  // new connection is served with it.
  Replace(b_->node_key(), server.key_file);
  Replace(b_->node_cert(), server.cert_file);
  const absl::Time start = absl::Now();
  while (absl::Now() - start < absl::Seconds(15)) {
    r = Call(address, b_->ClientTls(false));
    if (r.code == grpc::StatusCode::OK) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_EQ(r.code, grpc::StatusCode::OK) << r.message;
  EXPECT_EQ(r.server_cn, "b-node");
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(Call(address, a_->ClientTls(false)).code, grpc::StatusCode::UNAVAILABLE);
}

TEST(MakeTlsOptionsTest, ChecksTheFlagsTogetherAndTheFiles) {
  ASSERT_OK_AND_ASSIGN(TestCerts c, MakeTestCerts("flags"));
  ASSERT_OK_AND_ASSIGN(TlsOptions tls,
                       MakeTlsOptions(c.node_cert(), c.node_key(), c.ca(), true, false));
  EXPECT_TRUE(tls.enabled());
  EXPECT_EQ(tls.cert_file, c.node_cert());
  EXPECT_TRUE(tls.client_auth);
  EXPECT_EQ(tls.refresh_interval_s, 10);
  ASSERT_OK_AND_ASSIGN(tls, MakeTlsOptions("", "", "", false, true));
  EXPECT_FALSE(tls.enabled());
  EXPECT_TRUE(tls.allow_insecure);
  ASSERT_OK_AND_ASSIGN(tls, MakeTlsOptions("", "", c.ca(), false, false));
  EXPECT_TRUE(tls.enabled());  // A CLI with a CA only: TLS, no client certificate.

  EXPECT_STATUS_MSG(MakeTlsOptions(c.node_cert(), "", c.ca(), false, false).status(),
                    absl::StatusCode::kInvalidArgument, "must be given together");
  EXPECT_STATUS_MSG(MakeTlsOptions("", c.node_key(), "", false, false).status(),
                    absl::StatusCode::kInvalidArgument, "must be given together");
  EXPECT_STATUS_MSG(MakeTlsOptions(c.node_cert(), c.node_key(), "", true, false).status(),
                    absl::StatusCode::kInvalidArgument, "--tls_client_auth needs --tls_ca_file");
  EXPECT_STATUS_MSG(MakeTlsOptions("", "", c.ca(), true, false).status(),
                    absl::StatusCode::kInvalidArgument, "--tls_client_auth needs");
  EXPECT_STATUS_MSG(MakeTlsOptions(c.dir + "/nope.pem", c.node_key(), "", false, false).status(),
                    absl::StatusCode::kInvalidArgument, "--tls_cert_file: cannot read");
  EXPECT_STATUS_MSG(MakeTlsOptions("", "", c.dir + "/make_certs.log", false, false).status(),
                    absl::StatusCode::kInvalidArgument, "--tls_ca_file: ");
  EXPECT_STATUS_MSG(MakeTlsOptions("", "", c.dir + "/make_certs.log", false, false).status(),
                    absl::StatusCode::kInvalidArgument, "holds no PEM data");
}

TEST(ServerCredentialsTest, ATlsServerNeedsACertificate) {
  ASSERT_OK_AND_ASSIGN(TestCerts c, MakeTestCerts("ca-only"));
  RpcOptions rpc;
  rpc.tls.ca_file = c.ca();
  EchoService service;
  int port = -1;
  EXPECT_STATUS_MSG(StartGrpcServer("127.0.0.1:0", {&service}, rpc, "", &port).status(),
                    absl::StatusCode::kInvalidArgument, "a TLS server needs --tls_cert_file");
  EXPECT_EQ(port, 0);
}

// A taken port is an error (gRPC's default SO_REUSEPORT would let a second server share it).
TEST(StartGrpcServerTest, ATakenPortFails) {
  EchoService first_service, second_service;
  int port = -1;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<grpc::Server> first,
                       StartGrpcServer("127.0.0.1:0", {&first_service}, RpcOptions(), "", &port));
  ASSERT_GT(port, 0);
  int again = -1;
  EXPECT_STATUS_MSG(
      StartGrpcServer(absl::StrCat("127.0.0.1:", port), {&second_service}, RpcOptions(), "", &again)
          .status(),
      absl::StatusCode::kUnavailable, "cannot listen on");
  EXPECT_EQ(again, 0);
  first->Shutdown();
}

TEST(LogListenSecurityTest, WarnsForPlaintextOnANetworkAddressOnly) {
  std::vector<std::string> lines;
  Logger logger({}, nullptr, LogLevel::kInfo,
                [&lines](const std::string& line) { lines.push_back(line); });
  LogListenSecurity("0.0.0.0:7001", TlsOptions(), &logger);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("event=insecure_listen"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("address=0.0.0.0:7001"), std::string::npos) << lines[0];
  LogListenSecurity("127.0.0.1:7001", TlsOptions(), &logger);
  EXPECT_EQ(lines.size(), 1u);
  TlsOptions tls;
  tls.cert_file = "/c.pem";
  tls.key_file = "/k.pem";
  LogListenSecurity("0.0.0.0:7001", tls, &logger);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[1].find("event=tls"), std::string::npos) << lines[1];
}

}  // namespace
}  // namespace gradmesh
