// Tests of the `gradmesh` CLI (RunCli in process) against a fake coordinator JobService over
// real gRPC on 127.0.0.1: each command's exact output and exit code, refusals, an unreachable
// coordinator, usage errors, the auth header, and watch's endings, output modes and reconnects.
#include "cli/cli.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "cli/fake_job_service.h"
#include "common/job_spec.h"
#include "common/status_testing.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace cli {
namespace {

using ::google::protobuf::util::MessageDifferencer;

constexpr int64_t kCreatedMs = 1700000000000;  // 2023-11-14 22:13:20 UTC.

JobStatus MakeJob(const std::string& id, JobState state, int64_t step, int64_t total) {
  JobStatus j;
  j.set_job_id(id);
  JobSpec* spec = j.mutable_spec();
  spec->set_name(id);
  spec->mutable_model()->set_name("mlp");
  spec->mutable_dataset()->set_name("mnist");
  spec->mutable_optimizer()->set_name("adam");
  spec->mutable_optimizer()->set_lr(0.001);
  spec->set_batch_size(64);
  spec->set_epochs(1);
  spec->set_mode("async");
  spec->set_num_workers(2);
  spec->set_num_shards(2);
  j.set_state(state);
  j.set_created_ms(kCreatedMs);
  j.set_updated_ms(kCreatedMs + 35000);
  JobProgress* p = j.mutable_progress();
  p->set_step(step);
  p->set_total_steps(total);
  p->set_epoch(1);
  p->set_epochs(1);
  p->set_loss(0.3121);
  p->set_accuracy(-1);
  p->set_samples_per_s(11234);
  p->set_eta_s(35);
  p->set_checkpoint_step(-1);
  for (int s = 0; s < 2; ++s) {
    ShardPlacement* sp = j.add_shards();
    sp->set_shard(s);
    sp->set_node(absl::StrCat("srv-", s));
    sp->set_address(absl::StrCat("127.0.0.1:710", s));
    sp->set_alive(s == 0);
  }
  for (int r = 0; r < 2; ++r) {
    WorkerPlacement* w = j.add_workers();
    w->set_rank(r);
    w->set_node(absl::StrCat("wrk-", r));
    w->set_address(absl::StrCat("127.0.0.1:720", r));
    w->set_state("running");
    w->set_step(step + r);
  }
  j.set_job_token("tok-123");
  return j;
}

JobStatus WithState(JobStatus j, JobState state, const std::string& message = "") {
  j.set_state(state);
  j.set_message(message);
  return j;
}

struct Result {
  int code = -1;
  std::string out;
  std::string err;
};

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    coordinator_ = FakeCoordinator::Start();
    ASSERT_NE(coordinator_, nullptr);
    options_.env["GRADMESH_COORDINATOR"] = coordinator_->address();
    options_.now = [] { return absl::FromUnixMillis(kCreatedMs) + absl::Hours(1); };
    options_.rpc_deadline = absl::Seconds(10);
    options_.plain_update_interval = absl::ZeroDuration();
    options_.reconnect_initial_backoff = absl::Milliseconds(20);
    options_.reconnect_max_backoff = absl::Milliseconds(100);
    dir_ = ::testing::TempDir() + "/cli_test_" + std::to_string(getpid());
    ASSERT_EQ(std::system(("mkdir -p " + dir_).c_str()), 0);
  }

  Result Run(const std::vector<std::string>& args, bool terminal = false) {
    std::ostringstream out, err;
    CliIo io;
    io.out = &out;
    io.err = &err;
    io.out_is_terminal = terminal;
    Result r;
    r.code = RunCli(args, options_, io);
    r.out = out.str();
    r.err = err.str();
    return r;
  }

  std::string WriteFile(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }

  FakeJobService& fake() { return coordinator_->service(); }

  std::unique_ptr<FakeCoordinator> coordinator_;
  CliOptions options_;
  std::string dir_;
};

constexpr char kSpec[] =
    "name: mnist-mlp\n"
    "model: {name: mlp}\n"
    "optimizer: {name: adam, lr: 0.001}\n"
    "num_workers: 2\n"
    "num_shards: 2\n";

// --- help and usage --------------------------------------------------------------------------

TEST_F(CliTest, HelpForToolAndEveryCommand) {
  Result r = Run({"--help"});
  EXPECT_EQ(r.code, kExitOk);
  EXPECT_TRUE(absl::StrContains(r.out, "Usage: gradmesh [--coordinator=HOST:PORT]")) << r.out;
  for (const char* cmd : {"submit", "list", "status", "watch", "cancel", "export"}) {
    EXPECT_TRUE(absl::StrContains(r.out, absl::StrCat("\n  ", cmd, " "))) << cmd;
    Result c = Run({cmd, "--help"});
    EXPECT_EQ(c.code, kExitOk) << cmd;
    EXPECT_TRUE(absl::StrContains(c.out, absl::StrCat("Usage: gradmesh ", cmd))) << c.out;
    EXPECT_TRUE(absl::StrContains(c.out, "Examples:\n  gradmesh ")) << c.out;
    EXPECT_EQ(c.err, "");
  }
  EXPECT_TRUE(absl::StrContains(Run({"submit", "-h"}).out, "--dry-run"));
  EXPECT_TRUE(absl::StrContains(Run({"export", "--help"}).out, "--out=FILE"));
  EXPECT_EQ(fake().calls(), 0);
}

