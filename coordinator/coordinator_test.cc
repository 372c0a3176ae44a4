// Tests of the Coordinator core with a FakeClock and a real RocksDB in a temp dir: placement,
// refusals that change nothing, failure handling (reassignment, lost ranks, sync re-forming,
// paused jobs), reports and progress, cancel, and persistence across a restart of the core.
#include "coordinator/coordinator.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "common/token_hash.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

constexpr int64_t kTimeoutMs = 3000;

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    dir_ = absl::StrCat(::testing::TempDir(), "/coord_", getpid(), "_", counter++);
    Start();
  }

  // (Re)starts the core on dir_ (the previous one, if any, is destroyed first).
  void Start() {
    core_.reset();
    auto store = CoordinatorStore::Open(dir_, {});
    ASSERT_OK(store);
    Coordinator::Options o;
    store_ = store->get();
    o.store = std::move(store).value();
    o.clock = &clock_;
    o.finished_job_retention_ms = retention_ms_;
    o.max_finished_jobs = max_finished_jobs_;
    o.heartbeat_interval_ms = 500;
    o.heartbeat_timeout_ms = kTimeoutMs;
    o.monitor_interval_ms = monitor_interval_ms_;  // -1: the test drives time.
    o.token_source = [this] { return absl::StrCat("tok-", ++tokens_); };
    o.history_capacity = history_capacity_;
    auto core = Coordinator::Create(std::move(o));
    ASSERT_OK(core);
    core_ = std::move(core).value();
  }

  static std::string Addr(const std::string& node) { return node + ".addr:1"; }

  // The credentials of node `name`'s own daemon: the token its last registration got.
  Coordinator::NodeCredentials Creds(const std::string& name) {
    Coordinator::NodeCredentials c;
    auto it = node_tokens_.find(name);
    if (it != node_tokens_.end()) c.token = it->second;
    return c;
  }

  void Register(const std::string& name, NodeRole role, int slots = 1,
                const std::string& host = "") {
    RegisterRequest req;
    req.mutable_node()->set_name(name);
    req.mutable_node()->set_role(role);
    req.mutable_node()->set_address(Addr(name));
    req.mutable_node()->set_slots(slots);
    req.mutable_node()->set_host(host);
    ASSERT_OK_AND_ASSIGN(RegisterResponse r, core_->Register(req, Creds(name)));
    EXPECT_EQ(r.heartbeat_interval_ms(), 500);
    if (!r.node_token().empty()) node_tokens_[name] = r.node_token();
  }

  HeartbeatResponse Beat(const std::string& node, std::vector<TaskReport> reports = {},
                         bool leaving = false) {
    HeartbeatRequest req;
    req.set_node(node);
    for (auto& r : reports) *req.add_tasks() = r;
    req.set_leaving(leaving);
    auto resp = core_->Heartbeat(req, Creds(node));
    EXPECT_OK(resp);
    return resp.ok() ? *resp : HeartbeatResponse();
  }

  // The generation of `job`'s rank `rank` task, as `node`'s heartbeat hands it out.
  int64_t TaskGeneration(const std::string& node, const std::string& job, int rank) {
    const HeartbeatResponse h = Beat(node);
    for (const Task& t : h.tasks()) {
      if (t.job_id() == job && t.index() == rank) return t.generation();
    }
    ADD_FAILURE() << "no task for " << job << " rank " << rank << " on " << node;
    return -1;
  }

  // Registers workers a and b and submits allreduce job "ar" (2 ranks, checkpoints every 10
  // steps); `nodes[r]` is then the node running rank r.
  void SubmitCheckpointedAllreduce(std::vector<std::string>* nodes) {
    Register("a", WORKER);
    Register("b", WORKER);
    JobSpec spec = Spec("ar", "allreduce", 2);
    spec.mutable_checkpoint()->set_every_steps(10);
    ASSERT_OK_AND_ASSIGN(JobStatus st, Submit(spec));
    *nodes = {st.workers(0).node(), st.workers(1).node()};
  }

  // Shard node s0, worker nodes w0 and w1, and sync job "s" (2 ranks, 1 shard) running on them.
  void StartRunningSyncJob() {
    Register("s0", SERVER);
    Register("w0", WORKER);
    Register("w1", WORKER);
    ASSERT_OK(Submit(Spec("s", "sync", 2, 1)));
    Beat("w0", {Report("s", 0, "running", 3)});
    Beat("w1", {Report("s", 1, "running", 3)});
    ASSERT_EQ(Get("s").state(), RUNNING);
  }

  // Keeps `nodes` alive across `ms` of fake time (heartbeats every 500 ms).
  void Pass(int64_t ms, const std::vector<std::string>& nodes) {
    for (int64_t t = 0; t < ms; t += 500) {
      clock_.AdvanceMs(500);
      for (const auto& n : nodes) Beat(n);
    }
  }

  static TaskReport Report(const std::string& job, int index, const std::string& state,
                           int64_t step = 0, int64_t generation = 0) {
    TaskReport r;
    r.set_job_id(job);
    r.set_index(index);
    r.set_state(state);
    r.set_step(step);
    r.set_total_steps(100);
    r.set_epoch(1);
    r.set_accuracy(-1);
    r.set_test_loss(-1);
    r.set_perplexity(-1);
    r.set_checkpoint_step(-1);
    r.set_generation(generation);
    return r;
  }

  static JobSpec Spec(const std::string& name, const std::string& mode, int workers,
                      int shards = 0) {
    JobSpec spec;
    spec.set_name(name);
    spec.set_mode(mode);
    spec.set_num_workers(workers);
    spec.set_num_shards(shards);
    spec.set_steps(100);
    return spec;
  }

  absl::StatusOr<JobStatus> Submit(const JobSpec& spec, bool dry_run = false, bool resume = false) {
    SubmitJobRequest req;
    *req.mutable_spec() = spec;
    req.set_dry_run(dry_run);
    req.set_resume(resume);
    return core_->SubmitJob(req);
  }

  JobStatus Get(const std::string& id) {
    auto s = core_->GetJob(id);
    EXPECT_OK(s);
    return s.ok() ? *s : JobStatus();
  }

  static std::vector<std::string> WorkerNodes(const JobStatus& s) {
    std::vector<std::string> out;
    for (const auto& w : s.workers()) out.push_back(w.node());
    return out;
  }

  // Standard cluster: servers s0, s1 and workers w0, w1, w2 (one slot each).
  void Cluster() {
    Register("s0", SERVER);
    Register("s1", SERVER);
    Register("w0", WORKER);
    Register("w1", WORKER);
    Register("w2", WORKER);
  }

  FakeClock clock_;
  std::string dir_;
  int tokens_ = 0;
  std::map<std::string, std::string> node_tokens_;  // Per-node tokens issued by Register.
  int64_t retention_ms_ = 86'400'000;
  int64_t monitor_interval_ms_ = -1;
  int64_t max_finished_jobs_ = 1000;
  CoordinatorStore* store_ = nullptr;  // Owned by core_.
  int history_capacity_ = kDefaultHistoryCapacity;
  std::unique_ptr<Coordinator> core_;
};

using Strings = std::vector<std::string>;

TEST_F(CoordinatorTest, SubmitPlacesAndHandsOutTasks) {
  Cluster();
  JobSpec spec = Spec("j1", "async", 2);  // num_shards 0: defaults to the 2 alive servers.
  ASSERT_OK_AND_ASSIGN(JobStatus st, Submit(spec));
  EXPECT_EQ(st.job_id(), "j1");
  EXPECT_EQ(st.state(), PENDING);
  EXPECT_EQ(st.spec().num_shards(), 2);
  EXPECT_EQ(st.spec().model().name(), "mlp");  // Defaults applied.
  EXPECT_EQ(st.job_token(), "tok-1");
  ASSERT_EQ(st.shards_size(), 2);
  EXPECT_EQ(st.shards(0).node(), "s0");
  EXPECT_EQ(st.shards(1).node(), "s1");
  EXPECT_EQ(st.shards(1).address(), Addr("s1"));
  EXPECT_TRUE(st.shards(1).alive());
  EXPECT_EQ(WorkerNodes(st), (Strings{"w0", "w1"}));
  EXPECT_EQ(st.workers(1).state(), "pending");
  EXPECT_EQ(st.active_workers(), 2);
  EXPECT_EQ(st.progress().accuracy(), -1);
  EXPECT_EQ(st.progress().checkpoint_step(), -1);

  HeartbeatResponse w1 = Beat("w1");
  EXPECT_FALSE(w1.register_again());
  ASSERT_EQ(w1.tasks_size(), 1);
  const Task& t = w1.tasks(0);
  EXPECT_EQ(t.job_id(), "j1");
  EXPECT_EQ(t.index(), 1);
  EXPECT_EQ(t.spec().num_shards(), 2);
  EXPECT_EQ(Strings(t.servers().begin(), t.servers().end()), (Strings{Addr("s0"), Addr("s1")}));
  EXPECT_EQ(t.peers_size(), 0);  // ps mode: no peers.
  EXPECT_EQ(t.job_token(), "tok-1");
  EXPECT_EQ(t.rank_token(), "");  // No peer plane.
  EXPECT_EQ(t.rank_token_hashes_size(), 0);
  EXPECT_EQ(t.active_ranks_size(), 0);
  EXPECT_EQ(t.lr_scale(), 1.0);
  EXPECT_EQ(t.generation(), 1);
  EXPECT_EQ(Beat("w2").tasks_size(), 0);
  HeartbeatResponse s1 = Beat("s1");
  ASSERT_EQ(s1.tasks_size(), 1);
  EXPECT_EQ(s1.tasks(0).index(), 1);
  EXPECT_EQ(s1.tasks(0).job_token(), "tok-1");

  // A second job goes to the least-loaded worker node: w2, the only one with a free slot.
  ASSERT_OK_AND_ASSIGN(JobStatus st2, Submit(Spec("j2", "gossip", 1)));
  EXPECT_EQ(WorkerNodes(st2), (Strings{"w2"}));
  EXPECT_EQ(st2.job_token(), "tok-2");
}

TEST_F(CoordinatorTest, GossipGetsPeersAndAllreducePacksHosts) {
  Register("a0", WORKER, 1, "hostA");
  Register("b0", WORKER, 1, "hostB");
  Register("b1", WORKER, 1, "hostB");
  ASSERT_OK_AND_ASSIGN(JobStatus ar, Submit(Spec("ar", "allreduce", 2)));
  EXPECT_EQ(ar.shards_size(), 0);
  EXPECT_EQ(WorkerNodes(ar), (Strings{"b0", "b1"}));
  HeartbeatResponse b1 = Beat("b1");
  ASSERT_EQ(b1.tasks_size(), 1);
  EXPECT_EQ(b1.tasks(0).servers_size(), 0);
  EXPECT_EQ(Strings(b1.tasks(0).peers().begin(), b1.tasks(0).peers().end()),
            (Strings{Addr("b0"), Addr("b1")}));
  // Gossip with 3 ranks needs 3 distinct nodes with a free slot; only a0 has one left.
  EXPECT_STATUS_MSG(Submit(Spec("g", "gossip", 3)), absl::StatusCode::kFailedPrecondition,
                    "job needs 3 workers on distinct worker nodes (mode gossip: a node's peer "
                    "address serves one rank per job) but only 1 alive worker nodes have a free "
                    "slot (a0: 1, b0: 0, b1: 0)");
}

