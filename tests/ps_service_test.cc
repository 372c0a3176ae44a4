// End-to-end tests of the parameter service over real gRPC on 127.0.0.1: in-process servers
// (ServerBuilder + ConfigureServerBuilder + ParameterServiceImpl over a Shard), raw stubs
// (MakeChannel) and the real worker client (NewGrpcParameterClient).
//
// What must hold across the wire: status codes and messages arrive unchanged (exact code,
// message naming the job/tensor/chunk), bad requests never change state, oversized messages
// fail with RESOURCE_EXHAUSTED and leave the server serving, retried pushes apply once, the
// client retries UNAVAILABLE until a shard comes up, and concurrent pushes from several
// workers are all applied exactly.
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/status.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "proto/gradmesh.grpc.pb.h"
#include "proto/gradmesh.pb.h"
#include "rpc/grpc_util.h"
#include "server/job_tokens.h"
#include "server/parameter_service.h"
#include "server/shard.h"
#include "tests/testing/grpc_status_testing.h"
#include "tests/testing/loopback.h"
#include "worker/ps/parameter_client.h"

namespace gradmesh {
namespace {

// Shared loopback helpers (tests/testing/loopback.h).
using namespace ::gradmesh::loopback;  // NOLINT(build/namespaces)
using testutil::AbslHas;
using testutil::GrpcHas;

constexpr int64_t kMiB = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Helpers.

JobLayout MakeLayout(const std::string& job, std::vector<TensorSpec> tensors, int64_t chunk_elems,
                     double lr, int32_t num_workers = 1) {
  JobLayout l;
  l.job = job;
  l.tensors = std::move(tensors);
  l.chunk_elems = chunk_elems;
  l.optimizer.set_name("sgd");
  l.optimizer.set_lr(lr);
  l.num_workers = num_workers;
  return l;
}

ChunkData* AddChunk(PushRequest* r, int32_t tensor, int32_t chunk, const std::vector<float>& v) {
  ChunkData* d = r->add_chunks();
  d->set_tensor(tensor);
  d->set_chunk(chunk);
  d->set_dtype(FLOAT32);
  d->set_data(Bytes(v));
  return d;
}

PushRequest MakePush(const std::string& job, int32_t worker, uint64_t request_id) {
  PushRequest r;
  r.set_job(job);
  r.set_worker(worker);
  r.set_step(1);
  r.set_request_id(request_id);
  return r;
}

// A port that was free a moment ago (bound by a server on port 0, then released).
int PickFreePort() {
  std::unique_ptr<TestServer> s = StartServer();
  if (s == nullptr) return 0;
  const int port = s->port;
  s.reset();
  return port;
}

// ---------------------------------------------------------------------------------------------
// Fixture: two shards.

class TwoShardTest : public TwoShardFixture {};

// Odd sizes spanning both shards: 10, 1 (scalar-like), 12345 (13 chunks), 3x7.
JobLayout OddLayout(const std::string& job, int32_t num_workers = 1) {
  return MakeLayout(
      job, {Tensor("a", {10}), Tensor("b", {1}), Tensor("c", {12345}), Tensor("d", {3, 7})},
      /*chunk_elems=*/1000, /*lr=*/0.5, num_workers);
}

// 1. Full round trip through the real client.
TEST_F(TwoShardTest, RealClientRoundTripInitPushPullExact) {
  const JobLayout layout = OddLayout("roundtrip");
  const int64_t total_bytes = TotalElems(layout) * static_cast<int64_t>(sizeof(float));
  ASSERT_EQ(TotalElems(layout), 10 + 1 + 12345 + 21);
  const Partition p = MakePartition(layout, 2);
  // The layout really spans both shards, and tensor c is split across them.
  ASSERT_FALSE(p.shard_chunks(0).empty());
  ASSERT_FALSE(p.shard_chunks(1).empty());
  bool c_on[2] = {false, false};
  for (const ChunkInfo& c : p.chunks()) {
    if (c.tensor == 2) c_on[c.shard] = true;
  }
  ASSERT_TRUE(c_on[0] && c_on[1]);

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                       NewGrpcParameterClient(layout, ClientOptions(Addrs())));
  const Values init = OddInit(layout);
  ASSERT_OK(client->InitJob(ConstSpans(init)));
  // InitJob values are not counted as pushed payload.
  EXPECT_EQ(client->bytes_pushed(), 0);
  EXPECT_EQ(client->bytes_pulled(), 0);

  Values got = Zeros(layout);
  for (auto& t : got) std::fill(t.begin(), t.end(), -1.0f);
  ASSERT_OK(client->Pull(Spans(got)));
  EXPECT_EQ(got, init);
  EXPECT_EQ(client->bytes_pulled(), total_bytes);

