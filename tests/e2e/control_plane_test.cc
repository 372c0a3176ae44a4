// End-to-end tests of the control plane, through the `gradmesh` CLI, with every daemon a real
// process on 127.0.0.1: gradmesh_coordinator (with an API token), gradmesh_server shards and
// gradmesh_worker daemons in service mode (--coordinator), training the MNIST MLP.
//
// * A job submitted with `gradmesh submit` and followed with `gradmesh watch` succeeds with
//   test accuracy >= 0.97; calls without the token are refused.
// * A worker daemon killed (or preempted with SIGTERM) mid-job (async): its rank moves to the
//   other daemon, resumes where
//   the shards recorded it, and every rank's data is trained to the last step.
// * A sync job whose worker dies with no free slot elsewhere re-forms its barrier group with
//   the survivors (lr scaled 2/3 on the shards) and finishes.
// * An allreduce job with checkpoints whose worker daemon is killed: the ranks start again,
//   rank 1 moves to the spare daemon, they resume from the checkpoints and finish.
// * A gossip job whose rank 0's worker daemon is killed with no node to move it to: the
//   others take the lost peer in place (no restart), rank 1 gathers and publishes in its
//   place, and the job ends SUCCEEDED without it.
// * A worker daemon killed and started again at once keeps its rank: it proves it is the
//   node with the token it kept (no wait for its old registration to be declared dead).
// * The coordinator killed and restarted mid-job: it still knows the job and its progress,
//   and the job completes.
// * Every process stopped mid-job, then restarted: the job resumes from the shards'
//   checkpoint (the resumed step is the checkpoint's) and reaches the accuracy bar.
// * Bad specs (unknown model, negative batch, unknown field, too many workers) are refused
//   with messages that say what to fix, and nothing is created.
// * A gossip job placed by the coordinator: its ranks' peer services take only the job's
//   token (from the coordinator's task): a caller without it is UNAUTHENTICATED, one with
//   another token PERMISSION_DENIED, while the ranks mix with each other and the job succeeds.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "common/status_testing.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "proto/coordinator.pb.h"
#include "proto/gossip.grpc.pb.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/testing/subprocess.h"

namespace gradmesh {
namespace e2e {
namespace {

using testutil::LinesWith;
using testutil::LogField;
using testutil::ReadFile;
using testutil::RunfilePath;
using testutil::WaitForPortFile;

constexpr char kToken[] = "s3cret-token";

// Exit code and combined output of one CLI run.
struct CliResult {
  int code = -1;
  std::string out;
};

class ControlPlaneTest : public E2eHarness {
 protected:
  void SetUp() override {
    E2eHarness::SetUp();
    if (!HaveMnist()) GTEST_SKIP() << "MNIST not installed under " << DataDir();
    ASSERT_OK_AND_ASSIGN(coordinator_bin_, RunfilePath("coordinator/gradmesh_coordinator"));
    ASSERT_OK_AND_ASSIGN(cli_bin_, RunfilePath("cli/gradmesh"));
    token_file_ = dir_ + "/token";
    std::ofstream(token_file_) << kToken << "\n";
    ASSERT_OK_AND_ASSIGN(coordinator_port_, PickFreePort());
    coordinator_ = absl::StrCat("127.0.0.1:", coordinator_port_);
  }

  // Starts (or restarts) the coordinator on coordinator_port_ with its table in <dir>/coord.
  void StartCoordinator(int heartbeat_timeout_ms = 2000) {
    const std::string pf = absl::StrCat(dir_, "/coord.port", starts_++);
    ASSERT_OK_AND_ASSIGN(
        coord_proc_,
        Subprocess::Start(
            {coordinator_bin_, "--host=127.0.0.1", absl::StrCat("--port=", coordinator_port_),
             "--port_file=" + pf, "--data_dir=" + dir_ + "/coord",
             "--auth_token_file=" + token_file_, "--heartbeat_interval_ms=300",
             absl::StrCat("--heartbeat_timeout_ms=", heartbeat_timeout_ms), "--node=coordinator",
             "--metrics_port=0", "--metrics_port_file=" + dir_ + "/coordinator.metrics"},
            ChildEnv(), NewLog(absl::StrCat("coordinator", starts_))));
    ASSERT_OK(WaitForPortFile(pf, absl::Seconds(60), coord_proc_.get()).status());
  }

  // A shard daemon in service mode named `name` on `port` (0: any), state in <dir>/<name>.
  std::unique_ptr<Subprocess> StartServiceServer(const std::string& name, int port = 0) {
    const std::string pf = absl::StrCat(dir_, "/", name, ".port", starts_++);
    auto p = Subprocess::Start(
        {server_bin_, "--host=127.0.0.1", absl::StrCat("--port=", port), "--port_file=" + pf,
         "--node=" + name, "--data_dir=" + dir_ + "/" + name, "--coordinator=" + coordinator_,
         "--auth_token_file=" + token_file_, "--metrics_port=0",
         "--metrics_port_file=" + dir_ + "/" + name + ".metrics"},
        ChildEnv(), NewLog(absl::StrCat(name, "-", starts_)));
    EXPECT_OK(p);
    if (!p.ok()) return nullptr;
    EXPECT_OK(WaitForPortFile(pf, absl::Seconds(60), p->get()).status());
    return std::move(p).value();
  }

