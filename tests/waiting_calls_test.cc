// Pushes waiting at a sync barrier and pulls held by an ssp bound take no server thread
// (issue #15 item 6): a real gRPC server on 127.0.0.1 whose synchronous pool is capped at a few
// threads holds 1,000 waiting pushes while other calls answer promptly; then the last push
// releases them all with the rank-order average. Also: the shard's limit on waiting calls, a
// client's cancellation withdrawing its push, an ssp pull waiting without a thread, the barrier
// timeout, and a server shutdown with calls still waiting.
#include <grpcpp/client_context.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "proto/gradmesh.grpc.pb.h"
#include "rpc/grpc_util.h"
#include "server/parameter_service.h"
#include "server/shard.h"
#include "tests/testing/loopback.h"

namespace gradmesh {
namespace {

using loopback::Bytes;
using loopback::Floats;

constexpr int kSyncThreads = 4;  // The server's synchronous pool (InitJob, Finish, GetJobInfo).
constexpr int64_t kElems = 4;

// A shard server whose synchronous thread pool is capped at kSyncThreads threads.
struct CappedServer {
  std::unique_ptr<Shard> shard;
  std::unique_ptr<ParameterServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<ParameterService::Stub> stub;

  // Returns how long the shutdown took.
  absl::Duration Stop() {
    const absl::Time start = absl::Now();
    if (server != nullptr) {
      server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
      server->Wait();
      server.reset();
    }
    const absl::Duration took = absl::Now() - start;
    service.reset();
    shard.reset();
    return took;
  }
  ~CappedServer() { Stop(); }
};

std::unique_ptr<CappedServer> StartCapped(ShardOptions options = ShardOptions()) {
  auto s = std::make_unique<CappedServer>();
  auto shard = Shard::Create(std::move(options));
  EXPECT_OK(shard.status());
  if (!shard.ok()) return nullptr;
  s->shard = std::move(shard).value();
  s->service = std::make_unique<ParameterServiceImpl>(s->shard.get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  // The tests hold a thousand waiting calls, standing for a thousand workers, on one client
  // connection: no cap on streams per connection (RpcOptions.max_concurrent_streams).
  RpcOptions rpc;
  rpc.max_concurrent_streams = 0;
  ConfigureServerBuilder(rpc, &builder);
  grpc::ResourceQuota quota("capped");
  quota.SetMaxThreads(kSyncThreads);
  builder.SetResourceQuota(quota);
  builder.RegisterService(s->service.get());
  s->server = builder.BuildAndStart();
  if (s->server == nullptr || port == 0) return nullptr;
  s->stub = ParameterService::NewStub(MakeChannel(absl::StrCat("127.0.0.1:", port), RpcOptions()));
  return s;
}

// One tensor "w" of kElems elements in one chunk, zero-initialised, SGD with lr 1.
InitJobRequest Init(const std::string& job, const std::string& mode, int32_t workers,
                    double barrier_timeout_s = 60) {
  JobLayout l;
  l.job = job;
  l.tensors = {loopback::Tensor("w", {kElems})};
  l.chunk_elems = kElems;
  l.optimizer.set_name("sgd");
  l.optimizer.set_lr(1.0);
  l.consistency = mode;
  l.num_workers = workers;
  l.barrier_timeout_s = barrier_timeout_s;
  return loopback::MakeInitRequest(l, 1, 0, loopback::Zeros(l));
}

// Worker w's gradient: element e is w + e (exact sums in float32 for these sizes).
std::vector<float> Grad(int32_t w) {
  std::vector<float> g(kElems);
  for (int64_t e = 0; e < kElems; ++e) g[e] = static_cast<float>(w + e);
  return g;
}

PushRequest MakePush(const std::string& job, int32_t worker, int64_t step, uint64_t id) {
  PushRequest p;
  p.set_job(job);
  p.set_worker(worker);
  p.set_step(step);
  p.set_request_id(id);
  ChunkData* c = p.add_chunks();
  c->set_tensor(0);
  c->set_chunk(0);
  c->set_version(0);
  c->set_dtype(FLOAT32);
  c->set_data(Bytes(Grad(worker)));
  return p;
}

std::unique_ptr<grpc::ClientContext> Ctx(absl::Duration deadline = absl::Seconds(60)) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  return ctx;
}

// Calls made with the callback client API: no client thread per call either.
class AsyncCalls {
 public:
  // Starts a push; its outcome is recorded under `index`.
  void Push(ParameterService::Stub* stub, PushRequest request) {
    auto call = std::make_unique<Call>();
    call->push = std::move(request);
    call->ctx = Ctx();
    Call* c = call.get();
    {
      absl::MutexLock lock(&mu_);
      calls_.push_back(std::move(call));
    }
    stub->async()->Push(c->ctx.get(), &c->push, &c->push_response,
                        [this, c](grpc::Status st) { Done(c, std::move(st)); });
  }
  void Pull(ParameterService::Stub* stub, PullRequest request) {
    auto call = std::make_unique<Call>();
    call->pull = std::move(request);
    call->ctx = Ctx();
    Call* c = call.get();
    {
      absl::MutexLock lock(&mu_);
      calls_.push_back(std::move(call));
    }
    stub->async()->Pull(c->ctx.get(), &c->pull, &c->pull_response,
                        [this, c](grpc::Status st) { Done(c, std::move(st)); });
  }
  void Cancel(size_t i) {
    absl::MutexLock lock(&mu_);
    calls_[i]->ctx->TryCancel();
  }
  // Waits until `n` calls have completed.
  bool WaitDone(int n, absl::Duration timeout) {
    // A CondVar rather than a Condition: ThreadSanitizer runs see the hand-off.
    const absl::Time deadline = absl::Now() + timeout;
    absl::MutexLock lock(&mu_);
    while (done_ < n) {
      if (cv_.WaitWithDeadline(&mu_, deadline)) return done_ >= n;
    }
    return true;
  }
  int done() const {
    absl::MutexLock lock(&mu_);
    return done_;
  }
  grpc::Status status(size_t i) const {
    absl::MutexLock lock(&mu_);
    return calls_[i]->status;
  }
  PushResponse push_response(size_t i) const {
    absl::MutexLock lock(&mu_);
    return calls_[i]->push_response;
  }
  PullResponse pull_response(size_t i) const {
    absl::MutexLock lock(&mu_);
    return calls_[i]->pull_response;
  }
  ~AsyncCalls() { WaitDone(static_cast<int>(calls_.size()), absl::Seconds(60)); }

