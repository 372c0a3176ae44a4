// The gRPC ParameterClient against two in-process shards over real gRPC on 127.0.0.1, for a
// job with model buffers: buffer chunks are pushed dense even with a sparsifying push codec
// (the shards add the delta exactly), and pulled dense even with a narrowing pull codec, while
// the parameters' chunks go through both codecs.
#include "worker/ps/parameter_client.h"

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/status_testing.h"
#include "compression/compressor.h"
#include "compression/error_feedback.h"
#include "gtest/gtest.h"
#include "rpc/grpc_status.h"
#include "rpc/grpc_util.h"
#include "server/parameter_service.h"
#include "server/shard.h"
#include "server/sync_commits.h"
#include "tests/proxy/delay_proxy.h"
#include "worker/core/device_gradients.h"

namespace gradmesh {
namespace {

using Values = std::vector<std::vector<float>>;

struct InProcessShard {
  std::unique_ptr<Shard> shard;
  std::unique_ptr<ParameterServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::string addr;

  ~InProcessShard() {
    if (server != nullptr) {
      server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      server->Wait();
    }
  }
};

TensorSpec Spec(const std::string& name, std::vector<int64_t> shape, bool buffer = false,
                DType dtype = DTYPE_UNSPECIFIED) {
  TensorSpec t;
  t.set_name(name);
  for (int64_t d : shape) t.add_shape(d);
  t.set_buffer(buffer);
  t.set_dtype(dtype);
  return t;
}

// Serves `service` on a free port of 127.0.0.1 with `rpc`'s options; sets *addr to it.
std::unique_ptr<grpc::Server> Serve(grpc::Service* service, std::string* addr,
                                    const RpcOptions& rpc = RpcOptions()) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  ConfigureServerBuilder(rpc, &builder);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  *addr = absl::StrCat("127.0.0.1:", port);
  return server;
}

// A Logger whose lines the test reads back.
class CapturedLog {
 public:
  CapturedLog()
      : logger_({}, nullptr, LogLevel::kInfo, [this](const std::string& line) {
          absl::MutexLock lock(&mu_);
          lines_.push_back(line);
        }) {}
  const Logger* logger() const { return &logger_; }
  std::vector<std::string> lines() {
    absl::MutexLock lock(&mu_);
    return lines_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> lines_ ABSL_GUARDED_BY(mu_);
  const Logger logger_;
};

class BufferClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int s = 0; s < 2; ++s) {
      auto ps = std::make_unique<InProcessShard>();
      ASSERT_OK_AND_ASSIGN(ps->shard, Shard::Create(ShardOptions()));
      ps->service = std::make_unique<ParameterServiceImpl>(ps->shard.get());
      ps->server = Serve(ps->service.get(), &ps->addr);
      ASSERT_NE(ps->server, nullptr);
      shards_.push_back(std::move(ps));
    }
    // Parameter w[6] (chunks of 4 and 2), buffers rm[4] and nbt (int64 scalar); sgd lr 1, so
    // a parameter's value drops by exactly the decoded gradient.
    layout_.job = "bn";
    layout_.tensors = {Spec("w", {6}), Spec("rm", {4}, true), Spec("nbt", {}, true, INT64)};
    layout_.chunk_elems = 4;
    layout_.optimizer.set_name("sgd");
    layout_.optimizer.set_lr(1);
    layout_.num_workers = 1;
  }

  // One step of a commit_steps job: its gradient, pushed `pushes` times (a shard restarted
  // between the phases makes the worker push it again), flagged non-finite or not, then
  // committed with clip coefficient 1 (or skipped).
  struct CommitStep {
    Values grad;
    bool skip = false;
    int pushes = 1;
  };
  // w's gradient in the top-k tests: top-k 0.25 keeps 1 element of each chunk per step.
  static inline const Values kG1 = {{4, 3, 2, 1, 5, 6}, std::vector<float>(4, 0.0f), {0.0f}};
  static inline const Values kZeros = {
      std::vector<float>(6, 0.0f), std::vector<float>(4, 0.0f), {0.0f}};

  // Runs `steps` as sync job `job` with commit_steps and top-k 0.25 pushes (error feedback)
  // from zero values; returns the model after the last commit.
  absl::StatusOr<Values> RunTopKCommitSteps(const std::string& job,
                                            const std::vector<CommitStep>& steps) {
    layout_.consistency = "sync";
    layout_.commit_steps = true;
    layout_.job = job;
    ASSIGN_OR_RETURN(std::unique_ptr<ParameterClient> client,
                     NewGrpcParameterClient(layout_, Options("topk:0.25", "")));
    RETURN_IF_ERROR(client->InitJob(Const(kZeros)));
    Values model = kZeros;
    for (size_t step = 0; step < steps.size(); ++step) {
      const CommitStep& s = steps[step];
      for (int i = 0; i < s.pushes; ++i) {
        ASSIGN_OR_RETURN(PreparedFigures f, client->PushPrepared(step, Const(s.grad), s.skip));
        if (f.nonfinite != s.skip) return absl::InternalError("the shards' nonfinite flag differs");
      }
      SyncCommit commit;
      commit.set_step(step);
      commit.set_clip_coef(1.0);
      commit.set_skip(s.skip);
      ASSIGN_OR_RETURN(const bool held, client->PullCommitted(commit, Mut(model)));
      if (!held) return absl::InternalError("the shards lost the step");
    }
    return model;
  }

  GrpcParameterClientOptions Options(const std::string& push_codec,
                                     const std::string& pull_codec) const {
    GrpcParameterClientOptions o;
    for (const auto& s : shards_) o.servers.push_back(s->addr);
    o.push_codec = push_codec;
    o.pull_codec = pull_codec;
    o.rpc_deadline = absl::Seconds(10);
    o.max_attempts = 2;
    return o;
  }

  static std::vector<absl::Span<const float>> Const(const Values& v) {
    return {v.begin(), v.end()};
  }
  static std::vector<absl::Span<float>> Mut(Values& v) {
    std::vector<absl::Span<float>> out;
    for (auto& t : v) out.push_back(absl::MakeSpan(t));
    return out;
  }

  std::vector<std::unique_ptr<InProcessShard>> shards_;
  JobLayout layout_;
};

