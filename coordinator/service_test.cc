// Tests of the coordinator's gRPC services over real gRPC on 127.0.0.1: API-token checks on
// both services, per-node identity (x-gradmesh-node-token and the transport-identity hook:
// impersonation refused with PERMISSION_DENIED), status mapping, and the WatchJob stream
// (changes delivered, ends at the final state, ends when the client cancels).
#include "coordinator/service.h"

#include <grpcpp/client_context.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "rpc/auth.h"
#include "rpc/grpc_status.h"
#include "rpc/grpc_util.h"
#include "tests/security/certs.h"

namespace gradmesh {
namespace {

constexpr char kToken[] = "s3cret-token";
// Stands in for an mTLS certificate's name in the identity-hook test: the hook reads it.
constexpr char kProvedNameHeader[] = "x-test-proved-node";

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    dir_ = absl::StrCat(::testing::TempDir(), "/svc_", getpid(), "_", counter++);
    auto store = CoordinatorStore::Open(dir_, {});
    ASSERT_OK(store);
    Coordinator::Options o;
    o.store = std::move(store).value();
    o.clock = &clock_;
    o.monitor_interval_ms = -1;
    o.max_model_bytes = kMaxModelBytes;
    auto core = Coordinator::Create(std::move(o));
    ASSERT_OK(core);
    core_ = std::move(core).value();
    auth_ = std::make_unique<TokenChecker>(kToken);
    jobs_ = std::make_unique<JobServiceImpl>(core_.get(), auth_.get(), absl::Milliseconds(50));
    // The transport-identity hook (mTLS plugs in here); calls without the test header prove
    // no name, so they rely on node tokens.
    nodes_ = std::make_unique<NodeServiceImpl>(
        core_.get(), auth_.get(), [](const grpc::ServerContext& ctx) {
          // A bug inside a handler: the guard must turn it into INTERNAL.
          if (ctx.client_metadata().count("x-test-throw") > 0) {
            throw std::runtime_error("identity hook blew up");
          }
          auto it = ctx.client_metadata().find(kProvedNameHeader);
          return it == ctx.client_metadata().end()
                     ? std::string()
                     : std::string(it->second.data(), it->second.size());
        });
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

  // The node's own token as its daemon holds it ("" before it registered).
  std::string NodeToken(const std::string& name) {
    auto it = node_tokens_.find(name);
    return it == node_tokens_.end() ? "" : it->second;
  }

  // Registers `name` presenting `node_token` (as the node's daemon: its own token) and keeps
  // a token the answer issues as the node's.
  absl::StatusOr<RegisterResponse> RegisterAs(const std::string& name, NodeRole role,
                                              const std::string& node_token,
                                              const std::string& address = "",
                                              const std::string& proved = "") {
    RegisterRequest req;
    req.mutable_node()->set_name(name);
    req.mutable_node()->set_role(role);
    req.mutable_node()->set_address(address.empty() ? name + ":1" : address);
    req.mutable_node()->set_slots(1);
    RegisterResponse resp;
    auto ctx = Ctx();
    if (!node_token.empty()) ctx->AddMetadata(kNodeIdentityMetadataKey, node_token);
    if (!proved.empty()) ctx->AddMetadata(kProvedNameHeader, proved);
    absl::Status s = FromGrpcStatus(node_stub_->Register(ctx.get(), req, &resp));
    if (!s.ok()) return s;
    if (!resp.node_token().empty()) node_tokens_[name] = resp.node_token();
    return resp;
  }

  absl::Status Register(const std::string& name, NodeRole role, const char* token = kToken) {
    RegisterRequest req;
    req.mutable_node()->set_name(name);
    req.mutable_node()->set_role(role);
    req.mutable_node()->set_address(name + ":1");
    req.mutable_node()->set_slots(1);
    RegisterResponse resp;
    absl::Status s = FromGrpcStatus(node_stub_->Register(Ctx(token).get(), req, &resp));
    if (s.ok() && !resp.node_token().empty()) node_tokens_[name] = resp.node_token();
    return s;
  }