  // A worker daemon in service mode named `name`, with `extra` flags.
  std::unique_ptr<Subprocess> StartServiceWorker(const std::string& name,
                                                 const std::vector<std::string>& extra = {}) {
    const std::string pf = absl::StrCat(dir_, "/", name, ".port", starts_++);
    std::vector<std::string> argv = {worker_bin_,
                                     "--host=127.0.0.1",
                                     "--peer_port=0",
                                     "--port_file=" + pf,
                                     "--node=" + name,
                                     "--coordinator=" + coordinator_,
                                     "--auth_token_file=" + token_file_,
                                     "--data_dir=" + DataDir(),
                                     "--checkpoint_dir=" + dir_ + "/ckpt",
                                     "--metrics_port=0",
                                     "--metrics_port_file=" + dir_ + "/" + name + ".metrics"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto p = Subprocess::Start(argv, ChildEnv(), NewLog(absl::StrCat(name, "-", starts_)));
    EXPECT_OK(p);
    if (!p.ok()) return nullptr;
    EXPECT_OK(WaitForPortFile(pf, absl::Seconds(60), p->get()).status());
    return std::move(p).value();
  }

  // GET /metrics of the daemon `name` (its --metrics_port_file is <dir>/<name>.metrics):
  // the response body, or "" (a test failure) if it cannot be fetched.
  std::string Scrape(const std::string& name) {
    const std::string text = ReadFile(absl::StrCat(dir_, "/", name, ".metrics"));
    int port = 0;
    EXPECT_TRUE(absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port)) << name << ": " << text;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    std::string out;
    if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
      const std::string req = "GET /metrics HTTP/1.1\r\nHost: e2e\r\n\r\n";
      (void)!write(fd, req.data(), req.size());
      char buf[4096];
      ssize_t r;
      while ((r = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(r));
    }
    close(fd);
    EXPECT_TRUE(absl::StartsWith(out, "HTTP/1.1 200 OK\r\n")) << name << ": " << out;
    const size_t body = out.find("\r\n\r\n");
    return body == std::string::npos ? "" : out.substr(body + 4);
  }

  // The value of the sample line starting with `series` ("name{labels}") in `text`; NaN if
  // there is none.
  static double Sample(const std::string& text, const std::string& series) {
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      if (absl::StartsWith(line, series + " ")) {
        double v;
        if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
      }
    }
    return std::nan("");
  }

  // Runs the CLI with `args` (the coordinator and token flags added unless `bare`).
  CliResult Cli(std::vector<std::string> args, absl::Duration timeout = absl::Seconds(60),
                bool bare = false) {
    std::vector<std::string> argv = {cli_bin_};
    if (!bare) {
      argv.push_back("--coordinator=" + coordinator_);
      argv.push_back("--auth_token_file=" + token_file_);
    }
    argv.insert(argv.end(), args.begin(), args.end());
    const std::string log = absl::StrCat(dir_, "/cli", cli_runs_++, ".out");
    CliResult r;
    auto p = Subprocess::Start(argv, ChildEnv(), log);
    EXPECT_OK(p);
    if (!p.ok()) return r;
    auto code = (*p)->Wait(timeout);
    EXPECT_OK(code) << "gradmesh " << absl::StrJoin(args, " ") << " did not end";
    r.code = code.ok() ? *code : -1000;
    r.out = ReadFile(log);
    return r;
  }

  // `gradmesh status JOB --json` parsed; a failed call is a test failure and an empty status.
  JobStatus Status(const std::string& job) {
    CliResult r = Cli({"status", job, "--json"});
    EXPECT_EQ(r.code, 0) << r.out;
    JobStatus s;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &s).ok()) << r.out;
    return s;
  }

