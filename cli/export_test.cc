// `gradmesh export` against two in-process parameter-server shards with per-job tokens, over
// real gRPC on 127.0.0.1: FetchJobTensors returns the exact values, `export` writes a
// state_dict that Python's torch.load reads back exactly (skipped without /usr/bin/python3
// torch), and wrong tokens, swapped shards, unknown jobs and dead shards fail with their codes.
#include <grpcpp/client_context.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "cli/cli.h"
#include "cli/fake_job_service.h"
#include "cli/shard_export.h"
#include "common/partitioner.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "proto/coordinator.pb.h"
#include "proto/gradmesh.grpc.pb.h"
#include "rpc/grpc_util.h"
#include "server/job_tokens.h"
#include "server/parameter_service.h"
#include "server/shard.h"
#include "tests/testing/loopback.h"

namespace gradmesh {
namespace cli {
namespace {

constexpr char kJob[] = "mnist-mlp";
constexpr char kToken[] = "tok-123";
constexpr char kPython[] = "/usr/bin/python3";

// A shard that requires job tokens, as in service mode.
struct TokenShard {
  std::unique_ptr<Shard> shard;
  JobTokens tokens{/*required=*/true};
  std::unique_ptr<ParameterServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::string addr;

  ~TokenShard() {
    if (server != nullptr) {
      server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      server->Wait();
    }
  }
};

std::unique_ptr<grpc::ClientContext> TokenCtx() {
  auto ctx = loopback::Ctx();
  ctx->AddMetadata("x-gradmesh-job-token", kToken);
  return ctx;
}

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Four tensors in chunks of 4 elements over two shards: chunks of one tensor land on
    // both shards.
    layout_.job = kJob;
    layout_.tensors = {loopback::Tensor("fc1.weight", {3, 5}), loopback::Tensor("fc1.bias", {3}),
                       loopback::Tensor("fc2.weight", {2, 3}), loopback::Tensor("fc2.bias", {2})};
    layout_.chunk_elems = 4;
    layout_.optimizer.set_name("sgd");
    layout_.optimizer.set_lr(0.1);
    layout_.consistency = "ssp:0";
    layout_.num_workers = 2;
    init_ = loopback::OddInit(layout_);
    for (int s = 0; s < 2; ++s) {
      auto ts = std::make_unique<TokenShard>();
      auto shard = Shard::Create(ShardOptions());
      ASSERT_OK(shard);
      ts->shard = std::move(shard).value();
      ts->tokens.Set(kJob, kToken);
      ts->service = std::make_unique<ParameterServiceImpl>(ts->shard.get(), &ts->tokens);
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      ConfigureServerBuilder(RpcOptions(), &builder);
      builder.RegisterService(ts->service.get());
      ts->server = builder.BuildAndStart();
      ASSERT_NE(ts->server, nullptr);
      ts->addr = absl::StrCat("127.0.0.1:", port);
      auto stub = ParameterService::NewStub(MakeChannel(ts->addr, RpcOptions()));
      InitJobRequest init = loopback::MakeInitRequest(layout_, 2, s, init_);
      init.set_barrier_timeout_s(3);
      InitJobResponse resp;
      grpc::Status st = stub->InitJob(TokenCtx().get(), init, &resp);
      ASSERT_TRUE(st.ok()) << st.error_message();
      ASSERT_TRUE(resp.created());
      // Worker 0 pushes one step of zero gradients (values unchanged): under ssp:0 a pull as
      // worker 0 now waits for worker 1, so an export must pull as worker 1.
      Partition p = loopback::MakePartition(layout_, 2);
      PushRequest push;
      push.set_job(kJob);
      push.set_worker(0);
      push.set_step(0);
      push.set_request_id(1);
      for (int64_t idx : p.shard_chunks(s)) {
        ChunkData* c = push.add_chunks();
        c->set_tensor(p.chunks()[idx].tensor);
        c->set_chunk(p.chunks()[idx].chunk);
        c->set_dtype(FLOAT32);
        c->set_data(loopback::Bytes(std::vector<float>(p.chunks()[idx].numel, 0.0f)));
      }
      PushResponse pushed;
      st = stub->Push(TokenCtx().get(), push, &pushed);
      ASSERT_TRUE(st.ok()) << st.error_message();
      shards_.push_back(std::move(ts));
    }
    coordinator_ = FakeCoordinator::Start();
    ASSERT_NE(coordinator_, nullptr);
    options_.env["GRADMESH_COORDINATOR"] = coordinator_->address();
    options_.rpc_deadline = absl::Seconds(10);
    dir_ = ::testing::TempDir() + "/export_test_" + std::to_string(getpid());
    ASSERT_EQ(std::system(("mkdir -p " + dir_).c_str()), 0);
  }

