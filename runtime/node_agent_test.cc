// NodeAgent against a scripted NodeService on 127.0.0.1: registers with the API token, then
// heartbeats carrying the daemon's reports and hands every task list to Reconcile; registers
// again when told to or after UNAUTHENTICATED/NOT_FOUND; keeps retrying while the coordinator
// is away; Stop(leaving) sends a last heartbeat with leaving=true and no Reconcile.
#include "runtime/node_agent.h"

#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "rpc/auth.h"
#include "rpc/grpc_status.h"

namespace gradmesh {
namespace {

constexpr char kToken[] = "agent-token";

class ScriptedNodeService final : public NodeService::Service {
 public:
  grpc::Status Register(grpc::ServerContext* ctx, const RegisterRequest* req,
                        RegisterResponse* resp) override {
    if (absl::Status st = TokenChecker(kToken).Check(*ctx); !st.ok()) return ToGrpcStatus(st);
    absl::MutexLock lock(&mu_);
    registrations_.push_back(req->node());
    registration_tokens_.push_back(NodeTokenOf(*ctx));
    resp->set_heartbeat_interval_ms(50);
    // Issues a new per-node token each time, as the coordinator does for a caller without one.
    resp->set_node_token(absl::StrCat("node-tok-", registrations_.size()));
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext* ctx, const HeartbeatRequest* req,
                         HeartbeatResponse* resp) override {
    if (absl::Status st = TokenChecker(kToken).Check(*ctx); !st.ok()) return ToGrpcStatus(st);
    absl::MutexLock lock(&mu_);
    heartbeats_.push_back(*req);
    heartbeat_tokens_.push_back(NodeTokenOf(*ctx));
    if (deny_next_) {
      deny_next_ = false;
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "wrong node token");
    }
    if (forget_next_) {
      forget_next_ = false;
      resp->set_register_again(true);
      return grpc::Status::OK;
    }
    Task* t = resp->add_tasks();
    t->set_job_id("j");
    t->set_index(static_cast<int32_t>(heartbeats_.size()));
    return grpc::Status::OK;
  }

  void ForgetNode() {
    absl::MutexLock lock(&mu_);
    forget_next_ = true;
  }
  void DenyNextHeartbeat() {
    absl::MutexLock lock(&mu_);
    deny_next_ = true;
  }
  // The x-gradmesh-node-token each Register / Heartbeat carried ("" if none).
  std::vector<std::string> registration_tokens() {
    absl::MutexLock lock(&mu_);
    return registration_tokens_;
  }
  std::vector<std::string> heartbeat_tokens() {
    absl::MutexLock lock(&mu_);
    return heartbeat_tokens_;
  }
  int registrations() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(registrations_.size());
  }
  std::vector<HeartbeatRequest> heartbeats() {
    absl::MutexLock lock(&mu_);
    return heartbeats_;
  }
  NodeInfo first_registration() {
    absl::MutexLock lock(&mu_);
    return registrations_.at(0);
  }

 private:
  absl::Mutex mu_;
  std::vector<NodeInfo> registrations_ ABSL_GUARDED_BY(mu_);
  std::vector<HeartbeatRequest> heartbeats_ ABSL_GUARDED_BY(mu_);
  bool forget_next_ ABSL_GUARDED_BY(mu_) = false;
  bool deny_next_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::string> registration_tokens_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> heartbeat_tokens_ ABSL_GUARDED_BY(mu_);

  static std::string NodeTokenOf(const grpc::ServerContext& ctx) {
    auto it = ctx.client_metadata().find(kNodeIdentityMetadataKey);
    return it == ctx.client_metadata().end() ? ""
                                             : std::string(it->second.data(), it->second.size());
  }
};

struct Server {
  ScriptedNodeService service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

std::unique_ptr<Server> StartServer(int port = 0) {
  auto s = std::make_unique<Server>();
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(),
                     &s->port);
  b.RegisterService(&s->service);
  s->server = b.BuildAndStart();
  return s;
}

// Polls `pred` for up to 10 s.
template <typename Pred>
bool Eventually(Pred pred) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

class Recorder {
 public:
  void Reconcile(const std::vector<Task>& tasks) {
    absl::MutexLock lock(&mu_);
    lists_.push_back(tasks);
  }
  int lists() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(lists_.size());
  }
  std::vector<Task> last() {
    absl::MutexLock lock(&mu_);
    return lists_.back();
  }

 private:
  absl::Mutex mu_;
  std::vector<std::vector<Task>> lists_ ABSL_GUARDED_BY(mu_);
};