  // Polls the job's status until `pred` holds (true) or `timeout` passes (false).
  bool WaitForStatus(const std::string& job, const std::function<bool(const JobStatus&)>& pred,
                     absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      CliResult r = Cli({"status", job, "--json"});
      JobStatus s;
      if (r.code == 0 && google::protobuf::util::JsonStringToMessage(r.out, &s).ok() && pred(s)) {
        return true;
      }
      absl::SleepFor(absl::Milliseconds(500));
    }
    return false;
  }

  // `gradmesh submit spec`, retried while the daemons are still registering (the coordinator
  // refuses a job it cannot place yet) for up to 30 s.
  CliResult SubmitWhenPlaced(const std::string& spec) {
    CliResult submit;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    do {
      submit = Cli({"submit", spec});
      if (submit.code == 0) break;
      absl::SleepFor(absl::Milliseconds(500));
    } while (absl::Now() < deadline);
    return submit;
  }

  // Starts the coordinator, 2 service-mode shards (s0, s1) and 2 worker daemons (w0, w1).
  void StartCluster(int heartbeat_timeout_ms = 2000) {
    StartCoordinator(heartbeat_timeout_ms);
    s0_ = StartServiceServer("s0");
    s1_ = StartServiceServer("s1");
    w0_ = StartServiceWorker("w0");
    w1_ = StartServiceWorker("w1");
  }

  // The MNIST MLP job the tests run: 2 workers, 2 shards, async, Adam with a cosine schedule.
  static std::string MlpSpec(const std::string& name, int epochs, const std::string& extra = "") {
    return absl::StrCat("name: ", name, "\n", R"(model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: adam, lr: 0.001, lr_schedule: cosine}
batch_size: 64
mode: async
num_workers: 2
num_shards: 2
seed: 1
log_every: 25
)",
                        "epochs: ", epochs, "\n", extra);
  }

  void LoseWorkerMidJob(int sig, const std::string& job);

  // Submits `spec` (job `job`) and waits until the job is past step `step` with its `workers`
  // ranks placed; `*node` is then the node running rank `rank` (the one a test kills).
  void SubmitAndAwaitStep(const std::string& spec, const std::string& job, int64_t step,
                          int workers, int rank, std::string* node) {
    const CliResult submit = SubmitWhenPlaced(spec);
    ASSERT_EQ(submit.code, 0) << submit.out;
    ASSERT_TRUE(WaitForStatus(
        job,
        [&](const JobStatus& s) {
          if (s.progress().step() < step || s.workers_size() < workers) return false;
          *node = s.workers(rank).node();
          return true;
        },
        absl::Minutes(3)));
  }

  // The worker daemon named `name`: w0, w1, or `w2` (started by the tests that need a third).
  Subprocess* WorkerDaemon(const std::string& name, Subprocess* w2 = nullptr) {
    return name == "w0" ? w0_.get() : name == "w1" ? w1_.get() : w2;
  }

  std::string coordinator_bin_, cli_bin_, token_file_, coordinator_;
  int coordinator_port_ = 0;
  std::unique_ptr<Subprocess> coord_proc_;
  std::unique_ptr<Subprocess> s0_, s1_, w0_, w1_;
  int starts_ = 0;
  int cli_runs_ = 0;
};

TEST_F(ControlPlaneTest, SubmitAndWatchThroughTheCliReachesAccuracy) {
  StartCluster();

  // Without the API token the coordinator refuses.
  CliResult anon = Cli({"--coordinator=" + coordinator_, "list"}, absl::Seconds(30), true);
  EXPECT_EQ(anon.code, 1) << anon.out;
  EXPECT_TRUE(absl::StrContains(anon.out, "UNAUTHENTICATED")) << anon.out;

  // Daemons register within a few heartbeats; submit once both workers are there.
  const std::string spec = WriteYaml("mlp", MlpSpec("mlp-e2e", 2));
  const CliResult submit = SubmitWhenPlaced(spec);
  ASSERT_EQ(submit.code, 0) << submit.out;
  EXPECT_TRUE(absl::StrContains(submit.out, "mlp-e2e")) << submit.out;

  // While it trains, the worker daemons' /metrics show their rank's progress.
  ASSERT_TRUE(WaitForStatus(
      "mlp-e2e", [](const JobStatus& s) { return s.progress().step() >= 100; }, absl::Minutes(3)));
  for (const char* w : {"w0", "w1"}) {
    const std::string m = Scrape(w);
    // Running, or (on a fast machine) already done.
    auto ranks = [&m](const std::string& state) {
      const double v = Sample(m, "gradmesh_worker_ranks{state=\"" + state + "\"}");
      return std::isnan(v) ? 0.0 : v;
    };
    EXPECT_EQ(ranks("running") + ranks("succeeded"), 1) << w << ":\n" << m;
    double step = std::nan("");
    for (int rank = 0; rank < 2 && std::isnan(step); ++rank) {
      step =
          Sample(m, absl::StrCat("gradmesh_worker_step{job_id=\"mlp-e2e\",rank=\"", rank, "\"}"));
    }
    EXPECT_GE(step, 50) << w << ":\n" << m;
  }

  CliResult watch = Cli({"watch", "mlp-e2e"}, absl::Minutes(5));
  EXPECT_EQ(watch.code, 0) << watch.out;
  EXPECT_TRUE(absl::StrContains(watch.out, "SUCCEEDED")) << watch.out;
  // Not a terminal: plain lines, no carriage returns.
  EXPECT_FALSE(absl::StrContains(watch.out, "\r")) << watch.out;

  const JobStatus st = Status("mlp-e2e");
  EXPECT_EQ(st.state(), SUCCEEDED);
  EXPECT_GE(st.progress().accuracy(), 0.97) << st.DebugString();
  EXPECT_EQ(st.progress().step(), st.progress().total_steps());
  EXPECT_EQ(st.workers_size(), 2);
  EXPECT_EQ(st.shards_size(), 2);
  // Ranks spread over both worker daemons, shards over both servers.
  EXPECT_NE(st.workers(0).node(), st.workers(1).node());
  EXPECT_NE(st.shards(0).node(), st.shards(1).node());

  CliResult list = Cli({"list"});
  EXPECT_EQ(list.code, 0) << list.out;
  EXPECT_TRUE(absl::StrContains(list.out, "mlp-e2e")) << list.out;
  EXPECT_TRUE(absl::StrContains(list.out, "SUCCEEDED")) << list.out;

  // The coordinator's and the shards' /metrics agree with what the job did.
  const std::string cm = Scrape("coordinator");
  EXPECT_EQ(Sample(cm, "gradmesh_coordinator_jobs{state=\"succeeded\"}"), 1) << cm;
  EXPECT_EQ(Sample(cm, "gradmesh_coordinator_jobs{state=\"running\"}"), 0) << cm;
  EXPECT_EQ(Sample(cm, "gradmesh_coordinator_nodes{role=\"server\",alive=\"true\"}"), 2) << cm;
  EXPECT_EQ(Sample(cm, "gradmesh_coordinator_nodes{role=\"worker\",alive=\"true\"}"), 2) << cm;
  for (const ShardPlacement& shard : st.shards()) {
    ASSERT_OK_AND_ASSIGN(JobInfoResponse info, GetJobInfo(shard.address(), "mlp-e2e"));
    const std::string m = Scrape(shard.node());
    const std::string labels = absl::StrCat("{job_id=\"mlp-e2e\",shard=\"", shard.shard(), "\"");
    EXPECT_EQ(Sample(m, "gradmesh_shard_pushes_applied" + labels + "}"),
              static_cast<double>(info.pushes_applied()))
        << m;
    EXPECT_GT(info.pushes_applied(), 0);
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(Sample(m, absl::StrCat("gradmesh_shard_worker_last_step", labels, ",worker=\"",
                                       rank, "\"}")),
                static_cast<double>(st.progress().total_steps() - 1))
          << m;
    }
  }
}