// gossip/allreduce ranks each get their own peer-plane token and every rank's SHA-256, so a
// rank can prove which rank it is (worker/core/peer_token.h). The tokens differ per rank and
// per job, are stable across heartbeats and a coordinator restart, and appear nowhere in the
// job's status.
TEST_F(CoordinatorTest, PeerPlaneRanksEachGetTheirOwnToken) {
  Register("a0", WORKER, 2, "hostA");
  Register("b0", WORKER, 2, "hostB");
  ASSERT_OK(Submit(Spec("g", "gossip", 2)));
  ASSERT_OK(Submit(Spec("h", "allreduce", 2)));
  auto tokens = [&]() {
    std::map<std::string, std::string> out;  // "job/rank" -> token
    for (const char* node : {"a0", "b0"}) {
      HeartbeatResponse hb = Beat(node);
      for (const Task& t : hb.tasks()) {
        EXPECT_EQ(t.rank_token().size(), 64u) << t.job_id();
        EXPECT_EQ(t.rank_token_hashes_size(), 2) << t.job_id();
        if (t.rank_token_hashes_size() == 2) {
          EXPECT_EQ(t.rank_token_hashes(t.index()), Sha256(t.rank_token()));
        }
        out[absl::StrCat(t.job_id(), "/", t.index())] = t.rank_token();
      }
    }
    return out;
  };
  const std::map<std::string, std::string> first = tokens();
  ASSERT_EQ(first.size(), 4u);
  std::set<std::string> distinct;
  for (const auto& [key, token] : first) distinct.insert(token);
  EXPECT_EQ(distinct.size(), 4u);
  // Every rank's hashes name the same tokens: rank 0's list holds rank 1's hash.
  HeartbeatResponse hb = Beat(WorkerNodes(Get("g"))[0]);
  for (const Task& t : hb.tasks()) {
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(t.rank_token_hashes(r), Sha256(first.at(absl::StrCat(t.job_id(), "/", r))));
    }
  }
  EXPECT_EQ(tokens(), first);
  const std::string status = Get("g").DebugString();
  for (const auto& [key, token] : first) EXPECT_EQ(status.find(token), std::string::npos);
  ASSERT_NO_FATAL_FAILURE(Start());  // Restart: the same tokens (their secret is stored).
  EXPECT_EQ(tokens(), first);
}

TEST_F(CoordinatorTest, RefusalsSayWhatToFixAndChangeNothing) {
  Register("s0", SERVER);
  Register("w0", WORKER);
  Register("w1", WORKER);
  EXPECT_STATUS_MSG(Submit(Spec("big", "async", 3)), absl::StatusCode::kFailedPrecondition,
                    "job needs 3 workers but the alive worker nodes offer 2 slots (w0: 1, w1: 1); "
                    "start more gradmesh_worker --coordinator=... daemons or lower num_workers");
  EXPECT_STATUS_MSG(Submit(Spec("shardy", "sync", 1, 2)), absl::StatusCode::kFailedPrecondition,
                    "job needs 2 shards on distinct server nodes but only 1 alive server nodes "
                    "have a free slot (s0: 1); start more gradmesh_server");
  JobSpec bad = Spec("badmodel", "async", 1);
  bad.mutable_model()->set_name("resnet");
  EXPECT_STATUS_MSG(Submit(bad), absl::StatusCode::kInvalidArgument,
                    "job spec: unknown model \"resnet\" (known: lenet, mlp, torchscript)");
  bad.mutable_model()->set_name("torchscript");
  EXPECT_STATUS_MSG(Submit(bad), absl::StatusCode::kInvalidArgument,
                    "model \"torchscript\" needs model.path");
  bad = Spec("baddata", "async", 1);
  bad.mutable_dataset()->set_name("cifar10");
  EXPECT_STATUS_MSG(Submit(bad), absl::StatusCode::kInvalidArgument,
                    "unknown dataset \"cifar10\" (known: fashion-mnist, mnist, tensors)");
  EXPECT_STATUS_MSG(Submit(Spec("m", "hogwild", 1)), absl::StatusCode::kInvalidArgument,
                    "mode \"hogwild\"");
  // Dry run: placement on paper, nothing stored, no token.
  ASSERT_OK_AND_ASSIGN(JobStatus dry, Submit(Spec("dry", "async", 2), /*dry_run=*/true));
  EXPECT_EQ(WorkerNodes(dry), (Strings{"w0", "w1"}));
  EXPECT_EQ(dry.job_token(), "");
  EXPECT_TRUE(core_->ListJobs().empty());
  EXPECT_STATUS(core_->GetJob("dry"), absl::StatusCode::kNotFound);
  EXPECT_EQ(Beat("w0").tasks_size(), 0);

  ASSERT_OK(Submit(Spec("j", "async", 1)));
  EXPECT_STATUS_MSG(Submit(Spec("j", "async", 1)), absl::StatusCode::kAlreadyExists,
                    "job \"j\" already exists (PENDING); choose another name");
  EXPECT_STATUS_MSG(Submit(Spec("j", "async", 1), false, /*resume=*/true),
                    absl::StatusCode::kAlreadyExists,
                    "job \"j\" is PENDING; only a job that ended");
  ASSERT_EQ(core_->ListJobs().size(), 1u);
  EXPECT_EQ(Get("j").job_token(), "tok-1");
  EXPECT_STATUS_MSG(core_->GetJob("nope"), absl::StatusCode::kNotFound, "job \"nope\" not found");
  EXPECT_STATUS_MSG(core_->CancelJob("nope"), absl::StatusCode::kNotFound, "job \"nope\"");
}

TEST_F(CoordinatorTest, BadNodeRequestsAreRejected) {
  RegisterRequest req;
  EXPECT_STATUS_MSG(core_->Register(req, Creds(req.node().name())),
                    absl::StatusCode::kInvalidArgument, "node.name");
  req.mutable_node()->set_name("x");
  EXPECT_STATUS_MSG(core_->Register(req, Creds(req.node().name())),
                    absl::StatusCode::kInvalidArgument,
                    "node x: node.role must be SERVER or WORKER");
  req.mutable_node()->set_role(WORKER);
  EXPECT_STATUS_MSG(core_->Register(req, Creds(req.node().name())),
                    absl::StatusCode::kInvalidArgument, "node.address");
  req.mutable_node()->set_address("a:1");
  EXPECT_STATUS_MSG(core_->Register(req, Creds(req.node().name())),
                    absl::StatusCode::kInvalidArgument,
                    "node x: node.slots must be in 1..1024, got 0");
  EXPECT_STATUS(core_->Heartbeat(HeartbeatRequest(), {}), absl::StatusCode::kInvalidArgument);
  // Unknown node: register again.
  EXPECT_TRUE(Beat("ghost").register_again());
  // A node holding a job cannot change role.
  Register("w0", WORKER);
  ASSERT_OK(Submit(Spec("j", "gossip", 1)));
  req.mutable_node()->set_name("w0");
  req.mutable_node()->set_role(SERVER);
  req.mutable_node()->set_slots(1);
  EXPECT_STATUS_MSG(core_->Register(req, Creds(req.node().name())),
                    absl::StatusCode::kFailedPrecondition,
                    "node \"w0\" is registered as WORKER and placed in job j");
}

// Node and job names follow the name rule (common/job_name.h) at Register and SubmitJob;
// a refused name changes nothing.
TEST_F(CoordinatorTest, NamesBreakingTheRuleAreRefused) {
  const std::vector<std::string> bad = {"..",
                                        "a/b",
                                        "a/../../b",
                                        std::string(64, 'n'),
                                        "W0",
                                        "w_0",
                                        "w0.example.com",
                                        "-w0",
                                        "j\xc3\xb6"
                                        "b"};
  for (const std::string& name : bad) {
    RegisterRequest req;
    req.mutable_node()->set_name(name);
    req.mutable_node()->set_role(WORKER);
    req.mutable_node()->set_address("a:1");
    req.mutable_node()->set_slots(1);
    EXPECT_STATUS_MSG(core_->Register(req, Creds(name)), absl::StatusCode::kInvalidArgument,
                      "node.name \"")
        << name;
    EXPECT_STATUS_MSG(Submit(Spec(name, "async", 1)), absl::StatusCode::kInvalidArgument,
                      "job spec: name \"")
        << name;
  }
  EXPECT_TRUE(core_->ListNodes().empty());
  EXPECT_TRUE(core_->ListJobs().empty());
}

TEST_F(CoordinatorTest, EmptyNameIsGenerated) {
  Register("w0", WORKER);
  ASSERT_OK_AND_ASSIGN(JobStatus st, Submit(Spec("", "gossip", 1)));
  EXPECT_EQ(st.job_id().rfind(absl::StrCat("job-", clock_.NowMs() / 1000, "-"), 0), 0u)
      << st.job_id();
  EXPECT_EQ(st.job_id().size(), absl::StrCat("job-", clock_.NowMs() / 1000, "-abcd").size());
  EXPECT_EQ(st.spec().name(), st.job_id());
}