  // Every chunk is at version 0 on the shard that owns it, and nowhere else.
  for (int s = 0; s < 2; ++s) {
    PullRequest req;
    req.set_job(layout.job);
    PullResponse resp;
    grpc::Status st = RawPull(stubs_[s].get(), req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(resp.chunks_size(), static_cast<int>(p.shard_chunks(s).size()));
    for (int i = 0; i < resp.chunks_size(); ++i) {
      const ChunkInfo& c = p.chunks()[p.shard_chunks(s)[i]];
      EXPECT_EQ(resp.chunks(i).tensor(), c.tensor);
      EXPECT_EQ(resp.chunks(i).chunk(), c.chunk);
      EXPECT_EQ(resp.chunks(i).version(), 0);
      EXPECT_EQ(resp.chunks(i).dtype(), FLOAT32);
    }
  }

  // Gradient of element i of tensor t: ((i + t) % 13 - 6) / 2; sgd lr 0.5 subtracts a
  // multiple of 1/4, exact in float32 for these magnitudes.
  Values grad = Zeros(layout);
  for (size_t t = 0; t < grad.size(); ++t) {
    for (size_t i = 0; i < grad[t].size(); ++i) {
      grad[t][i] = static_cast<float>(static_cast<int>((i + t) % 13) - 6) * 0.5f;
    }
  }
  ASSERT_OK(client->Push(/*step=*/7, ConstSpans(grad)));
  EXPECT_EQ(client->bytes_pushed(), total_bytes);

  Values want = init;
  for (size_t t = 0; t < want.size(); ++t) {
    for (size_t i = 0; i < want[t].size(); ++i) {
      want[t][i] = static_cast<float>(static_cast<double>(init[t][i]) - 0.5 * grad[t][i]);
      ASSERT_EQ(static_cast<double>(want[t][i]),
                static_cast<double>(init[t][i]) - 0.5 * static_cast<double>(grad[t][i]));
    }
  }
  ASSERT_OK(client->Pull(Spans(got)));
  EXPECT_EQ(got, want);
  EXPECT_EQ(client->bytes_pulled(), 2 * total_bytes);

  // Shard-side view: one push applied per shard, worker 0 at step 7, elements split exactly.
  ASSERT_OK_AND_ASSIGN(std::vector<JobInfoResponse> infos, client->GetJobInfo());
  ASSERT_EQ(infos.size(), 2u);
  int64_t owned = 0;
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(infos[s].job(), layout.job);
    EXPECT_EQ(infos[s].shard_index(), s);
    EXPECT_EQ(infos[s].num_shards(), 2);
    EXPECT_EQ(infos[s].chunk_elems(), 1000);
    EXPECT_EQ(infos[s].consistency(), "async");
    EXPECT_EQ(infos[s].owned_elements(), p.shard_elements(s));
    EXPECT_EQ(infos[s].pushes_applied(), 1);
    EXPECT_EQ(infos[s].duplicates_dropped(), 0);
    ASSERT_EQ(infos[s].workers_size(), 1);
    EXPECT_EQ(infos[s].workers(0).last_step(), 7);
    EXPECT_EQ(infos[s].workers(0).pushes_applied(), 1);
    owned += infos[s].owned_elements();
  }
  EXPECT_EQ(owned, TotalElems(layout));

  // InitJob again (same values or different ones): idempotent, nothing changes.
  const std::string before0 = Snapshot(stubs_[0].get(), layout.job);
  const std::string before1 = Snapshot(stubs_[1].get(), layout.job);
  ASSERT_OK(client->InitJob(ConstSpans(init)));
  Values other = Zeros(layout);
  ASSERT_OK(client->InitJob(ConstSpans(other)));
  EXPECT_TRUE(Snapshot(stubs_[0].get(), layout.job) == before0);
  EXPECT_TRUE(Snapshot(stubs_[1].get(), layout.job) == before1);
  ASSERT_OK(client->Pull(Spans(got)));
  EXPECT_EQ(got, want);
  EXPECT_EQ(client->bytes_pushed(), total_bytes);
  EXPECT_EQ(client->bytes_pulled(), 3 * total_bytes);