// A worker daemon that goes away mid-job (SIGKILL: missed heartbeats; SIGTERM: preemption,
// it stops its rank after the current step and says it is leaving): its rank moves to the
// other daemon, resumes where the shards recorded it, and every rank trains to the end.
void ControlPlaneTest::LoseWorkerMidJob(int sig, const std::string& job) {
  StartCluster();
  const std::string spec = WriteYaml("mlp", MlpSpec(job, 2));

  // Kill the daemon running rank 1 once the job is well under way.
  std::string victim_node;
  ASSERT_NO_FATAL_FAILURE(SubmitAndAwaitStep(spec, job, 200, 2, 1, &victim_node));
  Subprocess* victim = WorkerDaemon(victim_node);
  ASSERT_OK(victim->Signal(sig));
  if (sig == SIGTERM) {
    // Preempted: it leaves cleanly and promptly, reporting its rank stopped.
    ASSERT_OK_AND_ASSIGN(int code, victim->Wait(absl::Seconds(20)));
    EXPECT_EQ(code, 0);
    const std::string log = ReadFile(victim->log_path());
    EXPECT_EQ(LinesWith(log, "state=stopped").size(), 1u) << log;
    EXPECT_EQ(LinesWith(log, "leaving=true").size(), 1u) << log;
  }

  CliResult watch = Cli({"watch", job}, absl::Minutes(5));
  EXPECT_EQ(watch.code, 0) << watch.out;
  const JobStatus st = Status(job);
  ASSERT_EQ(st.state(), SUCCEEDED) << st.DebugString();
  EXPECT_GE(st.workers(1).reassignments(), 1) << st.DebugString();
  EXPECT_NE(st.workers(1).node(), victim_node);
  EXPECT_GE(st.progress().accuracy(), 0.96) << st.DebugString();

  // Every rank's data was trained to its last step on both shards.
  for (const ShardPlacement& shard : st.shards()) {
    ASSERT_OK_AND_ASSIGN(JobInfoResponse info, GetJobInfo(shard.address(), job));
    ASSERT_EQ(info.workers_size(), 2);
    for (const WorkerState& w : info.workers()) {
      EXPECT_EQ(w.last_step(), st.progress().total_steps() - 1) << "rank " << w.worker();
      EXPECT_TRUE(w.finished()) << "rank " << w.worker();
    }
  }
}

TEST_F(ControlPlaneTest, GossipPeerServicesTakeOnlyTheJobsToken) {
  StartCluster();
  const std::string spec = WriteYaml("gossip", R"(name: gossip-svc
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: adam, lr: 0.001}
batch_size: 64
mode: gossip
num_workers: 2
steps: 3000
seed: 1
log_every: 25
gossip: {topology: exponential, every_steps: 1, timeout_s: 2}
)");
  const CliResult submit = SubmitWhenPlaced(spec);
  ASSERT_EQ(submit.code, 0) << submit.out;
  ASSERT_TRUE(WaitForStatus(
      "gossip-svc", [](const JobStatus& s) { return s.progress().step() >= 25; },
      absl::Minutes(3)));
  const JobStatus running = Status("gossip-svc");
  ASSERT_EQ(running.workers_size(), 2);
  int probed = 0;
  for (int rank = 0; rank < 2; ++rank) {
    auto stub = GossipService::NewStub(
        grpc::CreateChannel(running.workers(rank).address(), grpc::InsecureChannelCredentials()));
    auto get_state = [&](const char* token) {
      GossipStateRequest req;
      req.set_job("gossip-svc");
      req.set_rank(rank);
      GossipStateResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
      if (token != nullptr) ctx.AddMetadata("x-gradmesh-job-token", token);
      return stub->GetState(&ctx, req, &resp).error_code();
    };
    const grpc::StatusCode none = get_state(nullptr);
    // NOT_FOUND only if the rank already finished (a very fast machine).
    if (none != grpc::StatusCode::NOT_FOUND) {
      ++probed;
      EXPECT_EQ(none, grpc::StatusCode::UNAUTHENTICATED) << "rank " << rank;
      EXPECT_EQ(get_state("not-the-job-token"), grpc::StatusCode::PERMISSION_DENIED)
          << "rank " << rank;
    }
  }
  EXPECT_GE(probed, 1) << "both ranks had finished before the probe";
  CliResult watch = Cli({"watch", "gossip-svc"}, absl::Minutes(5));
  EXPECT_EQ(watch.code, 0) << watch.out;
  const JobStatus st = Status("gossip-svc");
  EXPECT_EQ(st.state(), SUCCEEDED) << st.DebugString();
  EXPECT_EQ(st.progress().step(), 3000);
}