TEST_F(CoordinatorTest, ReportsDriveStateAndProgress) {
  Cluster();
  ASSERT_OK(Submit(Spec("j", "async", 2, 1)));
  TaskReport r0 = Report("j", 0, "running", 10);
  r0.set_loss(2.0);
  r0.set_samples_per_s(100);
  Beat("w0", {r0});
  JobStatus st = Get("j");
  EXPECT_EQ(st.state(), PENDING);  // Rank 1 has not reported yet.
  EXPECT_EQ(st.workers(0).state(), "running");
  EXPECT_EQ(st.workers(0).step(), 10);
  EXPECT_EQ(st.progress().step(), 0);  // Min over ranks: rank 1 is at 0.

  clock_.AdvanceMs(1000);
  TaskReport r1 = Report("j", 1, "running", 6);
  r1.set_loss(1.0);
  r1.set_samples_per_s(50);
  r1.set_checkpoint_step(4);
  r0.set_checkpoint_step(8);
  Beat("w0", {r0});
  Beat("w1", {r1});
  st = Get("j");
  EXPECT_EQ(st.state(), RUNNING);
  EXPECT_EQ(st.progress().step(), 6);
  EXPECT_EQ(st.progress().total_steps(), 100);
  EXPECT_EQ(st.progress().epoch(), 1);
  EXPECT_DOUBLE_EQ(st.progress().loss(), 1.5);
  EXPECT_DOUBLE_EQ(st.progress().samples_per_s(), 150);
  EXPECT_EQ(st.progress().accuracy(), -1);
  EXPECT_EQ(st.progress().test_loss(), -1);
  EXPECT_EQ(st.progress().perplexity(), -1);
  EXPECT_EQ(st.progress().checkpoint_step(), 4);
  // Step samples: 0 at the first report, 6 one second later: 6 steps/s, 94 left.
  EXPECT_DOUBLE_EQ(st.progress().eta_s(), 94.0 / 6.0);
  // A report without a loss or a rate (a run resumed at its last step trains nothing) keeps
  // the rank's figures: they used to become 0, and the job's mean loss with them.
  TaskReport bare = Report("j", 1, "running", 6);
  bare.set_checkpoint_step(4);
  Beat("w1", {bare});
  EXPECT_DOUBLE_EQ(Get("j").progress().loss(), 1.5);
  EXPECT_DOUBLE_EQ(Get("j").progress().samples_per_s(), 150);
  // A restarted run that has not restored yet reports no step, total or epoch: the rank
  // keeps its last ones (the job's progress used to fall to step 0 at every restart).
  TaskReport restarting = Report("j", 1, "running");
  restarting.clear_step();
  restarting.set_total_steps(0);
  restarting.set_epoch(0);
  Beat("w1", {restarting});
  EXPECT_EQ(Get("j").workers(1).step(), 6);
  EXPECT_EQ(Get("j").progress().step(), 6);
  EXPECT_EQ(Get("j").progress().total_steps(), 100);
  EXPECT_EQ(Get("j").progress().epoch(), 1);

  // 2 s later rank 1 is at 26 and rank 0, now the slowest, at 10: 10 steps in the 3 s
  // window, 90 left -> 27 s.
  clock_.AdvanceMs(2000);
  r1.set_step(26);
  Beat("w1", {r1});
  EXPECT_EQ(Get("j").progress().step(), 10);
  EXPECT_NEAR(Get("j").progress().eta_s(), 27.0, 1e-9);

  // Stalled: no step for more than the 30 s window while the ranks still heartbeat their
  // last rates: samples/s 0 and the ETA unknown, until the step moves again.
  for (int i = 0; i < 31; ++i) {  // Heartbeats every second, as live daemons do.
    clock_.AdvanceMs(1000);
    Beat("w0", {r0});
    Beat("w1", {r1});
    for (const char* idle : {"w2", "s0", "s1"}) Beat(idle);
    if (i == 20) EXPECT_GT(Get("j").progress().eta_s(), 27.0);  // The rate decays meanwhile.
  }
  EXPECT_EQ(Get("j").progress().samples_per_s(), 0);
  EXPECT_EQ(Get("j").progress().eta_s(), -1);
  clock_.AdvanceMs(1000);
  r0.set_step(40);
  Beat("w0", {r0});
  EXPECT_DOUBLE_EQ(Get("j").progress().samples_per_s(), 150);
  EXPECT_GT(Get("j").progress().eta_s(), 0);
  r0.set_step(10);  // As the rest of this test expects.
  Beat("w0", {r0});

  // Reports from a node that does not hold the rank are ignored.
  Beat("w2", {Report("j", 0, "failed", 99)});
  EXPECT_EQ(Get("j").state(), RUNNING);
  EXPECT_EQ(Get("j").workers(0).step(), 10);

  // Rank 1 finishes: no longer in w1's task list; rank 0 evaluates and finishes. A succeeded
  // rank's report carries its whole run's rate; once no rank runs, the job's figure sums them.
  TaskReport done1 = Report("j", 1, "succeeded", 100);
  done1.set_samples_per_s(40);
  EXPECT_EQ(Beat("w1", {done1}).tasks_size(), 0);
  EXPECT_EQ(Get("j").state(), RUNNING);
  EXPECT_DOUBLE_EQ(Get("j").progress().samples_per_s(), 100);  // Rank 0's, still running.
  TaskReport done = Report("j", 0, "succeeded", 100);
  done.set_samples_per_s(90);
  done.set_accuracy(0.97);
  done.set_test_loss(1.25);
  done.set_perplexity(3.49);
  EXPECT_EQ(Beat("w0", {done}).tasks_size(), 0);
  st = Get("j");
  EXPECT_EQ(st.state(), SUCCEEDED);
  EXPECT_DOUBLE_EQ(st.progress().accuracy(), 0.97);
  EXPECT_DOUBLE_EQ(st.progress().test_loss(), 1.25);
  EXPECT_DOUBLE_EQ(st.progress().perplexity(), 3.49);
  EXPECT_EQ(st.progress().step(), 100);
  EXPECT_EQ(st.progress().eta_s(), 0);
  EXPECT_DOUBLE_EQ(st.progress().samples_per_s(), 130);
  // The shard keeps serving the finished job (export pulls the model from it).
  HeartbeatResponse s = Beat("s0");
  ASSERT_EQ(s.tasks_size(), 1);
  EXPECT_EQ(s.tasks(0).job_id(), "j");
  // Final: cancel is refused.
  EXPECT_STATUS_MSG(core_->CancelJob("j"), absl::StatusCode::kFailedPrecondition,
                    "job \"j\" already ended (SUCCEEDED); nothing to cancel");
}

TEST_F(CoordinatorTest, FailedReportFailsTheJobAndWithdrawsTasks) {
  Cluster();
  ASSERT_OK(Submit(Spec("j", "async", 2, 1)));
  TaskReport bad = Report("j", 1, "failed", 3, /*generation=*/1);
  bad.set_message("loss is NaN at step 3");
  Beat("w1", {bad});
  JobStatus st = Get("j");
  EXPECT_EQ(st.state(), FAILED);
  EXPECT_EQ(st.message(), "rank 1 on node w1: loss is NaN at step 3");
  EXPECT_EQ(st.workers(1).state(), "failed");
  EXPECT_EQ(Beat("w0").tasks_size(), 0);
  EXPECT_EQ(Beat("s0").tasks_size(), 0);
}

// allreduce with checkpoints: a rank that lost a peer (its ring link broke before the dead
// node missed its heartbeats) starts every rank again instead of failing the job, at most
// kMaxPeerLossRestarts times; any other failure, or a job without checkpoints, fails it.
TEST_F(CoordinatorTest, AnAllreduceRankThatLostAPeerRestartsTheRanksBoundedly) {
  std::vector<std::string> nodes;
  ASSERT_NO_FATAL_FAILURE(SubmitCheckpointedAllreduce(&nodes));
  const std::string node0 = nodes[0], node1 = nodes[1];
  auto generation = [&](int rank) { return TaskGeneration(nodes[rank], "ar", rank); };
  JobStatus st;
  Beat(node0, {Report("ar", 0, "running", 20, generation(0))});
  Beat(node1, {Report("ar", 1, "running", 20, generation(1))});
  ASSERT_EQ(Get("ar").state(), RUNNING);
  for (int restart = 1; restart <= kMaxPeerLossRestarts; ++restart) {
    const int64_t g0 = generation(0), g1 = generation(1);
    TaskReport lost = Report("ar", 0, "failed", 30, g0);
    lost.set_message("UNAVAILABLE: allreduce: ring link from rank 1 (127.0.0.1:9) ended");
    Beat(node0, {lost});
    st = Get("ar");
    EXPECT_EQ(st.state(), RUNNING) << restart;
    EXPECT_EQ(st.workers(0).state(), "pending") << restart;
    // Every rank gets a new generation: both start again and resume from checkpoints.
    EXPECT_GT(generation(0), g0) << restart;
    EXPECT_GT(generation(1), g1) << restart;
  }
  // A new checkpoint since: the faults before it are over, and the count starts again.
  TaskReport past0 = Report("ar", 0, "running", 40, generation(0));
  TaskReport past1 = Report("ar", 1, "running", 40, generation(1));
  past0.set_checkpoint_step(40);
  past1.set_checkpoint_step(40);
  Beat(node0, {past0});
  Beat(node1, {past1});
  ASSERT_EQ(Get("ar").progress().checkpoint_step(), 40);
  for (int restart = 1; restart <= kMaxPeerLossRestarts; ++restart) {
    TaskReport lost = Report("ar", 0, "failed", 45, generation(0));
    lost.set_message("UNAVAILABLE: allreduce: ring link from rank 1 (127.0.0.1:9) ended");
    Beat(node0, {lost});
    EXPECT_EQ(Get("ar").state(), RUNNING) << restart;
  }
  // Then one more without a checkpoint between: the job fails.
  TaskReport lost = Report("ar", 0, "failed", 30, generation(0));
  lost.set_message("DEADLINE_EXCEEDED: allreduce: rank 1 sent nothing for 30 s");
  Beat(node0, {lost});
  st = Get("ar");
  EXPECT_EQ(st.state(), FAILED);
  EXPECT_EQ(st.message(), absl::StrCat("rank 0 on node ", node0, ": ", lost.message()));

  // Another cause, or no checkpoints to resume from: the job fails at once.
  for (const bool checkpoints : {true, false}) {
    JobSpec other = Spec(checkpoints ? "bad" : "nockpt", "allreduce", 2);
    if (checkpoints) other.mutable_checkpoint()->set_every_steps(10);
    ASSERT_OK_AND_ASSIGN(JobStatus o, Submit(other));
    const std::string node = o.workers(1).node();
    TaskReport failed = Report(other.name(), 1, "failed", 5, TaskGeneration(node, other.name(), 1));
    failed.set_message(checkpoints ? "INVALID_ARGUMENT: trainer: the loss is nan at step 5"
                                   : "UNAVAILABLE: allreduce: ring link from rank 0 ended");
    Beat(node, {failed});
    EXPECT_EQ(Get(other.name()).state(), FAILED) << other.name();
  }
}

// A rank's success counts from an earlier generation too when it ran every step: a daemon
// paused past its heartbeat timeout lost its rank, got it back (a new generation) and then
// its old run finished. A stale report that did not finish changes nothing.
TEST_F(CoordinatorTest, AStaleReportThatRanEveryStepFinishesTheRank) {
  std::vector<std::string> nodes;
  ASSERT_NO_FATAL_FAILURE(SubmitCheckpointedAllreduce(&nodes));
  const std::string node0 = nodes[0], node1 = nodes[1];
  auto generation = [&](int rank) { return TaskGeneration(nodes[rank], "ar", rank); };
  const int64_t old0 = generation(0);
  Beat(node1, {Report("ar", 1, "running", 20, generation(1))});
  // A restart (a lost peer) gives every rank a new generation.
  TaskReport lost = Report("ar", 1, "failed", 30, generation(1));
  lost.set_message("UNAVAILABLE: allreduce: ring link from rank 0 ended");
  Beat(node1, {lost});
  ASSERT_GT(generation(0), old0);
  Beat(node0, {Report("ar", 0, "succeeded", 50, old0)});  // Stale, not finished: ignored.
  EXPECT_EQ(Get("ar").workers(0).state(), "pending");
  Beat(node0, {Report("ar", 0, "succeeded", 100, old0)});  // Stale, every step: done.
  EXPECT_EQ(Get("ar").workers(0).state(), "succeeded");
  Beat(node1, {Report("ar", 1, "succeeded", 100, generation(1))});
  EXPECT_EQ(Get("ar").state(), SUCCEEDED);
}

TEST_F(CoordinatorTest, CancelWithdrawsTasks) {
  Cluster();
  ASSERT_OK(Submit(Spec("j", "async", 2, 1)));
  EXPECT_EQ(Beat("w0").tasks_size(), 1);
  ASSERT_OK_AND_ASSIGN(JobStatus st, core_->CancelJob("j"));
  EXPECT_EQ(st.state(), CANCELLED);
  EXPECT_EQ(st.message(), "cancelled by CancelJob");
  EXPECT_EQ(Beat("w0").tasks_size(), 0);
  EXPECT_EQ(Beat("s0").tasks_size(), 0);
  EXPECT_STATUS(core_->CancelJob("j"), absl::StatusCode::kFailedPrecondition);
  // Its slots are free again.
  ASSERT_OK_AND_ASSIGN(JobStatus j2, Submit(Spec("j2", "async", 3, 1)));
  EXPECT_EQ(WorkerNodes(j2), (Strings{"w0", "w1", "w2"}));
}