TEST_F(BufferClientTest, BuffersTravelDenseWhateverTheCodecs) {
  // Values and deltas that bf16 cannot represent, so any narrowing would show.
  const Values init = {{0.1f, 0.2f, 0.3f, 0.4f, 0.7f, 0.9f}, {0.1f, 0.2f, 0.3f, 0.4f}, {3.0f}};
  const Values grad = {
      {1.0f, 0.5f, 0.25f, 0.125f, 2.0f, 0.0625f}, {0.01f, 0.02f, 0.03f, 0.04f}, {1.0f}};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                       NewGrpcParameterClient(layout_, Options("topk:0.25", "bf16")));
  ASSERT_OK(client->InitJob(Const(init)));
  ASSERT_OK(client->Push(0, Const(grad)));

  // Dense reference: only each parameter chunk's largest gradient arrived (top-k of 1), every
  // buffer delta arrived exactly.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> reader,
                       NewGrpcParameterClient(layout_, Options("", "")));
  Values dense = {std::vector<float>(6), std::vector<float>(4), std::vector<float>(1)};
  ASSERT_OK(reader->Pull(Mut(dense)));
  EXPECT_EQ(dense[0], (std::vector<float>{0.1f - 1.0f, 0.2f, 0.3f, 0.4f, 0.7f - 2.0f, 0.9f}));
  EXPECT_EQ(dense[1], (std::vector<float>{0.1f + 0.01f, 0.2f + 0.02f, 0.3f + 0.03f, 0.4f + 0.04f}));
  EXPECT_EQ(dense[2], (std::vector<float>{4.0f}));

  // The bf16 pull: buffers exact (sent dense), parameters narrowed.
  Values pulled = {std::vector<float>(6), std::vector<float>(4), std::vector<float>(1)};
  ASSERT_OK(client->Pull(Mut(pulled)));
  EXPECT_EQ(pulled[1], dense[1]);
  EXPECT_EQ(pulled[2], dense[2]);
  ASSERT_NE(pulled[0][1], dense[0][1]);  // 0.2 is not a bfloat16.
  for (int i = 0; i < 6; ++i) {
    EXPECT_NEAR(pulled[0][i], dense[0][i], 0.01) << "element " << i;
  }
  // Wire bytes: w's two chunks went as top-k payloads, the buffers dense (5 floats); raw
  // counts all 11. Pulled: w's chunks as bf16 payloads, the buffers dense.
  const auto encoded_size = [](const std::string& spec, absl::Span<const float> v) -> int64_t {
    std::unique_ptr<Compressor> codec = CompressorRegistry::WithBuiltins().Create(spec).value();
    std::string out;
    EXPECT_OK(codec->Encode(v, 1, &out));
    return static_cast<int64_t>(out.size());
  };
  const absl::Span<const float> w(grad[0]);
  EXPECT_EQ(client->raw_bytes_pushed(), 11 * 4);
  EXPECT_EQ(client->bytes_pushed(), 5 * 4 + encoded_size("topk:0.25", w.subspan(0, 4)) +
                                        encoded_size("topk:0.25", w.subspan(4, 2)));
  EXPECT_EQ(client->raw_bytes_pulled(), 11 * 4);
  EXPECT_EQ(client->bytes_pulled(),
            5 * 4 + encoded_size("bf16", absl::Span<const float>(dense[0]).subspan(0, 4)) +
                encoded_size("bf16", absl::Span<const float>(dense[0]).subspan(4, 2)));

  // The layout the shards keep names the buffers and their dtypes.
  ASSERT_OK_AND_ASSIGN(std::vector<JobInfoResponse> infos, client->GetJobInfo());
  ASSERT_EQ(infos.size(), 2u);
  for (const JobInfoResponse& info : infos) {
    ASSERT_EQ(info.tensors_size(), 3);
    EXPECT_FALSE(info.tensors(0).buffer());
    EXPECT_TRUE(info.tensors(1).buffer());
    EXPECT_TRUE(info.tensors(2).buffer());
    EXPECT_EQ(info.tensors(2).dtype(), INT64);
  }
}

TEST_F(BufferClientTest, JobInfoWhereHeldAnswersForShardsWithoutTheJob) {
  const Values init = {{0, 0, 0, 0, 0, 0}, {0.5f, 0.5f, 0.5f, 0.5f}, {0.0f}};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                       NewGrpcParameterClient(layout_, Options("", "")));
  EXPECT_EQ(client->GetJobInfo().status().code(), absl::StatusCode::kNotFound);
  ASSERT_OK_AND_ASSIGN(std::vector<JobInfoResponse> none, client->GetJobInfoWhereHeld());
  ASSERT_EQ(none.size(), 2u);
  for (const JobInfoResponse& info : none) EXPECT_EQ(info.job(), "");
  ASSERT_OK(client->InitJob(Const(init)));
  ASSERT_OK_AND_ASSIGN(std::vector<JobInfoResponse> held, client->GetJobInfoWhereHeld());
  ASSERT_EQ(held.size(), 2u);
  for (const JobInfoResponse& info : held) {
    EXPECT_EQ(info.job(), layout_.job);
    EXPECT_EQ(info.chunk_elems(), layout_.chunk_elems);
  }
}