TEST_F(ControlPlaneTest, KilledWorkerRankMovesAndNoDataIsDropped) {
  LoseWorkerMidJob(SIGKILL, "killed");
}

TEST_F(ControlPlaneTest, PreemptedWorkerLeavesCleanlyAndItsRankMoves) {
  LoseWorkerMidJob(SIGTERM, "preempted");
}

// A worker daemon killed and started again at once under its name (a crash-looping process, a
// pod restarted with its volume) proves it is the same node with the token it kept
// (--node_token_store, by default in its --checkpoint_dir): it registers again at once, its
// rank stays on it and resumes where the shards recorded it. It used to be refused until the
// old registration was declared dead, and the rank moved away.
TEST_F(ControlPlaneTest, ACrashedWorkerStartedAgainKeepsItsRank) {
  // Time enough for the new process to start (LibTorch's libraries load for seconds on a
  // busy machine) before its old registration would be declared dead: without the kept token
  // the new daemon is refused until then, whatever the timeout.
  StartCluster(/*heartbeat_timeout_ms=*/15000);
  const std::string spec = WriteYaml("mlp", MlpSpec("crashed", 2));
  std::string victim_node;
  ASSERT_NO_FATAL_FAILURE(SubmitAndAwaitStep(spec, "crashed", 200, 2, 1, &victim_node));
  std::unique_ptr<Subprocess>& victim = victim_node == "w0" ? w0_ : w1_;
  ASSERT_OK(victim->Signal(SIGKILL));
  ASSERT_OK(victim->Wait(absl::Seconds(20)).status());
  victim = StartServiceWorker(victim_node);
  ASSERT_NE(victim, nullptr);

  CliResult watch = Cli({"watch", "crashed"}, absl::Minutes(5));
  EXPECT_EQ(watch.code, 0) << watch.out;
  const JobStatus st = Status("crashed");
  ASSERT_EQ(st.state(), SUCCEEDED) << st.DebugString();
  EXPECT_EQ(st.workers(1).node(), victim_node) << st.DebugString();
  EXPECT_EQ(st.workers(1).reassignments(), 0) << st.DebugString();
  EXPECT_GE(st.progress().accuracy(), 0.96) << st.DebugString();
  const std::string log = ReadFile(victim->log_path());
  EXPECT_EQ(LinesWith(log, "event=node_token_restored").size(), 1u) << log;
  EXPECT_TRUE(LinesWith(log, "PERMISSION_DENIED").empty()) << log;
  EXPECT_EQ(LinesWith(log, "event=task_start").size(), 1u) << log;  // Its rank, resumed.
  const std::string coordinator_log = ReadFile(coord_proc_->log_path());
  EXPECT_TRUE(LinesWith(coordinator_log, "event=node_down").empty()) << coordinator_log;
  EXPECT_EQ(LinesWith(coordinator_log, "event=node_registered").size(), 1u) << coordinator_log;
}

TEST_F(ControlPlaneTest, SyncJobReformsItsGroupWhenAWorkerDies) {
  StartCluster();
  auto w2 = StartServiceWorker("w2");
  const std::string spec = WriteYaml(
      // 3 epochs (936 steps): long enough that the kill at step 50 lands well before the end
      // on a quiet machine too (1 epoch once finished before the coordinator saw step 50).
      "sync", absl::StrReplaceAll(MlpSpec("elastic", 3), {{"mode: async", "mode: sync"},
                                                          {"num_workers: 2", "num_workers: 3"}}));
  std::string victim_node;
  ASSERT_NO_FATAL_FAILURE(SubmitAndAwaitStep(spec, "elastic", 50, 3, 2, &victim_node));
  Subprocess* victim = WorkerDaemon(victim_node, w2.get());
  ASSERT_OK(victim->Signal(SIGKILL));

  // No worker has a free slot: the group re-forms with the two survivors, which finish the job.
  CliResult watch = Cli({"watch", "elastic"}, absl::Minutes(5));
  EXPECT_EQ(watch.code, 0) << watch.out;
  const JobStatus st = Status("elastic");
  ASSERT_EQ(st.state(), SUCCEEDED) << st.DebugString();
  EXPECT_EQ(st.active_workers(), 2);
  EXPECT_EQ(st.workers(2).state(), "lost");
  EXPECT_GT(st.progress().accuracy(), 0.9) << st.DebugString();
  for (const ShardPlacement& shard : st.shards()) {
    ASSERT_OK_AND_ASSIGN(JobInfoResponse info, GetJobInfo(shard.address(), "elastic"));
    EXPECT_EQ(std::vector<int32_t>(info.active_workers().begin(), info.active_workers().end()),
              (std::vector<int32_t>{0, 1}));
    EXPECT_FLOAT_EQ(info.lr_scale(), 2.0 / 3.0);
    // The survivors trained every step; the lost rank stopped where it died.
    EXPECT_EQ(info.workers(0).last_step(), st.progress().total_steps() - 1);
    EXPECT_EQ(info.workers(1).last_step(), st.progress().total_steps() - 1);
    EXPECT_LT(info.workers(2).last_step(), st.progress().total_steps() - 1);
  }
}