TEST_F(CoordinatorTest, DeadWorkerRankMovesToLeastLoadedNode) {
  Cluster();
  Register("w3", WORKER, 4);
  ASSERT_OK(Submit(Spec("j", "async", 3, 1)));      // w3, w0, w1 (w3 has 4 free slots).
  ASSERT_OK(Submit(Spec("other", "async", 1, 1)));  // w2.
  EXPECT_EQ(WorkerNodes(Get("j")), (Strings{"w3", "w0", "w1"}));
  Beat("w0", {Report("j", 1, "running", 5)});
  // w0 stops heartbeating; the others go on.
  Pass(kTimeoutMs, {"s0", "s1", "w1", "w2", "w3"});
  EXPECT_EQ(Get("j").workers(1).node(), "w0");  // 3000 ms is not yet more than the timeout.
  Pass(500, {"s0", "s1", "w1", "w2", "w3"});
  JobStatus st = Get("j");
  // Loads: w1 1/1, w2 1/1, w3 1/4: w3 is least loaded.
  EXPECT_EQ(WorkerNodes(st), (Strings{"w3", "w3", "w1"}));
  EXPECT_EQ(st.workers(1).state(), "pending");
  EXPECT_EQ(st.workers(1).reassignments(), 1);
  EXPECT_EQ(st.workers(1).address(), Addr("w3"));
  HeartbeatResponse w3 = Beat("w3");
  ASSERT_EQ(w3.tasks_size(), 2);
  EXPECT_EQ(w3.tasks(0).index(), 0);
  EXPECT_EQ(w3.tasks(0).generation(), 1);  // ps mode: only the moved rank's task changes.
  EXPECT_EQ(w3.tasks(1).index(), 1);
  EXPECT_EQ(w3.tasks(1).generation(), 2);
  // The old daemon comes back: it is told to run nothing of j, and its stale reports are
  // ignored.
  HeartbeatResponse w0 = Beat("w0", {Report("j", 1, "failed", 6, 1)});
  EXPECT_EQ(w0.tasks_size(), 0);
  EXPECT_EQ(Get("j").state(), PENDING);
  // A report of an outdated generation from the right node changes figures, not state.
  Beat("w3", {Report("j", 1, "stopped", 7, /*generation=*/1)});
  EXPECT_EQ(Get("j").workers(1).node(), "w3");
  EXPECT_EQ(Get("j").workers(1).step(), 7);
}

TEST_F(CoordinatorTest, LeavingAndStoppedMoveRanksAtOnce) {
  Cluster();
  ASSERT_OK(Submit(Spec("j", "gossip", 2)));  // w0, w1.
  // w1 leaves (SIGTERM): its rank goes to w2 at once; in gossip every rank's peers change.
  Beat("w1", {Report("j", 1, "stopped", 4, 1)}, /*leaving=*/true);
  JobStatus st = Get("j");
  EXPECT_EQ(WorkerNodes(st), (Strings{"w0", "w2"}));
  EXPECT_EQ(st.workers(1).reassignments(), 1);
  HeartbeatResponse w0 = Beat("w0");
  ASSERT_EQ(w0.tasks_size(), 1);
  EXPECT_EQ(w0.tasks(0).generation(), 2);
  EXPECT_EQ(Strings(w0.tasks(0).peers().begin(), w0.tasks(0).peers().end()),
            (Strings{Addr("w0"), Addr("w2")}));
  // Rank 0 stops on w0 without w0 leaving: no other node qualifies (w1 is gone, w2 holds rank 1
  // of this job), so the rank is lost until a worker node registers.
  Beat("w0", {Report("j", 0, "stopped", 5, 2)});
  st = Get("j");
  EXPECT_EQ(st.workers(0).state(), "lost");
  EXPECT_EQ(st.workers(0).node(), "");
  EXPECT_EQ(Beat("w0").tasks_size(), 0);
  HeartbeatResponse w2 = Beat("w2");
  ASSERT_EQ(w2.tasks_size(), 1);
  EXPECT_EQ(Strings(w2.tasks(0).peers().begin(), w2.tasks(0).peers().end()),
            (Strings{"", Addr("w2")}));
  Register("w9", WORKER);
  st = Get("j");
  EXPECT_EQ(WorkerNodes(st), (Strings{"w9", "w2"}));
  EXPECT_EQ(st.workers(0).state(), "pending");
  EXPECT_EQ(st.workers(0).reassignments(), 1);
}

TEST_F(CoordinatorTest, LostRankGoesToTheNextNodeThatRegisters) {
  Register("s0", SERVER);
  Register("w0", WORKER, 2);
  ASSERT_OK(Submit(Spec("j", "async", 2, 1)));  // Both ranks on w0.
  EXPECT_EQ(WorkerNodes(Get("j")), (Strings{"w0", "w0"}));
  Pass(kTimeoutMs + 500, {"s0"});
  JobStatus st = Get("j");
  EXPECT_EQ(st.workers(0).state(), "lost");
  EXPECT_EQ(st.workers(1).state(), "lost");
  EXPECT_EQ(st.state(), PENDING);
  Register("w5", WORKER, 1);
  st = Get("j");
  // async may exceed slots: both ranks go to the newcomer.
  EXPECT_EQ(WorkerNodes(st), (Strings{"w5", "w5"}));
  EXPECT_EQ(st.workers(1).reassignments(), 1);
  EXPECT_EQ(Beat("w5").tasks_size(), 2);
}

TEST_F(CoordinatorTest, SyncRegroupsWithoutALostRankAndFinishesWithTheSurvivors) {
  Register("s0", SERVER);
  Register("w0", WORKER);
  Register("w1", WORKER);
  Register("w2", WORKER);
  ASSERT_OK(Submit(Spec("s", "sync", 3, 1)));
  Beat("w0", {Report("s", 0, "running", 12)});
  Beat("w1", {Report("s", 1, "running", 12)});
  Beat("w2", {Report("s", 2, "running", 11)});
  EXPECT_EQ(Get("s").state(), RUNNING);
  // w2 dies. w0 and w1 have no free slot, and sync ranks do not double up: rank 2 is lost and
  // the group re-forms with ranks 0 and 1 at lr x 2/3.
  Pass(kTimeoutMs + 500, {"s0", "w0", "w1"});
  JobStatus st = Get("s");
  EXPECT_EQ(st.state(), RUNNING);
  EXPECT_EQ(st.workers(2).state(), "lost");
  EXPECT_EQ(st.active_workers(), 2);
  EXPECT_EQ(st.progress().step(), 12);  // The lost rank no longer holds the minimum.
  for (const std::string node : {"w0", "s0"}) {
    HeartbeatResponse r = Beat(node);
    ASSERT_EQ(r.tasks_size(), 1) << node;
    EXPECT_EQ(std::vector<int>(r.tasks(0).active_ranks().begin(), r.tasks(0).active_ranks().end()),
              (std::vector<int>{0, 1}))
        << node;
    EXPECT_DOUBLE_EQ(r.tasks(0).lr_scale(), 2.0 / 3.0) << node;
    EXPECT_EQ(r.tasks(0).generation(), 2) << node;
  }
  // A worker that registers later is not given the lost rank: it would start behind the
  // group's step. The job finishes with the survivors.
  Register("w7", WORKER);
  st = Get("s");
  EXPECT_EQ(st.workers(2).state(), "lost");
  EXPECT_EQ(st.active_workers(), 2);
  EXPECT_EQ(Beat("w7").tasks_size(), 0);
  Beat("w0", {Report("s", 0, "succeeded", 20)});
  EXPECT_EQ(Get("s").state(), RUNNING);
  Beat("w1", {Report("s", 1, "succeeded", 20)});
  EXPECT_EQ(Get("s").state(), SUCCEEDED);
}

// A sync group that loses its last rank has nobody left to train it: the job FAILS, saying
// so. (Its lost ranks count as out of a re-formed group, so it used to count as done:
// SUCCEEDED at step 0 with nothing trained.)
// A gossip rank lost once every other rank has finished must not keep the job RUNNING: they
// gave up on it in their final round and rank 0 published the model. It is not moved to a free
// node either, where it would train alone. Without rank 0 nobody published a model: the job
// waits for a node for it, as other modes do.
TEST_F(CoordinatorTest, AGossipJobEndsWithoutALostRankOnceRankZeroAndTheOthersFinished) {
  Register("w0", WORKER);
  Register("w1", WORKER);
  Register("w2", WORKER);
  ASSERT_OK(Submit(Spec("g", "gossip", 3)));
  EXPECT_EQ(WorkerNodes(Get("g")), (Strings{"w0", "w1", "w2"}));
  Register("w3", WORKER);  // Free.
  Beat("w0", {Report("g", 0, "succeeded", 100)});
  Beat("w1", {Report("g", 1, "succeeded", 100)});
  Beat("w2", {Report("g", 2, "running", 90)});
  EXPECT_EQ(Get("g").state(), RUNNING);
  Pass(kTimeoutMs + 500, {"w0", "w1", "w3"});  // w2 dies.
  JobStatus g = Get("g");
  EXPECT_EQ(g.workers(2).state(), "lost");
  EXPECT_EQ(g.workers(2).node(), "");
  EXPECT_EQ(g.state(), SUCCEEDED);
  EXPECT_EQ(g.message(),
            "finished without lost rank(s) 2: the other ranks averaged and published the final "
            "model without them");

  ASSERT_OK(Submit(Spec("h", "gossip", 3)));
  EXPECT_EQ(WorkerNodes(Get("h")), (Strings{"w0", "w1", "w3"}));
  Beat("w0", {Report("h", 0, "running", 3)});
  Beat("w1", {Report("h", 1, "running", 3)});
  Beat("w3", {Report("h", 2, "running", 3)});
  Pass(kTimeoutMs + 500, {"w1", "w3"});  // w0 dies: rank 0 has nowhere to go.
  Beat("w1", {Report("h", 1, "succeeded", 100)});
  Beat("w3", {Report("h", 2, "succeeded", 100)});
  JobStatus h = Get("h");
  EXPECT_EQ(h.workers(0).state(), "lost");
  EXPECT_EQ(h.state(), RUNNING) << "nobody published h's model: it waits for rank 0";
  Register("w5", WORKER);
  EXPECT_EQ(Get("h").workers(0).node(), "w5");
  Beat("w5", {Report("h", 0, "succeeded", 100)});
  h = Get("h");
  EXPECT_EQ(h.state(), SUCCEEDED);
  EXPECT_EQ(h.message(), "");
}

// Rank 0 of a gossip job lost for good: the lowest surviving rank gathers the finals in its
// place and publishes the final model, which only its node may (not another survivor's); once
// it has and the survivors have succeeded, the job ends SUCCEEDED without rank 0.
TEST_F(CoordinatorTest, AGossipJobWhoseRankZeroIsLostEndsOnceTheFallbackRootPublished) {
  Register("w0", WORKER);
  Register("w1", WORKER);
  Register("w2", WORKER);
  ASSERT_OK(Submit(Spec("g", "gossip", 3)));
  Beat("w0", {Report("g", 0, "running", 3)});
  Beat("w1", {Report("g", 1, "running", 3)});
  Beat("w2", {Report("g", 2, "running", 3)});
  Pass(kTimeoutMs + 500, {"w1", "w2"});  // w0 dies: rank 0 has nowhere to go.
  ASSERT_EQ(Get("g").workers(0).state(), "lost");
  ModelHeader h;
  h.set_job_id("g");
  h.set_kind(MODEL_STATE);
  h.set_step(100);
  h.set_final(true);
  ModelTensorInfo* t = h.add_tensors();
  t->set_name("w");
  t->add_shape(2);
  h.set_total_bytes(8);
  const std::string payload(8, '\0');
  h.set_node("w2");
  EXPECT_STATUS_MSG(core_->PublishModel(h, payload, Creds("w2")),
                    absl::StatusCode::kPermissionDenied,
                    "only the node running rank 1 publishes the model (rank 1 is on node \"w1\")");
  Beat("w2", {Report("g", 2, "succeeded", 100)});
  Beat("w1", {Report("g", 1, "succeeded", 100)});
  EXPECT_EQ(Get("g").state(), RUNNING) << "no final model yet";
  h.set_node("w1");
  ASSERT_OK(core_->PublishModel(h, payload, Creds("w1")));
  // A coordinator restart after the publish keeps the fact: the model is in its store.
  ASSERT_NO_FATAL_FAILURE(Start());
  Beat("w1", {Report("g", 1, "succeeded", 100)});
  const JobStatus g = Get("g");
  EXPECT_EQ(g.state(), SUCCEEDED);
  EXPECT_EQ(g.message(),
            "finished without lost rank(s) 0: the other ranks averaged and published the final "
            "model without them");

  // Resumed with more steps, and the coordinator restarts before this run publishes: the store
  // still holds the last run's final model, which must not end this run. With rank 0 lost
  // again and the others done, it waits for the fallback root's new final model.
  Register("w0", WORKER);
  JobSpec more = Spec("g", "gossip", 3);
  more.set_steps(200);
  ASSERT_OK(Submit(more, /*dry_run=*/false, /*resume=*/true));
  ASSERT_NO_FATAL_FAILURE(Start());
  const JobStatus resumed = Get("g");
  for (int i = 0; i < 3; ++i) Register(resumed.workers(i).node(), WORKER);
  for (int i = 0; i < 3; ++i) {
    Beat(resumed.workers(i).node(), {Report("g", i, "running", 120)});
  }
  const std::string zero = resumed.workers(0).node();
  std::vector<std::string> others = {resumed.workers(1).node(), resumed.workers(2).node()};
  Pass(kTimeoutMs + 500, others);  // Rank 0's node dies; no free node for it.
  ASSERT_EQ(Get("g").workers(0).state(), "lost");
  for (int i = 1; i < 3; ++i) {
    Beat(Get("g").workers(i).node(), {Report("g", i, "succeeded", 200)});
  }
  EXPECT_EQ(Get("g").state(), RUNNING) << "the last run's final model ended the resumed run";
}