TEST_F(BufferClientTest, ChangesPullsKeepBuffersExactAcrossSteps) {
  const Values init = {{0, 0, 0, 0, 0, 0}, {0.5f, 0.5f, 0.5f, 0.5f}, {0.0f}};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                       NewGrpcParameterClient(layout_, Options("fp16", "changes")));
  ASSERT_OK(client->InitJob(Const(init)));
  Values model = init;
  ASSERT_OK(client->Pull(Mut(model)));
  std::vector<float> want_rm = init[1];
  for (int step = 0; step < 5; ++step) {
    // fp16 cannot hold 0.1: a buffer delta through the push codec would be rounded.
    const Values grad = {std::vector<float>(6, 0.0f), std::vector<float>(4, 0.1f), {1.0f}};
    for (float& v : want_rm) v += 0.1f;
    ASSERT_OK(client->Push(step, Const(grad)));
    ASSERT_OK(client->Pull(Mut(model)));
    EXPECT_EQ(model[1], want_rm) << "step " << step;
    EXPECT_EQ(model[2], (std::vector<float>{static_cast<float>(step + 1)})) << "step " << step;
  }
}

// PushFrom: a push computed on an older pull carries that pull's versions, so the shards
// count its staleness (the pipelined exchange relies on it). A base of the wrong length is
// refused before anything is sent.
TEST_F(BufferClientTest, PushFromCarriesTheBaseVersionsItIsGiven) {
  const Values init = {{0, 0, 0, 0, 0, 0}, {0, 0, 0, 0}, {0.0f}};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                       NewGrpcParameterClient(layout_, Options("", "")));
  ASSERT_OK(client->InitJob(Const(init)));
  Values model = init;
  ASSERT_OK(client->Pull(Mut(model)));
  const std::vector<int64_t> first = client->PulledVersions();
  ASSERT_EQ(first.size(), 4u);  // w's two chunks, rm, nbt.
  const Values grad = {std::vector<float>(6, 1.0f), std::vector<float>(4, 0.0f), {0.0f}};
  EXPECT_EQ(client->PushFrom(0, Const(grad), {0, 0}).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_OK(client->Push(0, Const(grad)));  // Staleness 0.
  ASSERT_OK(client->Pull(Mut(model)));
  EXPECT_NE(client->PulledVersions(), first);
  ASSERT_OK(client->PushFrom(1, Const(grad), first));  // Computed on the first pull: 1.
  ASSERT_OK(client->Pull(Mut(model)));
  EXPECT_EQ(model[0], std::vector<float>(6, -2.0f));  // Both applied, once each.
  ASSERT_OK_AND_ASSIGN(std::vector<JobInfoResponse> infos, client->GetJobInfo());
  std::vector<int64_t> hist;
  for (const JobInfoResponse& info : infos) {
    hist.resize(std::max<size_t>(hist.size(), info.staleness_histogram_size()));
    for (int i = 0; i < info.staleness_histogram_size(); ++i) {
      hist[i] += info.staleness_histogram(i);
    }
  }
  ASSERT_GE(hist.size(), 3u);
  EXPECT_GT(hist[0], 0);
  EXPECT_EQ(hist[1], hist[0]);  // The same chunks, one step staler.
  for (size_t i = 2; i < hist.size(); ++i) EXPECT_EQ(hist[i], 0) << "staleness " << i;
}

// PushPull (one round trip per shard: PushRequest.pull) leaves the client, the model and the
// shards exactly as Push then Pull does: the same values, versions and staleness, over the
// stream and unary transports, dense, narrowed (buffers dense) and "changes" pulls, with and
// without base versions; the pulled values are those after the push.
TEST_F(BufferClientTest, PushPullEqualsPushThenPull) {
  const Values init = {{0.1f, 0.2f, 0.3f, 0.4f, 0.7f, 0.9f}, {0.1f, 0.2f, 0.3f, 0.4f}, {3.0f}};
  const Values g1 = {
      {1.0f, 0.5f, 0.25f, 0.125f, 2.0f, 0.0625f}, {0.01f, 0.02f, 0.03f, 0.04f}, {1.0f}};
  const Values g2 = {{0.3f, 0.1f, -0.7f, 0.2f, 0.0f, 1.5f}, {0.5f, 0.0f, 0.25f, 0.0f}, {1.0f}};
  int n = 0;
  // The client logs event=fused_pull_unsupported when it falls back to two calls: none here.
  CapturedLog log;
  for (const std::string transport : {"stream", "unary"}) {
    for (const std::string pull_codec : {"", "bf16", "changes"}) {
      SCOPED_TRACE(absl::StrCat(transport, " pull codec \"", pull_codec, "\""));
      Values fused_model = init, plain_model = init;
      std::vector<int64_t> fused_versions, plain_versions;
      for (const bool fused : {true, false}) {
        JobLayout layout = layout_;
        layout.job = absl::StrCat("pp", n++);
        GrpcParameterClientOptions o = Options("", pull_codec);
        o.transport = transport;
        o.logger = log.logger();
        ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                             NewGrpcParameterClient(layout, o));
        ASSERT_OK(client->InitJob(Const(init)));
        Values& model = fused ? fused_model : plain_model;
        ASSERT_OK(client->Pull(Mut(model)));
        const std::vector<int64_t> base = client->PulledVersions();
        if (fused) {
          ASSERT_OK(client->PushPull(0, Const(g1), Mut(model), nullptr));
          // Computed on the first pull's values: staleness 1 on every chunk.
          ASSERT_OK(client->PushPull(1, Const(g2), Mut(model), &base));
          const std::vector<int64_t> short_base = {0};
          EXPECT_EQ(client->PushPull(2, Const(g2), Mut(model), &short_base).code(),
                    absl::StatusCode::kInvalidArgument);
        } else {
          ASSERT_OK(client->Push(0, Const(g1)));
          ASSERT_OK(client->Pull(Mut(model)));
          ASSERT_OK(client->PushFrom(1, Const(g2), base));
          ASSERT_OK(client->Pull(Mut(model)));
        }
        (fused ? fused_versions : plain_versions) = client->PulledVersions();
        ASSERT_OK_AND_ASSIGN(std::vector<JobInfoResponse> infos, client->GetJobInfo());
        int64_t stale1 = 0, applied = 0;
        for (const JobInfoResponse& info : infos) {
          applied += info.pushes_applied();
          if (info.staleness_histogram_size() > 1) stale1 += info.staleness_histogram(1);
        }
        EXPECT_EQ(applied, 4);  // Two pushes on each of two shards, none twice.
        EXPECT_EQ(stale1, 4);   // The second push's four chunks.
      }
      EXPECT_EQ(fused_model, plain_model);
      EXPECT_EQ(fused_versions, plain_versions);
      // SGD lr 1: w = init - g1 - g2 (up to bf16 rounding of the pulled values).
      for (size_t i = 0; i < 6; ++i) {
        EXPECT_NEAR(fused_model[0][i], init[0][i] - g1[0][i] - g2[0][i], 0.01) << i;
      }
      EXPECT_EQ(fused_model[2][0], 5.0f);  // Buffer deltas added exactly, pulled dense.
    }
  }
  for (const std::string& line : log.lines())
    EXPECT_EQ(line.find("fused_pull_unsupported"), std::string::npos) << line;
}