// gossip under the coordinator: SIGKILL of the daemon running rank 0, with no node to move it
// to. The survivors take the lost peer's empty address in place (they neither restart from
// step 0 nor fail on a peer without an address); rank 1, having given up delivering its final
// to rank 0, gathers the finals in its place and publishes the model, and the job ends
// SUCCEEDED without rank 0 (it failed, and later stayed RUNNING, before).
TEST_F(ControlPlaneTest, GossipJobFinishesWithoutAKilledWorkersRank) {
  StartCluster();
  auto w2 = StartServiceWorker("w2");
  const std::string spec = WriteYaml("gossip-killed", R"(name: gossip-killed
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: adam, lr: 0.001}
batch_size: 64
mode: gossip
num_workers: 3
steps: 3000
seed: 1
log_every: 25
gossip: {topology: exponential, every_steps: 1, timeout_s: 2}
)");
  std::string victim_node;
  ASSERT_NO_FATAL_FAILURE(SubmitAndAwaitStep(spec, "gossip-killed", 200, 3, 0, &victim_node));
  ASSERT_OK(WorkerDaemon(victim_node, w2.get())->Signal(SIGKILL));
  CliResult watch = Cli({"watch", "gossip-killed"}, absl::Minutes(5));
  EXPECT_EQ(watch.code, 0) << watch.out;
  const JobStatus st = Status("gossip-killed");
  ASSERT_EQ(st.state(), SUCCEEDED) << st.DebugString();
  EXPECT_EQ(st.message(),
            "finished without lost rank(s) 0: the other ranks averaged and published the final "
            "model without them");
  EXPECT_EQ(st.workers(0).state(), "lost");
  EXPECT_GT(st.progress().accuracy(), 0.9) << st.DebugString();
  for (int rank : {1, 2}) {
    EXPECT_EQ(st.workers(rank).step(), 3000) << rank;
    const std::string log = ReadFile(WorkerDaemon(st.workers(rank).node(), w2.get())->log_path());
    // One run, from step 0 to the end: the new peers were taken in place.
    EXPECT_EQ(LinesWith(log, "event=task_start").size(), 1u) << log;
    EXPECT_NE(log.find("event=task_group_changed"), std::string::npos) << log;
    EXPECT_NE(log.find("state=succeeded steps=3000"), std::string::npos) << log;
    // Rank 1 gathered in rank 0's place; rank 2 delivered its final to it.
    EXPECT_EQ(LinesWith(log, "event=final_root_fallback").size(), rank == 1 ? 1u : 0u) << log;
  }
  const std::string coordinator_log = ReadFile(coord_proc_->log_path());
  EXPECT_EQ(LinesWith(coordinator_log,
                      absl::StrCat("publisher=", st.workers(1).node(), " step=3000 final=true"))
                .size(),
            1u)
      << coordinator_log;
}

// allreduce under the coordinator, with checkpoints: SIGKILL of the daemon running rank 1.
// The survivor's ring link breaks (UNAVAILABLE) well before the dead node misses its
// heartbeats; the coordinator starts the ranks again instead of failing the job, moves rank 1
// to the spare daemon when its node is declared dead, and the ranks resume from their
// checkpoints and finish.
TEST_F(ControlPlaneTest, AllreduceJobWithCheckpointsSurvivesAKilledWorker) {
  StartCluster();
  auto w2 = StartServiceWorker("w2");
  const std::string spec = WriteYaml("allreduce", R"(name: ar-killed
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: sgd, lr: 0.05, momentum: 0.9}
batch_size: 64
mode: allreduce
num_workers: 2
epochs: 8
seed: 1
log_every: 25
checkpoint: {every_steps: 100}
)");
  // The ring's default timeout (30 s): a survivor's run that waits on the dead peer must be
  // ended by the restart, not by the timeout.
  std::string victim_node;
  ASSERT_NO_FATAL_FAILURE(SubmitAndAwaitStep(spec, "ar-killed", 250, 2, 1, &victim_node));
  Subprocess* victim = WorkerDaemon(victim_node, w2.get());
  ASSERT_OK(victim->Signal(SIGKILL));

  CliResult watch = Cli({"watch", "ar-killed"}, absl::Minutes(5));
  EXPECT_EQ(watch.code, 0) << watch.out;
  const JobStatus st = Status("ar-killed");
  ASSERT_EQ(st.state(), SUCCEEDED) << st.DebugString();
  EXPECT_GE(st.workers(1).reassignments(), 1) << st.DebugString();
  EXPECT_NE(st.workers(1).node(), victim_node);
  EXPECT_EQ(st.progress().step(), st.progress().total_steps());
  EXPECT_GT(st.progress().accuracy(), 0.95) << st.DebugString();
  const std::string coordinator_log = ReadFile(coord_proc_->log_path());
  EXPECT_GE(LinesWith(coordinator_log, "event=job_restarting").size(), 1u) << coordinator_log;
  // Rank 0's daemon first restarted its rank with the dead daemon's address (the restart
  // comes before the dead node is noticed); when rank 1 moved (a new generation) that run,
  // waiting for the dead peer, was aborted at once. It used to wait out the ring's 30 s
  // timeout and fail with DEADLINE_EXCEEDED before the ranks could start again.
  const std::string survivor_log =
      ReadFile(WorkerDaemon(st.workers(0).node(), w2.get())->log_path());
  EXPECT_TRUE(LinesWith(survivor_log, "DEADLINE_EXCEEDED").empty()) << survivor_log;
  std::cout << LinesWith(survivor_log, "event=task_aborting").size()
            << " runs of rank 0 aborted for a new generation\n";
}

