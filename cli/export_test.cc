// `gradmesh export` against two in-process parameter-server shards with per-job tokens, over
// real gRPC on 127.0.0.1: FetchJobTensors returns the exact values, `export` writes a
// state_dict that Python's torch.load reads back exactly (skipped without /usr/bin/python3
// torch), buffers keep their dtypes (a BatchNorm file loads with load_state_dict(strict=True)),
// and wrong tokens, swapped shards, unknown jobs and dead shards fail with their codes.
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
#include "cli/state_dict.h"
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
  virtual Placement placement() const { return PLACEMENT_GREEDY; }

  void SetUp() override {
    // Four tensors in chunks of 4 elements over two shards: chunks of one tensor land on
    // both shards.
    layout_.job = kJob;
    layout_.tensors = {loopback::Tensor("fc1.weight", {3, 5}), loopback::Tensor("fc1.bias", {3}),
                       loopback::Tensor("fc2.weight", {2, 3}), loopback::Tensor("fc2.bias", {2})};
    layout_.chunk_elems = 4;
    layout_.placement = placement();
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

// The same job with placement "ordered" (contiguous ranges of the model on the shards): the
// export rebuilds the partition the shards report.
class OrderedExportTest : public ExportTest {
 protected:
  Placement placement() const override { return PLACEMENT_ORDERED; }
};

TEST_F(OrderedExportTest, FetchesExactValuesInTheJobsPlacement) {
  ShardExportOptions o;
  o.job = kJob;
  o.shards = Addrs();
  o.job_token = kToken;
  // 26 elements in chunks of 4: fc1.weight's first three chunks (middles 2, 6, 10; the
  // boundary is 13) on shard 0, everything after them on shard 1.
  const Partition ordered = loopback::MakePartition(layout_, 2);
  EXPECT_EQ(ordered.shard_chunks(0), (std::vector<int64_t>{0, 1, 2}));
  ASSERT_OK_AND_ASSIGN(std::vector<ExportedTensor> tensors, FetchJobTensors(o));
  ASSERT_EQ(tensors.size(), 4u);
  for (size_t t = 0; t < tensors.size(); ++t) {
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

// Runs `script` (Python, argv[1] = `arg`) with /usr/bin/python3 and returns its stdout;
// false (the test is skipped) when that Python cannot import torch.
bool RunPython(const std::string& dir, const std::string& script, const std::string& arg,
               std::string* out) {
  if (std::system(absl::StrCat(kPython, " -c 'import torch' >/dev/null 2>&1").c_str()) != 0) {
    return false;
  }
  const std::string script_path = dir + "/check.py";
  const std::string listing = dir + "/check.txt";
  std::ofstream(script_path) << script;
  const int rc = std::system(
      absl::StrCat(kPython, " ", script_path, " ", arg, " > ", listing, " 2>&1").c_str());
  std::stringstream got;
  got << std::ifstream(listing).rdbuf();
  *out = absl::StrCat("rc=", rc, "\n", got.str());
  return true;
}

// A BatchNorm1d(3) job: its buffers live on the shards beside the parameters, take pushed
// deltas as they are, and export writes them with their dtypes (num_batches_tracked an int64
// 0-dim tensor), so PyTorch's load_state_dict(strict=True) accepts the file.
TEST_F(ExportTest, BuffersKeepTheirDTypesAndLoadStrictlyIntoBatchNorm) {
  constexpr char kBnJob[] = "bn-job";
  JobLayout l;
  l.job = kBnJob;
  l.tensors = {loopback::Tensor("weight", {3}), loopback::Tensor("bias", {3}),
               loopback::Tensor("running_mean", {3}), loopback::Tensor("running_var", {3}),
               loopback::Tensor("num_batches_tracked", {})};
  for (int t = 2; t < 5; ++t) l.tensors[t].set_buffer(true);
  l.tensors[4].set_dtype(INT64);
  l.chunk_elems = 4;
  l.optimizer.set_name("sgd");
  l.optimizer.set_lr(0.1);
  l.consistency = "async";
  l.num_workers = 1;
  const loopback::Values init = {
      {1.5f, 2.0f, -0.5f}, {0.25f, 0.0f, -1.0f}, {0.125f, 4.0f, -2.0f}, {1.0f, 0.5f, 2.25f}, {7}};
  // Pushed: zero gradients (the parameters stay), buffer deltas.
  const loopback::Values delta = {
      {0, 0, 0}, {0, 0, 0}, {0.5f, -1.0f, 0.25f}, {-0.25f, 0.5f, 1.0f}, {1}};
  const loopback::Values want = {
      {1.5f, 2.0f, -0.5f}, {0.25f, 0.0f, -1.0f}, {0.625f, 3.0f, -1.75f}, {0.75f, 1.0f, 3.25f}, {8}};
  const Partition p = loopback::MakePartition(l, 2);
  for (int s = 0; s < 2; ++s) {
    shards_[s]->tokens.Set(kBnJob, kToken);
    auto stub = ParameterService::NewStub(MakeChannel(shards_[s]->addr, RpcOptions()));
    InitJobResponse created;
    grpc::Status st =
        stub->InitJob(TokenCtx().get(), loopback::MakeInitRequest(l, 2, s, init), &created);
    ASSERT_TRUE(st.ok()) << st.error_message();
    PushRequest push;
    push.set_job(kBnJob);
    push.set_request_id(1);
    for (int64_t idx : p.shard_chunks(s)) {
      const ChunkInfo& c = p.chunks()[idx];
      ChunkData* d = push.add_chunks();
      d->set_tensor(c.tensor);
      d->set_chunk(c.chunk);
      d->set_dtype(FLOAT32);
      d->set_data(loopback::Bytes(delta[c.tensor].data() + c.offset, c.numel));
    }
    PushResponse pushed;
    st = stub->Push(TokenCtx().get(), push, &pushed);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }

  ShardExportOptions o;
  o.job = kBnJob;
  o.shards = Addrs();
  o.job_token = kToken;
  ASSERT_OK_AND_ASSIGN(std::vector<ExportedTensor> tensors, FetchJobTensors(o));
  ASSERT_EQ(tensors.size(), 5u);
  const std::vector<DType> dtypes = {FLOAT32, FLOAT32, FLOAT32, FLOAT32, INT64};
  for (size_t t = 0; t < tensors.size(); ++t) {
    EXPECT_EQ(tensors[t].name, l.tensors[t].name());
    EXPECT_EQ(tensors[t].shape,
              std::vector<int64_t>(l.tensors[t].shape().begin(), l.tensors[t].shape().end()));
    EXPECT_EQ(tensors[t].values, want[t]) << tensors[t].name;
    EXPECT_EQ(tensors[t].dtype, dtypes[t]) << tensors[t].name;
    EXPECT_EQ(tensors[t].buffer, t >= 2) << tensors[t].name;
  }
  EXPECT_TRUE(tensors[4].shape.empty());

  const std::string path = dir_ + "/bn.pt";
  ASSERT_OK(SaveStateDict(path, tensors));
  std::string got;
  if (!RunPython(dir_,
                 "import sys, torch\n"
                 "d = torch.load(sys.argv[1])\n"
                 "for k, v in d.items():\n"
                 "    print(k, list(v.shape), v.dtype, v.flatten().tolist())\n"
                 "m = torch.nn.BatchNorm1d(3)\n"
                 "print(m.load_state_dict(d, strict=True))\n"
                 "print(m.num_batches_tracked.dtype, m.num_batches_tracked.item(),\n"
                 "      m.running_mean.tolist(), m.weight.tolist())\n",
                 path, &got)) {
    GTEST_SKIP() << kPython << " cannot import torch (install python3-torch)";
  }
  EXPECT_EQ(got,
            "rc=0\n"
            "weight [3] torch.float32 [1.5, 2.0, -0.5]\n"
            "bias [3] torch.float32 [0.25, 0.0, -1.0]\n"
            "running_mean [3] torch.float32 [0.625, 3.0, -1.75]\n"
            "running_var [3] torch.float32 [0.75, 1.0, 3.25]\n"
            "num_batches_tracked [] torch.int64 [8]\n"
            "<All keys matched successfully>\n"
            "torch.int64 8 [0.625, 3.0, -1.75] [1.5, 2.0, -0.5]\n");
}

// Every element type: float64 exact, float16/bfloat16 rounded to nearest even (3 + 2^-10 is
// a tie that goes to 3; -1e9 in bfloat16 is -238 * 2^22; fp16 overflows to -inf), integers
// rounded (halves away from zero) and clamped, bool != 0; an unknown dtype is refused.
TEST(SaveStateDictTest, WritesEachDTypeAsTorchReadsIt) {
  const std::string dir = ::testing::TempDir() + "/state_dict_test_" + std::to_string(getpid());
  ASSERT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  const std::vector<float> v = {1.5f, -2.5f, 0.0f, 300.25f, -1e9f, 3.0009765625f};
  std::vector<ExportedTensor> tensors;
  for (DType d : {FLOAT32, FLOAT64, FLOAT16, BFLOAT16, INT64, INT32, INT16, INT8, UINT8, BOOL}) {
    ExportedTensor t;
    t.name = DType_Name(d);
    t.shape = {2, 3};
    t.values = v;
    t.dtype = d;
    t.buffer = true;
    tensors.push_back(t);
  }
  ExportedTensor scalar;
  scalar.name = "scalar";
  scalar.values = {41.5f};
  scalar.dtype = INT32;
  tensors.push_back(scalar);
  const std::string path = dir + "/all.pt";
  ASSERT_OK(SaveStateDict(path, tensors));

  std::vector<ExportedTensor> bad = {tensors[0]};
  bad[0].dtype = static_cast<DType>(42);
  EXPECT_EQ(SaveStateDict(dir + "/bad.pt", bad),
            absl::InvalidArgumentError("tensor FLOAT32 has dtype 42, which export cannot write"));
  EXPECT_FALSE(std::ifstream(dir + "/bad.pt").good());

  std::string got;
  if (!RunPython(dir,
                 "import sys, torch\n"
                 "for k, v in torch.load(sys.argv[1]).items():\n"
                 "    print(k, list(v.shape), v.dtype, ' '.join('%.10g' % x for x in "
                 "v.flatten().tolist()))\n",
                 path, &got)) {
    GTEST_SKIP() << kPython << " cannot import torch (install python3-torch)";
  }
  EXPECT_EQ(got,
            "rc=0\n"
            "FLOAT32 [2, 3] torch.float32 1.5 -2.5 0 300.25 -1000000000 3.000976562\n"
            "FLOAT64 [2, 3] torch.float64 1.5 -2.5 0 300.25 -1000000000 3.000976562\n"
            "FLOAT16 [2, 3] torch.float16 1.5 -2.5 0 300.25 -inf 3\n"
            "BFLOAT16 [2, 3] torch.bfloat16 1.5 -2.5 0 300 -998244352 3\n"
            "INT64 [2, 3] torch.int64 2 -3 0 300 -1000000000 3\n"
            "INT32 [2, 3] torch.int32 2 -3 0 300 -1000000000 3\n"
            "INT16 [2, 3] torch.int16 2 -3 0 300 -32768 3\n"
            "INT8 [2, 3] torch.int8 2 -3 0 127 -128 3\n"
            "UINT8 [2, 3] torch.uint8 2 0 0 255 0 3\n"
            "BOOL [2, 3] torch.bool 1 1 0 1 1 1\n"
            "scalar [] torch.int32 42\n");
}

}  // namespace
}  // namespace cli
}  // namespace gradmesh