  // The coordinator's view of the job; shards listed in reverse order (export sorts them).
  JobStatus Status(const std::string& id, const std::vector<std::string>& addrs,
                   const std::string& token, JobState state = SUCCEEDED) {
    JobStatus j;
    j.set_job_id(id);
    j.mutable_spec()->set_name(id);
    j.mutable_spec()->set_mode("ssp:0");
    j.set_state(state);
    j.mutable_progress()->set_step(1);
    j.mutable_progress()->set_total_steps(10);
    for (int s = static_cast<int>(addrs.size()) - 1; s >= 0; --s) {
      ShardPlacement* p = j.add_shards();
      p->set_shard(s);
      p->set_address(addrs[s]);
    }
    j.set_job_token(token);
    return j;
  }

  std::vector<std::string> Addrs() const { return {shards_[0]->addr, shards_[1]->addr}; }

  int Run(const std::vector<std::string>& args, std::string* out, std::string* err) {
    std::ostringstream o, e;
    CliIo io;
    io.out = &o;
    io.err = &e;
    const int code = RunCli(args, options_, io);
    *out = o.str();
    *err = e.str();
    return code;
  }

  JobLayout layout_;
  loopback::Values init_;
  std::vector<std::unique_ptr<TokenShard>> shards_;
  std::unique_ptr<FakeCoordinator> coordinator_;
  CliOptions options_;
  std::string dir_;
};

TEST_F(ExportTest, FetchesExactValuesWithoutWaitingForSsp) {
  ShardExportOptions o;
  o.job = kJob;
  o.shards = Addrs();
  o.job_token = kToken;
  const absl::Time start = absl::Now();
  ASSERT_OK_AND_ASSIGN(std::vector<ExportedTensor> tensors, FetchJobTensors(o));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));  // Pulling as worker 0 would wait 3 s.
  ASSERT_EQ(tensors.size(), 4u);
  for (size_t t = 0; t < tensors.size(); ++t) {
    EXPECT_EQ(tensors[t].name, layout_.tensors[t].name());
    EXPECT_EQ(tensors[t].shape, std::vector<int64_t>(layout_.tensors[t].shape().begin(),
                                                     layout_.tensors[t].shape().end()));
    EXPECT_EQ(tensors[t].values, init_[t]) << tensors[t].name;
  }
}

TEST_F(ExportTest, WritesAStateDictThatTorchLoads) {
  coordinator_->service().AddJob(Status(kJob, Addrs(), kToken, RUNNING));
  const std::string path = dir_ + "/model.pt";
  std::string out, err;
  ASSERT_EQ(Run({"export", kJob, "--out", path}, &out, &err), kExitOk) << err;
  EXPECT_EQ(out, absl::StrCat("exported job mnist-mlp (4 tensors, 26 parameters, step 1/10) from "
                              "2 shards to ",
                              path, "\n"));
  EXPECT_EQ(err,
            "note: job mnist-mlp is RUNNING: exporting its current parameters (export after it "
            "ends for the final model)\n");
  std::ifstream f(path, std::ios::binary);
  ASSERT_TRUE(f.good());
  char magic[2] = {0, 0};
  f.read(magic, 2);
  EXPECT_EQ(std::string(magic, 2), "PK");  // torch.save's zip format.

  if (std::system(absl::StrCat(kPython, " -c 'import torch' >/dev/null 2>&1").c_str()) != 0) {
    GTEST_SKIP() << kPython << " cannot import torch (install python3-torch)";
  }
  const std::string listing = dir_ + "/listing.txt";
  const std::string script =
      "import sys, torch\n"
      "d = torch.load(sys.argv[1])\n"
      "print(type(d).__name__)\n"
      "for k, v in d.items():\n"
      "    print(k, list(v.shape), v.dtype, ' '.join('%.9g' % x for x in v.flatten().tolist()))\n";
  const std::string script_path = dir_ + "/read.py";
  std::ofstream(script_path) << script;
  ASSERT_EQ(std::system(absl::StrCat(kPython, " ", script_path, " ", path, " > ", listing).c_str()),
            0);
  std::stringstream got;
  got << std::ifstream(listing).rdbuf();
  std::string expected = "dict\n";
  for (size_t t = 0; t < layout_.tensors.size(); ++t) {
    std::vector<std::string> values;
    for (float v : init_[t]) values.push_back(absl::StrFormat("%.9g", v));
    absl::StrAppend(&expected, layout_.tensors[t].name(), " [",
                    absl::StrJoin(layout_.tensors[t].shape(), ", "), "] torch.float32 ",
                    absl::StrJoin(values, " "), "\n");
  }
  EXPECT_EQ(got.str(), expected);
}