  // Raw InitJob with the same layout and no initial values: created=false.
  for (int s = 0; s < 2; ++s) {
    InitJobRequest req = MakeInitRequest(layout, 2, s, init);
    req.clear_initial();
    InitJobResponse resp;
    grpc::Status st = stubs_[s]->InitJob(Ctx().get(), req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_FALSE(resp.created());
  }
  // A different layout under the same name: FAILED_PRECONDITION, naming the job.
  {
    JobLayout changed = layout;
    changed.optimizer.set_lr(0.25);
    InitJobRequest req = MakeInitRequest(changed, 2, 0, init);
    InitJobResponse resp;
    EXPECT_TRUE(GrpcHas(stubs_[0]->InitJob(Ctx().get(), req, &resp),
                        absl::StatusCode::kFailedPrecondition,
                        {"job roundtrip", "different layout"}));
    EXPECT_TRUE(Snapshot(stubs_[0].get(), layout.job) == before0);
  }
  // A fresh raw InitJob of a new job: created=true.
  {
    JobLayout fresh = layout;
    fresh.job = "roundtrip2";
    InitJobResponse resp;
    grpc::Status st = stubs_[1]->InitJob(Ctx().get(), MakeInitRequest(fresh, 2, 1, init), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_TRUE(resp.created());
  }
}

// 2. Bad input over the wire: exact codes, messages naming job/tensor/chunk, no state change.
TEST_F(TwoShardTest, BadRequestsFailWithExactCodesAndChangeNothing) {
  const JobLayout layout = OddLayout("bad", /*num_workers=*/2);
  const Partition p = MakePartition(layout, 2);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                       NewGrpcParameterClient(layout, ClientOptions(Addrs())));
  const Values init = OddInit(layout);
  ASSERT_OK(client->InitJob(ConstSpans(init)));

  // Two chunks owned by shard 0 (distinct, full-size ones of tensor c when possible), and
  // one owned by shard 1.
  std::vector<ChunkInfo> mine;
  for (int64_t idx : p.shard_chunks(0)) {
    if (p.chunks()[idx].tensor == 2 && p.chunks()[idx].numel == 1000)
      mine.push_back(p.chunks()[idx]);
  }
  ASSERT_GE(mine.size(), 2u);
  const ChunkInfo a = mine[0], b = mine[1];
  const ChunkInfo theirs = p.chunks()[p.shard_chunks(1)[0]];
  Stub* s0 = stubs_[0].get();

  const std::string snap0 = Snapshot(s0, layout.job);
  const std::string snap1 = Snapshot(stubs_[1].get(), layout.job);
  ASSERT_FALSE(snap0.empty());
  const std::vector<float> ones(1000, 1.0f);
  auto unchanged = [&]() {
    EXPECT_TRUE(Snapshot(s0, layout.job) == snap0);
    EXPECT_TRUE(Snapshot(stubs_[1].get(), layout.job) == snap1);
  };

  // Unknown job: Push, Pull, Finish and GetJobInfo.
  {
    PushRequest r = MakePush("nosuchjob", 0, 1);
    AddChunk(&r, a.tensor, a.chunk, ones);
    EXPECT_TRUE(GrpcHas(RawPush(s0, r), absl::StatusCode::kNotFound,
                        {"job nosuchjob is not known to this shard"}));
    PullRequest pr;
    pr.set_job("nosuchjob");
    PullResponse presp;
    EXPECT_TRUE(GrpcHas(RawPull(s0, pr, &presp), absl::StatusCode::kNotFound,
                        {"job nosuchjob is not known"}));
    FinishRequest fr;
    fr.set_job("nosuchjob");
    FinishResponse fresp;
    EXPECT_TRUE(GrpcHas(s0->Finish(Ctx().get(), fr, &fresp), absl::StatusCode::kNotFound,
                        {"job nosuchjob"}));
    JobInfoRequest ir;
    ir.set_job("nosuchjob");
    JobInfoResponse iresp;
    EXPECT_TRUE(GrpcHas(s0->GetJobInfo(Ctx().get(), ir, &iresp), absl::StatusCode::kNotFound,
                        {"job nosuchjob"}));
    unchanged();
  }
  // Unknown tensor index, and unknown chunk of a known tensor (Push and Pull).
  {
    PushRequest r = MakePush(layout.job, 0, 2);
    AddChunk(&r, a.tensor, a.chunk, ones);  // Valid, but must not be applied.
    AddChunk(&r, 99, 0, ones);
    EXPECT_TRUE(GrpcHas(RawPush(s0, r), absl::StatusCode::kNotFound,
                        {"job bad tensor 99", "chunk 0", "does not exist"}));
    PushRequest r2 = MakePush(layout.job, 0, 3);
    AddChunk(&r2, 2, 500, ones);
    EXPECT_TRUE(GrpcHas(RawPush(s0, r2), absl::StatusCode::kNotFound,
                        {"job bad tensor 2 (c) chunk 500 does not exist"}));
    PullRequest pr;
    pr.set_job(layout.job);
    pr.add_chunks()->set_tensor(-1);
    PullResponse presp;
    EXPECT_TRUE(GrpcHas(RawPull(s0, pr, &presp), absl::StatusCode::kNotFound,
                        {"job bad tensor -1", "does not exist"}));
    unchanged();
  }
  // Wrong data length.
  {
    PushRequest r = MakePush(layout.job, 0, 4);
    AddChunk(&r, a.tensor, a.chunk, ones);
    AddChunk(&r, b.tensor, b.chunk, std::vector<float>(999, 1.0f));
    EXPECT_TRUE(GrpcHas(RawPush(s0, r), absl::StatusCode::kInvalidArgument,
                        {absl::StrCat("job bad tensor 2 (c) chunk ", b.chunk),
                         "expected 1000 float32 values (4000 bytes), got 3996 bytes"}));
    // Not a whole number of floats.
    PushRequest r2 = MakePush(layout.job, 0, 5);
    AddChunk(&r2, a.tensor, a.chunk, ones)->mutable_data()->push_back('x');
    EXPECT_TRUE(GrpcHas(RawPush(s0, r2), absl::StatusCode::kInvalidArgument,
                        {absl::StrCat("job bad tensor 2 (c) chunk ", a.chunk), "got 4001 bytes"}));
    unchanged();
  }
  // Wrong dtype (right byte length for float32) and an unknown codec.
  {
    PushRequest r = MakePush(layout.job, 0, 6);
    AddChunk(&r, a.tensor, a.chunk, ones);
    AddChunk(&r, b.tensor, b.chunk, ones)->set_dtype(FLOAT16);
    EXPECT_TRUE(GrpcHas(
        RawPush(s0, r), absl::StatusCode::kInvalidArgument,
        {absl::StrCat("job bad tensor 2 (c) chunk ", b.chunk), "dtype FLOAT16 is not supported"}));
    PushRequest r2 = MakePush(layout.job, 0, 7);
    AddChunk(&r2, a.tensor, a.chunk, ones)->set_codec("zstd");
    EXPECT_TRUE(GrpcHas(RawPush(s0, r2), absl::StatusCode::kInvalidArgument,
                        {absl::StrCat("job bad tensor 2 (c) chunk ", a.chunk), "codec \"zstd\""}));
    unchanged();
  }
  // NaN and Inf in the second chunk: the first (valid) chunk must not be applied either.
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(bad);
    std::vector<float> g(1000, 0.5f);
    g[37] = bad;
    PushRequest r = MakePush(layout.job, 0, 8);
    AddChunk(&r, a.tensor, a.chunk, ones);
    AddChunk(&r, b.tensor, b.chunk, g);
    EXPECT_TRUE(GrpcHas(RawPush(s0, r), absl::StatusCode::kInvalidArgument,
                        {absl::StrCat("job bad tensor 2 (c) chunk ", b.chunk),
                         "element 37 is not finite", "nothing was applied"}));
    unchanged();
  }
  // Chunk owned by the other shard (after a valid one).
  {
    PushRequest r = MakePush(layout.job, 0, 9);
    AddChunk(&r, a.tensor, a.chunk, ones);
    AddChunk(&r, theirs.tensor, theirs.chunk, std::vector<float>(theirs.numel, 1.0f));
    EXPECT_TRUE(
        GrpcHas(RawPush(s0, r), absl::StatusCode::kFailedPrecondition,
                {absl::StrCat("job bad tensor ", theirs.tensor, " (",
                              layout.tensors[theirs.tensor].name(), ") chunk ", theirs.chunk),
                 "belongs to shard 1, not shard 0"}));
    PullRequest pr;
    pr.set_job(layout.job);
    pr.add_chunks()->set_tensor(theirs.tensor);
    pr.mutable_chunks(0)->set_chunk(theirs.chunk);
    PullResponse presp;
    EXPECT_TRUE(GrpcHas(RawPull(s0, pr, &presp), absl::StatusCode::kFailedPrecondition,
                        {"belongs to shard 1, not shard 0"}));
    unchanged();
  }
  // Same chunk twice; worker rank out of range.
  {
    PushRequest r = MakePush(layout.job, 0, 10);
    AddChunk(&r, a.tensor, a.chunk, ones);
    AddChunk(&r, a.tensor, a.chunk, ones);
    EXPECT_TRUE(GrpcHas(RawPush(s0, r), absl::StatusCode::kInvalidArgument, {"appears twice"}));
    PushRequest r2 = MakePush(layout.job, 2, 11);
    AddChunk(&r2, a.tensor, a.chunk, ones);
    EXPECT_TRUE(GrpcHas(RawPush(s0, r2), absl::StatusCode::kInvalidArgument,
                        {"job bad worker 2 not in [0, 2)"}));
    unchanged();
  }