// JobSpec.overlap's calls: a step pushed shard by shard (each shard once, in any order) is the
// step pushed whole, for every consistency mode, with the ordered placement.
TEST_F(BufferClientTest, PushPullShardsByShardEqualsPushPull) {
  const Values init = {{0.1f, 0.2f, 0.3f, 0.4f, 0.7f, 0.9f}, {0.1f, 0.2f, 0.3f, 0.4f}, {3.0f}};
  const Values g = {
      {1.0f, 0.5f, 0.25f, 0.125f, 2.0f, 0.0625f}, {0.01f, 0.02f, 0.03f, 0.04f}, {1.0f}};
  int n = 0;
  for (const std::string consistency : {"async", "ssp:1", "sync"}) {
    for (const std::string pull_codec : {"", "changes"}) {
      SCOPED_TRACE(absl::StrCat(consistency, " pull codec \"", pull_codec, "\""));
      Values whole_model = init, split_model = init;
      for (const bool split : {true, false}) {
        JobLayout layout = layout_;
        layout.job = absl::StrCat("split", n++);
        layout.consistency = consistency;
        layout.placement = PLACEMENT_ORDERED;
        ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                             NewGrpcParameterClient(layout, Options("", pull_codec)));
        ASSERT_OK(client->InitJob(Const(init)));
        EXPECT_EQ(client->num_shards(), 2);
        // w = [4 | 2], rm = [4], nbt = [1]: middles 2, 5, 8, 10.5 of 11 (boundary 5.5).
        EXPECT_EQ(client->TensorShards(), (std::vector<std::vector<int32_t>>{{0}, {1}, {1}}));
        Values& model = split ? split_model : whole_model;
        ASSERT_OK(client->Pull(Mut(model)));
        for (int64_t step = 0; step < 2; ++step) {
          if (split) {
            ASSERT_OK(client->PushPullShards(step, Const(g), Mut(model), {1}));
            ASSERT_OK(client->PushPullShards(step, Const(g), Mut(model), {0}));
          } else {
            ASSERT_OK(client->PushPull(step, Const(g), Mut(model), nullptr));
          }
        }
        ASSERT_OK_AND_ASSIGN(std::vector<JobInfoResponse> infos, client->GetJobInfo());
        for (const JobInfoResponse& info : infos) {
          EXPECT_EQ(info.workers(0).last_step(), 1);
        }
        EXPECT_OK(client->PushPullShards(2, Const(g), Mut(model), {}));  // Nothing sent.
        for (const std::vector<int32_t>& bad :
             std::vector<std::vector<int32_t>>{{2}, {-1}, {1, 0}, {0, 0}}) {
          EXPECT_STATUS_MSG(client->PushPullShards(2, Const(g), Mut(model), bad),
                            absl::StatusCode::kInvalidArgument,
                            "are not distinct, ascending and in [0, 2)");
        }
      }
      EXPECT_EQ(split_model, whole_model);
      EXPECT_FLOAT_EQ(split_model[0][0], init[0][0] - 2 * g[0][0]);
      EXPECT_EQ(split_model[2][0], 5.0f);
    }
  }
  // A job made with one placement is another layout to a client with the other.
  JobLayout greedy = layout_;
  greedy.job = "split0";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                       NewGrpcParameterClient(greedy, Options("", "")));
  EXPECT_STATUS_MSG(client->InitJob(Const(init)), absl::StatusCode::kFailedPrecondition,
                    "already exists on this shard with a different layout");
}

// A shard built before PushRequest.pull: it ignores the field (unknown to it), applies the
// push and answers without values.
class PrePullShardService final : public ParameterService::Service {
 public:
  explicit PrePullShardService(Shard* shard) : shard_(shard) {}
  grpc::Status InitJob(grpc::ServerContext*, const InitJobRequest* req,
                       InitJobResponse* resp) override {
    absl::StatusOr<InitJobResponse> r = shard_->InitJob(*req);
    if (r.ok()) *resp = *r;
    return ToGrpcStatus(r.status());
  }
  grpc::Status Push(grpc::ServerContext*, const PushRequest* req, PushResponse* resp) override {
    PushRequest old = *req;
    old.clear_pull();
    absl::StatusOr<PushResponse> r = shard_->Push(old);
    if (r.ok()) *resp = *r;
    return ToGrpcStatus(r.status());
  }
  grpc::Status Pull(grpc::ServerContext*, const PullRequest* req, PullResponse* resp) override {
    return ToGrpcStatus(shard_->Pull(*req, resp));
  }
  grpc::Status GetJobInfo(grpc::ServerContext*, const JobInfoRequest* req,
                          JobInfoResponse* resp) override {
    absl::StatusOr<JobInfoResponse> r = shard_->GetJobInfo(*req);
    if (r.ok()) *resp = *r;
    return ToGrpcStatus(r.status());
  }

