// End-to-end test of the gradmesh_coordinator binary as a subprocess: bad flags exit 2; with a
// token file it serves both services over gRPC, requires the token, logs structured lines,
// exits 0 on SIGTERM, and a restart on the same --data_dir knows the job and its node.
#include <grpcpp/client_context.h>
#include <signal.h>

#include <fstream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "proto/coordinator.grpc.pb.h"
#include "rpc/auth.h"
#include "rpc/grpc_util.h"
#include "tests/testing/subprocess.h"

namespace gradmesh {
namespace {

using testutil::LinesWith;
using testutil::LogField;
using testutil::ReadFile;
using testutil::Subprocess;

class CoordinatorMainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(binary_, testutil::RunfilePath("coordinator/gradmesh_coordinator"));
    ASSERT_OK_AND_ASSIGN(dir_, testutil::MakeTestDir("coordinator_main"));
  }

  // Starts the daemon with `extra` flags; returns its port.
  absl::StatusOr<int> Start(const std::string& tag, std::vector<std::string> extra) {
    const std::string port_file = absl::StrCat(dir_, "/", tag, ".port");
    std::remove(port_file.c_str());
    std::vector<std::string> argv = {binary_, "--port=0", "--port_file=" + port_file,
                                     "--node=coord-test", "--heartbeat_timeout_ms=60000"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    log_ = absl::StrCat(dir_, "/", tag, ".log");
    auto proc = Subprocess::Start(argv, {}, log_);
    if (!proc.ok()) return proc.status();
    proc_ = std::move(proc).value();
    return testutil::WaitForPortFile(port_file, absl::Seconds(30), proc_.get());
  }

  std::string binary_, dir_, log_;
  std::unique_ptr<Subprocess> proc_;
};

std::unique_ptr<grpc::ClientContext> Ctx(const std::string& token) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  AddBearerToken(token, ctx.get());
  return ctx;
}

TEST_F(CoordinatorMainTest, BadFlagsExitTwo) {
  auto proc = Subprocess::Start({binary_, "--port=0"}, {}, dir_ + "/nodir.log");
  ASSERT_OK(proc);
  ASSERT_OK_AND_ASSIGN(int code, (*proc)->Wait(absl::Seconds(20)));
  EXPECT_EQ(code, 2);
  EXPECT_EQ(LinesWith(ReadFile(dir_ + "/nodir.log"), "--data_dir is required").size(), 1u);

  const std::string empty = dir_ + "/empty.token";
  std::ofstream(empty) << "\n";
  proc = Subprocess::Start(
      {binary_, "--port=0", "--data_dir=" + dir_ + "/d0", "--auth_token_file=" + empty}, {},
      dir_ + "/empty.log");
  ASSERT_OK(proc);
  ASSERT_OK_AND_ASSIGN(code, (*proc)->Wait(absl::Seconds(20)));
  EXPECT_EQ(code, 2);
  EXPECT_EQ(LinesWith(ReadFile(dir_ + "/empty.log"), "is empty").size(), 1u);

  // A node token needs an API token, and must differ from it.
  const std::string tok = dir_ + "/t.token";
  std::ofstream(tok) << "same\n";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--node_token_file=" + tok}, "--node_token_file needs --auth_token_file"},
      {{"--auth_token_file=" + tok, "--node_token_file=" + tok}, "holds the API token"},
      {{"--max_finished_jobs=-1"}, "--max_finished_jobs must be >= 0"},
      {{"--finished_job_retention_s=-5"}, "--finished_job_retention_s (at most 100 years)"},
      {{"--node_identity_from_certificate"}, "--node_identity_from_certificate needs"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<std::string> argv = {binary_, "--port=0",
                                     absl::StrCat("--data_dir=", dir_, "/n", i)};
    argv.insert(argv.end(), cases[i].first.begin(), cases[i].first.end());
    const std::string log = absl::StrCat(dir_, "/node", i, ".log");
    proc = Subprocess::Start(argv, {}, log);
    ASSERT_OK(proc);
    ASSERT_OK_AND_ASSIGN(code, (*proc)->Wait(absl::Seconds(20)));
    EXPECT_EQ(code, 2) << cases[i].second;
    EXPECT_EQ(LinesWith(ReadFile(log), cases[i].second).size(), 1u) << ReadFile(log);
  }
}

