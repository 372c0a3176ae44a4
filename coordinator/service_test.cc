// Tests of the coordinator's gRPC services over real gRPC on 127.0.0.1: API-token checks on
// both services, status mapping, and the WatchJob stream (changes delivered, ends at the final
// state, ends when the client cancels).
#include "coordinator/service.h"

#include <grpcpp/client_context.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "rpc/auth.h"
#include "rpc/grpc_status.h"
#include "rpc/grpc_util.h"

namespace gradmesh {
namespace {

constexpr char kToken[] = "s3cret-token";

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    const std::string dir = absl::StrCat(::testing::TempDir(), "/svc_", getpid(), "_", counter++);
    auto store = CoordinatorStore::Open(dir, {});
    ASSERT_OK(store);
    Coordinator::Options o;
    o.store = std::move(store).value();
    o.clock = &clock_;
    o.monitor_interval_ms = -1;
    auto core = Coordinator::Create(std::move(o));
    ASSERT_OK(core);
    core_ = std::move(core).value();
    auth_ = std::make_unique<TokenChecker>(kToken);
    jobs_ = std::make_unique<JobServiceImpl>(core_.get(), auth_.get(), absl::Milliseconds(50));
    nodes_ = std::make_unique<NodeServiceImpl>(core_.get(), auth_.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(jobs_.get());
    builder.RegisterService(nodes_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    auto channel = MakeChannel(absl::StrCat("127.0.0.1:", port), RpcOptions());
    job_stub_ = JobService::NewStub(channel);
    node_stub_ = NodeService::NewStub(channel);
  }

  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }

  // A context with a deadline and, unless `token` is null, the authorization header.
  static std::unique_ptr<grpc::ClientContext> Ctx(const char* token = kToken) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (token != nullptr) AddBearerToken(token, ctx.get());
    return ctx;
  }

  absl::Status Register(const std::string& name, NodeRole role, const char* token = kToken) {
    RegisterRequest req;
    req.mutable_node()->set_name(name);
    req.mutable_node()->set_role(role);
    req.mutable_node()->set_address(name + ":1");
    req.mutable_node()->set_slots(1);
    RegisterResponse resp;
    return FromGrpcStatus(node_stub_->Register(Ctx(token).get(), req, &resp));
  }

  absl::StatusOr<HeartbeatResponse> Beat(const std::string& node,
                                         std::vector<TaskReport> reports = {},
                                         const char* token = kToken) {
    HeartbeatRequest req;
    req.set_node(node);
    for (auto& r : reports) *req.add_tasks() = r;
    HeartbeatResponse resp;
    absl::Status s = FromGrpcStatus(node_stub_->Heartbeat(Ctx(token).get(), req, &resp));
    if (!s.ok()) return s;
    return resp;
  }

  absl::StatusOr<JobStatus> Submit(const std::string& name, const char* token = kToken) {
    SubmitJobRequest req;
    req.mutable_spec()->set_name(name);
    req.mutable_spec()->set_mode("gossip");
    req.mutable_spec()->set_num_workers(1);
    req.mutable_spec()->set_steps(10);
    SubmitJobResponse resp;
    absl::Status s = FromGrpcStatus(job_stub_->SubmitJob(Ctx(token).get(), req, &resp));
    if (!s.ok()) return s;
    return resp.job();
  }

  static TaskReport Report(const std::string& state, int64_t step) {
    TaskReport r;
    r.set_job_id("j");
    r.set_index(0);
    r.set_state(state);
    r.set_step(step);
    r.set_total_steps(10);
    r.set_accuracy(state == "succeeded" ? 0.9 : -1);
    r.set_checkpoint_step(-1);
    return r;
  }

  FakeClock clock_;
  std::unique_ptr<Coordinator> core_;
  std::unique_ptr<TokenChecker> auth_;
  std::unique_ptr<JobServiceImpl> jobs_;
  std::unique_ptr<NodeServiceImpl> nodes_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<JobService::Stub> job_stub_;
  std::unique_ptr<NodeService::Stub> node_stub_;
};

TEST_F(ServiceTest, EveryMethodNeedsTheToken) {
  const auto kUnauth = absl::StatusCode::kUnauthenticated;
  for (const char* token : {static_cast<const char*>(nullptr), "wrong-token"}) {
    SCOPED_TRACE(token == nullptr ? "no token" : token);
    EXPECT_STATUS_MSG(Register("w0", WORKER, token), kUnauth, "missing or wrong API token");
    EXPECT_STATUS_MSG(Beat("w0", {}, token), kUnauth, "missing or wrong API token");
    EXPECT_STATUS_MSG(Submit("j", token), kUnauth, "missing or wrong API token");
    JobStatus st;
    GetJobRequest get;
    get.set_job_id("j");
    EXPECT_STATUS(FromGrpcStatus(job_stub_->GetJob(Ctx(token).get(), get, &st)), kUnauth);
    ListJobsResponse list;
    EXPECT_STATUS(FromGrpcStatus(job_stub_->ListJobs(Ctx(token).get(), ListJobsRequest(), &list)),
                  kUnauth);
    CancelJobRequest cancel;
    cancel.set_job_id("j");
    EXPECT_STATUS(FromGrpcStatus(job_stub_->CancelJob(Ctx(token).get(), cancel, &st)), kUnauth);
    WatchJobRequest watch;
    watch.set_job_id("j");
    auto ctx = Ctx(token);
    auto reader = job_stub_->WatchJob(ctx.get(), watch);
    EXPECT_FALSE(reader->Read(&st));
    EXPECT_STATUS(FromGrpcStatus(reader->Finish()), kUnauth);
  }
  // The refused calls changed nothing: w0 is unknown and there is no job.
  ASSERT_OK_AND_ASSIGN(HeartbeatResponse hb, Beat("w0"));
  EXPECT_TRUE(hb.register_again());
  EXPECT_TRUE(core_->ListJobs().empty());

  // With the right token everything works.
  ASSERT_OK(Register("w0", WORKER));
  ASSERT_OK_AND_ASSIGN(JobStatus job, Submit("j"));
  EXPECT_EQ(job.state(), PENDING);
  EXPECT_EQ(job.job_token().size(), 32u);  // 128 random bits in hex.
  ASSERT_OK_AND_ASSIGN(hb, Beat("w0"));
  ASSERT_EQ(hb.tasks_size(), 1);
  EXPECT_EQ(hb.tasks(0).job_token(), job.job_token());
  ListJobsResponse list;
  ASSERT_TRUE(job_stub_->ListJobs(Ctx().get(), ListJobsRequest(), &list).ok());
  ASSERT_EQ(list.jobs_size(), 1);
  EXPECT_EQ(list.jobs(0).job_token(), job.job_token());
}