// Publishes of a job go one at a time per kind (the service buffers each payload), and who
// publishes is checked before the header's tensors: a caller that may not publish is refused
// without the coordinator walking what it sent.
TEST_F(CoordinatorTest, PublishesGoOneAtATimeAndStrangersAreRefusedFirst) {
  Register("w0", WORKER);
  ASSERT_OK(Submit(Spec("p", "gossip", 1)));
  ModelHeader h;
  h.set_job_id("p");
  h.set_kind(MODEL_STATE);
  h.set_node("w0");
  ASSERT_OK(core_->BeginPublish(h));
  EXPECT_STATUS_MSG(core_->BeginPublish(h), absl::StatusCode::kAborted,
                    "PublishModel of job p: another publish of its MODEL_STATE is in progress");
  ModelHeader module = h;
  module.set_kind(MODEL_MODULE);
  ASSERT_OK(core_->BeginPublish(module));  // Another kind.
  core_->EndPublish(module);
  core_->EndPublish(h);
  ASSERT_OK(core_->BeginPublish(h));
  core_->EndPublish(h);
  // A malformed header (a repeated name) for an unknown job, or from a node that is not rank
  // 0's: the caller's refusal comes first.
  ModelHeader bad = h;
  for (int i = 0; i < 2; ++i) bad.add_tensors()->set_name("same");
  bad.set_job_id("nope");
  EXPECT_STATUS(core_->CheckModelHeader(bad, Creds("w0")), absl::StatusCode::kNotFound);
  bad.set_job_id("p");
  EXPECT_STATUS(core_->CheckModelHeader(bad, Creds("w0")), absl::StatusCode::kInvalidArgument);
  bad.set_node("w9");
  EXPECT_STATUS(core_->CheckModelHeader(bad, Creds("w0")), absl::StatusCode::kPermissionDenied);
}

TEST_F(CoordinatorTest, ASyncGroupThatLosesEveryRankFails) {
  ASSERT_NO_FATAL_FAILURE(StartRunningSyncJob());
  Pass(kTimeoutMs + 500, {"s0", "w1"});  // w0 dies: the group re-forms with rank 1.
  ASSERT_EQ(Get("s").state(), RUNNING);
  ASSERT_EQ(Get("s").active_workers(), 1);
  Pass(kTimeoutMs + 500, {"s0"});  // w1 dies too.
  const JobStatus st = Get("s");
  EXPECT_EQ(st.workers(0).state(), "lost");
  EXPECT_EQ(st.workers(1).state(), "lost");
  EXPECT_EQ(st.state(), FAILED);
  EXPECT_NE(st.message().find("every rank of the sync group was lost"), std::string::npos)
      << st.message();
}

// Every rank of a whole sync group lost at once (their nodes missed their heartbeats in one
// sweep: a power cut, a restart of everything) leaves no survivors to finish it. The job does
// not fail and does not re-form a group of nobody: it waits for worker nodes, placing each
// rank again on a free slot as nodes register, and the group stays whole meanwhile (a group
// of the first rank back would shut the others out for good). It used to stay RUNNING with no
// task anywhere, forever; with the nodes expiring one by one in the sweep it used to re-form
// around the second and then FAIL.
TEST_F(CoordinatorTest, ASyncGroupThatLosesEveryRankAtOnceWaitsForNodesAndResumesWhole) {
  ASSERT_NO_FATAL_FAILURE(StartRunningSyncJob());
  Pass(kTimeoutMs + 500, {"s0"});  // w0 and w1 die in the same sweep.
  JobStatus st = Get("s");
  EXPECT_EQ(st.state(), RUNNING) << st.message();
  EXPECT_EQ(st.workers(0).state(), "lost");
  EXPECT_EQ(st.workers(1).state(), "lost");
  EXPECT_EQ(st.active_workers(), 2);

  Register("w0", WORKER);  // One slot: rank 0 only; the group stays whole.
  st = Get("s");
  EXPECT_EQ(st.workers(0).node(), "w0");
  EXPECT_EQ(st.workers(1).state(), "lost");
  EXPECT_EQ(st.active_workers(), 2);
  // Not started yet: alone it would wait at the barrier for rank 1 and fail at its timeout.
  EXPECT_EQ(Beat("w0").tasks_size(), 0);
  Register("w1", WORKER);
  st = Get("s");
  EXPECT_EQ(st.workers(1).node(), "w1");
  HeartbeatResponse r = Beat("w0");
  ASSERT_EQ(r.tasks_size(), 1);
  EXPECT_EQ(r.tasks(0).index(), 0);
  EXPECT_EQ(r.tasks(0).active_ranks_size(), 0);  // Every rank.
  EXPECT_DOUBLE_EQ(r.tasks(0).lr_scale(), 1.0);
  r = Beat("w1");
  ASSERT_EQ(r.tasks_size(), 1);
  EXPECT_EQ(r.tasks(0).index(), 1);
  EXPECT_EQ(r.tasks(0).active_ranks_size(), 0);
  EXPECT_DOUBLE_EQ(r.tasks(0).lr_scale(), 1.0);
  Beat("w0", {Report("s", 0, "running", 3)});
  Beat("w1", {Report("s", 1, "running", 3)});
  EXPECT_EQ(Get("s").state(), RUNNING);

  // Whole again: a later loss re-forms the group as usual.
  Pass(kTimeoutMs + 500, {"s0", "w1"});
  st = Get("s");
  EXPECT_EQ(st.state(), RUNNING);
  EXPECT_EQ(st.active_workers(), 1);
  Beat("w1", {Report("s", 1, "succeeded", 20)});
  EXPECT_EQ(Get("s").state(), SUCCEEDED);

  // Nodes that die together expire in separate checks (their last heartbeats were apart):
  // the group re-formed around the second for a moment, and losing it too within a heartbeat
  // timeout counts as losing every rank at once.
  Register("w0", WORKER);
  ASSERT_OK(Submit(Spec("u", "sync", 2, 1)));
  const JobStatus u = Get("u");
  Beat(u.workers(0).node(), {Report("u", 0, "running", 3)});
  Beat(u.workers(1).node(), {Report("u", 1, "running", 3)});
  Pass(500, {"s0", u.workers(1).node()});  // workers(0)'s last heartbeat is 500 ms older.
  Pass(kTimeoutMs + 1000, {"s0"});
  st = Get("u");
  EXPECT_EQ(st.state(), RUNNING) << st.message();
  EXPECT_EQ(st.workers(0).state(), "lost");
  EXPECT_EQ(st.workers(1).state(), "lost");
  EXPECT_EQ(st.active_workers(), 2);
  Register(u.workers(0).node(), WORKER);
  Register(u.workers(1).node(), WORKER);
  r = Beat(u.workers(1).node());
  ASSERT_EQ(r.tasks_size(), 1);
  EXPECT_EQ(r.tasks(0).active_ranks_size(), 0);
  EXPECT_DOUBLE_EQ(r.tasks(0).lr_scale(), 1.0);
  for (int i = 0; i < 2; ++i) Beat(u.workers(i).node(), {Report("u", i, "succeeded", 9)});
  EXPECT_EQ(Get("u").state(), SUCCEEDED);

  // One rank on one node, lost: the same.
  ASSERT_OK(Submit(Spec("t", "sync", 1, 1)));
  const std::string node = Get("t").workers(0).node();
  Beat(node, {Report("t", 0, "running", 3)});
  Pass(kTimeoutMs + 500, {"s0"});
  EXPECT_EQ(Get("t").state(), RUNNING);
  EXPECT_EQ(Get("t").workers(0).state(), "lost");
  Register("w5", WORKER);
  EXPECT_EQ(Get("t").workers(0).node(), "w5");
  ASSERT_EQ(Beat("w5").tasks_size(), 1);
  Beat("w5", {Report("t", 0, "succeeded", 9)});
  EXPECT_EQ(Get("t").state(), SUCCEEDED);
}