TEST_F(ControlPlaneTest, RestartedCoordinatorKnowsTheJobAndItCompletes) {
  StartCluster();
  const std::string spec = WriteYaml("mlp", MlpSpec("restarted", 2));
  const CliResult submit = SubmitWhenPlaced(spec);
  ASSERT_EQ(submit.code, 0) << submit.out;
  int64_t before = 0;
  ASSERT_TRUE(WaitForStatus(
      "restarted",
      [&](const JobStatus& s) {
        before = s.progress().step();
        return before >= 100;
      },
      absl::Minutes(3)));
  // The coordinator persists progress at most once a second per job: give it that second, so
  // the kill cannot land before the job's first progress write (seen on a loaded machine).
  absl::SleepFor(absl::Milliseconds(1500));

  ASSERT_OK(coord_proc_->Signal(SIGKILL));
  ASSERT_OK(coord_proc_->Wait(absl::Seconds(10)).status());
  absl::SleepFor(absl::Seconds(2));  // Workers train on without it.
  StartCoordinator();
  // Straight from its table: the job, its spec and its progress (saved at most ~1 s before
  // the kill, so at least the 100 steps seen earlier minus that second's).
  const JobStatus after = Status("restarted");
  EXPECT_EQ(after.job_id(), "restarted");
  EXPECT_GT(after.progress().step(), 0) << after.DebugString();
  EXPECT_EQ(after.spec().num_workers(), 2);
  EXPECT_EQ(after.workers_size(), 2);
  // The workers trained on meanwhile, and their heartbeats bring it up to date.
  EXPECT_TRUE(WaitForStatus(
      "restarted", [&](const JobStatus& s) { return s.progress().step() > before; },
      absl::Seconds(30)));

  CliResult watch = Cli({"watch", "restarted"}, absl::Minutes(5));
  EXPECT_EQ(watch.code, 0) << watch.out;
  EXPECT_EQ(Status("restarted").state(), SUCCEEDED);
}

// A job cancelled and resumed at once: the worker daemon's run of the cancelled task is still
// ending (its step is slow) when the resumed task arrives, which reads the same but for its
// generation. That run must end and a new one start: taken in place, as a re-formed sync group
// is, the ending run reported "stopped" under the new generation, the coordinator moved the
// rank off the daemon, found no other, and the job waited for a node forever.
TEST_F(ControlPlaneTest, CancelledThenResumedAtOnceStartsAFreshRun) {
  StartCoordinator();
  s0_ = StartServiceServer("s0");
  w0_ = StartServiceWorker("w0", {"--step_delay_ms=700"});
  const std::string spec = WriteYaml("slow", R"(name: slow
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: sgd, lr: 0.05}
batch_size: 32
steps: 12
mode: async
num_workers: 1
num_shards: 1
log_every: 1
)");
  const CliResult submit = SubmitWhenPlaced(spec);
  ASSERT_EQ(submit.code, 0) << submit.out;
  ASSERT_TRUE(WaitForStatus(
      "slow", [](const JobStatus& s) { return s.progress().step() >= 2; }, absl::Minutes(2)));
  const CliResult cancel = Cli({"cancel", "slow"});
  ASSERT_EQ(cancel.code, 0) << cancel.out;
  const CliResult resume = Cli({"submit", spec, "--resume"});
  ASSERT_EQ(resume.code, 0) << resume.out;
  const CliResult watch = Cli({"watch", "slow"}, absl::Minutes(2));
  EXPECT_EQ(watch.code, 0) << watch.out;
  const JobStatus st = Status("slow");
  EXPECT_EQ(st.state(), SUCCEEDED) << st.DebugString();
  EXPECT_EQ(st.workers(0).node(), "w0");
  // (The coordinator started once: its log is coordinator1.log.)
  EXPECT_TRUE(LinesWith(ReadFile(dir_ + "/coordinator1.log"), "event=rank_lost").empty());
}