TEST_F(CoordinatorMainTest, ServesWithTokenAndRestartsWithItsTables) {
  const std::string token_file = dir_ + "/api.token";
  std::ofstream(token_file) << "  tok-e2e\n";
  const std::vector<std::string> flags = {"--data_dir=" + dir_ + "/tables",
                                          "--auth_token_file=" + token_file};
  ASSERT_OK_AND_ASSIGN(int port, Start("first", flags));
  auto channel = MakeChannel(absl::StrCat("127.0.0.1:", port), RpcOptions());
  auto jobs = JobService::NewStub(channel);
  auto nodes = NodeService::NewStub(channel);

  RegisterRequest reg;
  reg.mutable_node()->set_name("w0");
  reg.mutable_node()->set_role(WORKER);
  reg.mutable_node()->set_address("127.0.0.1:1");
  reg.mutable_node()->set_slots(1);
  RegisterResponse reg_resp;
  EXPECT_EQ(nodes->Register(Ctx("nope").get(), reg, &reg_resp).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  ASSERT_TRUE(nodes->Register(Ctx("tok-e2e").get(), reg, &reg_resp).ok());
  EXPECT_EQ(reg_resp.heartbeat_interval_ms(), 500);
  const std::string node_token = reg_resp.node_token();
  ASSERT_EQ(node_token.size(), 32u);

  SubmitJobRequest submit;
  submit.mutable_spec()->set_name("e2e");
  submit.mutable_spec()->set_mode("gossip");
  submit.mutable_spec()->set_steps(5);
  SubmitJobResponse submitted;
  ASSERT_TRUE(jobs->SubmitJob(Ctx("tok-e2e").get(), submit, &submitted).ok());
  EXPECT_EQ(submitted.job().workers(0).node(), "w0");

  ASSERT_OK(proc_->Signal(SIGTERM));
  ASSERT_OK_AND_ASSIGN(int code, proc_->Wait(absl::Seconds(20)));
  EXPECT_EQ(code, 0);
  const std::string log = ReadFile(log_);
  const auto placed = LinesWith(log, "event=job_placed");
  ASSERT_EQ(placed.size(), 1u) << log;
  EXPECT_EQ(LogField(placed[0], "role"), "coordinator");
  EXPECT_EQ(LogField(placed[0], "node"), "coord-test");
  EXPECT_EQ(LogField(placed[0], "job"), "e2e");
  EXPECT_EQ(LogField(placed[0], "workers"), "w0");
  EXPECT_EQ(LinesWith(log, "event=stopped").size(), 1u) << log;

  ASSERT_OK_AND_ASSIGN(port, Start("second", flags));
  channel = MakeChannel(absl::StrCat("127.0.0.1:", port), RpcOptions());
  jobs = JobService::NewStub(channel);
  nodes = NodeService::NewStub(channel);
  GetJobRequest get;
  get.set_job_id("e2e");
  JobStatus st;
  ASSERT_TRUE(jobs->GetJob(Ctx("tok-e2e").get(), get, &st).ok());
  EXPECT_EQ(st.state(), PENDING);
  EXPECT_EQ(st.job_token(), submitted.job().job_token());
  // w0 is known from the table: its heartbeat gets its task without registering again, with
  // the node token it got before the restart (only its hash was stored) and not without it.
  HeartbeatRequest hb;
  hb.set_node("w0");
  HeartbeatResponse hb_resp;
  EXPECT_EQ(nodes->Heartbeat(Ctx("tok-e2e").get(), hb, &hb_resp).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  auto hb_ctx = Ctx("tok-e2e");
  hb_ctx->AddMetadata(kNodeIdentityMetadataKey, node_token);
  ASSERT_TRUE(nodes->Heartbeat(hb_ctx.get(), hb, &hb_resp).ok());
  EXPECT_FALSE(hb_resp.register_again());
  ASSERT_EQ(hb_resp.tasks_size(), 1);
  EXPECT_EQ(hb_resp.tasks(0).job_id(), "e2e");
  ASSERT_OK(proc_->Signal(SIGTERM));
  ASSERT_OK_AND_ASSIGN(code, proc_->Wait(absl::Seconds(20)));
  EXPECT_EQ(code, 0);
}

TEST_F(CoordinatorMainTest, NodeTokenSeparatesDaemonsFromUsers) {
  const std::string api_file = dir_ + "/api.token";
  const std::string node_file = dir_ + "/node.token";
  std::ofstream(api_file) << "api-secret\n";
  std::ofstream(node_file) << "node-secret\n";
  ASSERT_OK_AND_ASSIGN(
      int port, Start("tokens", {"--data_dir=" + dir_ + "/t2", "--auth_token_file=" + api_file,
                                 "--node_token_file=" + node_file}));
  auto channel = MakeChannel(absl::StrCat("127.0.0.1:", port), RpcOptions());
  auto jobs = JobService::NewStub(channel);
  auto nodes = NodeService::NewStub(channel);
  RegisterRequest reg;
  reg.mutable_node()->set_name("s0");
  reg.mutable_node()->set_role(SERVER);
  reg.mutable_node()->set_address("127.0.0.1:1");
  reg.mutable_node()->set_slots(1);
  RegisterResponse reg_resp;
  // Daemons: the node token, not the API token.
  grpc::Status st = nodes->Register(Ctx("api-secret").get(), reg, &reg_resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(st.error_message(), "missing or wrong node token");
  EXPECT_TRUE(nodes->Register(Ctx("node-secret").get(), reg, &reg_resp).ok());
  // Users: the API token; a daemon's node token cannot list jobs (or read their tokens).
  ListJobsRequest list;
  ListJobsResponse listed;
  st = jobs->ListJobs(Ctx("node-secret").get(), list, &listed);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(st.error_message(), "missing or wrong API token");
  EXPECT_TRUE(jobs->ListJobs(Ctx("api-secret").get(), list, &listed).ok());
  ASSERT_OK(proc_->Signal(SIGTERM));
  ASSERT_OK_AND_ASSIGN(int code, proc_->Wait(absl::Seconds(20)));
  EXPECT_EQ(code, 0);
  EXPECT_EQ(LinesWith(ReadFile(log_), "auth=api+node").size(), 1u) << ReadFile(log_);
}

}  // namespace
}  // namespace gradmesh