  // Nothing was counted as applied or duplicate.
  for (int s = 0; s < 2; ++s) {
    const JobInfoResponse info = RawInfo(stubs_[s].get(), layout.job);
    EXPECT_EQ(info.pushes_applied(), 0);
    EXPECT_EQ(info.duplicates_dropped(), 0);
  }

  // A rejected request id was not remembered: a valid push reusing id 8 is applied.
  {
    PushRequest r = MakePush(layout.job, 0, 8);
    AddChunk(&r, a.tensor, a.chunk, ones);
    PushResponse resp;
    grpc::Status st = RawPush(s0, r, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_FALSE(resp.duplicate());
    ASSERT_EQ(resp.new_versions_size(), 1);
    EXPECT_EQ(resp.new_versions(0), 1);
    Values got = Zeros(layout);
    ASSERT_OK(client->Pull(Spans(got)));
    for (int64_t i = 0; i < 1000; ++i) {
      ASSERT_EQ(got[2][a.offset + i], init[2][a.offset + i] - 0.5f);
    }
    EXPECT_TRUE(Snapshot(stubs_[1].get(), layout.job) == snap1);
  }

  // Errors reach the real client with the same code, annotated with RPC and shard.
  {
    JobLayout ghost = layout;
    ghost.job = "ghost";
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> c2,
                         NewGrpcParameterClient(ghost, ClientOptions(Addrs())));
    Values got = Zeros(ghost);
    EXPECT_TRUE(AbslHas(c2->Pull(Spans(got)), absl::StatusCode::kNotFound,
                        {"Pull to shard ", "job ghost is not known to this shard"}));
    EXPECT_TRUE(AbslHas(c2->Push(1, ConstSpans(got)), absl::StatusCode::kNotFound,
                        {"Push to shard ", "job ghost is not known"}));
    EXPECT_EQ(c2->bytes_pushed(), 0);
    EXPECT_EQ(c2->bytes_pulled(), 0);
    // NaN through the real client: refused before anything is sent, so no shard applies
    // any part of the step (the shards' own check is covered by the raw pushes above).
    const std::string before0 = Snapshot(stubs_[0].get(), layout.job);
    const std::string before1 = Snapshot(stubs_[1].get(), layout.job);
    Stub* so = stubs_[0].get();
    const int64_t applied_before = RawInfo(so, layout.job).pushes_applied();
    Values g = Zeros(layout);
    g[2][12000] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_TRUE(AbslHas(
        client->Push(2, ConstSpans(g)), absl::StatusCode::kInvalidArgument,
        {"Push: job bad step 2 gradient of c element 12000 is not finite", "nothing was sent"}));
    EXPECT_TRUE(Snapshot(stubs_[0].get(), layout.job) == before0);
    EXPECT_TRUE(Snapshot(stubs_[1].get(), layout.job) == before1);
    EXPECT_EQ(RawInfo(so, layout.job).pushes_applied(), applied_before);
  }
}

// InitJob errors over the wire: exact codes, and a failed InitJob creates no job.
TEST_F(TwoShardTest, InitJobErrorsCrossTheWire) {
  const JobLayout layout = OddLayout("initbad");
  const Values init = OddInit(layout);
  Stub* s0 = stubs_[0].get();
  auto init_status = [&](const InitJobRequest& req) {
    InitJobResponse resp;
    return s0->InitJob(Ctx().get(), req, &resp);
  };
  {  // A new job without initial values.
    InitJobRequest r = MakeInitRequest(layout, 2, 0, init);
    const int owned = r.initial_size();
    r.clear_initial();
    EXPECT_TRUE(GrpcHas(init_status(r), absl::StatusCode::kInvalidArgument,
                        {absl::StrCat("job initbad shard 0 owns ", owned,
                                      " chunks but the request carries initial values for 0")}));
  }
  {  // Initial values with a non-finite element.
    InitJobRequest r = MakeInitRequest(layout, 2, 0, init);
    ChunkData* d = r.mutable_initial(0);
    std::vector<float> v = Floats(d->data());
    v.back() = std::numeric_limits<float>::infinity();
    d->set_data(Bytes(v));
    EXPECT_TRUE(GrpcHas(
        init_status(r), absl::StatusCode::kInvalidArgument,
        {absl::StrCat("InitJob: job initbad tensor ", d->tensor()),
         absl::StrCat("chunk ", d->chunk(), ": element ", v.size() - 1, " is not finite")}));
  }
  {  // Initial values for a chunk of the other shard.
    InitJobRequest r = MakeInitRequest(layout, 2, 0, init);
    InitJobRequest other = MakeInitRequest(layout, 2, 1, init);
    *r.mutable_initial(0) = other.initial(0);
    EXPECT_TRUE(
        GrpcHas(init_status(r), absl::StatusCode::kInvalidArgument, {"is not owned by shard 0"}));
  }
  {  // Unknown optimizer, bad shard index, duplicate tensor names, bad chunk size.
    InitJobRequest r = MakeInitRequest(layout, 2, 0, init);
    r.mutable_optimizer()->set_name("lion");
    EXPECT_TRUE(GrpcHas(init_status(r), absl::StatusCode::kInvalidArgument,
                        {"job initbad", "unknown optimizer \"lion\""}));
    r = MakeInitRequest(layout, 2, 0, init);
    r.set_shard_index(2);
    EXPECT_TRUE(GrpcHas(init_status(r), absl::StatusCode::kInvalidArgument,
                        {"job initbad shard_index 2 not in [0, 2)"}));
    r = MakeInitRequest(layout, 2, 0, init);
    r.mutable_tensors(1)->set_name("a");
    EXPECT_TRUE(GrpcHas(init_status(r), absl::StatusCode::kInvalidArgument,
                        {"job initbad tensor 1 has an empty or repeated name \"a\""}));
    r = MakeInitRequest(layout, 2, 0, init);
    r.set_chunk_elems(0);
    // (The message does not name the job: see the report on server/shard.cc.)
    EXPECT_TRUE(
        GrpcHas(init_status(r), absl::StatusCode::kInvalidArgument, {"chunk_elems must be > 0"}));
  }
  // None of these created the job.
  JobInfoRequest ir;
  ir.set_job("initbad");
  JobInfoResponse iresp;
  EXPECT_TRUE(GrpcHas(s0->GetJobInfo(Ctx().get(), ir, &iresp), absl::StatusCode::kNotFound,
                      {"job initbad is not known to this shard"}));
  // The valid request still creates it.
  InitJobResponse resp;
  grpc::Status st = s0->InitJob(Ctx().get(), MakeInitRequest(layout, 2, 0, init), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(resp.created());
}

// 4. A retried push (same request id) is applied once.
TEST_F(TwoShardTest, RetriedPushIsAppliedOnce) {
  const JobLayout layout = OddLayout("dedupe");
  const Partition p = MakePartition(layout, 2);
  const Values init = OddInit(layout);
  for (int s = 0; s < 2; ++s) {
    InitJobResponse resp;
    grpc::Status st = stubs_[s]->InitJob(Ctx().get(), MakeInitRequest(layout, 2, s, init), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_TRUE(resp.created());
  }
  // Every chunk of shard 0, gradient 2 everywhere.
  PushRequest r = MakePush(layout.job, 0, 0xfeedULL);
  r.set_step(3);
  for (int64_t idx : p.shard_chunks(0)) {
    const ChunkInfo& c = p.chunks()[idx];
    AddChunk(&r, c.tensor, c.chunk, std::vector<float>(c.numel, 2.0f));
  }
  PushResponse first, second;
  grpc::Status st = RawPush(stubs_[0].get(), r, &first);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_FALSE(first.duplicate());
  ASSERT_EQ(first.new_versions_size(), r.chunks_size());
  for (int64_t v : first.new_versions()) EXPECT_EQ(v, 1);
  st = RawPush(stubs_[0].get(), r, &second);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(second.duplicate());
  EXPECT_EQ(second.new_versions_size(), 0);

  PullRequest pr;
  pr.set_job(layout.job);
  PullResponse presp;
  st = RawPull(stubs_[0].get(), pr, &presp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(presp.chunks_size(), r.chunks_size());
  for (const ChunkData& d : presp.chunks()) {
    EXPECT_EQ(d.version(), 1);
    const int64_t idx = p.Find(d.tensor(), d.chunk());
    ASSERT_GE(idx, 0);
    const ChunkInfo& c = p.chunks()[idx];
    const std::vector<float> v = Floats(d.data());
    ASSERT_EQ(static_cast<int64_t>(v.size()), c.numel);
    for (int64_t i = 0; i < c.numel; ++i) {
      ASSERT_EQ(v[i], init[c.tensor][c.offset + i] - 1.0f) << c.tensor << "/" << c.chunk;
    }
  }
  const JobInfoResponse info = RawInfo(stubs_[0].get(), layout.job);
  EXPECT_EQ(info.duplicates_dropped(), 1);
  EXPECT_EQ(info.pushes_applied(), 1);
  ASSERT_EQ(info.workers_size(), 1);
  EXPECT_EQ(info.workers(0).pushes_applied(), 1);
  EXPECT_EQ(info.workers(0).last_step(), 3);
  // Shard 1 saw nothing.
  const JobInfoResponse info1 = RawInfo(stubs_[1].get(), layout.job);
  EXPECT_EQ(info1.pushes_applied(), 0);
  EXPECT_EQ(info1.duplicates_dropped(), 0);
}

// 3. Oversized messages: server-side and client-side limits.
TEST(PsServiceTest, OversizedMessagesAreResourceExhaustedAndServerKeepsServing) {
  RpcOptions small;
  small.max_message_bytes = kMiB;
  std::unique_ptr<TestServer> server = StartServer(small);
  ASSERT_NE(server, nullptr);
  RpcOptions big;
  big.max_message_bytes = 64 * kMiB;
  auto stub = ParameterService::NewStub(MakeChannel(server->addr, big));

  const JobLayout layout = MakeLayout("small", {Tensor("w", {1000})}, 1000, 0.5);
  Values init = Zeros(layout);
  for (int i = 0; i < 1000; ++i) init[0][i] = static_cast<float>(i);
  {
    InitJobResponse resp;
    grpc::Status st = stub->InitJob(Ctx().get(), MakeInitRequest(layout, 1, 0, init), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  const std::string snap = Snapshot(stub.get(), layout.job);

  // 2 MiB of payload for chunk (0, 0): the server's transport rejects it before the shard
  // sees it (otherwise it would be INVALID_ARGUMENT for the wrong length).
  PushRequest huge = MakePush(layout.job, 0, 1);
  AddChunk(&huge, 0, 0, std::vector<float>(2 * kMiB / sizeof(float), 1.0f));
  ASSERT_GT(huge.ByteSizeLong(), static_cast<size_t>(2 * kMiB));
  const grpc::Status server_side = RawPush(stub.get(), huge);
  std::printf("server-side oversized push: code %d, message \"%s\"\n",
              static_cast<int>(server_side.error_code()), server_side.error_message().c_str());
  EXPECT_TRUE(GrpcHas(
      server_side, absl::StatusCode::kResourceExhausted,
      {"Received message larger than max", absl::StrCat(huge.ByteSizeLong(), " vs. ", kMiB)}));
  EXPECT_TRUE(Snapshot(stub.get(), layout.job) == snap);

  // Client-side limit: the channel refuses to send it; the server never sees it.
  auto small_stub = ParameterService::NewStub(MakeChannel(server->addr, small));
  const grpc::Status client_side = RawPush(small_stub.get(), huge);
  std::printf("client-side oversized push: code %d, message \"%s\"\n",
              static_cast<int>(client_side.error_code()), client_side.error_message().c_str());
  EXPECT_TRUE(
      GrpcHas(client_side, absl::StatusCode::kResourceExhausted,
              {"Sent message larger than max", absl::StrCat(huge.ByteSizeLong(), " vs. ", kMiB)}));
  EXPECT_TRUE(Snapshot(stub.get(), layout.job) == snap);

  // The real client against the small server: an InitJob above the limit fails the same way,
  // annotated with the shard, is not retried into success, and creates no job.
  {
    const JobLayout large =
        MakeLayout("large", {Tensor("w", {300000})}, 300000, 0.5);  // 1.2 MB of initial values.
    GrpcParameterClientOptions o = ClientOptions({server->addr});
    o.rpc = big;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> c, NewGrpcParameterClient(large, o));
    Values v = Zeros(large);
    EXPECT_TRUE(AbslHas(c->InitJob(ConstSpans(v)), absl::StatusCode::kResourceExhausted,
                        {absl::StrCat("InitJob to shard 0 (", server->addr, ")"),
                         "Received message larger than max"}));
    JobInfoRequest ir;
    ir.set_job("large");
    JobInfoResponse iresp;
    EXPECT_TRUE(GrpcHas(stub->GetJobInfo(Ctx().get(), ir, &iresp), absl::StatusCode::kNotFound,
                        {"job large"}));
  }

  JobInfoResponse info = RawInfo(stub.get(), layout.job);
  EXPECT_EQ(info.pushes_applied(), 0);
  EXPECT_EQ(info.duplicates_dropped(), 0);

  // The server keeps serving: a normal push (reusing the rejected request id) applies.
  PushRequest ok = MakePush(layout.job, 0, 1);
  AddChunk(&ok, 0, 0, std::vector<float>(1000, 4.0f));
  PushResponse resp;
  grpc::Status st = RawPush(stub.get(), ok, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_FALSE(resp.duplicate());
  ASSERT_EQ(resp.new_versions_size(), 1);
  EXPECT_EQ(resp.new_versions(0), 1);
  PullRequest pr;
  pr.set_job(layout.job);
  PullResponse presp;
  st = RawPull(small_stub.get(), pr, &presp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(presp.chunks_size(), 1);
  EXPECT_EQ(presp.chunks(0).version(), 1);
  const std::vector<float> v = Floats(presp.chunks(0).data());
  ASSERT_EQ(v.size(), 1000u);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(v[i], static_cast<float>(i) - 2.0f);
  info = RawInfo(stub.get(), layout.job);
  EXPECT_EQ(info.pushes_applied(), 1);
}

// 5a. The client retries UNAVAILABLE until the shard comes up.
// One shard, dense pushes: the client leaves the finiteness check to the shard (it checks the
// whole push before applying any of it), so a NaN comes back as the shard's INVALID_ARGUMENT,
// named by the shard, and nothing changes.
TEST(PsServiceTest, OneShardRefusesANonFinitePushWholeAndChangesNothing) {
  std::unique_ptr<TestServer> server = StartServer(RpcOptions());
  ASSERT_NE(server, nullptr);
  auto stub = ParameterService::NewStub(MakeChannel(server->addr, RpcOptions()));
  const JobLayout layout = MakeLayout("one", {Tensor("a", {10}), Tensor("b", {6})}, 4, 0.5);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                       NewGrpcParameterClient(layout, ClientOptions({server->addr})));
  Values v = Zeros(layout);
  ASSERT_OK(client->InitJob(ConstSpans(v)));
  const std::string before = Snapshot(stub.get(), layout.job);
  Values g = Zeros(layout);
  g[0][1] = 1.0f;  // A valid chunk first: it must not be applied either.
  g[1][5] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(AbslHas(client->Push(0, ConstSpans(g)), absl::StatusCode::kInvalidArgument,
                      {"Push to shard 0", "tensor 1 (b) chunk 1: element 1 is not finite (inf)",
                       "nothing was applied"}));
  EXPECT_TRUE(Snapshot(stub.get(), layout.job) == before);
  EXPECT_EQ(RawInfo(stub.get(), layout.job).pushes_applied(), 0);
  // The same step with finite values is then applied (the refused one left no trace).
  g[1][5] = 2.0f;
  ASSERT_OK(client->Push(0, ConstSpans(g)));
  ASSERT_OK(client->Pull(Spans(v)));
  EXPECT_EQ(v[0][1], -0.5f);
  EXPECT_EQ(v[1][5], -1.0f);
}

TEST(PsServiceTest, ClientRetriesUntilServerStarts) {
  const int port = PickFreePort();
  ASSERT_NE(port, 0);
  const std::string addr = absl::StrCat("127.0.0.1:", port);

  const JobLayout layout = MakeLayout("late", {Tensor("w", {5}), Tensor("v", {2, 3})}, 4, 0.5);
  GrpcParameterClientOptions o = ClientOptions({addr});
  o.max_attempts = 20;
  o.initial_backoff = absl::Milliseconds(20);
  o.max_backoff = absl::Milliseconds(200);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client, NewGrpcParameterClient(layout, o));

  std::unique_ptr<TestServer> server;
  std::atomic<bool> started{false};
  const absl::Time t0 = absl::Now();
  std::thread starter([&] {
    absl::SleepFor(absl::Milliseconds(300));
    server = StartServer(RpcOptions(), port);
    started = true;
  });
  Values init = Zeros(layout);
  for (size_t t = 0; t < init.size(); ++t) {
    for (size_t i = 0; i < init[t].size(); ++i) init[t][i] = static_cast<float>(10 * t + i);
  }
  const absl::Status st = client->InitJob(ConstSpans(init));
  const absl::Duration took = absl::Now() - t0;
  starter.join();
  ASSERT_NE(server, nullptr) << "could not restart a server on port " << port;
  ASSERT_TRUE(started);
  ASSERT_OK(st);
  EXPECT_GE(took, absl::Milliseconds(300));
  EXPECT_EQ(server->port, port);

  Values got = Zeros(layout);
  ASSERT_OK(client->Pull(Spans(got)));
  EXPECT_EQ(got, init);
  EXPECT_EQ(client->bytes_pulled(), 11 * static_cast<int64_t>(sizeof(float)));
}

// 5b. ... and gives up after max_attempts with UNAVAILABLE naming the shard.
TEST(PsServiceTest, ClientGivesUpAfterMaxAttempts) {
  const int port = PickFreePort();
  ASSERT_NE(port, 0);
  const std::string addr = absl::StrCat("127.0.0.1:", port);
  const JobLayout layout = MakeLayout("dead", {Tensor("w", {5})}, 4, 0.5);
  GrpcParameterClientOptions o = ClientOptions({addr});
  o.max_attempts = 2;
  o.initial_backoff = absl::Milliseconds(10);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client, NewGrpcParameterClient(layout, o));
  Values v = Zeros(layout);
  const absl::Status st = client->InitJob(ConstSpans(v));
  EXPECT_TRUE(
      AbslHas(st, absl::StatusCode::kUnavailable,
              {"gave up after 2 attempts", absl::StrCat("InitJob to shard 0 (", addr, ")")}))
      << st;
  EXPECT_TRUE(AbslHas(client->Push(1, ConstSpans(v)), absl::StatusCode::kUnavailable,
                      {"gave up after 2 attempts", addr}));
  EXPECT_EQ(client->bytes_pushed(), 0);
}

// 5c. ... but not once the run stops: a call waiting out a backoff against a dead shard
// (here 5 s, with 400 attempts: what the worker daemon uses) returns CANCELLED within ~50 ms
// of StopRetrying, and later calls do not retry at all.
TEST(PsServiceTest, StopRetryingEndsRetriesAgainstADeadShard) {
  const int port = PickFreePort();
  ASSERT_NE(port, 0);
  const std::string addr = absl::StrCat("127.0.0.1:", port);
  const JobLayout layout = MakeLayout("dead", {Tensor("w", {5})}, 4, 0.5);
  GrpcParameterClientOptions o = ClientOptions({addr});
  o.max_attempts = 400;
  o.initial_backoff = absl::Seconds(5);
  o.max_backoff = absl::Seconds(5);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client, NewGrpcParameterClient(layout, o));
  Values v = Zeros(layout);
  const absl::Time t0 = absl::Now();
  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(300));
    client->StopRetrying();
  });
  const absl::Status st = client->Push(1, ConstSpans(v));
  const absl::Duration took = absl::Now() - t0;
  stopper.join();
  EXPECT_TRUE(AbslHas(st, absl::StatusCode::kCancelled,
                      {"stop requested: not retrying after 1 attempt(s)", addr}))
      << st;
  EXPECT_GE(took, absl::Milliseconds(300));
  EXPECT_LT(took, absl::Seconds(2));
  const absl::Time t1 = absl::Now();
  EXPECT_EQ(client->Pull(Spans(v)).code(), absl::StatusCode::kCancelled);
  EXPECT_LT(absl::Now() - t1, absl::Seconds(2));
  EXPECT_EQ(client->bytes_pushed(), 0);
}