TEST_F(ControlPlaneTest, FullStopThenResumeFromCheckpoint) {
  ASSERT_OK_AND_ASSIGN(int p0, PickFreePort());
  ASSERT_OK_AND_ASSIGN(int p1, PickFreePort());
  StartCoordinator();
  auto s0 = StartServiceServer("s0", p0);
  auto s1 = StartServiceServer("s1", p1);
  auto w0 = StartServiceWorker("w0");
  auto w1 = StartServiceWorker("w1");
  const std::string spec =
      WriteYaml("mlp", MlpSpec("resumed", 2, "checkpoint: {every_steps: 100}\n"));
  const CliResult submit = SubmitWhenPlaced(spec);
  ASSERT_EQ(submit.code, 0) << submit.out;

  // Wait for a checkpoint (the shards' snapshot at 100 steps of both workers).
  int64_t checkpoint_update = 0;
  ASSERT_TRUE(WaitForStatus(
      "resumed",
      [&](const JobStatus& s) {
        if (s.progress().step() < 350 || s.shards_size() < 2) return false;
        auto info = GetJobInfo(s.shards(0).address(), "resumed");
        if (!info.ok() || info->snapshot_update() == 0) return false;
        checkpoint_update = info->snapshot_update();
        return true;
      },
      absl::Minutes(3)));
  // Every 100 steps of 2 workers: about every 200 updates (async pushes race the snapshot's
  // start, so it may hold an update or two more).
  EXPECT_GE(checkpoint_update, 200);

  // Stop everything, hard.
  for (Subprocess* p : {w0.get(), w1.get(), s0.get(), s1.get(), coord_proc_.get()}) {
    ASSERT_OK(p->Signal(SIGKILL));
    ASSERT_OK(p->Wait(absl::Seconds(10)).status());
  }

  // Restart every process with the same names, data directories and shard ports.
  StartCoordinator();
  s0 = StartServiceServer("s0", p0);
  s1 = StartServiceServer("s1", p1);
  // The shards restored the checkpoint: each rank must resume right after the last step both
  // shards hold for it.
  std::vector<int64_t> expected_first(2, INT64_MAX);
  for (int port : {p0, p1}) {
    ASSERT_OK_AND_ASSIGN(JobInfoResponse info,
                         GetJobInfo(absl::StrCat("127.0.0.1:", port), "resumed"));
    EXPECT_TRUE(info.restored());
    EXPECT_GE(info.updates_applied(), 200);  // At least the first checkpoint.
    ASSERT_EQ(info.workers_size(), 2);
    for (const WorkerState& w : info.workers()) {
      expected_first[w.worker()] = std::min(expected_first[w.worker()], w.last_step() + 1);
    }
  }
  w0 = StartServiceWorker("w0");
  w1 = StartServiceWorker("w1");
  CliResult watch = Cli({"watch", "resumed"}, absl::Minutes(5));
  EXPECT_EQ(watch.code, 0) << watch.out;
  const JobStatus st = Status("resumed");
  EXPECT_EQ(st.state(), SUCCEEDED) << st.DebugString();
  EXPECT_GE(st.progress().accuracy(), 0.97) << st.DebugString();

  // Each rank resumed exactly at the checkpoint's step (not from 0).
  int resumed = 0;
  for (const std::string& log : logs_) {
    if (!absl::StrContains(log, "/w")) continue;
    for (const std::string& line : LinesWith(ReadFile(log), "event=resuming")) {
      if (LogField(line, "job") != "resumed") continue;
      ++resumed;
      const int64_t rank = ToInt(LogField(line, "rank"));
      ASSERT_TRUE(rank == 0 || rank == 1) << line;
      EXPECT_GT(expected_first[rank], 0);
      EXPECT_EQ(ToInt(LogField(line, "step")), expected_first[rank]) << line;
    }
  }
  EXPECT_EQ(resumed, 2);
}

TEST_F(ControlPlaneTest, BadSpecsAreRefusedAndChangeNothing) {
  StartCluster();
  absl::SleepFor(absl::Seconds(2));  // Let the daemons register.

  struct Case {
    std::string name, yaml;
    int code;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      // The CLI checks a spec before sending it (exit 2, a usage error); the coordinator
      // checks again (coordinator_test).
      {"unknown-model",
       absl::StrReplaceAll(MlpSpec("bad1", 1), {{"{name: mlp}", "{name: resnet}"}}),
       2,
       {"resnet", "known: lenet, mlp, torchscript"}},
      {"negative-batch",
       absl::StrReplaceAll(MlpSpec("bad2", 1), {{"batch_size: 64", "batch_size: -8"}}),
       2,
       {"batch_size must be > 0", "-8"}},
      {"unknown-field",
       MlpSpec("bad3", 1) + "optimiser: {name: sgd}\n",
       2,
       {"unknown field \"optimiser\""}},
      {"too-many-workers",
       absl::StrReplaceAll(MlpSpec("bad4", 1), {{"num_workers: 2", "num_workers: 5"}}),
       1,
       {"FAILED_PRECONDITION", "5 workers"}},
  };
  for (const Case& c : cases) {
    CliResult r = Cli({"submit", WriteYaml(c.name, c.yaml)});
    EXPECT_EQ(r.code, c.code) << c.name << ": " << r.out;
    for (const std::string& s : c.says) {
      EXPECT_TRUE(absl::StrContains(r.out, s))
          << c.name << " should mention " << s << ": " << r.out;
    }
  }
  CliResult list = Cli({"list"});
  EXPECT_EQ(list.code, 0) << list.out;
  for (const char* job : {"bad1", "bad2", "bad3", "bad4"}) {
    EXPECT_FALSE(absl::StrContains(list.out, job)) << list.out;
  }
  CliResult missing = Cli({"status", "bad1"});
  EXPECT_EQ(missing.code, 1) << missing.out;
  EXPECT_TRUE(absl::StrContains(missing.out, "NOT_FOUND")) << missing.out;
}

}  // namespace
}  // namespace e2e
}  // namespace gradmesh