// The monitor thread checks liveness every few ms; a gap of more than a heartbeat timeout
// between two checks means the coordinator itself did not run (SIGSTOP, a frozen machine),
// so every node gets a timeout from then to be heard from instead of all being declared dead
// at once. A node that stays silent after that is declared dead as usual.
TEST_F(CoordinatorTest, ACoordinatorThatStalledGivesNodesATimeoutBeforeDeclaringThemDead) {
  monitor_interval_ms_ = 5;
  Start();
  Register("w0", WORKER);
  auto alive = [&] {
    for (const coordinator_state::NodeRecord& n : core_->ListNodes()) {
      if (n.info().name() == "w0") return n.alive();
    }
    return false;
  };
  absl::SleepFor(absl::Milliseconds(50));  // The thread has checked at this time.
  clock_.AdvanceMs(kTimeoutMs + 4000);     // The stall: no check ran meanwhile.
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_TRUE(alive()) << "declared dead for the coordinator's own stall";
  // Silent for more than the grace (a timeout) after the stall: dead.
  for (int64_t t = 0; t <= kTimeoutMs + 1000; t += 250) {
    clock_.AdvanceMs(250);
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_FALSE(alive());
}

TEST_F(CoordinatorTest, SyncWithoutLrScalingKeepsTheRate) {
  Register("s0", SERVER);
  Register("w0", WORKER);
  Register("w1", WORKER);
  JobSpec spec = Spec("s", "sync", 2, 1);
  spec.set_sync_lr_scaling("none");
  ASSERT_OK(Submit(spec));
  Beat("w1", {}, /*leaving=*/true);
  HeartbeatResponse r = Beat("s0");
  ASSERT_EQ(r.tasks_size(), 1);
  EXPECT_EQ(std::vector<int>(r.tasks(0).active_ranks().begin(), r.tasks(0).active_ranks().end()),
            (std::vector<int>{0}));
  EXPECT_EQ(r.tasks(0).lr_scale(), 1.0);
  EXPECT_EQ(Get("s").active_workers(), 1);
}

// lr_scaling (#14) decides the factor when a sync group shrinks: sqrt of the smaller global
// batch's ratio (the lr the rule gives 1 worker over the lr it gives 2: sqrt(1/2)).
TEST_F(CoordinatorTest, SyncGroupShrinkFollowsTheLrScalingRule) {
  Register("s0", SERVER);
  Register("w0", WORKER);
  Register("w1", WORKER);
  JobSpec spec = Spec("s", "sync", 2, 1);
  spec.mutable_lr_scaling()->set_rule("sqrt");
  spec.mutable_lr_scaling()->set_base_batch_size(32);
  ASSERT_OK(Submit(spec));
  Beat("w1", {}, /*leaving=*/true);
  HeartbeatResponse r = Beat("s0");
  ASSERT_EQ(r.tasks_size(), 1);
  EXPECT_DOUBLE_EQ(r.tasks(0).lr_scale(), std::sqrt(0.5));
}

TEST_F(CoordinatorTest, DeadServerPausesJobsUntilItComesBack) {
  Cluster();
  ASSERT_OK(Submit(Spec("j", "async", 1, 2)));
  ASSERT_OK(Submit(Spec("g", "gossip", 1)));  // No shards: unaffected.
  Beat("w0", {Report("j", 0, "running", 1)});
  EXPECT_EQ(Get("j").state(), RUNNING);
  Pass(kTimeoutMs + 500, {"s0", "w0", "w1", "w2"});
  JobStatus st = Get("j");
  EXPECT_EQ(st.state(), PAUSED);
  EXPECT_EQ(st.message(),
            "shard 1 on node s1 (s1.addr:1) is down; workers wait for it to come back");
  EXPECT_FALSE(st.shards(1).alive());
  EXPECT_TRUE(st.shards(0).alive());
  EXPECT_EQ(Get("g").state(), PENDING);
  // Workers keep their task (they retry until the shard is back); shards never move.
  EXPECT_EQ(Beat("w0").tasks_size(), 1);
  EXPECT_EQ(st.shards(1).node(), "s1");

  // s1 restarts on another port under the same name.
  RegisterRequest req;
  req.mutable_node()->set_name("s1");
  req.mutable_node()->set_role(SERVER);
  req.mutable_node()->set_address("s1.addr:2");
  req.mutable_node()->set_slots(1);
  ASSERT_OK_AND_ASSIGN(RegisterResponse again, core_->Register(req, Creds(req.node().name())));
  node_tokens_["s1"] = again.node_token();  // Every registration issues a new one.
  st = Get("j");
  EXPECT_EQ(st.state(), RUNNING);
  EXPECT_EQ(st.message(), "");
  EXPECT_TRUE(st.shards(1).alive());
  EXPECT_EQ(st.shards(1).address(), "s1.addr:2");
  HeartbeatResponse w0 = Beat("w0");
  ASSERT_EQ(w0.tasks_size(), 1);
  EXPECT_EQ(Strings(w0.tasks(0).servers().begin(), w0.tasks(0).servers().end()),
            (Strings{Addr("s0"), "s1.addr:2"}));
  EXPECT_EQ(w0.tasks(0).generation(), 2);

  // A server that only stalled past the timeout and heartbeats again also resumes the job.
  Pass(kTimeoutMs + 500, {"s1", "w0", "w1", "w2"});
  EXPECT_EQ(Get("j").state(), PAUSED);
  EXPECT_EQ(Get("j").message(),
            "shard 0 on node s0 (s0.addr:1) is down; workers wait for it to come back");
  EXPECT_FALSE(Beat("s0").register_again());
  EXPECT_EQ(Get("j").state(), RUNNING);
}

// Resume needs something to resume: a job that does not exist is NOT_FOUND (nothing is
// created), and one that succeeded is refused unless the spec asks for more steps.
TEST_F(CoordinatorTest, ResumeNeedsSomethingToResume) {
  Cluster();
  EXPECT_STATUS_MSG(Submit(Spec("ghost", "gossip", 1), false, /*resume=*/true),
                    absl::StatusCode::kNotFound, "job \"ghost\" does not exist: nothing to resume");
  EXPECT_STATUS(core_->GetJob("ghost"), absl::StatusCode::kNotFound);
  ASSERT_OK(Submit(Spec("done", "gossip", 1)));
  const std::string node = Get("done").workers(0).node();
  TaskReport ok = Report("done", 0, "succeeded", 100);
  ok.set_samples_per_s(90);
  Beat(node, {ok});
  ASSERT_EQ(Get("done").state(), SUCCEEDED);
  EXPECT_STATUS_MSG(Submit(Spec("done", "gossip", 1), false, true),
                    absl::StatusCode::kFailedPrecondition,
                    "job \"done\" SUCCEEDED: nothing left to train");
  EXPECT_EQ(Get("done").state(), SUCCEEDED);
  EXPECT_DOUBLE_EQ(Get("done").progress().samples_per_s(), 90);  // Its results are kept.
  JobSpec longer = Spec("done", "gossip", 1);
  longer.set_steps(200);
  ASSERT_OK_AND_ASSIGN(JobStatus again, Submit(longer, false, true));
  EXPECT_EQ(again.state(), PENDING);
}

TEST_F(CoordinatorTest, ResumeReusesShardsAndToken) {
  Cluster();
  ASSERT_OK(Submit(Spec("j", "async", 1, 2)));
  TaskReport bad = Report("j", 0, "failed", 40);
  bad.set_message("out of memory");
  Beat("w0", {bad});
  ASSERT_EQ(Get("j").state(), FAILED);
  JobSpec spec = Spec("j", "async", 1, 1);
  EXPECT_STATUS_MSG(Submit(spec, false, true), absl::StatusCode::kFailedPrecondition,
                    "job \"j\" ran with 2 shards, which hold its state; resume it with "
                    "num_shards: 2");
  spec.set_num_shards(2);
  JobSpec more_workers = spec;
  more_workers.set_num_workers(2);
  EXPECT_STATUS_MSG(Submit(more_workers, false, true), absl::StatusCode::kFailedPrecondition,
                    "job \"j\" ran with 1 workers, which its shards' state is laid out for; "
                    "resume it with num_workers: 1");
  ASSERT_OK_AND_ASSIGN(JobStatus st, Submit(spec, false, /*resume=*/true));
  EXPECT_EQ(st.state(), PENDING);
  EXPECT_EQ(st.job_token(), "tok-1");
  EXPECT_EQ(st.shards(0).node(), "s0");
  EXPECT_EQ(st.shards(1).node(), "s1");
  EXPECT_EQ(st.message(), "");
  HeartbeatResponse s1 = Beat("s1");
  ASSERT_EQ(s1.tasks_size(), 1);
  EXPECT_EQ(s1.tasks(0).generation(), 2);
  EXPECT_EQ(core_->ListJobs().size(), 1u);
  // Resume while a shard's node is down is refused.
  ASSERT_OK(core_->CancelJob("j"));
  Pass(kTimeoutMs + 500, {"s0", "w0", "w1", "w2"});
  EXPECT_STATUS_MSG(Submit(spec, false, true), absl::StatusCode::kFailedPrecondition,
                    "resuming job \"j\" needs shard 1's node s1 (it holds the job's state), "
                    "which is not alive");
  EXPECT_EQ(Get("j").state(), CANCELLED);
  // Its name registered again by a worker daemon (no active job uses it): its address has no
  // ParameterService, so the job's state is not there either.
  Register("s1", WORKER);
  EXPECT_STATUS_MSG(Submit(spec, false, true), absl::StatusCode::kFailedPrecondition,
                    "resuming job \"j\" needs shard 1's node s1 (it holds the job's state), "
                    "which is now registered as a WORKER, not a server");
  EXPECT_EQ(Get("j").state(), CANCELLED);
}

// A heartbeat that reports many steps of one rank (a broken or hostile daemon: one report per
// step) costs time linear in its size, now and when the samples age out: the job's (time,
// step) samples for its ETA stay bounded. Reported steps beyond any job's are clamped.
TEST_F(CoordinatorTest, AFloodOfReportsInOneHeartbeatStaysCheap) {
  Cluster();
  ASSERT_OK_AND_ASSIGN(JobStatus st, Submit(Spec("flood", "gossip", 1)));
  const std::string node = st.workers(0).node();
  constexpr int kReports = 300'000;
  HeartbeatRequest req;
  req.set_node(node);
  for (int i = 1; i <= kReports; ++i) *req.add_tasks() = Report("flood", 0, "running", i);
  const absl::Time start = absl::Now();
  ASSERT_OK(core_->Heartbeat(req, Creds(node)));
  clock_.AdvanceMs(31'000);
  Beat(node, {Report("flood", 0, "running", kReports + 10)});
  // Linear work takes well under a second here; trimming the samples one erase at a time
  // took minutes.
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  EXPECT_EQ(Get("flood").progress().step(), kReports + 10);
  TaskReport huge = Report("flood", 0, "running", std::numeric_limits<int64_t>::max());
  huge.set_total_steps(std::numeric_limits<int64_t>::max());
  Beat(node, {huge});
  EXPECT_EQ(Get("flood").progress().step(), int64_t{1} << 53);
  EXPECT_EQ(Get("flood").progress().total_steps(), int64_t{1} << 53);
}

// The job's progress history: one point per new job step, downsampled at the capacity, the
// final accuracy folded into the last point, restored from the tables after a restart.
TEST_F(CoordinatorTest, HistoryIsBoundedAndRestoredAfterRestart) {
  history_capacity_ = 4;
  ASSERT_NO_FATAL_FAILURE(Start());
  Cluster();
  ASSERT_OK(Submit(Spec("j", "async", 1, 1)));
  const std::string node = WorkerNodes(Get("j"))[0];
  const int64_t t0 = clock_.NowMs();
  for (int i = 1; i <= 5; ++i) {
    clock_.AdvanceMs(1000);
    TaskReport r = Report("j", 0, "running", i * 10);
    r.set_loss(1.0 / i);
    r.set_samples_per_s(100 * i);
    Beat(node, {r});
  }
  TaskReport done = Report("j", 0, "succeeded", 50);
  done.set_loss(0.125);
  done.set_accuracy(0.97);
  Beat(node, {done});
  ASSERT_EQ(Get("j").state(), SUCCEEDED);
  ASSERT_OK_AND_ASSIGN(coordinator_state::JobHistory h, core_->GetJobHistory("j"));
  EXPECT_EQ(h.stride(), 2);
  EXPECT_EQ(h.offered(), 5);
  ASSERT_EQ(h.points_size(), 3);  // Steps 10, 30 and 50 (indices 0, 2, 4).
  const int64_t steps[] = {10, 30, 50};
  const double losses[] = {1.0, 1.0 / 3, 0.125};
  const double rates[] = {100, 300, 500};  // The final report has no rate: 500 stays.
  const double accuracies[] = {-1, -1, 0.97};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(h.points(i).step(), steps[i]) << i;
    EXPECT_EQ(h.points(i).index(), 2 * i) << i;
    EXPECT_DOUBLE_EQ(h.points(i).loss(), losses[i]) << i;
    EXPECT_DOUBLE_EQ(h.points(i).samples_per_s(), rates[i]) << i;
    EXPECT_DOUBLE_EQ(h.points(i).accuracy(), accuracies[i]) << i;
  }
  EXPECT_EQ(h.points(0).t_ms(), t0 + 1000);
  EXPECT_EQ(h.points(1).t_ms(), t0 + 3000);
  EXPECT_EQ(h.points(2).t_ms(), t0 + 5000);

  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_OK_AND_ASSIGN(coordinator_state::JobHistory restored, core_->GetJobHistory("j"));
  EXPECT_EQ(restored.SerializeAsString(), h.SerializeAsString());
  EXPECT_STATUS_MSG(core_->GetJobHistory("nope"), absl::StatusCode::kNotFound,
                    "job \"nope\" not found");
}

// Log lines from the rank's node are kept per rank (bounded), numbered across the job's
// ranks, readable after the job ended; errors for unknown jobs and ranks out of range.
TEST_F(CoordinatorTest, LogsArePerRankBoundedAndNumberedAcrossRanks) {
  Cluster();
  ASSERT_OK(Submit(Spec("j", "async", 2, 1)));
  const std::vector<std::string> nodes = WorkerNodes(Get("j"));
  TaskReport r0 = Report("j", 0, "running", 1);
  r0.add_log_lines("r0 a");
  r0.add_log_lines("r0 b");
  Beat(nodes[0], {r0});
  TaskReport r1 = Report("j", 1, "running", 1);
  r1.add_log_lines("r1 a");
  Beat(nodes[1], {r1});
  // From a node that does not hold the rank: ignored.
  TaskReport stray = Report("j", 1, "running", 1);
  stray.add_log_lines("stray");
  Beat(nodes[0], {stray});
  ASSERT_OK_AND_ASSIGN(GetLogsResponse all, core_->GetLogs("j", -1, 0));
  ASSERT_EQ(all.lines_size(), 3);
  EXPECT_EQ(all.state(), RUNNING);
  ASSERT_TRUE(all.has_last_sequence());
  EXPECT_EQ(all.last_sequence(), 3);
  const int ranks[] = {0, 0, 1};
  const char* texts[] = {"r0 a", "r0 b", "r1 a"};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(all.lines(i).rank(), ranks[i]);
    EXPECT_EQ(all.lines(i).sequence(), i + 1);
    EXPECT_EQ(all.lines(i).text(), texts[i]);
  }
  ASSERT_OK_AND_ASSIGN(GetLogsResponse one, core_->GetLogs("j", 1, 0));
  ASSERT_EQ(one.lines_size(), 1);
  EXPECT_EQ(one.lines(0).sequence(), 3);
  ASSERT_OK_AND_ASSIGN(GetLogsResponse after, core_->GetLogs("j", -1, 2));
  ASSERT_EQ(after.lines_size(), 1);
  EXPECT_EQ(after.lines(0).text(), "r1 a");
  // Bounded: 250 more lines of rank 0 keep its last 200; the final report's lines count.
  TaskReport more = Report("j", 0, "succeeded", 100);
  for (int i = 0; i < 250; ++i) more.add_log_lines(absl::StrCat("line ", i));
  Beat(nodes[0], {more});
  ASSERT_OK_AND_ASSIGN(GetLogsResponse r0_logs, core_->GetLogs("j", 0, 0));
  ASSERT_EQ(r0_logs.lines_size(), 200);
  EXPECT_EQ(r0_logs.lines(0).text(), "line 50");
  EXPECT_EQ(r0_logs.lines(0).sequence(), 54);
  EXPECT_EQ(r0_logs.lines(199).text(), "line 249");
  EXPECT_EQ(r0_logs.lines(199).sequence(), 253);
  Beat(nodes[1], {Report("j", 1, "succeeded", 100)});
  ASSERT_OK_AND_ASSIGN(GetLogsResponse done, core_->GetLogs("j", 1, 0));
  EXPECT_EQ(done.state(), SUCCEEDED);
  EXPECT_EQ(done.lines_size(), 1);
  EXPECT_STATUS_MSG(core_->GetLogs("nope", -1, 0), absl::StatusCode::kNotFound,
                    "job \"nope\" not found");
  EXPECT_STATUS_MSG(core_->GetLogs("j", 2, 0), absl::StatusCode::kInvalidArgument,
                    "rank 2 is out of range: job \"j\" has ranks 0..1 (-1 or no rank: every rank)");
  EXPECT_STATUS_MSG(core_->GetLogs("j", -2, 0), absl::StatusCode::kInvalidArgument,
                    "rank -2 is out of range");
}