TEST_F(CliTest, UsageErrorsExit2WithoutAnyCall) {
  struct Case {
    std::vector<std::string> args;
    std::string err;
  };
  const std::vector<Case> cases = {
      {{}, "error: no command given\n"},
      {{"frobnicate"},
       "error: unknown command \"frobnicate\" (commands: submit, list, status, watch, cancel, "
       "logs, "
       "export)\nRun 'gradmesh --help' for usage.\n"},
      {{"--bogus", "list"}, "error: unknown flag --bogus\nRun 'gradmesh --help' for usage.\n"},
      {{"list", "--bogus=1"},
       "error: unknown flag --bogus\nRun 'gradmesh list --help' for usage.\n"},
      {{"status"}, "error: status needs JOB\nRun 'gradmesh status --help' for usage.\n"},
      {{"status", "a", "b"},
       "error: too many arguments for status: b\nRun 'gradmesh status --help' for usage.\n"},
      {{"status", "a", "--json=yes"},
       "error: flag --json takes no value (or true/false), got \"yes\"\nRun 'gradmesh status "
       "--help' for usage.\n"},
      {{"list", "--coordinator"},
       "error: flag --coordinator needs a value (--coordinator=HOST:PORT)\nRun 'gradmesh list "
       "--help' for usage.\n"},
      {{"export", "job"},
       "error: export needs --out=FILE (where to write the state_dict)\nRun 'gradmesh export "
       "--help' for usage.\n"},
      {{"submit", "x.yaml", "--watch", "--dry-run"},
       "error: --watch cannot be used with --dry-run\nRun 'gradmesh submit --help' for usage.\n"},
      // Job names follow the name rule (common/job_name.h) before any call.
      {{"cancel", "../x"}, "error: JOB \"../x\" is not a valid name: 1-63 characters"},
      {{"status", "Mnist"}, "error: JOB \"Mnist\" is not a valid name"},
      {{"logs", "a/b"}, "error: JOB \"a/b\" is not a valid name"},
      {{"watch", "my_job"}, "error: JOB \"my_job\" is not a valid name"},
      {{"export", "j.x", "--out=m.pt"}, "error: JOB \"j.x\" is not a valid name"},
      {{"list", "--coordinator=127.0.0.1:99999"},
       "error: --coordinator 127.0.0.1:99999: port 99999 is not in 1..65535"},
      {{"list", "--coordinator=127.0.0.1:0"},
       "error: --coordinator 127.0.0.1:0: port 0 is not in 1..65535"},
      {{"list", "--auth_token_file=/dev/zero"},
       "error: token file /dev/zero is larger than 65536 bytes"},
  };
  for (const Case& c : cases) {
    Result r = Run(c.args);
    EXPECT_EQ(r.code, kExitUsage) << c.err;
    EXPECT_TRUE(absl::StartsWith(r.err, c.err)) << r.err;
    EXPECT_EQ(r.out, "");
  }
  EXPECT_EQ(fake().calls(), 0);
}

// --- submit ----------------------------------------------------------------------------------

TEST_F(CliTest, SubmitSendsTheSpecAndPrintsPlacement) {
  const std::string path = WriteFile("job.yaml", kSpec);
  Result r = Run({"submit", path});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out,
            "job mnist-mlp submitted (PENDING)\n"
            "  shards:  0->srv-0 (127.0.0.1:7100), 1->srv-1 (127.0.0.1:7101)\n"
            "  workers: 0->wrk-0, 1->wrk-1\n");
  EXPECT_EQ(r.err, "");
  ASSERT_EQ(fake().submits().size(), 1u);
  const SubmitJobRequest req = fake().submits()[0];
  ASSERT_OK_AND_ASSIGN(JobSpec expected, LoadJobSpecFile(path));
  EXPECT_TRUE(MessageDifferencer::Equals(req.spec(), expected)) << req.DebugString();
  EXPECT_FALSE(req.dry_run());
  EXPECT_FALSE(req.resume());
}

TEST_F(CliTest, SubmitDryRunAndResumeFlags) {
  const std::string path =
      WriteFile("job.json", R"({"name": "j2", "numWorkers": 1, "num_shards": 1})");
  Result r = Run({"submit", "--dry_run", path});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out,
            "dry run: job j2 would be accepted (nothing was started)\n"
            "  shards:  0->srv-0 (127.0.0.1:7100)\n"
            "  workers: 0->wrk-0\n");
  r = Run({"submit", path, "--resume"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out.substr(0, r.out.find('\n')), "job j2 resumed (PENDING)");
  ASSERT_EQ(fake().submits().size(), 2u);
  EXPECT_TRUE(fake().submits()[0].dry_run());
  EXPECT_FALSE(fake().submits()[0].resume());
  EXPECT_FALSE(fake().submits()[1].dry_run());
  EXPECT_TRUE(fake().submits()[1].resume());
}

TEST_F(CliTest, SubmitRejectsBadSpecsBeforeAnyCall) {
  Result r = Run({"submit", WriteFile("typo.yaml", "name: x\noptimiser: {lr: 0.1}\n")});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_TRUE(absl::StartsWith(
      r.err, absl::StrCat("error: ", dir_, "/typo.yaml: unknown field \"optimiser\"")))
      << r.err;
  r = Run({"submit", WriteFile("nested.yaml", "name: x\noptimizer: {name: sgd, rate: 1}\n")});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_TRUE(absl::StrContains(r.err, "unknown field \"rate\"")) << r.err;
  r = Run({"submit", WriteFile("neg.yaml", "name: x\nbatch_size: -3\n")});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err,
            absl::StrCat("error: ", dir_, "/neg.yaml: job spec: batch_size must be > 0, got -3\n"));
  r = Run({"submit", WriteFile("dots.yaml", "name: ../../etc\n")});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_TRUE(absl::StrContains(r.err, "job spec: name \"../../etc\" is not a valid name"))
      << r.err;
  r = Run({"submit", dir_ + "/missing.yaml"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err, absl::StrCat("error: cannot read job spec file ", dir_, "/missing.yaml\n"));
  // Push codecs are checked against the codecs here too, as the coordinator checks them.
  for (const char* codec : {"topk:1.5", "qsgd:0", "+fp16", "zip"}) {
    r = Run({"submit", WriteFile("codec.yaml",
                                 absl::StrCat("name: x\ncompression: {push: \"", codec, "\"}\n"))});
    EXPECT_EQ(r.code, kExitUsage) << codec;
    EXPECT_TRUE(absl::StartsWith(
        r.err,
        absl::StrCat("error: ", dir_, "/codec.yaml: job spec: compression.push: \"", codec, "\" ")))
        << r.err;
  }
  EXPECT_EQ(fake().calls(), 0);
}