TEST_F(ExportTest, WrongTokenIsPermissionDenied) {
  coordinator_->service().AddJob(Status(kJob, Addrs(), "not-the-token"));
  std::string out, err;
  EXPECT_EQ(Run({"export", kJob, "--out", dir_ + "/x.pt"}, &out, &err), kExitFailed);
  // GetJobInfo (layout only) is open; the first Pull is refused.
  EXPECT_TRUE(absl::StrContains(err, "error: PERMISSION_DENIED: export of job mnist-mlp: ")) << err;
  EXPECT_TRUE(absl::StrContains(err, "job mnist-mlp: missing or wrong job token")) << err;
  EXPECT_EQ(out, "");
  EXPECT_FALSE(std::ifstream(dir_ + "/x.pt").good());
}

TEST_F(ExportTest, UnwritableOutputFailsWithoutPartialFile) {
  coordinator_->service().AddJob(Status(kJob, Addrs(), kToken));
  std::string out, err;
  const std::string path = dir_ + "/no/such/dir/model.pt";
  EXPECT_EQ(Run({"export", kJob, "--out", path}, &out, &err), kExitFailed);
  EXPECT_EQ(err, absl::StrCat("error: INTERNAL: cannot write ", path,
                              ".tmp: No such file or directory\n"));
  EXPECT_EQ(out, "");
}

TEST_F(ExportTest, SwappedShardsAreRefused) {
  coordinator_->service().AddJob(Status(kJob, {shards_[1]->addr, shards_[0]->addr}, kToken));
  std::string out, err;
  EXPECT_EQ(Run({"export", kJob, "--out", dir_ + "/x.pt"}, &out, &err), kExitFailed);
  EXPECT_EQ(err, absl::StrCat("error: FAILED_PRECONDITION: export of job mnist-mlp: shard 0 (",
                              shards_[1]->addr,
                              ") holds job mnist-mlp as shard 1 of 2, but the coordinator lists "
                              "it as shard 0 of 2\n"));
}

TEST_F(ExportTest, UnknownJobAndDeadShardFail) {
  ShardExportOptions o;
  o.job = "other";
  o.shards = Addrs();
  o.job_token = kToken;
  // A job the shards do not hold.
  EXPECT_STATUS_MSG(FetchJobTensors(o), absl::StatusCode::kNotFound,
                    "GetJobInfo on shard 0 (" + shards_[0]->addr + "): ");
  // A shard that is gone.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string dead = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  o.job = kJob;
  o.shards = {shards_[0]->addr, dead};
  EXPECT_STATUS_MSG(FetchJobTensors(o), absl::StatusCode::kUnavailable,
                    "GetJobInfo on shard 1 (" + dead + ")");
  close(fd);
  // Through the CLI a dead shard is exit 1 (the coordinator itself was reachable).
  coordinator_->service().AddJob(Status(kJob, o.shards, kToken));
  std::string out, err;
  EXPECT_EQ(Run({"export", kJob, "--out", dir_ + "/x.pt"}, &out, &err), kExitFailed);
  EXPECT_TRUE(
      absl::StrContains(err, "error: UNAVAILABLE: export of job mnist-mlp: GetJobInfo on shard 1"))
      << err;
}

}  // namespace
}  // namespace cli
}  // namespace gradmesh