 private:
  Shard* const shard_;
};

// Against such a shard, PushPull's push is applied once and the values come from a Pull of
// their own (every later step too): a mixed-version job keeps training.
TEST(PushPullFallbackTest, AShardWithoutFusedPullsGetsAPullOfItsOwn) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Shard> shard, Shard::Create(ShardOptions()));
  PrePullShardService service(shard.get());
  std::string addr;
  std::unique_ptr<grpc::Server> server = Serve(&service, &addr);
  ASSERT_NE(server, nullptr);
  JobLayout layout;
  layout.job = "old";
  layout.tensors = {Spec("w", {6})};
  layout.chunk_elems = 4;
  layout.optimizer.set_name("sgd");
  layout.optimizer.set_lr(1);
  CapturedLog log;
  GrpcParameterClientOptions o;
  o.logger = log.logger();
  o.servers = {addr};
  o.transport = "unary";  // It has no Stream either.
  o.rpc_deadline = absl::Seconds(10);
  o.max_attempts = 2;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client, NewGrpcParameterClient(layout, o));
  std::vector<float> w(6, 1.0f);
  ASSERT_OK(client->InitJob({absl::MakeConstSpan(w)}));
  const std::vector<float> g = {1, 2, 3, 4, 5, 6};
  for (int step = 0; step < 2; ++step) {
    std::vector<float> got(6, -9.0f);
    ASSERT_OK(client->PushPull(step, {absl::MakeConstSpan(g)}, {absl::MakeSpan(got)}, nullptr));
    for (int i = 0; i < 6; ++i) EXPECT_EQ(got[i], 1.0f - (step + 1) * g[i]) << step << " " << i;
  }
  ASSERT_OK_AND_ASSIGN(std::vector<JobInfoResponse> infos, client->GetJobInfo());
  EXPECT_EQ(infos[0].pushes_applied(), 2);  // Each step's push applied once.
  EXPECT_EQ(infos[0].duplicates_dropped(), 0);
  const std::vector<std::string> lines = log.lines();
  ASSERT_EQ(lines.size(), 1u);  // Said once; the second step made two calls straight away.
  EXPECT_NE(lines[0].find("event=fused_pull_unsupported"), std::string::npos) << lines[0];
  server->Shutdown();
}

// An in-process shard behind a DelayProxy (tests/proxy/delay_proxy.h): a slow or broken link.
class SlowLinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(shard_, Shard::Create(ShardOptions()));
    service_ = std::make_unique<ParameterServiceImpl>(shard_.get());
    std::string addr;
    server_ = Serve(service_.get(), &addr, ServerRpc());
    ASSERT_NE(server_, nullptr);
    port_ = std::stoi(addr.substr(addr.rfind(':') + 1));
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }
  // The shard server's gRPC options (a subclass may change them).
  virtual RpcOptions ServerRpc() const { return RpcOptions(); }

  // Job `job`: one tensor w[6] in one chunk, sgd lr 1 (a value drops by exactly the gradient).
  static JobLayout Layout(const std::string& job) {
    JobLayout layout;
    layout.job = job;
    layout.tensors = {Spec("w", {6})};
    layout.chunk_elems = 8;
    layout.optimizer.set_name("sgd");
    layout.optimizer.set_lr(1);
    return layout;
  }

  std::unique_ptr<Shard> shard_;
  std::unique_ptr<ParameterServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// Through a link slower than the client's per-attempt deadline (a proxy that holds every
// piece 150 ms, so a call takes at least 300 ms, the first one longer), every attempt of 100 ms
// would time out: each attempt that runs out of time doubles the next one's, so the call gets
// through, its push applied once, and later calls keep the longer deadline.
TEST_F(SlowLinkTest, AnAttemptThatRanOutOfTimeDoublesTheNextOnesDeadline) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<testutil::DelayProxy> proxy,
                       testutil::DelayProxy::Start(port_, absl::Milliseconds(150)));
  const JobLayout layout = Layout("slow");
  CapturedLog log;
  GrpcParameterClientOptions o;
  o.logger = log.logger();
  o.servers = {proxy->address()};
  o.rpc_deadline = absl::Milliseconds(100);
  o.initial_backoff = absl::Milliseconds(1);
  o.max_attempts = 8;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client, NewGrpcParameterClient(layout, o));
  std::vector<float> w(6, 1.0f);
  ASSERT_OK(client->InitJob({absl::MakeConstSpan(w)}));
  const std::vector<float> g = {1, 2, 3, 4, 5, 6};
  std::vector<float> got(6, -9.0f);
  ASSERT_OK(client->PushPull(0, {absl::MakeConstSpan(g)}, {absl::MakeSpan(got)}, nullptr));
  for (int i = 0; i < 6; ++i) EXPECT_EQ(got[i], 1.0f - g[i]) << i;
  const size_t retries_before = log.lines().size();
  EXPECT_GE(retries_before, 1u);  // InitJob's first attempts ran out of time.
  for (const std::string& line : log.lines()) {
    EXPECT_NE(line.find("event=rpc_retry"), std::string::npos) << line;
  }
  EXPECT_NE(log.lines().back().find("deadline_s="), std::string::npos) << log.lines().back();
  ASSERT_OK(client->PushPull(1, {absl::MakeConstSpan(g)}, {absl::MakeSpan(got)}, nullptr));
  EXPECT_EQ(log.lines().size(), retries_before);  // The grown deadline was kept.
  ASSERT_OK_AND_ASSIGN(std::vector<JobInfoResponse> infos, client->GetJobInfo());
  EXPECT_EQ(infos[0].pushes_applied(), 2);  // Each push applied once, retried or not.
  for (int i = 0; i < 6; ++i) EXPECT_EQ(got[i], 1.0f - 2 * g[i]) << i;
}