TEST_F(CliTest, RefusalExits1WithCodeAndMessage) {
  fake().SetSubmitError(
      grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "job needs 3 workers, 2 registered"));
  Result r = Run({"submit", WriteFile("job.yaml", kSpec)});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_EQ(r.err, "error: FAILED_PRECONDITION: job needs 3 workers, 2 registered\n");
  EXPECT_EQ(r.out, "");
}

// --- reaching the coordinator ----------------------------------------------------------------

// A port bound but not listening: connecting to it is refused for as long as it is held.
class RefusingPort {
 public:
  RefusingPort() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
        getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port_ = ntohs(addr.sin_port);
    }
  }
  ~RefusingPort() { close(fd_); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST_F(CliTest, UnreachableCoordinatorExits3) {
  RefusingPort dead;
  ASSERT_NE(dead.port(), 0);
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"--coordinator=" + dead.address(), "list"},
                                             {"status", "j", "--coordinator", dead.address()},
                                             {"--coordinator=" + dead.address(), "watch", "j"}}) {
    Result r = Run(args);
    EXPECT_EQ(r.code, kExitUnreachable) << r.err;
    EXPECT_TRUE(absl::StartsWith(r.err, absl::StrCat("error: cannot reach the coordinator at ",
                                                     dead.address(), " (UNAVAILABLE: ")))
        << r.err;
    EXPECT_TRUE(absl::EndsWith(
        r.err, "): is gradmesh_coordinator running? set --coordinator or $GRADMESH_COORDINATOR\n"))
        << r.err;
  }
  // The environment gives the default address.
  options_.env["GRADMESH_COORDINATOR"] = dead.address();
  Result r = Run({"list"});
  EXPECT_EQ(r.code, kExitUnreachable);
  EXPECT_TRUE(absl::StrContains(r.err, dead.address())) << r.err;
  EXPECT_EQ(fake().calls(), 0);
  // A flag after the command overrides the environment.
  r = Run({"list", "--coordinator=" + coordinator_->address()});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(fake().calls(), 1);
}

// --- auth ------------------------------------------------------------------------------------