 private:
  struct Call {
    std::unique_ptr<grpc::ClientContext> ctx;
    PushRequest push;
    PushResponse push_response;
    PullRequest pull;
    PullResponse pull_response;
    grpc::Status status;
  };
  void Done(Call* c, grpc::Status st) {
    absl::MutexLock lock(&mu_);
    c->status = std::move(st);
    ++done_;
    cv_.SignalAll();
  }

  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  std::vector<std::unique_ptr<Call>> calls_ ABSL_GUARDED_BY(mu_);
  int done_ ABSL_GUARDED_BY(mu_) = 0;
};

// Polls until the shard holds `n` waiting calls.
bool WaitForWaiting(const Shard& shard, int64_t n, absl::Duration timeout = absl::Seconds(60)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (shard.waiting() != n) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// Threads of this process (the server is in it), from /proc/self/status.
int ProcessThreads() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    int n = 0;
    if (line.rfind("Threads:", 0) == 0 && absl::SimpleAtoi(line.substr(8), &n)) return n;
  }
  return -1;
}

PullResponse PullAll(ParameterService::Stub* stub, const std::string& job, int32_t worker) {
  PullRequest req;
  req.set_job(job);
  req.set_worker(worker);
  PullResponse resp;
  grpc::Status st = stub->Pull(Ctx().get(), req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return resp;
}

TEST(WaitingCallsTest, ThousandWaitingPushesDoNotExhaustTheServersThreads) {
  constexpr int32_t kWaiting = 1000;
  auto s = StartCapped();
  ASSERT_NE(s, nullptr);
  InitJobResponse created;
  ASSERT_TRUE(s->stub->InitJob(Ctx().get(), Init("big", "sync", kWaiting + 1), &created).ok());
  const int threads_before = ProcessThreads();
  AsyncCalls calls;
  for (int32_t w = 0; w < kWaiting; ++w) calls.Push(s->stub.get(), MakePush("big", w, 0, w + 1));
  ASSERT_TRUE(WaitForWaiting(*s->shard, kWaiting)) << s->shard->waiting();
  EXPECT_EQ(calls.done(), 0);
  // Not a thread per waiting push (the old server would have needed 1,000).
  const int threads_waiting = ProcessThreads();
  EXPECT_LT(threads_waiting - threads_before, 50)
      << threads_before << " threads before, " << threads_waiting << " with 1000 pushes waiting";

  // Meanwhile the server answers promptly: another job's InitJob, push and pull, and this
  // job's info.
  const absl::Time start = absl::Now();
  JobInfoRequest info_req;
  info_req.set_job("big");
  JobInfoResponse info;
  ASSERT_TRUE(s->stub->GetJobInfo(Ctx().get(), info_req, &info).ok());
  EXPECT_EQ(info.num_workers(), kWaiting + 1);
  EXPECT_EQ(info.pushes_applied(), 0);
  ASSERT_TRUE(s->stub->InitJob(Ctx().get(), Init("other", "async", 1), &created).ok());
  PushResponse other;
  ASSERT_TRUE(s->stub->Push(Ctx().get(), MakePush("other", 0, 0, 1), &other).ok());
  EXPECT_EQ(other.new_versions(0), 1);
  EXPECT_EQ(Floats(PullAll(s->stub.get(), "other", 0).chunks(0).data()),
            (std::vector<float>{0.0f, -1.0f, -2.0f, -3.0f}));
  const absl::Duration others = absl::Now() - start;
  EXPECT_LT(others, absl::Seconds(1)) << "four calls took " << others;
  RecordProperty("threads_before", threads_before);
  RecordProperty("threads_with_1000_waiting", threads_waiting);
  RecordProperty("four_other_calls_us", static_cast<int>(absl::ToInt64Microseconds(others)));
  EXPECT_EQ(calls.done(), 0);

  // The 1,001st push releases all of them with the average over the 1,001 workers.
  PushResponse last;
  const absl::Time release_start = absl::Now();
  grpc::Status st = s->stub->Push(Ctx().get(), MakePush("big", kWaiting, 0, 5000), &last);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(last.new_versions(0), 1);
  ASSERT_TRUE(calls.WaitDone(kWaiting, absl::Seconds(60)));
  RecordProperty("release_1000_us",
                 static_cast<int>(absl::ToInt64Microseconds(absl::Now() - release_start)));
  for (int32_t w = 0; w < kWaiting; ++w) {
    ASSERT_TRUE(calls.status(w).ok()) << w << ": " << calls.status(w).error_message();
    ASSERT_FALSE(calls.push_response(w).duplicate());
    ASSERT_EQ(calls.push_response(w).new_versions(0), 1) << w;
  }
  EXPECT_EQ(s->shard->waiting(), 0);
  // Rank order, as the shard sums: (sum_w (w + e)) * (1/1001); values 0 - 1 * average.
  std::vector<float> want(kElems);
  for (int64_t e = 0; e < kElems; ++e) {
    float sum = 0;
    for (int32_t w = 0; w <= kWaiting; ++w) sum += Grad(w)[e];
    want[e] = -(sum * (1.0f / static_cast<float>(kWaiting + 1)));
  }
  const PullResponse pulled = PullAll(s->stub.get(), "big", 0);
  EXPECT_EQ(pulled.chunks(0).version(), 1);
  EXPECT_EQ(Floats(pulled.chunks(0).data()), want);
  ASSERT_TRUE(s->stub->GetJobInfo(Ctx().get(), info_req, &info).ok());
  EXPECT_EQ(info.pushes_applied(), kWaiting + 1);
  EXPECT_EQ(info.updates_applied(), 1);
}

TEST(WaitingCallsTest, WaitingPushesBeyondTheLimitAreRefused) {
  ShardOptions options;
  options.limits.max_waiting_pushes = 2;
  auto s = StartCapped(std::move(options));
  ASSERT_NE(s, nullptr);
  InitJobResponse created;
  ASSERT_TRUE(s->stub->InitJob(Ctx().get(), Init("lim", "sync", 4), &created).ok());
  AsyncCalls calls;
  calls.Push(s->stub.get(), MakePush("lim", 0, 0, 1));
  calls.Push(s->stub.get(), MakePush("lim", 1, 0, 2));
  ASSERT_TRUE(WaitForWaiting(*s->shard, 2));
  PushResponse r;
  grpc::Status st = s->stub->Push(Ctx().get(), MakePush("lim", 2, 0, 3), &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(st.error_message(),
            "Push: job lim worker 2 step 0: 2 requests already wait at barriers on this shard, "
            "the most it allows (--max_waiting_pushes)");
  EXPECT_EQ(s->shard->waiting(), 2);
  // The refused push changed nothing: its id is not in progress, and it is not counted.
  JobInfoRequest info_req;
  info_req.set_job("lim");
  JobInfoResponse info;
  ASSERT_TRUE(s->stub->GetJobInfo(Ctx().get(), info_req, &info).ok());
  EXPECT_EQ(info.workers(2).last_step(), -1);
  // A shutdown cancels the waiting calls: they are withdrawn and the server stops promptly.
  const absl::Duration stop = s->Stop();
  EXPECT_LT(stop, absl::Seconds(5));
  ASSERT_TRUE(calls.WaitDone(2, absl::Seconds(10)));
  EXPECT_FALSE(calls.status(0).ok());
  EXPECT_FALSE(calls.status(1).ok());
}

TEST(WaitingCallsTest, CancelledPushIsWithdrawnAndItsRetryCounts) {
  auto s = StartCapped();
  ASSERT_NE(s, nullptr);
  InitJobResponse created;
  ASSERT_TRUE(s->stub->InitJob(Ctx().get(), Init("c", "sync", 2), &created).ok());
  AsyncCalls calls;
  calls.Push(s->stub.get(), MakePush("c", 0, 0, 7));
  ASSERT_TRUE(WaitForWaiting(*s->shard, 1));
  calls.Cancel(0);
  ASSERT_TRUE(calls.WaitDone(1, absl::Seconds(10)));
  EXPECT_EQ(calls.status(0).error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(WaitForWaiting(*s->shard, 0, absl::Seconds(10)));
  // The same request id again: not "already being applied" (the withdrawn push forgot it).
  calls.Push(s->stub.get(), MakePush("c", 0, 0, 7));
  ASSERT_TRUE(WaitForWaiting(*s->shard, 1));
  PushResponse r;
  grpc::Status st = s->stub->Push(Ctx().get(), MakePush("c", 1, 0, 8), &r);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_TRUE(calls.WaitDone(2, absl::Seconds(10)));
  ASSERT_TRUE(calls.status(1).ok()) << calls.status(1).error_message();
  EXPECT_FALSE(calls.push_response(1).duplicate());
  // Exactly one update, the average of the two workers' pushes (nothing of the cancelled one
  // twice).
  std::vector<float> want(kElems);
  for (int64_t e = 0; e < kElems; ++e) want[e] = -((Grad(0)[e] + Grad(1)[e]) * 0.5f);
  const PullResponse pulled = PullAll(s->stub.get(), "c", 0);
  EXPECT_EQ(pulled.chunks(0).version(), 1);
  EXPECT_EQ(Floats(pulled.chunks(0).data()), want);
}

TEST(WaitingCallsTest, SspPullWaitsWithoutAThread) {
  auto s = StartCapped();
  ASSERT_NE(s, nullptr);
  InitJobResponse created;
  ASSERT_TRUE(s->stub->InitJob(Ctx().get(), Init("ssp", "ssp:0", 2), &created).ok());
  PushResponse r;
  ASSERT_TRUE(s->stub->Push(Ctx().get(), MakePush("ssp", 0, 0, 1), &r).ok());
  AsyncCalls calls;
  PullRequest pull;
  pull.set_job("ssp");
  pull.set_worker(0);
  calls.Pull(s->stub.get(), pull);  // Worker 0 leads by one step > 0: waits.
  ASSERT_TRUE(WaitForWaiting(*s->shard, 1));
  EXPECT_EQ(calls.done(), 0);
  ASSERT_TRUE(s->stub->Push(Ctx().get(), MakePush("ssp", 1, 0, 2), &r).ok());
  ASSERT_TRUE(calls.WaitDone(1, absl::Seconds(10)));
  ASSERT_TRUE(calls.status(0).ok()) << calls.status(0).error_message();
  const PullResponse got = calls.pull_response(0);
  ASSERT_EQ(got.chunks_size(), 1);
  EXPECT_EQ(got.chunks(0).version(), 2);  // Both pushes applied before the pull was served.
  std::vector<float> want(kElems);
  for (int64_t e = 0; e < kElems; ++e) want[e] = (0.0f - Grad(0)[e]) - Grad(1)[e];
  EXPECT_EQ(Floats(got.chunks(0).data()), want);
}

TEST(WaitingCallsTest, BarrierTimeoutComesFromTheTimer) {
  auto s = StartCapped();
  ASSERT_NE(s, nullptr);
  InitJobResponse created;
  ASSERT_TRUE(s->stub->InitJob(Ctx().get(), Init("t", "sync", 2, 0.2), &created).ok());
  PushResponse r;
  const absl::Time start = absl::Now();
  grpc::Status st = s->stub->Push(Ctx().get(), MakePush("t", 1, 3, 1), &r);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(st.error_message(),
            "sync barrier for step 3 timed out after 200ms: workers [0] did not push; nothing "
            "was applied");
  EXPECT_EQ(s->shard->waiting(), 0);
}

}  // namespace
}  // namespace gradmesh