// A connection that dies silently (the proxy drops what it carries, closing nothing, as a NAT
// that forgot it would) is found by keepalive and replaced: the next exchange goes through a
// new connection in about keepalive time + timeout, not after its 30 s deadline, and its push
// is applied once.
TEST_F(SlowLinkTest, AConnectionThatDiedSilentlyIsReplaced) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<testutil::DelayProxy> proxy,
                       testutil::DelayProxy::Start(port_, absl::ZeroDuration()));
  const JobLayout layout = Layout("frozen");
  GrpcParameterClientOptions o;
  o.servers = {proxy->address()};
  o.rpc_deadline = absl::Seconds(30);
  o.max_attempts = 3;
  o.rpc.keepalive_time_ms = 500;
  o.rpc.keepalive_timeout_ms = 500;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client, NewGrpcParameterClient(layout, o));
  std::vector<float> w(6, 1.0f);
  ASSERT_OK(client->InitJob({absl::MakeConstSpan(w)}));
  const std::vector<float> g = {1, 2, 3, 4, 5, 6};
  std::vector<float> got(6, -9.0f);
  ASSERT_OK(client->PushPull(0, {absl::MakeConstSpan(g)}, {absl::MakeSpan(got)}, nullptr));
  const int before = proxy->accepted();
  proxy->Freeze();
  const absl::Time start = absl::Now();
  ASSERT_OK(client->PushPull(1, {absl::MakeConstSpan(g)}, {absl::MakeSpan(got)}, nullptr));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_GT(proxy->accepted(), before);  // A new connection carried it.
  for (int i = 0; i < 6; ++i) EXPECT_EQ(got[i], 1.0f - 2 * g[i]) << i;
  ASSERT_OK_AND_ASSIGN(std::vector<JobInfoResponse> infos, client->GetJobInfo());
  EXPECT_EQ(infos[0].pushes_applied(), 2);
}

// Fixed HTTP/2 windows (RpcOptions.http2_window_bytes, the daemons' --http2_window_kb) on
// the shard and the client, at 128 KiB (twice gRPC's default): messages up to 20 times the
// window, pushed and pulled over both transports through a link with a 2 ms delay, arrive
// whole and exact, the windows reopened as the readers consume them (the largest, 2.5 MiB,
// go unary whatever the transport: over stream_max_bytes).
class FixedHttp2WindowTest : public SlowLinkTest {
 protected:
  static constexpr int64_t kWindow = int64_t{128} << 10;
  static RpcOptions FixedWindow() {
    RpcOptions rpc;
    rpc.http2_window_bytes = kWindow;
    return rpc;
  }
  RpcOptions ServerRpc() const override { return FixedWindow(); }
};

TEST_F(FixedHttp2WindowTest, MessagesLargerThanTheWindowArriveExactly) {
  for (const char* transport : {"stream", "unary"}) {
    for (int64_t n : {int64_t{200}, int64_t{200000}, int64_t{20} * kWindow / 4}) {
      ASSERT_OK_AND_ASSIGN(std::unique_ptr<testutil::DelayProxy> proxy,
                           testutil::DelayProxy::Start(port_, absl::Milliseconds(2)));
      JobLayout layout;
      layout.job = absl::StrCat("window-", transport, "-", n);
      layout.tensors = {Spec("w", {n})};
      layout.chunk_elems = n;
      layout.optimizer.set_name("sgd");
      layout.optimizer.set_lr(1);
      GrpcParameterClientOptions o;
      o.servers = {proxy->address()};
      o.transport = transport;
      o.rpc = FixedWindow();
      ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                           NewGrpcParameterClient(layout, o));
      std::vector<float> w(n), g(n), got(n, -1.0f);
      for (int64_t i = 0; i < n; ++i) {
        w[i] = static_cast<float>(i % 1000);
        g[i] = static_cast<float>(i % 7) - 3.0f;
      }
      ASSERT_OK(client->InitJob({absl::MakeConstSpan(w)}));
      for (int step = 0; step < 2; ++step) {
        ASSERT_OK(client->PushPull(step, {absl::MakeConstSpan(g)}, {absl::MakeSpan(got)}, nullptr))
            << transport << " " << n;
      }
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], w[i] - 2 * g[i]) << transport << " " << i;
      ASSERT_OK(client->Pull({absl::MakeSpan(got)}));
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], w[i] - 2 * g[i]) << transport << " " << i;
    }
  }
}

// A stop (a cancelled job) cuts short a call waiting for an answer that is not coming (a
// black-holed link, keepalive off), over the stream and unary alike: CANCELLED within a
// second, not after the attempt's 30 s deadline.
TEST_F(SlowLinkTest, AStopCutsShortACallInFlight) {
  for (const char* transport : {"stream", "unary"}) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<testutil::DelayProxy> proxy,
                         testutil::DelayProxy::Start(port_, absl::ZeroDuration()));
    const JobLayout layout = Layout(absl::StrCat("stopped-", transport));
    GrpcParameterClientOptions o;
    o.servers = {proxy->address()};
    o.transport = transport;
    o.rpc_deadline = absl::Seconds(30);
    o.rpc.keepalive_time_ms = 0;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                         NewGrpcParameterClient(layout, o));
    std::vector<float> w(6, 1.0f);
    ASSERT_OK(client->InitJob({absl::MakeConstSpan(w)}));
    const std::vector<float> g = {1, 2, 3, 4, 5, 6};
    std::vector<float> got(6, -9.0f);
    ASSERT_OK(client->PushPull(0, {absl::MakeConstSpan(g)}, {absl::MakeSpan(got)}, nullptr));
    proxy->Freeze();
    std::thread stopper([&] {
      absl::SleepFor(absl::Milliseconds(300));
      client->StopRetrying();
    });
    const absl::Time start = absl::Now();
    const absl::Status st =
        client->PushPull(1, {absl::MakeConstSpan(g)}, {absl::MakeSpan(got)}, nullptr);
    const absl::Duration took = absl::Now() - start;
    stopper.join();
    EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << transport << ": " << st;
    EXPECT_NE(st.message().find("stop requested"), std::string::npos) << st;
    EXPECT_LT(took, absl::Seconds(2)) << transport;
  }
}