NodeAgentOptions Options(int port, const std::string& token) {
  NodeAgentOptions o;
  o.coordinator = "127.0.0.1:" + std::to_string(port);
  o.auth_token = token;
  o.node.set_name("w7");
  o.node.set_role(WORKER);
  o.node.set_address("127.0.0.1:9");
  o.node.set_slots(2);
  o.rpc_deadline = absl::Seconds(2);
  return o;
}

std::vector<TaskReport> OneReport() {
  TaskReport r;
  r.set_job_id("j");
  r.set_index(3);
  r.set_state("running");
  r.set_step(42);
  return {r};
}

TEST(NodeAgentTest, RegistersHeartbeatsWithReportsAndReconciles) {
  auto server = StartServer();
  Recorder rec;
  NodeAgent agent(
      Options(server->port, kToken), [&rec](const std::vector<Task>& t) { rec.Reconcile(t); },
      OneReport);
  agent.Start();
  ASSERT_TRUE(Eventually([&] { return rec.lists() >= 3; }));
  EXPECT_EQ(server->service.registrations(), 1);
  const NodeInfo n = server->service.first_registration();
  EXPECT_EQ(n.name(), "w7");
  EXPECT_EQ(n.role(), WORKER);
  EXPECT_EQ(n.slots(), 2);
  for (const HeartbeatRequest& hb : server->service.heartbeats()) {
    EXPECT_EQ(hb.node(), "w7");
    EXPECT_FALSE(hb.leaving());
    ASSERT_EQ(hb.tasks_size(), 1);
    EXPECT_EQ(hb.tasks(0).step(), 42);
  }
  // Each list is the coordinator's answer to one heartbeat.
  const std::vector<Task> last = rec.last();
  ASSERT_EQ(last.size(), 1u);
  EXPECT_EQ(last[0].job_id(), "j");
  EXPECT_GE(last[0].index(), 3);

  const int before = rec.lists();
  agent.Stop(/*leaving=*/true);
  const std::vector<HeartbeatRequest> hbs = server->service.heartbeats();
  EXPECT_TRUE(hbs.back().leaving());
  EXPECT_EQ(hbs.back().tasks_size(), 1);
  EXPECT_EQ(rec.lists(), before) << "a leaving heartbeat's answer is not reconciled";
}

TEST(NodeAgentTest, RegistersAgainWhenTheCoordinatorForgetsTheNode) {
  auto server = StartServer();
  Recorder rec;
  NodeAgent agent(
      Options(server->port, kToken), [&rec](const std::vector<Task>& t) { rec.Reconcile(t); },
      OneReport);
  agent.Start();
  ASSERT_TRUE(Eventually([&] { return rec.lists() >= 1; }));
  server->service.ForgetNode();
  ASSERT_TRUE(Eventually([&] { return server->service.registrations() == 2; }));
  agent.Stop(false);
}

// The per-node token: none on the first registration, the issued one on every heartbeat; a
// PERMISSION_DENIED heartbeat makes the agent register again presenting it, and it takes the
// token that registration issues.
TEST(NodeAgentTest, SendsItsNodeTokenAndRegistersAgainWhenRefused) {
  auto server = StartServer();
  Recorder rec;
  NodeAgent agent(
      Options(server->port, kToken), [&rec](const std::vector<Task>& t) { rec.Reconcile(t); },
      OneReport);
  agent.Start();
  ASSERT_TRUE(Eventually([&] { return rec.lists() >= 2; }));
  server->service.DenyNextHeartbeat();
  ASSERT_TRUE(Eventually([&] { return server->service.registrations() == 2; }));
  const int lists = rec.lists();
  ASSERT_TRUE(Eventually([&] { return rec.lists() >= lists + 2; }));
  agent.Stop(/*leaving=*/true);

  EXPECT_EQ(server->service.registration_tokens(), (std::vector<std::string>{"", "node-tok-1"}));
  const std::vector<std::string> beats = server->service.heartbeat_tokens();
  ASSERT_GE(beats.size(), 4u);
  // node-tok-1 until the refused heartbeat (included), node-tok-2 after, also when leaving.
  size_t i = 0;
  while (i < beats.size() && beats[i] == "node-tok-1") ++i;
  EXPECT_GE(i, 3u);  // At least two answered, then the refused one.
  for (; i < beats.size(); ++i) EXPECT_EQ(beats[i], "node-tok-2") << i;
}