TEST_F(CoordinatorTest, RestartKeepsJobsNodesAndPlacements) {
  Cluster();
  ASSERT_OK(Submit(Spec("j", "async", 2, 1)));
  ASSERT_OK(Submit(Spec("k", "gossip", 1)));
  ASSERT_OK(core_->CancelJob("k"));
  TaskReport r0 = Report("j", 0, "running", 10);
  TaskReport r1 = Report("j", 1, "running", 10);
  Beat("w0", {r0});
  Beat("w1", {r1});
  ASSERT_EQ(Get("j").state(), RUNNING);
  // Progress-only change within the 1 s write interval: written by the destructor.
  r0.set_step(20);
  r1.set_step(20);
  Beat("w0", {r0});
  Beat("w1", {r1});
  ASSERT_EQ(Get("j").progress().step(), 20);

  clock_.AdvanceMs(60'000);  // The coordinator was down for a minute.
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_EQ(core_->ListJobs().size(), 2u);
  EXPECT_EQ(core_->ListJobs()[0].job_id(), "k");  // Newest first.
  JobStatus st = Get("j");
  EXPECT_EQ(st.state(), RUNNING);
  EXPECT_EQ(st.progress().step(), 20);
  EXPECT_EQ(st.job_token(), "tok-1");
  EXPECT_EQ(WorkerNodes(st), (Strings{"w0", "w1"}));
  EXPECT_EQ(Get("k").state(), CANCELLED);
  // Grace: stored nodes count as alive; a daemon restarted under its old name gets its task.
  HeartbeatResponse w1 = Beat("w1");
  EXPECT_FALSE(w1.register_again());
  ASSERT_EQ(w1.tasks_size(), 1);
  EXPECT_EQ(w1.tasks(0).index(), 1);
  EXPECT_EQ(w1.tasks(0).job_token(), "tok-1");
  EXPECT_TRUE(Beat("never-seen").register_again());
  // A heartbeat timeout later w0 has not come back, but the restart grace (15 s: daemons
  // reconnect only after gRPC's and their own backoffs) keeps its rank in place.
  Pass(kTimeoutMs + 500, {"s0", "s1", "w1", "w2"});
  EXPECT_EQ(WorkerNodes(Get("j")), (Strings{"w0", "w1"}));
  // After the grace, nodes that did not come back are dead: rank 0 moves to w2.
  Pass(15'000, {"s0", "w1", "w2"});
  st = Get("j");
  EXPECT_EQ(WorkerNodes(st), (Strings{"w2", "w1"}));
  EXPECT_EQ(st.workers(0).reassignments(), 1);
  // And that is durable too.
  ASSERT_NO_FATAL_FAILURE(Start());
  EXPECT_EQ(WorkerNodes(Get("j")), (Strings{"w2", "w1"}));
  EXPECT_EQ(Get("j").workers(0).reassignments(), 1);
}

TEST_F(CoordinatorTest, WaitForJobChangeWakesOnChange) {
  Register("w0", WORKER);
  ASSERT_OK(Submit(Spec("g", "gossip", 1)));
  ASSERT_OK_AND_ASSIGN(Coordinator::JobView v0,
                       core_->WaitForJobChange("g", 0, absl::Now() + absl::Seconds(5)));
  EXPECT_EQ(v0.version, 1);
  // No change: times out with the same version.
  ASSERT_OK_AND_ASSIGN(Coordinator::JobView same,
                       core_->WaitForJobChange("g", 1, absl::Now() + absl::Milliseconds(50)));
  EXPECT_EQ(same.version, 1);
  std::thread reporter([this] {
    absl::SleepFor(absl::Milliseconds(50));
    Beat("w0", {Report("g", 0, "running", 3)});
  });
  ASSERT_OK_AND_ASSIGN(Coordinator::JobView next,
                       core_->WaitForJobChange("g", 1, absl::Now() + absl::Seconds(10)));
  reporter.join();
  EXPECT_EQ(next.version, 2);
  EXPECT_EQ(next.status.state(), RUNNING);
  EXPECT_STATUS(core_->WaitForJobChange("nope", 0, absl::Now()), absl::StatusCode::kNotFound);
}

// ---- Security and hardening (issue #15): node identity, bounds, reads, compaction.

// A daemon (holding the shared node token, which the service checked) can act only as the node
// whose per-node token it holds: heartbeats, reports and registrations as another node are
// PERMISSION_DENIED or ignored, and change nothing.
TEST_F(CoordinatorTest, NodesActOnlyAsThemselves) {
  const auto kDenied = absl::StatusCode::kPermissionDenied;
  Cluster();
  ASSERT_OK_AND_ASSIGN(JobStatus job, Submit(Spec("j", "async", 2, 1)));
  ASSERT_EQ(WorkerNodes(job), (Strings{"w0", "w1"}));
  ASSERT_EQ(job.shards(0).node(), "s0");
  const std::string w0_token = node_tokens_.at("w0");
  const std::string w1_token = node_tokens_.at("w1");
  ASSERT_EQ(w0_token.size(), 32u);
  ASSERT_NE(w0_token, w1_token);

  // Heartbeat as w0 with w1's token, or none: refused; w0's liveness is not refreshed.
  HeartbeatRequest as_w0;
  as_w0.set_node("w0");
  *as_w0.add_tasks() = Report("j", 0, "failed");
  EXPECT_STATUS_MSG(core_->Heartbeat(as_w0, {w1_token, ""}), kDenied,
                    "heartbeat as node \"w0\" refused: wrong node token");
  EXPECT_STATUS_MSG(core_->Heartbeat(as_w0, {}), kDenied, "no node token");
  EXPECT_EQ(Get("j").workers(0).state(), "pending");
  EXPECT_EQ(Get("j").state(), PENDING);

  // w1 reports w0's rank failed and s0's shard failed (as itself): ignored, not its tasks.
  Beat("w1", {Report("j", 0, "failed"), Report("j", 0, "succeeded")});
  // s1 reports shard 0 (on s0) failed: ignored too.
  Beat("s1", {Report("j", 0, "failed")});
  JobStatus st = Get("j");
  EXPECT_EQ(st.state(), PENDING);
  EXPECT_EQ(st.workers(0).state(), "pending");

  // Re-registering live w0 with w1's token (to take its address) or no token: refused, the
  // placement keeps w0's address.
  RegisterRequest take;
  take.mutable_node()->set_name("w0");
  take.mutable_node()->set_role(WORKER);
  take.mutable_node()->set_address("evil:1");
  take.mutable_node()->set_slots(8);
  EXPECT_STATUS_MSG(core_->Register(take, {w1_token, ""}), kDenied,
                    "registering as node \"w0\" refused: wrong node token");
  EXPECT_STATUS_MSG(core_->Register(take, {}), kDenied,
                    "is alive (w0.addr:1): its own daemon keeps its token");
  EXPECT_EQ(Get("j").workers(0).address(), Addr("w0"));
  for (const auto& n : core_->ListNodes()) {
    if (n.info().name() == "w0") EXPECT_EQ(n.info().slots(), 1);
  }

  // A transport-proved name (mTLS) for another node is refused whatever the token.
  EXPECT_STATUS_MSG(core_->Heartbeat(as_w0, {w0_token, "w1"}), kDenied,
                    "certificate is for node \"w1\"");
  EXPECT_STATUS(core_->Register(take, {w0_token, "w1"}), kDenied);
  // With its own proved name no token is needed.
  HeartbeatRequest plain;
  plain.set_node("w0");
  EXPECT_OK(core_->Heartbeat(plain, {"", "w0"}));

  // w0's own daemon re-registers with its token (a restart with a kept token): admitted
  // while alive, with a new token that locks out the old one.
  RegisterRequest own = take;
  own.mutable_node()->set_address(Addr("w0"));
  own.mutable_node()->set_slots(1);
  ASSERT_OK_AND_ASSIGN(RegisterResponse again, core_->Register(own, {w0_token, ""}));
  ASSERT_EQ(again.node_token().size(), 32u);
  EXPECT_NE(again.node_token(), w0_token);
  HeartbeatRequest beat;
  beat.set_node("w0");
  EXPECT_STATUS(core_->Heartbeat(beat, {w0_token, ""}), kDenied);
  EXPECT_OK(core_->Heartbeat(beat, {again.node_token(), ""}));
  node_tokens_["w0"] = again.node_token();

  // A node may fail only its own tasks: s0 fails shard 0.
  Beat("s0", {Report("j", 0, "failed")});
  EXPECT_EQ(Get("j").state(), FAILED);
  EXPECT_EQ(Get("j").message(), "shard 0 on node s0: ");
}

// A daemon restarted without its token gets its name back once the old registration is dead
// (here: a clean leave, then a timeout); the old token stops working; the token survives a
// coordinator restart, and only its hash is stored.
TEST_F(CoordinatorTest, NodeTokenLifecycle) {
  Register("w0", WORKER);
  Register("w1", WORKER);
  const std::string first = node_tokens_.at("w0");
  // Restart of the core: the stored hash keeps the token valid.
  Start();
  HeartbeatRequest hb;
  hb.set_node("w0");
  ASSERT_OK_AND_ASSIGN(HeartbeatResponse r, core_->Heartbeat(hb, {first, ""}));
  EXPECT_FALSE(r.register_again());

  // w0 leaves cleanly (dead at once): a new daemon without the token may take the name.
  Beat("w0", {}, /*leaving=*/true);
  RegisterRequest req;
  req.mutable_node()->set_name("w0");
  req.mutable_node()->set_role(WORKER);
  req.mutable_node()->set_address("w0.addr:2");
  req.mutable_node()->set_slots(1);
  ASSERT_OK_AND_ASSIGN(RegisterResponse second, core_->Register(req, {}));
  ASSERT_EQ(second.node_token().size(), 32u);
  EXPECT_NE(second.node_token(), first);
  EXPECT_STATUS(core_->Heartbeat(hb, {first, ""}), absl::StatusCode::kPermissionDenied);
  EXPECT_OK(core_->Heartbeat(hb, {second.node_token(), ""}));

  // A crashed daemon (no leave): refused while the name is alive, accepted once it is dead.
  EXPECT_STATUS(core_->Register(req, {}), absl::StatusCode::kPermissionDenied);
  Pass(kTimeoutMs + 500, {"w1"});
  ASSERT_OK_AND_ASSIGN(RegisterResponse third, core_->Register(req, {}));
  EXPECT_EQ(third.node_token().size(), 32u);

  // The tables hold the SHA-256 of the current token, never a token.
  core_.reset();
  ASSERT_OK_AND_ASSIGN(auto store, CoordinatorStore::Open(dir_, {}));
  ASSERT_OK_AND_ASSIGN(auto nodes, store->LoadNodes());
  bool found = false;
  for (const auto& n : nodes) {
    if (n.info().name() != "w0") continue;
    found = true;
    EXPECT_EQ(n.token_sha256(), Sha256(third.node_token()));
    for (const std::string& t : {first, second.node_token(), third.node_token()}) {
      EXPECT_EQ(n.SerializeAsString().find(t), std::string::npos);
    }
  }
  EXPECT_TRUE(found);
}

// Bounds: registrations and specs outside the limits are INVALID_ARGUMENT (the placement of
// 2^31 slots or workers used to allocate ~1 GB and answer UNKNOWN).
TEST_F(CoordinatorTest, HugeSlotsAndCountsAreRefused) {
  RegisterRequest req;
  req.mutable_node()->set_name("big");
  req.mutable_node()->set_role(WORKER);
  req.mutable_node()->set_address("big:1");
  req.mutable_node()->set_slots(2147483647);
  EXPECT_STATUS_MSG(core_->Register(req, {}), absl::StatusCode::kInvalidArgument,
                    "node big: node.slots must be in 1..1024, got 2147483647");
  req.mutable_node()->set_slots(1);
  req.mutable_node()->set_cores(-1);
  EXPECT_STATUS_MSG(core_->Register(req, {}), absl::StatusCode::kInvalidArgument,
                    "node.cores and node.gpus must be in 0..1024");
  req.mutable_node()->set_cores(0);
  req.mutable_node()->set_address(std::string(300, 'a'));
  EXPECT_STATUS_MSG(core_->Register(req, {}), absl::StatusCode::kInvalidArgument,
                    "node.address is 300 bytes; at most 256");
  EXPECT_TRUE(core_->ListNodes().empty());

  Register("w0", WORKER, 1024);
  Register("s0", SERVER, 1024);
  JobSpec spec = Spec("huge", "async", 2147483647, 1);
  EXPECT_STATUS_MSG(Submit(spec, /*dry_run=*/true), absl::StatusCode::kInvalidArgument,
                    "job spec: num_workers: 2147483647 is out of range [1, 1024]");
  spec = Spec("huge", "async", 1, 10000000);
  EXPECT_STATUS_MSG(Submit(spec, /*dry_run=*/true), absl::StatusCode::kInvalidArgument,
                    "job spec: num_shards: 10000000 is out of range [1, 256]");
  // The largest allowed job is placed (slots permitting) without trouble.
  ASSERT_OK_AND_ASSIGN(JobStatus dry, Submit(Spec("max", "async", 1024, 1), true));
  EXPECT_EQ(dry.workers_size(), 1024);
}

// Submit validates the whole spec (coordinator side: the push codec; the rest is
// ValidateJobSpec, tested in common/job_spec_test): INVALID_ARGUMENT naming the field.
TEST_F(CoordinatorTest, SubmitRefusesInvalidSpecsNamingTheField) {
  Register("w0", WORKER);
  Register("s0", SERVER);
  struct Case {
    std::function<void(JobSpec*)> edit;
    std::string says;
  };
  const std::vector<Case> cases = {
      {[](JobSpec* s) { s->mutable_optimizer()->set_lr(1e39); },
       "job spec: optimizer.lr: 1e+39 is not a finite float32"},
      {[](JobSpec* s) { s->mutable_optimizer()->set_lr(1e-50); },
       "job spec: optimizer.lr: 1e-50 must be > 0 (and > 0 as a float32)"},
      {[](JobSpec* s) { s->mutable_optimizer()->set_name("lion"); },
       "job spec: optimizer.name: \"lion\" is not one of adam, adamw, sgd"},
      {[](JobSpec* s) { s->mutable_compression()->set_push("zip"); },
       "job spec: compression.push: \"zip\""},
      {[](JobSpec* s) { s->set_barrier_timeout_s(std::nan("")); },
       "job spec: barrier_timeout_s: nan is not a finite float32"},
      {[](JobSpec* s) { s->mutable_gossip()->set_codec("zstd"); }, "gossip.codec \"zstd\""},
      {[](JobSpec* s) { s->set_mode("ssp:x"); }, "mode \"ssp:x\""},
  };
  for (const Case& c : cases) {
    JobSpec spec = Spec("bad", "async", 1, 1);
    c.edit(&spec);
    EXPECT_STATUS_MSG(Submit(spec), absl::StatusCode::kInvalidArgument, c.says);
  }
  // Unknown fields in a spec sent as protobuf bytes (a newer client).
  JobSpec spec = Spec("bad", "async", 1, 1);
  spec.mutable_optimizer()
      ->GetReflection()
      ->MutableUnknownFields(spec.mutable_optimizer())
      ->AddVarint(99, 1);
  EXPECT_STATUS_MSG(Submit(spec), absl::StatusCode::kInvalidArgument,
                    "job spec: unknown field number 99 in optimizer");
  EXPECT_TRUE(core_->ListJobs().empty());
  JobSpec good = Spec("good", "async", 1, 1);
  good.mutable_compression()->set_push("topk:0.01+fp16");
  EXPECT_OK(Submit(good));
}

// Read calls neither run failure checks nor write: a node past its timeout stays alive for
// GetJob/ListJobs/ListNodes/GetJobHistory/GetLogs, and RocksDB sees no write, until a write
// path (the monitor's CheckNodes here) decides.
TEST_F(CoordinatorTest, ReadsDoNotWrite) {
  Register("w0", WORKER);
  Register("w1", WORKER);
  ASSERT_OK(Submit(Spec("g", "gossip", 1)));
  clock_.AdvanceMs(kTimeoutMs * 3);  // No heartbeats: both are overdue.
  const int64_t writes = store_->writes();
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(core_->GetJob("g"));
    EXPECT_EQ(core_->ListJobs().size(), 1u);
    ASSERT_OK(core_->GetJobHistory("g"));
    ASSERT_OK(core_->GetLogs("g", -1, 0));
    for (const auto& n : core_->ListNodes()) EXPECT_TRUE(n.alive()) << n.info().name();
  }
  EXPECT_EQ(store_->writes(), writes);
  EXPECT_EQ(Get("g").workers(0).node(), "w0");
  core_->CheckNodes();
  EXPECT_GT(store_->writes(), writes);
  for (const auto& n : core_->ListNodes()) EXPECT_FALSE(n.alive()) << n.info().name();
}

// Finished jobs are compacted by count (oldest ended first) and by age, from memory and
// RocksDB; until then GetJob works and a SUCCEEDED job's shard keeps its task (export).
TEST_F(CoordinatorTest, FinishedJobsAreCompacted) {
  retention_ms_ = 60'000;
  max_finished_jobs_ = 2;
  Start();
  Register("s0", SERVER, 8);
  Register("w0", WORKER, 8);
  for (const char* id : {"a", "b", "c", "live"}) ASSERT_OK(Submit(Spec(id, "async", 1, 1)));
  // "a" succeeds first, then b and c are cancelled, 1 s apart.
  Beat("w0", {Report("a", 0, "succeeded", 100)});
  ASSERT_EQ(Get("a").state(), SUCCEEDED);
  EXPECT_EQ(Beat("s0").tasks_size(), 4);  // a's shard still serves the final model.
  for (const char* id : {"b", "c"}) {
    clock_.AdvanceMs(1000);
    ASSERT_OK(core_->CancelJob(id));
  }
  EXPECT_EQ(core_->CompactJobs(), 1);  // Three finished, two kept: the oldest (a) goes.
  EXPECT_STATUS(core_->GetJob("a"), absl::StatusCode::kNotFound);
  ASSERT_OK(core_->GetJob("b"));
  ASSERT_OK(core_->GetJob("c"));
  EXPECT_EQ(Beat("s0").tasks_size(), 1);  // Only "live" now (a compacted; b, c cancelled).
  EXPECT_EQ(core_->CompactJobs(), 0);

  clock_.AdvanceMs(59'000);  // b ended 60 s ago (not more), c 59 s.
  EXPECT_EQ(core_->CompactJobs(), 0);
  clock_.AdvanceMs(1);
  EXPECT_EQ(core_->CompactJobs(), 1);  // b
  clock_.AdvanceMs(1'000);
  EXPECT_EQ(core_->CompactJobs(), 1);  // c
  ASSERT_EQ(core_->ListJobs().size(), 1u);
  EXPECT_EQ(core_->ListJobs()[0].job_id(), "live");

  // Gone from RocksDB too; the id is free again; the active job is untouched.
  Start();
  EXPECT_STATUS(core_->GetJob("a"), absl::StatusCode::kNotFound);
  EXPECT_STATUS(core_->GetJob("b"), absl::StatusCode::kNotFound);
  EXPECT_EQ(Get("live").state(), PENDING);
  Register("s0", SERVER, 8);
  Register("w0", WORKER, 8);
  EXPECT_OK(Submit(Spec("a", "async", 1, 1)));
}

}  // namespace
}  // namespace gradmesh