// A sync step flagged non-finite (PushPrepared with zeros, then a skip) is skipped by every
// shard, so it must leave the error-feedback residual as it was: job A (steps g1, skipped,
// g2) ends with the same values as job B (steps g1, g2). top-k keeps 1 of each chunk's
// elements, so after g1 the residual holds 3, 2, 1 and 5; spending it on the skipped step
// would lose the 3 and the 5.
TEST_F(BufferClientTest, SkippedSyncStepLeavesTheErrorFeedbackResidualAlone) {
  ASSERT_OK_AND_ASSIGN(const Values with_skip,
                       RunTopKCommitSteps("ef-skip", {{kG1}, {kZeros, true}, {kZeros}}));
  // The last step sends the residual's largest elements.
  ASSERT_OK_AND_ASSIGN(const Values without, RunTopKCommitSteps("ef-plain", {{kG1}, {kZeros}}));
  // lr 1: w = -(4 + 3) in chunk 0's first two elements, -(6 + 5) in chunk 1.
  EXPECT_EQ(without[0], (std::vector<float>{-4, -3, 0, 0, -5, -6}));
  EXPECT_EQ(with_skip[0], without[0]);
}

// A commit_steps step pushed again (a shard restarted between the two phases: ps_mode's
// CommittedExchange pushes it again and commits again) sends the step's first encodings: error
// feedback counts the step once. (Encoded twice, the residual gave out the step's gradient a
// second time over the next steps: here 4 and 3 applied twice.)
TEST_F(BufferClientTest, AStepPushedAgainBeforeItsCommitIsEncodedOnce) {
  // After g1, the residual's largest elements, and the next.
  ASSERT_OK_AND_ASSIGN(const Values twice,
                       RunTopKCommitSteps("ef-twice", {{kG1, false, 2}, {kZeros}, {kZeros}}));
  ASSERT_OK_AND_ASSIGN(const Values once,
                       RunTopKCommitSteps("ef-once", {{kG1}, {kZeros}, {kZeros}}));
  // lr 1, the largest element of each chunk per step (chunk 0: elements 0-3, chunk 1: 4-5):
  // 4, 3, 2 and 6, 5 go out once each.
  EXPECT_EQ(once[0], (std::vector<float>{-4, -3, -2, 0, -5, -6}));
  EXPECT_EQ(twice[0], once[0]);
}

// A step pushed again that a shard applied but no longer holds the figures of (they are kept
// in memory for the last 16 committed steps: a shard restarted after applying it, while
// another lost it before, forgets them the same way) is answered as a duplicate without them.
// The client decides from the other shards' parts, and the commit finds the step applied. It
// used to fail the step with INTERNAL, and the job for good: every retry met the same answer.
TEST_F(BufferClientTest, AStepAppliedButForgottenByTheShardsIsCommittedWithoutItsFigures) {
  layout_.consistency = "sync";
  layout_.commit_steps = true;
  layout_.job = "forgotten";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                       NewGrpcParameterClient(layout_, Options("", "")));
  const Values zeros = {std::vector<float>(6, 0.0f), std::vector<float>(4, 0.0f), {0.0f}};
  const Values g = {{1, 2, 3, 4, 5, 6}, std::vector<float>(4, 0.0f), {0.0f}};
  ASSERT_OK(client->InitJob(Const(zeros)));
  Values model = zeros;
  auto commit = [&](int64_t step) -> absl::StatusOr<bool> {
    SyncCommit c;
    c.set_step(step);
    c.set_clip_coef(1.0);
    return client->PullCommitted(c, Mut(model));
  };
  for (int64_t step = 0; step <= SyncCommits::kRemembered; ++step) {
    ASSERT_OK_AND_ASSIGN(PreparedFigures f,
                         client->PushPrepared(step, Const(step == 0 ? g : zeros), false));
    EXPECT_EQ(f.forgotten, 0);
    ASSERT_OK_AND_ASSIGN(const bool held, commit(step));
    ASSERT_TRUE(held) << step;
  }
  const Values trained = model;
  EXPECT_EQ(trained[0], (std::vector<float>{-1, -2, -3, -4, -5, -6}));
  ASSERT_OK_AND_ASSIGN(PreparedFigures again, client->PushPrepared(0, Const(g), false));
  EXPECT_EQ(again.forgotten, 2);
  EXPECT_EQ(again.grad_sq_norm, 0.0);
  ASSERT_OK_AND_ASSIGN(const bool held, commit(0));
  EXPECT_TRUE(held);
  EXPECT_EQ(model, trained);  // Applied once.
}

// Device gradients (worker/core/device_gradients.h) on the host: the "device" holds the true
// gradient and encodes it with the host codec and error feedback, as the LibTorch side does.
class FakeDeviceGradients : public DeviceGradients {
 public:
  struct Call {
    int param;
    int64_t offset, numel, slot;
    bool ef;
  };
  FakeDeviceGradients(Values grads, std::string spec) : grads(std::move(grads)), spec_(spec) {}