// The node's token outlives the agent in a NodeTokenStore: a restarted daemon (a new agent
// and store on the same file) presents the token issued to the one before from its first
// registration, which the coordinator takes at once from the node it issued it to.
TEST(NodeAgentTest, ATokenStoreKeepsTheNodesTokenAcrossRestarts) {
  auto server = StartServer();
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/token_store");
  const std::string path = NodeTokenStorePath(dir, "w/7 x");
  EXPECT_EQ(path, dir + "/node-w_7_x.token");
  auto run_agent = [&](std::shared_ptr<NodeTokenStore> store, int registrations) {
    NodeAgentOptions o = Options(server->port, kToken);
    o.token_store = std::move(store);
    Recorder rec;
    NodeAgent agent(
        o, [&rec](const std::vector<Task>& t) { rec.Reconcile(t); }, OneReport);
    agent.Start();
    ASSERT_TRUE(Eventually([&] { return rec.lists() >= 1; }));
    EXPECT_EQ(server->service.registrations(), registrations);
    agent.Stop(/*leaving=*/false);
  };
  {
    std::shared_ptr<NodeTokenStore> store = OpenNodeTokenStore("", dir, "w/7 x", nullptr);
    ASSERT_NE(store, nullptr);  // The directory is made.
    EXPECT_EQ(store->Load(), "");
    // Another daemon of the same name and directory cannot take it while this one runs.
    EXPECT_STATUS_MSG(NodeTokenStore::Open(path).status(), absl::StatusCode::kFailedPrecondition,
                      "held by another daemon");
    EXPECT_EQ(OpenNodeTokenStore("", dir, "w/7 x", nullptr), nullptr);
    run_agent(store, 1);
    EXPECT_EQ(store->Load(), "node-tok-1");
  }
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600);  // A credential.
  // The restarted daemon's registration presents the stored token (the coordinator takes it
  // while the node's old registration is still alive, and issues none: this scripted one
  // issues a new one every time).
  run_agent(OpenNodeTokenStore(path, "", "ignored", nullptr), 2);
  EXPECT_EQ(server->service.registration_tokens(), (std::vector<std::string>{"", "node-tok-1"}));
  // A torn or foreign file is no token: nothing is presented.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<NodeTokenStore> store, NodeTokenStore::Open(path));
  ASSERT_OK(store->Save("not a token\n"));
  EXPECT_EQ(store->Load(), "");
  ASSERT_OK(store->Save("node-tok-9"));
  EXPECT_EQ(store->Load(), "node-tok-9");
  // Never through a symbolic link (one planted in a shared directory would make Save
  // overwrite its target).
  const std::string target = dir + "/target", link = dir + "/link.token";
  std::ofstream(target) << "precious";
  ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0);
  EXPECT_FALSE(NodeTokenStore::Open(link).ok());
  std::ifstream in(target);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "precious");
  EXPECT_EQ(OpenNodeTokenStore("none", dir, "w7", nullptr), nullptr);
  EXPECT_EQ(OpenNodeTokenStore("", "", "w7", nullptr), nullptr);  // No directory: none.
}

TEST(NodeAgentTest, WrongTokenNeverReconcilesAndKeepsTrying) {
  auto server = StartServer();
  Recorder rec;
  NodeAgent agent(
      Options(server->port, "wrong"), [&rec](const std::vector<Task>& t) { rec.Reconcile(t); },
      OneReport);
  agent.Start();
  absl::SleepFor(absl::Milliseconds(400));
  agent.Stop(false);
  EXPECT_EQ(rec.lists(), 0);
  EXPECT_EQ(server->service.registrations(), 0);
  EXPECT_TRUE(server->service.heartbeats().empty());
}

TEST(NodeAgentTest, KeepsRetryingUntilTheCoordinatorComesUp) {
  // Reserve a port, then start the coordinator on it only after the agent has been failing.
  int port = 0;
  {
    auto probe = StartServer();
    port = probe->port;
    probe->server->Shutdown();
  }
  Recorder rec;
  NodeAgentOptions o = Options(port, kToken);
  NodeAgent agent(
      o, [&rec](const std::vector<Task>& t) { rec.Reconcile(t); }, OneReport);
  agent.Start();
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(rec.lists(), 0);
  auto server = StartServer(port);
  ASSERT_NE(server->server, nullptr);
  ASSERT_TRUE(Eventually([&] { return rec.lists() >= 1; }));
  EXPECT_EQ(server->service.registrations(), 1);
  agent.Stop(false);
}

}  // namespace
}  // namespace gradmesh