TEST_F(ServiceTest, ErrorsKeepCodeAndMessage) {
  JobStatus st;
  GetJobRequest get;
  get.set_job_id("nope");
  grpc::Status s = job_stub_->GetJob(Ctx().get(), get, &st);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "job \"nope\" not found");
  EXPECT_STATUS_MSG(Submit("j"), absl::StatusCode::kFailedPrecondition,
                    "job needs 1 workers on distinct worker nodes");
  EXPECT_STATUS_MSG(Register("", WORKER), absl::StatusCode::kInvalidArgument, "node.name");
}

TEST_F(ServiceTest, WatchDeliversChangesAndEndsAtTheFinalState) {
  ASSERT_OK(Register("w0", WORKER));
  ASSERT_OK(Submit("j"));
  WatchJobRequest req;
  req.set_job_id("j");
  auto ctx = Ctx();
  auto reader = job_stub_->WatchJob(ctx.get(), req);
  JobStatus st;
  ASSERT_TRUE(reader->Read(&st));
  EXPECT_EQ(st.state(), PENDING);
  EXPECT_EQ(st.progress().step(), 0);

  ASSERT_OK(Beat("w0", {Report("running", 4)}));
  ASSERT_TRUE(reader->Read(&st));
  EXPECT_EQ(st.state(), RUNNING);
  EXPECT_EQ(st.progress().step(), 4);

  ASSERT_OK(Beat("w0", {Report("running", 7)}));
  ASSERT_TRUE(reader->Read(&st));
  EXPECT_EQ(st.state(), RUNNING);
  EXPECT_EQ(st.progress().step(), 7);

  ASSERT_OK(Beat("w0", {Report("succeeded", 10)}));
  ASSERT_TRUE(reader->Read(&st));
  EXPECT_EQ(st.state(), SUCCEEDED);
  EXPECT_DOUBLE_EQ(st.progress().accuracy(), 0.9);
  EXPECT_FALSE(reader->Read(&st));  // The stream ends after the final state.
  EXPECT_TRUE(reader->Finish().ok());

  // Watching a finished job: one message, then the end.
  auto ctx2 = Ctx();
  auto again = job_stub_->WatchJob(ctx2.get(), req);
  ASSERT_TRUE(again->Read(&st));
  EXPECT_EQ(st.state(), SUCCEEDED);
  EXPECT_FALSE(again->Read(&st));
  EXPECT_TRUE(again->Finish().ok());

  // Unknown job.
  req.set_job_id("nope");
  auto ctx3 = Ctx();
  auto unknown = job_stub_->WatchJob(ctx3.get(), req);
  EXPECT_FALSE(unknown->Read(&st));
  EXPECT_STATUS(FromGrpcStatus(unknown->Finish()), absl::StatusCode::kNotFound);
}

TEST_F(ServiceTest, CancelledWatchEndsAndOtherCallsGoOn) {
  ASSERT_OK(Register("w0", WORKER));
  ASSERT_OK(Submit("j"));
  WatchJobRequest req;
  req.set_job_id("j");
  auto ctx = Ctx();
  auto reader = job_stub_->WatchJob(ctx.get(), req);
  JobStatus st;
  ASSERT_TRUE(reader->Read(&st));
  // While the watch waits, other calls are served.
  ASSERT_OK(Beat("w0"));
  ListJobsResponse list;
  ASSERT_TRUE(job_stub_->ListJobs(Ctx().get(), ListJobsRequest(), &list).ok());
  const absl::Time start = absl::Now();
  ctx->TryCancel();
  EXPECT_FALSE(reader->Read(&st));
  EXPECT_STATUS(FromGrpcStatus(reader->Finish()), absl::StatusCode::kCancelled);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // The server's handler has ended too: a shutdown that waits up to 10 s for calls in flight
  // returns at once (a handler still looping would hold it for the full 10 s).
  const absl::Time shutdown_start = absl::Now();
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(10));
  EXPECT_LT(absl::Now() - shutdown_start, absl::Seconds(3));
  server_.reset();
}

}  // namespace
}  // namespace gradmesh