  // A heartbeat as `node`, presenting `node_token` (default: the node's own).
  absl::StatusOr<HeartbeatResponse> BeatAs(const std::string& node, const std::string& node_token,
                                           std::vector<TaskReport> reports = {},
                                           const std::string& proved = "") {
    HeartbeatRequest req;
    req.set_node(node);
    for (auto& r : reports) *req.add_tasks() = r;
    HeartbeatResponse resp;
    auto ctx = Ctx();
    if (!node_token.empty()) ctx->AddMetadata(kNodeIdentityMetadataKey, node_token);
    if (!proved.empty()) ctx->AddMetadata(kProvedNameHeader, proved);
    absl::Status s = FromGrpcStatus(node_stub_->Heartbeat(ctx.get(), req, &resp));
    if (!s.ok()) return s;
    return resp;
  }

  absl::StatusOr<HeartbeatResponse> Beat(const std::string& node,
                                         std::vector<TaskReport> reports = {},
                                         const char* token = kToken) {
    HeartbeatRequest req;
    req.set_node(node);
    for (auto& r : reports) *req.add_tasks() = r;
    HeartbeatResponse resp;
    auto ctx = Ctx(token);
    if (!NodeToken(node).empty()) ctx->AddMetadata(kNodeIdentityMetadataKey, NodeToken(node));
    absl::Status s = FromGrpcStatus(node_stub_->Heartbeat(ctx.get(), req, &resp));
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

  // Publishes `header` and `payload` (in pieces of `piece` bytes) as `node` with its token.
  absl::StatusOr<PublishModelResponse> Publish(const std::string& node, ModelHeader header,
                                               const std::string& payload, size_t piece = 1 << 20) {
    header.set_node(node);
    auto ctx = Ctx();
    if (!NodeToken(node).empty()) ctx->AddMetadata(kNodeIdentityMetadataKey, NodeToken(node));
    PublishModelResponse resp;
    auto writer = node_stub_->PublishModel(ctx.get(), &resp);
    ModelChunk first;
    *first.mutable_header() = header;
    writer->Write(first);
    for (size_t off = 0; off < payload.size(); off += piece) {
      ModelChunk c;
      c.set_data(payload.substr(off, piece));
      if (!writer->Write(c)) break;  // Refused early: Finish says why.
    }
    writer->WritesDone();
    absl::Status s = FromGrpcStatus(writer->Finish());
    if (!s.ok()) return s;
    return resp;
  }

  struct Downloaded {
    ModelHeader header;
    std::string payload;
    int messages = 0;
  };
  absl::StatusOr<Downloaded> Download(const std::string& job, ModelKind kind) {
    GetModelRequest req;
    req.set_job_id(job);
    req.set_kind(kind);
    auto ctx = Ctx();
    auto reader = job_stub_->GetModel(ctx.get(), req);
    Downloaded d;
    ModelChunk c;
    while (reader->Read(&c)) {
      if (d.messages++ == 0) {
        d.header = c.header();
      } else {
        d.payload += c.data();
      }
    }
    absl::Status s = FromGrpcStatus(reader->Finish());
    if (!s.ok()) return s;
    return d;
  }

  static constexpr int64_t kMaxModelBytes = 4 << 20;

  std::string dir_;
  FakeClock clock_;
  std::unique_ptr<Coordinator> core_;
  std::unique_ptr<TokenChecker> auth_;
  std::unique_ptr<JobServiceImpl> jobs_;
  std::unique_ptr<NodeServiceImpl> nodes_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<JobService::Stub> job_stub_;
  std::unique_ptr<NodeService::Stub> node_stub_;
  std::map<std::string, std::string> node_tokens_;  // Issued per-node tokens, by node name.
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

// Node identity over gRPC: a daemon holding the shared node token can act only as itself.
TEST_F(ServiceTest, NodesCannotImpersonateEachOther) {
  const auto kDenied = absl::StatusCode::kPermissionDenied;
  ASSERT_OK_AND_ASSIGN(RegisterResponse w0, RegisterAs("w0", WORKER, ""));
  ASSERT_OK_AND_ASSIGN(RegisterResponse w1, RegisterAs("w1", WORKER, ""));
  EXPECT_EQ(w0.node_token().size(), 32u);  // 128 random bits in hex.
  EXPECT_NE(w0.node_token(), w1.node_token());
  ASSERT_OK_AND_ASSIGN(JobStatus job, Submit("j"));
  ASSERT_EQ(job.workers(0).node(), "w0");

  // w1's daemon (right shared token, its own node token) heartbeats as w0: refused, and it
  // gets neither w0's task nor the job token; so does a call without a node token.
  EXPECT_STATUS_MSG(BeatAs("w0", NodeToken("w1")), kDenied,
                    "heartbeat as node \"w0\" refused: wrong node token");
  EXPECT_STATUS_MSG(BeatAs("w0", ""), kDenied, "heartbeat as node \"w0\" refused: no node token");
  EXPECT_STATUS_MSG(BeatAs("w0", NodeToken("w1"), {Report("failed", 3)}), kDenied, "w0");
  // ... and its "failed" report for w0's rank changed nothing.
  ASSERT_OK_AND_ASSIGN(HeartbeatResponse own, BeatAs("w0", NodeToken("w0")));
  ASSERT_EQ(own.tasks_size(), 1);
  EXPECT_EQ(own.tasks(0).job_token(), job.job_token());
  JobStatus st;
  GetJobRequest get;
  get.set_job_id("j");
  ASSERT_TRUE(job_stub_->GetJob(Ctx().get(), get, &st).ok());
  EXPECT_EQ(st.state(), PENDING);
  EXPECT_EQ(st.workers(0).state(), "pending");

  // Re-registering live w0 with w1's token (to point w0's address at itself) is refused and
  // changes nothing; w0's own daemon re-registers with its token and gets a new one.
  EXPECT_STATUS_MSG(RegisterAs("w0", WORKER, NodeToken("w1"), "evil:1"), kDenied,
                    "registering as node \"w0\" refused: wrong node token");
  EXPECT_STATUS_MSG(RegisterAs("w0", WORKER, "", "evil:1"), kDenied, "is alive (w0:1)");
  ASSERT_TRUE(job_stub_->GetJob(Ctx().get(), get, &st).ok());
  EXPECT_EQ(st.workers(0).address(), "w0:1");
  const std::string w0_token = NodeToken("w0");
  ASSERT_OK_AND_ASSIGN(RegisterResponse again, RegisterAs("w0", WORKER, w0_token));
  // Admitted, with a new token (the old one no longer counts).
  ASSERT_EQ(again.node_token().size(), 32u);
  EXPECT_NE(again.node_token(), w0_token);
  EXPECT_STATUS(BeatAs("w0", w0_token), kDenied);
  ASSERT_OK(BeatAs("w0", again.node_token()));

  // Two token headers are ambiguous: no token.
  auto ctx = Ctx();
  ctx->AddMetadata(kNodeIdentityMetadataKey, w0_token);
  ctx->AddMetadata(kNodeIdentityMetadataKey, NodeToken("w1"));
  HeartbeatRequest req;
  req.set_node("w0");
  HeartbeatResponse resp;
  EXPECT_EQ(node_stub_->Heartbeat(ctx.get(), req, &resp).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

// The transport-identity hook (mTLS): a proved name is the caller's identity, token or not.
TEST_F(ServiceTest, ProvedNameIsTheIdentity) {
  ASSERT_OK(RegisterAs("w0", WORKER, "", "", /*proved=*/"w0"));
  ASSERT_OK(BeatAs("w0", "", {}, /*proved=*/"w0"));
  EXPECT_STATUS_MSG(BeatAs("w0", "", {}, /*proved=*/"w1"), absl::StatusCode::kPermissionDenied,
                    "the caller's certificate is for node \"w1\"");
  // Even with w0's token: the certificate says w1.
  EXPECT_STATUS(BeatAs("w0", NodeToken("w0"), {}, /*proved=*/"w1"),
                absl::StatusCode::kPermissionDenied);
  EXPECT_STATUS(RegisterAs("w2", WORKER, "", "", /*proved=*/"w1"),
                absl::StatusCode::kPermissionDenied);
}

// An exception inside a handler never reaches gRPC (which would answer UNKNOWN): INTERNAL
// naming the method.
TEST_F(ServiceTest, ExceptionsBecomeInternalNamingTheMethod) {
  ASSERT_OK(Register("w0", WORKER));
  auto ctx = Ctx();
  ctx->AddMetadata("x-test-throw", "1");
  HeartbeatRequest req;
  req.set_node("w0");
  HeartbeatResponse resp;
  const grpc::Status s = node_stub_->Heartbeat(ctx.get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_EQ(s.error_message(), "Heartbeat: internal error: identity hook blew up");
  // The service goes on.
  ASSERT_OK(Beat("w0"));
}

// Mutual TLS with CertificateNodeName as the identity: the verified client certificate's CN
// is the node's name, no node token needed; a certificate for another name is refused.
TEST(CertificateIdentityTest, TheClientCertificateNamesTheNode) {
  ASSERT_OK_AND_ASSIGN(testutil::TestCerts certs, testutil::MakeTestCerts("cid"));
  FakeClock clock;
  ASSERT_OK_AND_ASSIGN(auto store, CoordinatorStore::Open(
                                       absl::StrCat(::testing::TempDir(), "/cid_", getpid()), {}));
  Coordinator::Options o;
  o.store = std::move(store);
  o.clock = &clock;
  o.monitor_interval_ms = -1;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Coordinator> core, Coordinator::Create(std::move(o)));
  TokenChecker no_token("");
  NodeServiceImpl nodes(core.get(), &no_token, CertificateNodeName);
  RpcOptions server_rpc;
  server_rpc.tls = certs.NodeTls(/*client_auth=*/true);
  int port = 0;
  ASSERT_OK_AND_ASSIGN(auto server,
                       StartGrpcServer("127.0.0.1:0", {&nodes}, server_rpc, "", &port));
  // Two clients: the node certificate (CN cid-node) and the CLI one (CN cid-client).
  RpcOptions node_rpc, client_rpc;
  node_rpc.tls = certs.NodeTls(false);
  client_rpc.tls = certs.ClientTls(/*with_cert=*/true);
  const std::string address = absl::StrCat("localhost:", port);
  auto as_node = NodeService::NewStub(MakeChannel(address, node_rpc));
  auto as_client = NodeService::NewStub(MakeChannel(address, client_rpc));
  auto ctx = [] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    return c;
  };
  RegisterRequest reg;
  reg.mutable_node()->set_name("cid-node");
  reg.mutable_node()->set_role(WORKER);
  reg.mutable_node()->set_address("127.0.0.1:1");
  reg.mutable_node()->set_slots(1);
  RegisterResponse reg_resp;
  grpc::Status st = as_node->Register(ctx().get(), reg, &reg_resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  HeartbeatRequest hb;
  hb.set_node("cid-node");
  HeartbeatResponse hb_resp;
  st = as_node->Heartbeat(ctx().get(), hb, &hb_resp);  // No node token: the certificate.
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_FALSE(hb_resp.register_again());
  // The CLI's certificate cannot act as cid-node, even holding cid-node's token.
  auto c = ctx();
  c->AddMetadata(kNodeIdentityMetadataKey, reg_resp.node_token());
  st = as_client->Heartbeat(c.get(), hb, &hb_resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(st.error_message(),
            "heartbeat as node \"cid-node\" refused: the caller's certificate is for node "
            "\"cid-client\"");
  reg.mutable_node()->set_name("w9");
  EXPECT_EQ(as_node->Register(ctx().get(), reg, &reg_resp).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  server->Shutdown();
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

namespace gradmesh {
namespace {

// A state header of tensors with these shapes ("t0", "t1", ...; t1 is an int64 buffer).
ModelHeader StateHeader(const std::string& job, const std::vector<std::vector<int64_t>>& shapes,
                        int64_t step) {
  ModelHeader h;
  h.set_job_id(job);
  h.set_kind(MODEL_STATE);
  h.set_step(step);
  int64_t values = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    ModelTensorInfo* t = h.add_tensors();
    t->set_name(absl::StrCat("t", i));
    int64_t n = 1;
    for (int64_t d : shapes[i]) {
      t->add_shape(d);
      n *= d;
    }
    if (i == 1) {
      t->set_dtype(INT64);
      t->set_buffer(true);
    }
    values += n;
  }
  h.set_total_bytes(values * 4);
  return h;
}

// `n` float32 values (little-endian) i * scale.
std::string Floats(int64_t n, float scale) {
  std::string out(static_cast<size_t>(n) * 4, '\0');
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(i) * scale;
    std::memcpy(&out[static_cast<size_t>(i) * 4], &v, 4);
  }
  return out;
}

class ModelServiceTest : public ServiceTest {
 protected:
  void SetUp() override {
    ServiceTest::SetUp();
    ASSERT_OK(RegisterAs("w0", WORKER, ""));
    ASSERT_OK(RegisterAs("w1", WORKER, ""));
    absl::StatusOr<JobStatus> job = Submit("j");
    ASSERT_OK(job);
    rank0_ = job->workers(0).node();
    other_ = rank0_ == "w0" ? "w1" : "w0";
  }
  std::string rank0_, other_;
};

TEST_F(ModelServiceTest, RankZerosNodePublishesAndGetModelReturnsTheExactBytes) {
  // 300 x 1000 + 3 values: 1.2 MB, two stored pieces and two published pieces of odd size.
  const ModelHeader h = StateHeader("j", {{300, 1000}, {3}}, 7);
  const std::string payload = Floats(300 * 1000 + 3, 0.5f);
  absl::StatusOr<PublishModelResponse> r = Publish(rank0_, h, payload, 777'777);
  ASSERT_OK(r);
  EXPECT_EQ(r->stored_bytes(), static_cast<int64_t>(payload.size()));
  absl::StatusOr<Downloaded> d = Download("j", MODEL_STATE);
  ASSERT_OK(d);
  EXPECT_EQ(d->messages, 3);  // Header, then 1 MiB + the rest.
  EXPECT_TRUE(d->payload == payload);
  EXPECT_EQ(d->header.job_id(), "j");
  EXPECT_EQ(d->header.node(), rank0_);
  EXPECT_EQ(d->header.step(), 7);
  EXPECT_FALSE(d->header.final());
  EXPECT_EQ(d->header.total_bytes(), static_cast<int64_t>(payload.size()));
  EXPECT_EQ(d->header.published_ms(), clock_.NowMs());
  ASSERT_EQ(d->header.tensors_size(), 2);
  EXPECT_EQ(d->header.tensors(0).name(), "t0");
  EXPECT_EQ(std::vector<int64_t>(d->header.tensors(0).shape().begin(),
                                 d->header.tensors(0).shape().end()),
            (std::vector<int64_t>{300, 1000}));
  EXPECT_EQ(d->header.tensors(1).dtype(), INT64);
  EXPECT_TRUE(d->header.tensors(1).buffer());
  EXPECT_FALSE(d->header.tensors(0).buffer());
}

TEST_F(ModelServiceTest, NotPublishedYetIsFailedPrecondition) {
  EXPECT_STATUS_MSG(Download("j", MODEL_STATE), absl::StatusCode::kFailedPrecondition,
                    "job j (gossip) has not published a model yet; rank 0 publishes at "
                    "checkpoints, every 60 s and at the end");
  EXPECT_STATUS_MSG(Download("nope", MODEL_STATE), absl::StatusCode::kNotFound, "job nope");
  // The job's model is not TorchScript: no module to ask for.
  EXPECT_STATUS_MSG(Download("j", MODEL_MODULE), absl::StatusCode::kFailedPrecondition,
                    "not a TorchScript module");
  EXPECT_STATUS_MSG(Download("j", MODEL_KIND_UNSPECIFIED), absl::StatusCode::kInvalidArgument,
                    "kind");
}

TEST_F(ModelServiceTest, RefusedPublishesChangeNothing) {
  const ModelHeader good = StateHeader("j", {{2, 3}, {1}}, 5);
  const std::string payload = Floats(7, 1.0f);
  ASSERT_OK(Publish(rank0_, good, payload));

  // Another node (with its own valid token) is not rank 0's.
  EXPECT_STATUS_MSG(Publish(other_, StateHeader("j", {{2, 3}, {1}}, 9), Floats(7, 2.0f)),
                    absl::StatusCode::kPermissionDenied, "only the node running rank 0");
  // Rank 0's name without its token.
  {
    ModelHeader h = StateHeader("j", {{2, 3}, {1}}, 9);
    h.set_node(rank0_);
    auto ctx = Ctx();
    ctx->AddMetadata(kNodeIdentityMetadataKey, NodeToken(other_));
    PublishModelResponse resp;
    auto writer = node_stub_->PublishModel(ctx.get(), &resp);
    ModelChunk c;
    *c.mutable_header() = h;
    writer->Write(c);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  EXPECT_STATUS_MSG(Publish(rank0_, StateHeader("nope", {{1}}, 1), Floats(1, 1.0f)),
                    absl::StatusCode::kNotFound, "job nope not found");
  // Over --max_model_bytes (4 MiB here): refused from the header, before the payload.
  EXPECT_STATUS_MSG(Publish(rank0_, StateHeader("j", {{1024, 1025}}, 9), Floats(1024 * 1025, 1)),
                    absl::StatusCode::kResourceExhausted, "--max_model_bytes");
  // Shapes and values disagree: fewer payload bytes than the header says...
  EXPECT_STATUS_MSG(Publish(rank0_, StateHeader("j", {{2, 3}, {1}}, 9), Floats(6, 1.0f)),
                    absl::StatusCode::kInvalidArgument,
                    "got 24 payload bytes, header.total_bytes says 28");
  // ... more ...
  EXPECT_STATUS_MSG(Publish(rank0_, StateHeader("j", {{2, 3}, {1}}, 9), Floats(8, 1.0f)),
                    absl::StatusCode::kInvalidArgument, "more payload than header.total_bytes");
  // ... or a header whose total_bytes does not match its shapes.
  {
    ModelHeader h = StateHeader("j", {{2, 3}, {1}}, 9);
    h.set_total_bytes(32);
    EXPECT_STATUS_MSG(Publish(rank0_, h, Floats(8, 1.0f)), absl::StatusCode::kInvalidArgument,
                      "the tensors' shapes hold 7 float32 values");
  }
  {
    ModelHeader h = StateHeader("j", {{2, 3}, {1}}, 9);
    h.mutable_tensors(1)->set_name("t0");
    EXPECT_STATUS_MSG(Publish(rank0_, h, Floats(7, 1.0f)), absl::StatusCode::kInvalidArgument,
                      "tensor 1 \"t0\": the name is repeated");
    h.mutable_tensors(1)->set_name("");
    EXPECT_STATUS_MSG(Publish(rank0_, h, Floats(7, 1.0f)), absl::StatusCode::kInvalidArgument,
                      "the name must have 1..1024 bytes");
    h = StateHeader("j", {{2, 3}, {1}}, 9);
    h.mutable_tensors(0)->set_shape(0, -2);
    EXPECT_STATUS_MSG(Publish(rank0_, h, Floats(7, 1.0f)), absl::StatusCode::kInvalidArgument,
                      "negative dimension");
  }
  // A module for a job whose model is not TorchScript.
  {
    ModelHeader h;
    h.set_job_id("j");
    h.set_kind(MODEL_MODULE);
    h.set_total_bytes(3);
    EXPECT_STATUS_MSG(Publish(rank0_, h, "abc"), absl::StatusCode::kInvalidArgument,
                      "not a TorchScript module");
  }
  // No header at all.
  {
    auto ctx = Ctx();
    ctx->AddMetadata(kNodeIdentityMetadataKey, NodeToken(rank0_));
    PublishModelResponse resp;
    auto writer = node_stub_->PublishModel(ctx.get(), &resp);
    ModelChunk c;
    c.set_data("xxxx");
    writer->Write(c);
    writer->WritesDone();
    grpc::Status st = writer->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(st.error_message(), "PublishModel: the first message must carry the header");
  }

  absl::StatusOr<Downloaded> d = Download("j", MODEL_STATE);
  ASSERT_OK(d);
  EXPECT_EQ(d->header.step(), 5);
  EXPECT_TRUE(d->payload == payload);
}

TEST_F(ModelServiceTest, OverwriteKeepsOnlyTheLatest) {
  // A larger model (3 pieces) replaced by a smaller one (1 piece): no stale piece survives.
  ASSERT_OK(Publish(rank0_, StateHeader("j", {{600, 1000}, {1}}, 1), Floats(600'001, 1.0f)));
  ModelHeader h = StateHeader("j", {{2, 2}, {1}}, 2);
  h.set_final(true);
  ASSERT_OK(Publish(rank0_, h, Floats(5, 3.0f)));
  absl::StatusOr<Downloaded> d = Download("j", MODEL_STATE);
  ASSERT_OK(d);
  EXPECT_EQ(d->header.step(), 2);
  EXPECT_TRUE(d->header.final());
  EXPECT_EQ(d->messages, 2);
  EXPECT_TRUE(d->payload == Floats(5, 3.0f));
}

TEST_F(ModelServiceTest, ModulesOfTorchScriptJobsAndSurvivingARestart) {
  SubmitJobRequest req;
  req.mutable_spec()->set_name("ts");
  req.mutable_spec()->set_mode("async");
  req.mutable_spec()->set_num_workers(1);
  req.mutable_spec()->set_num_shards(0);
  req.mutable_spec()->set_steps(10);
  req.mutable_spec()->mutable_model()->set_name("torchscript");
  req.mutable_spec()->mutable_model()->set_path("/models/m.pt");
  // ps modes need a server node.
  ASSERT_OK(RegisterAs("s0", SERVER, ""));
  SubmitJobResponse resp;
  ASSERT_OK(FromGrpcStatus(job_stub_->SubmitJob(Ctx().get(), req, &resp)));
  const std::string ts_rank0 = resp.job().workers(0).node();
  EXPECT_STATUS_MSG(Download("ts", MODEL_MODULE), absl::StatusCode::kFailedPrecondition,
                    "job ts (async) has not published its TorchScript module yet");
  ModelHeader m;
  m.set_job_id("ts");
  m.set_kind(MODEL_MODULE);
  const std::string module = std::string("PK\x03\x04", 4) + std::string(100, 'z');
  m.set_total_bytes(static_cast<int64_t>(module.size()));
  ASSERT_OK(Publish(ts_rank0, m, module));
  ASSERT_OK(Publish(rank0_, StateHeader("j", {{4}}, 3), Floats(4, 2.0f)));

  // Restart: a new core on the same tables serves both.
  server_->Shutdown(std::chrono::system_clock::now());
  server_.reset();
  core_.reset();
  auto store = CoordinatorStore::Open(dir_, {});
  ASSERT_OK(store);
  Coordinator::Options o;
  o.store = std::move(store).value();
  o.clock = &clock_;
  o.monitor_interval_ms = -1;
  auto core = Coordinator::Create(std::move(o));
  ASSERT_OK(core);
  std::string got;
  ModelHeader header;
  ASSERT_OK((*core)->GetModel(
      "ts", MODEL_MODULE,
      [&](const ModelHeader& h) {
        header = h;
        return true;
      },
      [&](absl::string_view piece) {
        got.append(piece.data(), piece.size());
        return true;
      }));
  EXPECT_EQ(header.kind(), MODEL_MODULE);
  EXPECT_TRUE(got == module);
  got.clear();
  ASSERT_OK((*core)->GetModel(
      "j", MODEL_STATE, [&](const ModelHeader& h) { return h.step() == 3; },
      [&](absl::string_view piece) {
        got.append(piece.data(), piece.size());
        return true;
      }));
  EXPECT_TRUE(got == Floats(4, 2.0f));
}

TEST_F(ModelServiceTest, CompactedJobsLoseTheirModels) {
  ASSERT_OK(Publish(rank0_, StateHeader("j", {{4}}, 3), Floats(4, 2.0f)));
  JobStatus st;
  CancelJobRequest cancel;
  cancel.set_job_id("j");
  ASSERT_OK(FromGrpcStatus(job_stub_->CancelJob(Ctx().get(), cancel, &st)));
  clock_.AdvanceMs(86'400'000 + 1);
  EXPECT_EQ(core_->CompactJobs(), 1);
  ASSERT_OK(Beat("w0"));  // Alive again after the day that passed.
  ASSERT_OK(Beat("w1"));
  // The same id again: a new job, with no model.
  absl::StatusOr<JobStatus> again = Submit("j");
  ASSERT_OK(again);
  EXPECT_STATUS(Download("j", MODEL_STATE), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace gradmesh