  absl::Status Encode(absl::Span<const DeviceChunk> chunks, const DeviceCodec& codec,
                      const ErrorFeedbackOptions* ef, std::vector<std::string>* out) override {
    ++batches;
    RETURN_IF_ERROR(finite);
    ASSIGN_OR_RETURN(std::unique_ptr<Compressor> c,
                     CompressorRegistry::WithBuiltins().Create(spec_));
    out->resize(chunks.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      const DeviceChunk& d = chunks[i];
      calls.push_back({d.param, d.offset, d.numel, d.slot, ef != nullptr});
      const absl::Span<const float> g =
          absl::MakeConstSpan(grads[d.param]).subspan(d.offset, d.numel);
      if (ef == nullptr) {
        RETURN_IF_ERROR(c->Encode(g, 0, &(*out)[i]));
        continue;
      }
      auto [it, fresh] = feedback_.try_emplace(d.slot, static_cast<size_t>(d.numel), *ef);
      RETURN_IF_ERROR(it->second.Compress(*c, g, 0, &(*out)[i]));
    }
    return absl::OkStatus();
  }
  void ResetFeedback() override {
    feedback_.clear();
    ++resets;
  }
  int64_t bytes_to_host() const override { return 0; }

  Values grads;  // The gradient "on the device".
  absl::Status finite = absl::OkStatus();
  std::vector<Call> calls;
  int batches = 0;
  int resets = 0;

 private:
  const std::string spec_;
  std::map<int64_t, ErrorFeedback> feedback_;
};

TEST_F(BufferClientTest, DeviceGradientsAreEncodedWhereTheyAreAndBuffersStayOnTheHost) {
  const Values init = {{0.1f, 0.2f, 0.3f, 0.4f, 0.7f, 0.9f}, {0.1f, 0.2f, 0.3f, 0.4f}, {3.0f}};
  const std::vector<float> w = {1.0f, 0.5f, 0.25f, 0.125f, 2.0f, 0.0625f};
  FakeDeviceGradients device({w}, "topk:0.25");
  // What the spans hold for the parameter is stale (NaN here: reading it would fail the push).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Values host = {std::vector<float>(6, nan), {0.01f, 0.02f, 0.03f, 0.04f}, {1.0f}};

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> dense,
                       NewGrpcParameterClient(layout_, Options("", "")));
  EXPECT_FALSE(dense->UseDeviceGradients(&device));  // No push codec: nothing to encode.
  for (const char* spec : {"topk_approx:0.25", "randomk:0.5", "qsgd:4"}) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> other,
                         NewGrpcParameterClient(layout_, Options(spec, "")));
    EXPECT_FALSE(other->UseDeviceGradients(&device)) << spec;
  }
  EXPECT_TRUE(device.calls.empty());

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                       NewGrpcParameterClient(layout_, Options("topk:0.25", "")));
  ASSERT_TRUE(client->UseDeviceGradients(&device));
  ASSERT_OK(client->InitJob(Const(init)));
  ASSERT_OK(client->Push(0, Const(host)));
  // One batch: both chunks of w (4 and 2 elements), with error feedback by chunk index.
  EXPECT_EQ(device.batches, 1);
  ASSERT_EQ(device.calls.size(), 2u);
  EXPECT_EQ(device.calls[0].param, 0);
  EXPECT_EQ(device.calls[0].offset, 0);
  EXPECT_EQ(device.calls[0].numel, 4);
  EXPECT_EQ(device.calls[1].offset, 4);
  EXPECT_EQ(device.calls[1].numel, 2);
  EXPECT_NE(device.calls[0].slot, device.calls[1].slot);
  EXPECT_TRUE(device.calls[0].ef && device.calls[1].ef);
  // As if the host had encoded w: each chunk's largest gradient arrived; buffers exact.
  Values pulled = {std::vector<float>(6), std::vector<float>(4), std::vector<float>(1)};
  ASSERT_OK(dense->Pull(Mut(pulled)));
  EXPECT_EQ(pulled[0], (std::vector<float>{0.1f - 1.0f, 0.2f, 0.3f, 0.4f, 0.7f - 2.0f, 0.9f}));
  EXPECT_EQ(pulled[1],
            (std::vector<float>{0.1f + 0.01f, 0.2f + 0.02f, 0.3f + 0.03f, 0.4f + 0.04f}));
  EXPECT_EQ(pulled[2], (std::vector<float>{4.0f}));
  // A zero gradient next: each chunk sends its largest residual (0.5 and 0.0625).
  device.grads = {std::vector<float>(6, 0.0f)};
  ASSERT_OK(client->Push(1, Const(host)));
  ASSERT_OK(dense->Pull(Mut(pulled)));
  EXPECT_EQ(pulled[0], (std::vector<float>{0.1f - 1.0f, 0.2f - 0.5f, 0.3f, 0.4f, 0.7f - 2.0f,
                                           0.9f - 0.0625f}));

  // A non-finite gradient on the device: nothing sent, the step named.
  const Values before = pulled;
  device.finite = absl::InvalidArgumentError("gradient of w element 3 is not finite");
  absl::Status st = client->Push(2, Const(host));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("step 2 gradient of w element 3 is not finite; nothing was sent"),
            std::string::npos)
      << st;
  ASSERT_OK(dense->Pull(Mut(pulled)));
  EXPECT_EQ(pulled, before);
  device.finite = absl::OkStatus();

  // The codec can change only to one the device encodes; a change resets error feedback.
  const int resets = device.resets;
  st = client->SetPushCodec("randomk:0.5");
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_EQ(client->SetPushCodec("").code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(client->SetPushCodec("topk:0.5+fp16"));
  EXPECT_EQ(device.resets, resets + 1);
}

}  // namespace
}  // namespace gradmesh