TEST_F(CliTest, SendsBearerTokenFromFlagOrEnvironment) {
  const std::string token = WriteFile("token", "  s3cret-token\n");
  fake().SetRequiredToken("s3cret-token");
  Result r = Run({"--auth_token_file=" + token, "list"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  options_.env["GRADMESH_AUTH_TOKEN_FILE"] = token;
  r = Run({"status", "nope"});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_EQ(r.err, "error: NOT_FOUND: job nope not found\n");
  EXPECT_EQ(fake().authorizations(),
            (std::vector<std::string>{"Bearer s3cret-token", "Bearer s3cret-token"}));
}

TEST_F(CliTest, MissingOrWrongTokenIsRefused) {
  fake().SetRequiredToken("s3cret-token");
  Result r = Run({"list"});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_EQ(r.err,
            "error: UNAUTHENTICATED: missing or wrong API token\n"
            "hint: give the coordinator's API token with --auth_token_file or "
            "$GRADMESH_AUTH_TOKEN_FILE\n");
  r = Run({"list", "--auth_token_file", WriteFile("other", "other-token")});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_EQ(fake().authorizations(), (std::vector<std::string>{"", "Bearer other-token"}));
}

TEST_F(CliTest, BadTokenFilesAreUsageErrors) {
  Result r = Run({"--auth_token_file=" + WriteFile("empty", " \n"), "list"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_TRUE(absl::StrContains(r.err, "is empty")) << r.err;
  r = Run({"--auth_token_file=" + dir_ + "/none", "list"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err, absl::StrCat("error: cannot read token file ", dir_, "/none\n"));
  EXPECT_EQ(fake().calls(), 0);
}

// --- list, status, cancel --------------------------------------------------------------------

TEST_F(CliTest, ListPrintsTable) {
  EXPECT_EQ(Run({"list"}).out, "No jobs.\n");
  fake().AddJob(MakeJob("mnist-mlp", RUNNING, 410, 938));
  JobStatus done = MakeJob("fashion-lenet-long-name", SUCCEEDED, 1876, 1876);
  done.mutable_spec()->set_mode("ssp:2");
  done.mutable_progress()->set_accuracy(0.91234);
  done.set_created_ms(kCreatedMs - 2 * 86400 * 1000);
  fake().AddJob(done);
  JobStatus pending = MakeJob("g", PENDING, 0, 0);
  pending.mutable_spec()->set_mode("gossip");
  pending.set_active_workers(1);
  pending.set_created_ms(kCreatedMs + 3600 * 1000 - 42 * 1000);
  fake().AddJob(pending);
  Result r = Run({"list"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(
      r.out,
      "JOB                      STATE      MODE    WORKERS  STEP/TOTAL  LOSS    ACC     AGE\n"
      "mnist-mlp                RUNNING    async   2        410/938     0.3121  -       1h\n"
      "fashion-lenet-long-name  SUCCEEDED  ssp:2   2        1876/1876   0.3121  0.9123  2d\n"
      "g                        PENDING    gossip  1/2      0/-         -       -       42s\n");
}

TEST_F(CliTest, StatusPrintsStatePlacementAndProgress) {
  JobStatus job = MakeJob("mnist-mlp", PAUSED, 410, 938);
  job.set_message("shard 1 (srv-1) is down");
  job.mutable_progress()->set_checkpoint_step(400);
  job.mutable_spec()->set_output("/models/mnist.pt");
  fake().AddJob(job);
  Result r = Run({"status", "mnist-mlp"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out,
            "Job:         mnist-mlp\n"
            "State:       PAUSED\n"
            "Message:     shard 1 (srv-1) is down\n"
            "Mode:        async, 2 workers, 2 shards\n"
            "Model:       mlp on mnist, adam lr=0.001, batch 64, 1 epoch\n"
            "Output:      /models/mnist.pt\n"
            "Created:     2023-11-14 22:13:20 UTC (1h ago)\n"
            "Progress:    [########............]  43% step 410/938 epoch 1/1 loss 0.3121 acc - "
            "11.2k samples/s ETA 0:35\n"
            "Checkpoint:  step 400\n"
            "Shards:\n"
            "  SHARD  NODE   ADDRESS         ALIVE\n"
            "  0      srv-0  127.0.0.1:7100  yes\n"
            "  1      srv-1  127.0.0.1:7101  no\n"
            "Workers:\n"
            "  RANK  NODE   ADDRESS         STATE    STEP  MOVED\n"
            "  0     wrk-0  127.0.0.1:7200  running  410   0\n"
            "  1     wrk-1  127.0.0.1:7201  running  411   0\n");
  EXPECT_FALSE(absl::StrContains(r.out, "tok-123"));
}

TEST_F(CliTest, StatusJsonIsTheJobStatusWithoutItsToken) {
  const JobStatus job = MakeJob("mnist-mlp", RUNNING, 410, 938);
  fake().AddJob(job);
  Result r = Run({"status", "--json", "mnist-mlp"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_FALSE(absl::StrContains(r.out, "tok-123"));
  EXPECT_TRUE(absl::StrContains(r.out, "\"state\": \"RUNNING\"")) << r.out;
  EXPECT_TRUE(absl::StrContains(r.out, "\"totalSteps\": \"938\"")) << r.out;
  JobStatus parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &parsed).ok()) << r.out;
  JobStatus expected = job;
  expected.clear_job_token();
  EXPECT_TRUE(MessageDifferencer::Equals(parsed, expected)) << parsed.DebugString();
}

TEST_F(CliTest, CancelPrintsNewStateAndRefusalExits1) {
  fake().AddJob(MakeJob("mnist-mlp", RUNNING, 410, 938));
  Result r = Run({"cancel", "mnist-mlp"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out, "job mnist-mlp CANCELLED: cancelled by the user\n");
  r = Run({"cancel", "mnist-mlp"});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_EQ(r.err, "error: FAILED_PRECONDITION: job mnist-mlp already ended (CANCELLED)\n");
  r = Run({"cancel", "other"});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_EQ(r.err, "error: NOT_FOUND: job other not found\n");
}

// --- watch -----------------------------------------------------------------------------------

std::vector<JobStatus> Lifecycle(JobState end, const std::string& message = "") {
  JobStatus done = WithState(MakeJob("mnist-mlp", end, 400, 400), end, message);
  if (end == SUCCEEDED) done.mutable_progress()->set_accuracy(0.9812);
  if (end != SUCCEEDED) done.mutable_progress()->set_step(250);
  // Finished workers report no rate: the final line shows the last rate seen.
  done.mutable_progress()->set_samples_per_s(0);
  return {MakeJob("mnist-mlp", PENDING, 0, 400), MakeJob("mnist-mlp", RUNNING, 100, 400),
          MakeJob("mnist-mlp", RUNNING, 200, 400), done};
}

TEST_F(CliTest, WatchPlainLinesUntilSucceeded) {
  fake().AddWatchScript({Lifecycle(SUCCEEDED)});
  Result r = Run({"watch", "mnist-mlp"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out,
            "job mnist-mlp PENDING\n"
            "job mnist-mlp RUNNING\n"
            "25% step 100/400 epoch 1/1 loss 0.3121 acc - 11.2k samples/s ETA 0:35\n"
            "50% step 200/400 epoch 1/1 loss 0.3121 acc - 11.2k samples/s ETA 0:35\n"
            "job mnist-mlp SUCCEEDED accuracy=0.9812 loss=0.3121 steps=400/400 "
            "samples_per_s(all workers)=11.2k time=0:35\n");
  EXPECT_EQ(r.err, "");
}

// Rank 1 finishes first: the job's rate then counts rank 0 only (5k). The final line keeps
// the last rate of all workers (11.2k), the same definition as the quickstart's RESULT line.
TEST_F(CliTest, WatchFinalRateIsThatOfAllWorkers) {
  std::vector<JobStatus> msgs = Lifecycle(SUCCEEDED);
  JobStatus tail = MakeJob("mnist-mlp", RUNNING, 300, 400);
  tail.mutable_workers(1)->set_state("succeeded");
  tail.mutable_progress()->set_samples_per_s(5000);
  msgs.insert(msgs.begin() + 3, tail);
  fake().AddWatchScript({msgs});
  Result r = Run({"watch", "mnist-mlp"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out,
            "job mnist-mlp PENDING\n"
            "job mnist-mlp RUNNING\n"
            "25% step 100/400 epoch 1/1 loss 0.3121 acc - 11.2k samples/s ETA 0:35\n"
            "50% step 200/400 epoch 1/1 loss 0.3121 acc - 11.2k samples/s ETA 0:35\n"
            "75% step 300/400 epoch 1/1 loss 0.3121 acc - 5.0k samples/s ETA 0:35\n"
            "job mnist-mlp SUCCEEDED accuracy=0.9812 loss=0.3121 steps=400/400 "
            "samples_per_s(all workers)=11.2k time=0:35\n");
}

TEST_F(CliTest, WatchPlainLinesAreThrottled) {
  options_.plain_update_interval = absl::Hours(1);  // The fixed clock never gets there.
  std::vector<JobStatus> msgs = Lifecycle(SUCCEEDED);
  msgs.insert(msgs.begin() + 3,
              WithState(MakeJob("mnist-mlp", PAUSED, 200, 400), PAUSED, "shard 1 is down"));
  msgs.insert(msgs.begin() + 4, MakeJob("mnist-mlp", RUNNING, 300, 400));
  fake().AddWatchScript({msgs});
  Result r = Run({"watch", "mnist-mlp"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out,
            "job mnist-mlp PENDING\n"
            "job mnist-mlp RUNNING\n"
            "25% step 100/400 epoch 1/1 loss 0.3121 acc - 11.2k samples/s ETA 0:35\n"
            "job mnist-mlp PAUSED: shard 1 is down\n"
            "job mnist-mlp RUNNING\n"
            "job mnist-mlp SUCCEEDED accuracy=0.9812 loss=0.3121 steps=400/400 "
            "samples_per_s(all workers)=11.2k time=0:35\n");
}

TEST_F(CliTest, WatchFailedOrCancelledExits1WithMessage) {
  fake().AddWatchScript({Lifecycle(FAILED, "worker 1 failed: loss is NaN at step 250")});
  Result r = Run({"watch", "mnist-mlp"});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_TRUE(absl::EndsWith(
      r.out, "\njob mnist-mlp FAILED at step 250/400: worker 1 failed: loss is NaN at step 250\n"))
      << r.out;
  fake().AddWatchScript({Lifecycle(CANCELLED, "cancelled by the user")});
  r = Run({"watch", "mnist-mlp"});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_TRUE(
      absl::EndsWith(r.out, "\njob mnist-mlp CANCELLED at step 250/400: cancelled by the user\n"))
      << r.out;
  // A job that already ended: only the final line (no rate was seen).
  fake().AddWatchScript({{Lifecycle(SUCCEEDED).back()}});
  r = Run({"watch", "mnist-mlp"});
  EXPECT_EQ(r.code, kExitOk);
  EXPECT_EQ(r.out,
            "job mnist-mlp SUCCEEDED accuracy=0.9812 loss=0.3121 steps=400/400 "
            "samples_per_s(all workers)=0 time=0:35\n");
}

TEST_F(CliTest, WatchOnTerminalRedrawsOneLine) {
  fake().AddWatchScript({Lifecycle(SUCCEEDED)});
  Result r = Run({"watch", "mnist-mlp"}, /*terminal=*/true);
  EXPECT_EQ(r.code, kExitOk) << r.err;
  const std::string progress = " epoch 1/1 loss 0.3121 acc - 11.2k samples/s ETA 0:35";
  EXPECT_EQ(r.out,
            absl::StrCat("job mnist-mlp PENDING\n"
                         "job mnist-mlp RUNNING\n"
                         "\r\033[K[#####...............]  25% step 100/400",
                         progress, "\r\033[K[##########..........]  50% step 200/400", progress,
                         "\r\033[K"
                         "job mnist-mlp SUCCEEDED accuracy=0.9812 loss=0.3121 "
                         "steps=400/400 samples_per_s(all workers)=11.2k time=0:35\n"));
}

// --- logs ------------------------------------------------------------------------------------

GetLogsResponse Logs(JobState state, std::vector<std::tuple<int, int64_t, std::string>> lines) {
  GetLogsResponse r;
  r.set_state(state);
  for (auto& [rank, seq, text] : lines) {
    LogLine* l = r.add_lines();
    l->set_rank(rank);
    l->set_sequence(seq);
    l->set_text(text);
  }
  return r;
}

TEST_F(CliTest, LogsPrintsEveryRanksLinesWithTheirRank) {
  fake().AddLogsAnswer(grpc::Status::OK, Logs(RUNNING, {{0, 1, "event=task_start rank=0"},
                                                        {1, 2, "event=progress rank=1 step=10"}}));
  Result r = Run({"logs", "mnist-mlp"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out, "[rank 0] event=task_start rank=0\n[rank 1] event=progress rank=1 step=10\n");
  ASSERT_EQ(fake().logs_requests().size(), 1u);
  EXPECT_EQ(fake().logs_requests()[0].job_id(), "mnist-mlp");
  EXPECT_EQ(fake().logs_requests()[0].rank(), -1);
  EXPECT_EQ(fake().logs_requests()[0].after_sequence(), 0);
}

TEST_F(CliTest, LogsFollowPollsAfterTheLastLineUntilTheJobEnds) {
  options_.logs_poll_interval = absl::Milliseconds(1);
  fake().AddLogsAnswer(grpc::Status::OK, Logs(RUNNING, {{1, 4, "a"}, {1, 7, "b"}}));
  fake().AddLogsAnswer(grpc::Status::OK, Logs(RUNNING, {}));
  fake().AddLogsAnswer(grpc::Status::OK, Logs(SUCCEEDED, {{1, 9, "event=task_end"}}));
  Result r = Run({"logs", "mnist-mlp", "--rank=1", "--follow"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out, "a\nb\nevent=task_end\n");
  const std::vector<GetLogsRequest> req = fake().logs_requests();
  ASSERT_EQ(req.size(), 3u);
  const int64_t after[] = {0, 7, 7};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(req[i].rank(), 1);
    EXPECT_EQ(req[i].after_sequence(), after[i]) << i;
  }
}

// Following, a coordinator that goes away is waited for (notes on stderr), and one that
// restarted (its in-memory lines numbered from 1 again: another incarnation, even with more
// lines than were printed) is read from its first line; before any answer an unreachable
// coordinator is an error.
TEST_F(CliTest, LogsFollowReconnectsAndStartsOverAfterACoordinatorRestart) {
  options_.logs_poll_interval = absl::Milliseconds(1);
  options_.reconnect_initial_backoff = absl::Milliseconds(1);
  GetLogsResponse first = Logs(RUNNING, {{0, 5, "a"}});
  first.set_last_sequence(5);
  first.set_incarnation(1);
  fake().AddLogsAnswer(grpc::Status::OK, first);
  fake().AddLogsAnswer(grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection refused"));
  fake().AddLogsAnswer(grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection refused"));
  GetLogsResponse restarted = Logs(RUNNING, {{0, 6, "d"}});
  restarted.set_last_sequence(6);
  restarted.set_incarnation(2);
  fake().AddLogsAnswer(grpc::Status::OK, restarted);
  GetLogsResponse again = Logs(SUCCEEDED, {{0, 1, "b"}, {0, 2, "c"}});
  again.set_last_sequence(2);
  again.set_incarnation(2);
  fake().AddLogsAnswer(grpc::Status::OK, again);
  Result r = Run({"logs", "j", "--rank=0", "--follow"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out, "a\nb\nc\n");
  EXPECT_NE(r.err.find("note: lost the coordinator at"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("note: reconnected to the coordinator at"), std::string::npos) << r.err;
  const std::vector<GetLogsRequest> req = fake().logs_requests();
  ASSERT_EQ(req.size(), 5u);
  const int64_t after[] = {0, 5, 5, 5, 0};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(req[i].after_sequence(), after[i]) << i;

  // Unreachable from the start: an error, not a wait.
  fake().AddLogsAnswer(grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection refused"));
  r = Run({"logs", "j", "--follow"});
  EXPECT_EQ(r.code, kExitUnreachable) << r.err;
}

TEST_F(CliTest, LogsErrors) {
  fake().AddLogsAnswer(grpc::Status(grpc::StatusCode::NOT_FOUND, "job \"nope\" not found"));
  Result r = Run({"logs", "nope"});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_EQ(r.err, "error: NOT_FOUND: job \"nope\" not found\n");
  fake().AddLogsAnswer(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                    "rank 5 is out of range: job \"j\" has ranks 0..1"));
  r = Run({"logs", "j", "--rank=5"});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_EQ(r.err, "error: INVALID_ARGUMENT: rank 5 is out of range: job \"j\" has ranks 0..1\n");
  r = Run({"logs", "j", "--rank=x"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err,
            "error: --rank must be a rank number (0, 1, ...), not \"x\"\n"
            "Run 'gradmesh logs --help' for usage.\n");
}

TEST_F(CliTest, WatchUnknownJobExits1) {
  Result r = Run({"watch", "nope"});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_EQ(r.err, "error: NOT_FOUND: job nope not found\n");
}

TEST_F(CliTest, WatchReconnectsWhenTheStreamBreaks) {
  std::vector<JobStatus> msgs = Lifecycle(SUCCEEDED);
  fake().AddWatchScript({{msgs[1]}, grpc::Status(grpc::StatusCode::UNAVAILABLE, "restarting")});
  fake().AddWatchScript({{}, grpc::Status(grpc::StatusCode::UNAVAILABLE, "still restarting")});
  fake().AddWatchScript({{msgs[2], msgs[3]}});
  Result r = Run({"watch", "mnist-mlp"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out,
            "job mnist-mlp RUNNING\n"
            "25% step 100/400 epoch 1/1 loss 0.3121 acc - 11.2k samples/s ETA 0:35\n"
            "50% step 200/400 epoch 1/1 loss 0.3121 acc - 11.2k samples/s ETA 0:35\n"
            "job mnist-mlp SUCCEEDED accuracy=0.9812 loss=0.3121 steps=400/400 "
            "samples_per_s(all workers)=11.2k time=0:35\n");
  EXPECT_EQ(r.err, absl::StrCat("note: lost the watch stream of job mnist-mlp (UNAVAILABLE: "
                                "restarting); reconnecting to ",
                                coordinator_->address(), " until the job ends\n",
                                "note: reconnected to the coordinator at ", coordinator_->address(),
                                "\n"));
  EXPECT_EQ(fake().watches(), 3);
}

TEST_F(CliTest, WatchSurvivesACoordinatorRestart) {
  const int port = coordinator_->port();
  std::vector<JobStatus> msgs = Lifecycle(SUCCEEDED);
  FakeJobService::WatchScript held;
  held.messages = {msgs[1]};
  held.hold = true;
  fake().AddWatchScript(held);
  Result r;
  std::thread cli([&] { r = Run({"watch", "mnist-mlp"}); });
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (fake().watches() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(fake().watches(), 1);
  absl::SleepFor(absl::Milliseconds(100));  // Let the first message reach the client.
  coordinator_.reset();                     // The coordinator goes away mid-stream...
  absl::SleepFor(absl::Milliseconds(300));
  coordinator_ = FakeCoordinator::Start(port);  // ...and comes back on the same address.
  ASSERT_NE(coordinator_, nullptr);
  fake().AddWatchScript({{msgs[2], msgs[3]}});
  cli.join();
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_TRUE(absl::StartsWith(r.out, "job mnist-mlp RUNNING\n25% step 100/400")) << r.out;
  EXPECT_TRUE(absl::EndsWith(r.out,
                             "\njob mnist-mlp SUCCEEDED accuracy=0.9812 loss=0.3121 "
                             "steps=400/400 samples_per_s(all workers)=11.2k time=0:35\n"))
      << r.out;
  EXPECT_TRUE(absl::StartsWith(r.err, "note: lost the watch stream of job mnist-mlp (")) << r.err;
  EXPECT_TRUE(absl::EndsWith(
      r.err, absl::StrCat("note: reconnected to the coordinator at 127.0.0.1:", port, "\n")))
      << r.err;
}

TEST_F(CliTest, SubmitWatchFollowsTheJob) {
  fake().AddWatchScript({Lifecycle(FAILED, "rank 0 lost")});
  Result r = Run({"submit", WriteFile("job.yaml", kSpec), "--watch"});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_TRUE(absl::StartsWith(r.out, "job mnist-mlp submitted (PENDING)\n  shards:  ")) << r.out;
  EXPECT_TRUE(absl::EndsWith(r.out, "\njob mnist-mlp FAILED at step 250/400: rank 0 lost\n"))
      << r.out;
}

// --- export (published models; the shard path is in export_test.cc) --------------------------

constexpr char kPython[] = "/usr/bin/python3";

// Runs `script` with /usr/bin/python3 and `arg`; its stdout, or "" when python3 cannot import
// torch (the caller skips).
std::string PythonOutput(const std::string& script, const std::string& arg, int* exit_code) {
  if (std::system(absl::StrCat(kPython, " -c 'import torch' >/dev/null 2>&1").c_str()) != 0) {
    return "";
  }
  const std::string cmd = absl::StrCat(kPython, " -c '", script, "' ", arg, " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  *exit_code = pclose(p);
  return out;
}

struct TestTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
  DType dtype = DTYPE_UNSPECIFIED;
  bool buffer = false;
};

// The published form: a header and the values as float32 little-endian.
std::pair<ModelHeader, std::string> Published(const std::string& job,
                                              const std::vector<TestTensor>& tensors, int64_t step,
                                              bool final) {
  ModelHeader h;
  h.set_job_id(job);
  h.set_kind(MODEL_STATE);
  h.set_node("wrk-0");
  h.set_step(step);
  h.set_final(final);
  std::string payload;
  for (const TestTensor& t : tensors) {
    ModelTensorInfo* info = h.add_tensors();
    info->set_name(t.name);
    for (int64_t d : t.shape) info->add_shape(d);
    info->set_dtype(t.dtype);
    info->set_buffer(t.buffer);
    payload.append(reinterpret_cast<const char*>(t.values.data()), t.values.size() * 4);
  }
  h.set_total_bytes(static_cast<int64_t>(payload.size()));
  return {h, payload};
}

// The tensors of cli/testdata/tiny_module.pt (Linear(3, 2), BatchNorm1d(2)) with exact values.
std::vector<TestTensor> TinyModuleTensors() {
  return {
      {"fc.weight", {2, 3}, {0.5f, -1.0f, 1.5f, 2.0f, -2.5f, 3.0f}},
      {"fc.bias", {2}, {0.25f, -0.75f}},
      {"bn.weight", {2}, {1.0f, 2.0f}},
      {"bn.bias", {2}, {-1.0f, 1.0f}},
      {"bn.running_mean", {2}, {0.125f, -0.5f}, FLOAT32, true},
      {"bn.running_var", {2}, {4.0f, 0.5f}, FLOAT32, true},
      {"bn.num_batches_tracked", {}, {42.0f}, INT64, true},
  };
}

constexpr char kTinyModuleOut[] =
    "fc.weight torch.float32 [2, 3] [0.5, -1.0, 1.5, 2.0, -2.5, 3.0]\n"
    "fc.bias torch.float32 [2] [0.25, -0.75]\n"
    "bn.weight torch.float32 [2] [1.0, 2.0]\n"
    "bn.bias torch.float32 [2] [-1.0, 1.0]\n"
    "bn.running_mean torch.float32 [2] [0.125, -0.5]\n"
    "bn.running_var torch.float32 [2] [4.0, 0.5]\n"
    "bn.num_batches_tracked torch.int64 [] [42]\n";

std::string ReadBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

JobStatus PeerJob(const std::string& id, const std::string& mode, JobState state) {
  JobStatus job = MakeJob(id, state, 120, 200);
  job.mutable_spec()->set_mode(mode);
  job.mutable_spec()->set_num_shards(0);
  job.clear_shards();
  return job;
}

TEST_F(CliTest, ExportOfAPeerJobWithoutAPublishedModelSaysWhen) {
  fake().AddJob(PeerJob("a", "allreduce", RUNNING));
  Result r = Run({"export", "a", "--out", dir_ + "/a.pt"});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_EQ(r.err,
            "error: FAILED_PRECONDITION: job a (allreduce) has not published a model yet; rank 0 "
            "publishes at checkpoints, every 60 s and at the end\n");
  EXPECT_FALSE(std::ifstream(dir_ + "/a.pt").good());
  r = Run({"export", "nope", "--out=" + dir_ + "/n.pt"});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_EQ(r.err, "error: NOT_FOUND: job nope not found\n");
}

TEST_F(CliTest, ExportOfAGossipJobWritesThePublishedTensors) {
  fake().AddJob(PeerJob("g", "gossip", RUNNING));
  // A 1.2 MB tensor: the download spans several 1 MiB messages.
  TestTensor big{"big.weight", {300, 1000}, {}};
  for (int i = 0; i < 300 * 1000; ++i) big.values.push_back(static_cast<float>(i % 1024) / 8);
  std::vector<TestTensor> tensors = TinyModuleTensors();
  tensors.push_back(big);
  auto [header, payload] = Published("g", tensors, 120, false);
  fake().SetModel(header, payload);
  const std::string path = dir_ + "/g.pt";
  Result r = Run({"export", "g", "--out", path});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out, absl::StrCat("exported job g (8 tensors, 300017 parameters, step 120/200) "
                                "published by rank 0 at step 120 to ",
                                path, "\n"));
  EXPECT_EQ(r.err,
            "note: job g is RUNNING: exporting its current parameters (export after it ends for "
            "the final model)\n");
  ASSERT_EQ(fake().model_requests().size(), 1u);
  EXPECT_EQ(fake().model_requests()[0].kind(), MODEL_STATE);
  EXPECT_EQ(ReadBytes(path).substr(0, 2), "PK");  // torch.save's zip format.
  int code = -1;
  const std::string out = PythonOutput(
      "import sys, torch\n"
      "d = torch.load(sys.argv[1])\n"
      "for k, v in d.items():\n"
      "  if k == \"big.weight\":\n"
      "    e = (torch.arange(300000) % 1024).float().div(8).reshape(300, 1000)\n"
      "    print(k, v.dtype, list(v.shape), bool(torch.equal(v, e)))\n"
      "  else:\n"
      "    print(k, v.dtype, list(v.shape), v.flatten().tolist())\n",
      path, &code);
  if (out.empty()) GTEST_SKIP() << kPython << " cannot import torch";
  EXPECT_EQ(code, 0) << out;
  EXPECT_EQ(out, absl::StrCat(kTinyModuleOut, "big.weight torch.float32 [300, 1000] True\n"));
}

TEST_F(CliTest, ExportAsTorchScriptWritesTheModuleWithTheTrainedWeights) {
  JobStatus job = PeerJob("t", "allreduce", SUCCEEDED);
  job.mutable_spec()->mutable_model()->set_name("torchscript");
  job.mutable_spec()->mutable_model()->set_path("/models/tiny.pt");
  fake().AddJob(job);
  auto [header, payload] = Published("t", TinyModuleTensors(), 200, true);
  fake().SetModel(header, payload);
  ModelHeader module;
  module.set_job_id("t");
  module.set_kind(MODEL_MODULE);
  const std::string module_bytes = ReadBytes("cli/testdata/tiny_module.pt");
  ASSERT_GT(module_bytes.size(), 1000u);
  module.set_total_bytes(static_cast<int64_t>(module_bytes.size()));
  fake().SetModel(module, module_bytes);

  const std::string path = dir_ + "/t.pt";
  Result r = Run({"export", "t", "--out", path, "--format", "torchscript"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(r.out, absl::StrCat("exported job t (7 tensors, 17 parameters, step 120/200) "
                                "published by rank 0 at step 200 (final) to ",
                                path, " as a TorchScript module\n"));
  EXPECT_FALSE(std::ifstream(path + ".tmp").good());
  int code = -1;
  const std::string out = PythonOutput(
      "import sys, torch\n"
      "m = torch.jit.load(sys.argv[1])\n"
      "for k, v in m.state_dict().items():\n"
      "  print(k, v.dtype, list(v.shape), v.flatten().tolist())\n"
      "m.eval()\n"
      "print(m(torch.ones(1, 3)).tolist())\n",
      path, &code);
  if (out.empty()) GTEST_SKIP() << kPython << " cannot import torch";
  EXPECT_EQ(code, 0) << out;
  // eval: (fc(1,1,1) - running_mean) / sqrt(running_var + 1e-5) * weight + bias:
  // fc = [1.25, 1.75]; [(1.25 - 0.125) / 2.0000025 - 1, (1.75 + 0.5) / 0.70711 * 2 + 1].
  EXPECT_TRUE(absl::StartsWith(out, kTinyModuleOut)) << out;
  EXPECT_TRUE(absl::StrContains(out, "[[-0.43750")) << out;

  // Every module tensor must be covered.
  std::vector<TestTensor> partial = TinyModuleTensors();
  partial.erase(partial.begin() + 5, partial.end());
  auto [h2, p2] = Published("t", partial, 200, true);
  fake().SetModel(h2, p2);
  r = Run({"export", "t", "--out", dir_ + "/t2.pt", "--format=torchscript"});
  EXPECT_EQ(r.code, kExitFailed);
  EXPECT_EQ(r.err,
            "error: FAILED_PRECONDITION: export of job t: the job's model does not cover 2 of the "
            "module's 7 parameters and buffers: bn.running_var, bn.num_batches_tracked\n");
  EXPECT_FALSE(std::ifstream(dir_ + "/t2.pt").good());
}

// cli/testdata/tied_module.pt ties b.weight to a.weight (make_tiny_module.py): the worker
// trains the shared tensor once, as a.weight, and publishes a.weight, a.bias, b.bias. Both
// exports give the module back whole: the state_dict has b.weight too (PyTorch's state_dict
// lists every name, and load_state_dict(strict=True) wants them), and the TorchScript module's
// shared tensor holds the trained values under both names.
TEST_F(CliTest, ExportsOfTiedWeightsHaveEveryName) {
  JobStatus job = PeerJob("t", "allreduce", SUCCEEDED);
  job.mutable_spec()->mutable_model()->set_name("torchscript");
  job.mutable_spec()->mutable_model()->set_path("/models/tied.pt");
  fake().AddJob(job);
  const std::vector<TestTensor> tensors = {
      {"a.weight", {2, 2}, {1.0f, 2.0f, 3.0f, 4.0f}},
      {"a.bias", {2}, {0.5f, -0.5f}},
      {"b.bias", {2}, {0.25f, 0.75f}},
  };
  auto [header, payload] = Published("t", tensors, 200, true);
  fake().SetModel(header, payload);
  ModelHeader module;
  module.set_job_id("t");
  module.set_kind(MODEL_MODULE);
  const std::string module_bytes = ReadBytes("cli/testdata/tied_module.pt");
  ASSERT_GT(module_bytes.size(), 1000u);
  module.set_total_bytes(static_cast<int64_t>(module_bytes.size()));
  fake().SetModel(module, module_bytes);

  const std::string dict = dir_ + "/dict.pt";
  Result r = Run({"export", "t", "--out", dict});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_TRUE(absl::StartsWith(r.out, "exported job t (4 tensors, 12 parameters,")) << r.out;
  int code = -1;
  std::string out = PythonOutput(
      "import sys, torch\n"
      "d = torch.load(sys.argv[1])\n"
      "for k, v in d.items():\n"
      "  print(k, v.flatten().tolist())\n"
      "m = torch.jit.load(\"cli/testdata/tied_module.pt\")\n"
      "m.load_state_dict(d, strict=True)\n"
      "print(m(torch.ones(1, 2)).tolist())\n",
      dict, &code);
  if (out.empty()) GTEST_SKIP() << kPython << " cannot import torch";
  EXPECT_EQ(code, 0) << out;
  // a(1, 1) = [3.5, 6.5]; b of that: [3.5 + 13 + 0.25, 10.5 + 26 + 0.75].
  EXPECT_EQ(out,
            "a.weight [1.0, 2.0, 3.0, 4.0]\n"
            "b.weight [1.0, 2.0, 3.0, 4.0]\n"
            "a.bias [0.5, -0.5]\n"
            "b.bias [0.25, 0.75]\n"
            "[[16.75, 37.25]]\n");

  const std::string scripted = dir_ + "/scripted.pt";
  r = Run({"export", "t", "--out", scripted, "--format", "torchscript"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.err, "");
  out = PythonOutput(
      "import sys, torch\n"
      "m = torch.jit.load(sys.argv[1])\n"
      "print(m.a.weight.flatten().tolist(), m.b.weight.flatten().tolist())\n"
      "print(m(torch.ones(1, 2)).tolist())\n",
      scripted, &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_EQ(out, "[1.0, 2.0, 3.0, 4.0] [1.0, 2.0, 3.0, 4.0]\n[[16.75, 37.25]]\n");
}

TEST_F(CliTest, ExportAsTorchScriptNeedsATorchScriptJob) {
  fake().AddJob(PeerJob("g", "gossip", SUCCEEDED));
  fake().AddJob(MakeJob("p", SUCCEEDED, 10, 10));  // ps (async): refused before any shard call.
  for (const char* job : {"g", "p"}) {
    Result r = Run({"export", job, "--out", dir_ + "/x.pt", "--format", "torchscript"});
    EXPECT_EQ(r.code, kExitFailed);
    EXPECT_EQ(r.err, absl::StrCat("error: INVALID_ARGUMENT: --format torchscript needs a job whose "
                                  "model is a TorchScript module (job ",
                                  job, "'s model is \"mlp\")\n"));
  }
  EXPECT_TRUE(fake().model_requests().empty());
  Result r = Run({"export", "g", "--out", dir_ + "/x.pt", "--format", "onnx"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err,
            "error: --format must be state_dict or torchscript, got \"onnx\"\nRun 'gradmesh "
            "export --help' for usage.\n");
}

}  // namespace
}  // namespace cli
}  // namespace gradmesh