// 6. Concurrent pushes from 4 workers through separate clients are all applied exactly.
TEST_F(TwoShardTest, ConcurrentPushesFromFourWorkersAreAllApplied) {
  constexpr int kWorkers = 4;
  constexpr int kPushes = 200;
  constexpr float kGrad = 0.25f;  // lr 0.5: each push subtracts exactly 1/8.
  const JobLayout layout = MakeLayout(
      "conc", {Tensor("a", {2500}), Tensor("b", {7}), Tensor("c", {3, 3})}, 1000, 0.5, kWorkers);
  const Partition p = MakePartition(layout, 2);
  ASSERT_FALSE(p.shard_chunks(0).empty());
  ASSERT_FALSE(p.shard_chunks(1).empty());
  Values init = Zeros(layout);
  for (size_t t = 0; t < init.size(); ++t) {
    for (size_t i = 0; i < init[t].size(); ++i) init[t][i] = static_cast<float>(100 * t + i);
  }
  std::vector<std::unique_ptr<ParameterClient>> clients;
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> c,
                         NewGrpcParameterClient(layout, ClientOptions(Addrs(), w)));
    clients.push_back(std::move(c));
  }
  ASSERT_OK(clients[0]->InitJob(ConstSpans(init)));

  Values grad = Zeros(layout);
  for (auto& t : grad) std::fill(t.begin(), t.end(), kGrad);
  std::vector<absl::Status> results(kWorkers);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      Values scratch = Zeros(layout);
      for (int i = 0; i < kPushes; ++i) {
        absl::Status st = clients[w]->Push(i, ConstSpans(grad));
        if (st.ok() && i % 50 == 0) st = clients[w]->Pull(Spans(scratch));
        if (!st.ok()) {
          results[w] = st;
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < kWorkers; ++w) EXPECT_OK(results[w]) << "worker " << w;

  const float delta = static_cast<float>(kWorkers * kPushes) * 0.5f * kGrad;  // 100.
  ASSERT_EQ(delta, 100.0f);
  for (int s = 0; s < 2; ++s) {
    PullRequest pr;
    pr.set_job(layout.job);
    PullResponse presp;
    grpc::Status st = RawPull(stubs_[s].get(), pr, &presp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(presp.chunks_size(), static_cast<int>(p.shard_chunks(s).size()));
    for (const ChunkData& d : presp.chunks()) {
      EXPECT_EQ(d.version(), kWorkers * kPushes) << d.tensor() << "/" << d.chunk();
      const ChunkInfo& c = p.chunks()[p.Find(d.tensor(), d.chunk())];
      const std::vector<float> v = Floats(d.data());
      ASSERT_EQ(static_cast<int64_t>(v.size()), c.numel);
      for (int64_t i = 0; i < c.numel; ++i) {
        ASSERT_EQ(v[i], init[c.tensor][c.offset + i] - delta) << c.tensor << "/" << c.chunk;
      }
    }
    const JobInfoResponse info = RawInfo(stubs_[s].get(), layout.job);
    EXPECT_EQ(info.pushes_applied(), kWorkers * kPushes);
    EXPECT_EQ(info.duplicates_dropped(), 0);
    ASSERT_EQ(info.workers_size(), kWorkers);
    for (int w = 0; w < kWorkers; ++w) {
      EXPECT_EQ(info.workers(w).pushes_applied(), kPushes);
      EXPECT_EQ(info.workers(w).last_step(), kPushes - 1);
    }
  }
  const int64_t total_bytes = TotalElems(layout) * static_cast<int64_t>(sizeof(float));
  for (int w = 0; w < kWorkers; ++w) {
    EXPECT_EQ(clients[w]->bytes_pushed(), kPushes * total_bytes);
    EXPECT_EQ(clients[w]->bytes_pulled(), (kPushes / 50) * total_bytes);
  }
  Values got = Zeros(layout);
  ASSERT_OK(clients[1]->Pull(Spans(got)));
  for (size_t t = 0; t < got.size(); ++t) {
    for (size_t i = 0; i < got[t].size(); ++i) ASSERT_EQ(got[t][i], init[t][i] - delta);
  }
}

// The service stamps every InitJob with the hash of the caller's job token: a new submission
// (a new token, as the coordinator issues when a compacted job's name is reused) replaces the
// job the shard still holds; the same token (a resuming worker) keeps it.
TEST(JobIncarnationTest, ANewTokenForTheNameStartsTheJobAfresh) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Shard> shard, Shard::Create(ShardOptions()));
  JobTokens tokens(/*required=*/true);
  ParameterServiceImpl service(shard.get(), &tokens);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = ParameterService::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  const JobLayout layout = OddLayout("reused", /*num_workers=*/1);
  const InitJobRequest init = MakeInitRequest(layout, 1, 0, OddInit(layout));
  auto call = [&](const std::string& token, InitJobResponse* resp) {
    auto ctx = Ctx();
    ctx->AddMetadata("x-gradmesh-job-token", token);
    return stub->InitJob(ctx.get(), init, resp);
  };
  auto push = [&](const std::string& token) {
    PushRequest req;
    req.set_job("reused");
    req.set_step(1);
    req.set_request_id(7);
    for (const ChunkData& c : init.initial()) *req.add_chunks() = c;  // Gradient = values.
    auto ctx = Ctx();
    ctx->AddMetadata("x-gradmesh-job-token", token);
    PushResponse resp;
    return stub->Push(ctx.get(), req, &resp);
  };
  auto pull = [&](const std::string& token) {
    auto ctx = Ctx();
    ctx->AddMetadata("x-gradmesh-job-token", token);
    PullRequest req;
    req.set_job("reused");
    PullResponse resp;
    EXPECT_TRUE(stub->Pull(ctx.get(), req, &resp).ok());
    std::string out;
    for (const ChunkData& c : resp.chunks()) out += c.data();
    return out;
  };
  std::string initial;
  for (const ChunkData& c : init.initial()) initial += c.data();

  tokens.Set("reused", "first-token");
  InitJobResponse resp;
  ASSERT_TRUE(call("first-token", &resp).ok());
  EXPECT_TRUE(resp.created());
  ASSERT_TRUE(push("first-token").ok());
  const std::string trained = pull("first-token");
  ASSERT_NE(trained, initial);
  ASSERT_TRUE(call("first-token", &resp).ok());  // A resuming worker: the same job.
  EXPECT_FALSE(resp.created());
  EXPECT_EQ(pull("first-token"), trained);

  tokens.Set("reused", "second-token");  // The coordinator gave the name to a new job.
  ASSERT_TRUE(call("second-token", &resp).ok());
  EXPECT_TRUE(resp.created());
  EXPECT_EQ(pull("second-token"), initial);
  server->Shutdown();
}

}  // namespace
}  // namespace gradmesh
