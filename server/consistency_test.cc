#include "server/consistency.h"

#include <atomic>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

// What an ApplyFn was called with, copied (the update's buffers die with the call).
struct AppliedUpdate {
  const ChunkUpdate* address = nullptr;
  std::vector<int64_t> chunks;
  std::vector<int64_t> numels;
  std::vector<std::vector<float>> grads;
  std::vector<int64_t> base_versions;
  std::vector<RequestRef> requests;
  float lr_scale = 0;
};

// A fake ApplyFn: records every call and returns a fixed status.
class FakeApply {
 public:
  explicit FakeApply(absl::Status result = absl::OkStatus()) : result_(std::move(result)) {}

  ApplyFn fn() {
    return [this](const ChunkUpdate& u) {
      AppliedUpdate a;
      a.address = &u;
      a.chunks = u.chunks;
      a.numels = u.numels;
      for (size_t i = 0; i < u.grads.size(); ++i) {
        a.grads.emplace_back(u.grads[i], u.grads[i] + u.numels[i]);
      }
      a.base_versions = u.base_versions;
      a.requests = u.requests;
      a.lr_scale = u.lr_scale;
      absl::MutexLock lock(&mu_);
      calls_.push_back(std::move(a));
      return result_;
    };
  }

  int calls() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(calls_.size());
  }
  std::vector<AppliedUpdate> records() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  const absl::Status result_;
  mutable absl::Mutex mu_;
  std::vector<AppliedUpdate> calls_ ABSL_GUARDED_BY(mu_);
};

// A push that owns its gradient buffers.
struct OwnedPush {
  std::vector<std::vector<float>> data;
  ChunkUpdate update;
};

std::unique_ptr<OwnedPush> MakePush(int32_t worker, int64_t step, std::vector<int64_t> chunks,
                                    std::vector<std::vector<float>> grads,
                                    std::vector<int64_t> base_versions = {}) {
  auto p = std::make_unique<OwnedPush>();
  p->data = std::move(grads);
  p->update.chunks = std::move(chunks);
  for (const auto& g : p->data) {
    p->update.numels.push_back(static_cast<int64_t>(g.size()));
    p->update.grads.push_back(g.data());
  }
  if (base_versions.empty()) base_versions.assign(p->update.chunks.size(), 0);
  p->update.base_versions = std::move(base_versions);
  p->update.requests.push_back({worker, step, static_cast<uint64_t>(1000 * worker + step + 1)});
  return p;
}

// A single-chunk push of `n` copies of `value`.
std::unique_ptr<OwnedPush> SimplePush(int32_t worker, int64_t step, float value = 1.0f) {
  return MakePush(worker, step, {0}, {std::vector<float>(2, value)});
}

// Runs OnPush on its own thread.
class PushThread {
 public:
  PushThread(ConsistencyPolicy* policy, std::unique_ptr<OwnedPush> push, ApplyFn apply)
      : push_(std::move(push)) {
    thread_ = std::thread([this, policy, apply = std::move(apply)] {
      status_ = policy->OnPush(push_->update, apply);
      done_.Notify();
    });
  }
  ~PushThread() {
    if (thread_.joinable()) thread_.join();
  }
  bool done() const { return done_.HasBeenNotified(); }
  bool WaitFor(absl::Duration d) { return done_.WaitForNotificationWithTimeout(d); }
  // Joins the thread before reading what it wrote (a hand-off ThreadSanitizer runs can see).
  absl::Status status() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }

 private:
  std::unique_ptr<OwnedPush> push_;
  absl::Status status_;
  absl::Notification done_;
  std::thread thread_;
};

// Runs BeforePull on its own thread.
class PullThread {
 public:
  PullThread(ConsistencyPolicy* policy, int32_t worker) {
    thread_ = std::thread([this, policy, worker] {
      status_ = policy->BeforePull(worker);
      done_.Notify();
    });
  }
  ~PullThread() {
    if (thread_.joinable()) thread_.join();
  }
  bool done() const { return done_.HasBeenNotified(); }
  bool WaitFor(absl::Duration d) { return done_.WaitForNotificationWithTimeout(d); }
  absl::Status status() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }

 private:
  absl::Status status_;
  absl::Notification done_;
  std::thread thread_;
};

std::unique_ptr<ConsistencyPolicy> MakePolicy(const std::string& mode, int32_t workers,
                                              absl::Duration timeout = absl::Seconds(10)) {
  ConsistencyConfig c;
  c.job = "j";
  c.mode = mode;
  c.num_workers = workers;
  c.barrier_timeout = timeout;
  auto p = ConsistencyRegistry::WithBuiltins().Create(c);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::move(p).value() : nullptr;
}

absl::Status CreateStatus(const std::string& mode, int32_t workers = 2,
                          absl::Duration timeout = absl::Seconds(1)) {
  ConsistencyConfig c;
  c.mode = mode;
  c.num_workers = workers;
  c.barrier_timeout = timeout;
  return ConsistencyRegistry::WithBuiltins().Create(c).status();
}

// How long a blocked call is watched to make sure it stays blocked.
constexpr absl::Duration kStaysBlocked = absl::Milliseconds(100);
// Bound for something that must happen promptly (generous, for loaded machines).
constexpr absl::Duration kPromptly = absl::Seconds(5);

// ---------------------------------------------------------------------------------------------
// Registry

TEST(ConsistencyRegistryTest, BuiltinModes) {
  EXPECT_EQ(ConsistencyRegistry::WithBuiltins().names(),
            (std::vector<std::string>{"async", "ssp", "sync"}));
  for (const std::string mode : {"async", "sync", "ssp:0", "ssp:3"}) {
    auto p = MakePolicy(mode, 2);
    ASSERT_NE(p, nullptr) << mode;
    EXPECT_EQ(p->mode(), mode);
  }
  // A bound with leading zeros parses; mode() is canonical.
  EXPECT_EQ(MakePolicy("ssp:03", 2)->mode(), "ssp:3");
}

TEST(ConsistencyRegistryTest, BadSspBound) {
  for (const std::string mode : {"ssp", "ssp:", "ssp:-1", "ssp:x", "ssp:1.5"}) {
    EXPECT_STATUS_MSG(
        CreateStatus(mode), absl::StatusCode::kInvalidArgument,
        "staleness bound >= 0, as in \"ssp:3\"; got \"" + mode + (mode == "ssp" ? ":" : "") + "\"")
        << mode;
  }
}

TEST(ConsistencyRegistryTest, ParameterForParameterlessModes) {
  EXPECT_STATUS_MSG(CreateStatus("sync:1"), absl::StatusCode::kInvalidArgument,
                    "consistency mode \"sync\" takes no parameter, got \"1\"");
  EXPECT_STATUS_MSG(CreateStatus("async:fast"), absl::StatusCode::kInvalidArgument,
                    "consistency mode \"async\" takes no parameter, got \"fast\"");
}

TEST(ConsistencyRegistryTest, UnknownMode) {
  EXPECT_STATUS_MSG(CreateStatus("bogus"), absl::StatusCode::kInvalidArgument,
                    "unknown consistency mode \"bogus\" (known: async, ssp, sync;");
  EXPECT_STATUS_MSG(CreateStatus("bogus:3"), absl::StatusCode::kInvalidArgument,
                    "unknown consistency mode \"bogus:3\" (known: async, ssp, sync;");
  EXPECT_STATUS_MSG(CreateStatus(""), absl::StatusCode::kInvalidArgument,
                    "unknown consistency mode \"\"");
}

TEST(ConsistencyRegistryTest, BadConfig) {
  EXPECT_STATUS_MSG(CreateStatus("async", 0), absl::StatusCode::kInvalidArgument,
                    "num_workers must be > 0, got 0");
  EXPECT_STATUS_MSG(CreateStatus("sync", -2), absl::StatusCode::kInvalidArgument,
                    "num_workers must be > 0, got -2");
  EXPECT_STATUS_MSG(CreateStatus("ssp:1", 2, absl::ZeroDuration()),
                    absl::StatusCode::kInvalidArgument, "barrier timeout must be > 0");
}

TEST(ConsistencyRegistryTest, CustomFactoryGetsParamAndConfig) {
  ConsistencyRegistry r = ConsistencyRegistry::WithBuiltins();
  std::string seen_param;
  int32_t seen_workers = 0;
  r.Register("custom",
             [&](const ConsistencyConfig& c,
                 const std::string& param) -> absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> {
               seen_param = param;
               seen_workers = c.num_workers;
               return absl::UnimplementedError("custom factory ran");
             });
  EXPECT_EQ(r.names(), (std::vector<std::string>{"async", "custom", "ssp", "sync"}));
  ConsistencyConfig c;
  c.mode = "custom:a:b";
  c.num_workers = 7;
  EXPECT_STATUS_MSG(r.Create(c).status(), absl::StatusCode::kUnimplemented, "custom factory ran");
  EXPECT_EQ(seen_param, "a:b");  // Everything after the first ':'.
  EXPECT_EQ(seen_workers, 7);
}

// ---------------------------------------------------------------------------------------------
// async

TEST(AsyncPolicyTest, AppliesEachPushOnceAndReturnsItsStatus) {
  auto policy = MakePolicy("async", 3);
  FakeApply apply;
  auto push = MakePush(1, 4, {2, 5}, {{1.5f, -2.0f}, {3.0f}}, {7, 9});
  EXPECT_OK(policy->OnPush(push->update, apply.fn()));
  ASSERT_EQ(apply.calls(), 1);
  const AppliedUpdate a = apply.records()[0];
  EXPECT_EQ(a.address, &push->update);  // Passed through, not copied or averaged.
  EXPECT_EQ(a.chunks, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(a.numels, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(a.grads, (std::vector<std::vector<float>>{{1.5f, -2.0f}, {3.0f}}));
  EXPECT_EQ(a.base_versions, (std::vector<int64_t>{7, 9}));
  ASSERT_EQ(a.requests.size(), 1u);
  EXPECT_EQ(a.requests[0].worker, 1);
  EXPECT_EQ(a.requests[0].step, 4);
  EXPECT_EQ(a.requests[0].request_id, 1005u);

  // A second push of the same worker and step is simply applied again (dedupe is the shard's).
  EXPECT_OK(policy->OnPush(push->update, apply.fn()));
  EXPECT_EQ(apply.calls(), 2);

  // Pulls never wait, even for a worker far ahead of the others.
  for (int64_t s = 0; s < 50; ++s) ASSERT_OK(policy->OnPush(SimplePush(0, s)->update, apply.fn()));
  EXPECT_OK(policy->BeforePull(0));
  EXPECT_EQ(policy->stats().max_clock_lead, 0);
  EXPECT_EQ(policy->stats().barrier_wait_s, 0);
}

TEST(AsyncPolicyTest, ApplyErrorIsReturnedUnchanged) {
  auto policy = MakePolicy("async", 1);
  FakeApply apply(absl::DataLossError("disk on fire"));
  auto push = SimplePush(0, 0);
  const absl::Status st = policy->OnPush(push->update, apply.fn());
  EXPECT_EQ(st, absl::DataLossError("disk on fire"));
  EXPECT_EQ(apply.calls(), 1);
}

// ---------------------------------------------------------------------------------------------
// sync

// Element k of worker w's gradient for the first chunk. The values make a float sum depend on
// the order of the terms: 1e8 + 1 == 1e8 in float.
const float kBig[3][3] = {{1e8f, 1.0f, 1e8f}, {1.0f, 1e8f, -1e8f}, {-1e8f, -1e8f, 1.0f}};

std::vector<std::vector<float>> SyncGrads(int32_t w) {
  return {{kBig[w][0], kBig[w][1], kBig[w][2]},
          {0.1f * static_cast<float>(w + 1), static_cast<float>(w) - 0.7f}};
}

// Average of the three workers' gradients with the terms added in `order`.
std::vector<std::vector<float>> AverageInOrder(const std::vector<int32_t>& order) {
  std::vector<std::vector<float>> sum = SyncGrads(order[0]);
  for (size_t i = 1; i < order.size(); ++i) {
    const auto g = SyncGrads(order[i]);
    for (size_t c = 0; c < sum.size(); ++c) {
      for (size_t k = 0; k < sum[c].size(); ++k) sum[c][k] += g[c][k];
    }
  }
  const float inv = 1.0f / 3.0f;
  for (auto& chunk : sum) {
    for (float& v : chunk) v *= inv;
  }
  return sum;
}

// Pushes step `step` from three workers, each on its own thread, arriving in `order`. Checks
// that nobody is released before the last push, and that apply ran exactly once, before any
// push returned.
void RunSyncStep(ConsistencyPolicy* policy, FakeApply* apply, const std::vector<int32_t>& order,
                 int64_t step) {
  const int calls_before = apply->calls();
  std::atomic<int> returned{0};
  std::vector<int> calls_seen(3, -1);
  std::vector<absl::Status> statuses(3);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < order.size(); ++i) {
    const int32_t w = order[i];
    if (i + 1 == order.size()) {
      // Everyone else has had time to arrive and must still be waiting.
      absl::SleepFor(absl::Milliseconds(30));
      EXPECT_EQ(returned.load(), 0) << "a sync push returned before the step was complete";
      EXPECT_EQ(apply->calls(), calls_before);
    }
    threads.emplace_back([&, w] {
      auto push = MakePush(w, step, {3, 7}, SyncGrads(w), {11, 4});
      statuses[w] = policy->OnPush(push->update, apply->fn());
      calls_seen[w] = apply->calls();
      ++returned;
    });
    if (i + 1 < order.size()) absl::SleepFor(absl::Milliseconds(30));  // Fix the arrival order.
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < 3; ++w) {
    EXPECT_OK(statuses[w]) << "worker " << w;
    EXPECT_EQ(calls_seen[w], calls_before + 1) << "worker " << w << " returned before apply";
  }
  ASSERT_EQ(apply->calls(), calls_before + 1);
}

TEST(SyncPolicyTest, AveragesInRankOrderWhateverTheArrivalOrder) {
  const auto rank_order = AverageInOrder({0, 1, 2});
  const std::vector<std::vector<int32_t>> orders = {{2, 0, 1}, {1, 2, 0}, {0, 1, 2}};
  for (const auto& order : orders) {
    SCOPED_TRACE(::testing::Message() << "arrival order " << order[0] << order[1] << order[2]);
    if (order != std::vector<int32_t>{0, 1, 2}) {
      // The values really tell the orders apart.
      ASSERT_NE(AverageInOrder(order), rank_order);
    }
    auto policy = MakePolicy("sync", 3);
    FakeApply apply;
    RunSyncStep(policy.get(), &apply, order, 0);
    const AppliedUpdate a = apply.records().at(0);
    EXPECT_EQ(a.chunks, (std::vector<int64_t>{3, 7}));
    EXPECT_EQ(a.numels, (std::vector<int64_t>{3, 2}));
    EXPECT_EQ(a.base_versions, (std::vector<int64_t>{11, 4}));
    ASSERT_EQ(a.grads.size(), 2u);
    for (size_t c = 0; c < 2; ++c) {
      ASSERT_EQ(a.grads[c].size(), rank_order[c].size());
      for (size_t k = 0; k < a.grads[c].size(); ++k) {
        // Bit-exact.
        EXPECT_EQ(a.grads[c][k], rank_order[c][k]) << "chunk " << c << " element " << k;
      }
    }
    ASSERT_EQ(a.requests.size(), 3u);
    for (int32_t w = 0; w < 3; ++w) {
      EXPECT_EQ(a.requests[w].worker, w);
      EXPECT_EQ(a.requests[w].step, 0);
      EXPECT_EQ(a.requests[w].request_id, static_cast<uint64_t>(1000 * w + 1));
    }
    EXPECT_GT(policy->stats().barrier_wait_s, 0.0);
    EXPECT_EQ(policy->stats().max_clock_lead, 0);
  }
  // Spot-check the arithmetic the test relies on: element 0 is (1e8 + 1 - 1e8) / 3 == 0 in
  // rank order, (-1e8 + 1e8 + 1) / 3 in arrival order 2, 0, 1.
  EXPECT_EQ(rank_order[0][0], 0.0f);
  EXPECT_EQ(AverageInOrder({2, 0, 1})[0][0], 1.0f * (1.0f / 3.0f));
}

TEST(SyncPolicyTest, ConsecutiveStepsEachApplyOnce) {
  auto policy = MakePolicy("sync", 3);
  FakeApply apply;
  RunSyncStep(policy.get(), &apply, {1, 0, 2}, 0);
  RunSyncStep(policy.get(), &apply, {2, 1, 0}, 1);
  const auto records = apply.records();
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].requests[0].step, 0);
  EXPECT_EQ(records[1].requests[0].step, 1);
  EXPECT_EQ(records[1].requests[2].request_id, 2002u);
}

TEST(SyncPolicyTest, SingleWorkerAppliesImmediately) {
  auto policy = MakePolicy("sync", 1);
  FakeApply apply;
  auto push = MakePush(0, 3, {1}, {{2.5f, -1.0f}});
  EXPECT_OK(policy->OnPush(push->update, apply.fn()));
  ASSERT_EQ(apply.calls(), 1);
  const AppliedUpdate a = apply.records()[0];
  EXPECT_EQ(a.grads, (std::vector<std::vector<float>>{{2.5f, -1.0f}}));  // Times 1/1.
  ASSERT_EQ(a.requests.size(), 1u);
  EXPECT_EQ(a.requests[0].request_id, 4u);
}

TEST(SyncPolicyTest, ApplyErrorReachesEveryWorkerOfTheStep) {
  auto policy = MakePolicy("sync", 2);
  FakeApply apply(absl::InternalError("log append failed"));
  PushThread first(policy.get(), SimplePush(0, 0), apply.fn());
  EXPECT_FALSE(first.WaitFor(absl::Milliseconds(30)));
  auto second = SimplePush(1, 0);
  EXPECT_EQ(policy->OnPush(second->update, apply.fn()), absl::InternalError("log append failed"));
  EXPECT_EQ(first.status(), absl::InternalError("log append failed"));
  EXPECT_EQ(apply.calls(), 1);
}

TEST(SyncPolicyTest, SecondPushOfAWorkerForAStepIsAborted) {
  auto policy = MakePolicy("sync", 3);
  FakeApply apply;
  // Two pushes of worker 0 for step 5: whichever arrives second is refused at once.
  std::vector<std::unique_ptr<PushThread>> dup;
  dup.push_back(std::make_unique<PushThread>(policy.get(), SimplePush(0, 5, 1.0f), apply.fn()));
  dup.push_back(std::make_unique<PushThread>(policy.get(), SimplePush(0, 5, 2.0f), apply.fn()));
  const absl::Time deadline = absl::Now() + kPromptly;
  while (!dup[0]->done() && !dup[1]->done() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_TRUE(dup[0]->done() != dup[1]->done()) << "exactly one must be refused at once";
  const int refused = dup[0]->done() ? 0 : 1;
  EXPECT_STATUS_MSG(dup[refused]->status(), absl::StatusCode::kAborted,
                    "sync step 5: worker 0 already pushed for this step");
  EXPECT_EQ(apply.calls(), 0);
  // The accepted one still counts: the step completes with workers 1 and 2.
  PushThread w1(policy.get(), SimplePush(1, 5, 4.0f), apply.fn());
  PushThread w2(policy.get(), SimplePush(2, 5, 7.0f), apply.fn());
  EXPECT_OK(dup[1 - refused]->status());
  EXPECT_OK(w1.status());
  EXPECT_OK(w2.status());
  ASSERT_EQ(apply.calls(), 1);
  const AppliedUpdate a = apply.records()[0];
  const float accepted = refused == 0 ? 2.0f : 1.0f;
  const float avg = ((accepted + 4.0f) + 7.0f) * (1.0f / 3.0f);
  EXPECT_EQ(a.grads, (std::vector<std::vector<float>>{{avg, avg}}));
}

TEST(SyncPolicyTest, DifferentChunkSetsAreRejected) {
  auto policy = MakePolicy("sync", 2);
  FakeApply apply;
  auto a =
      std::make_unique<PushThread>(policy.get(), MakePush(0, 0, {3, 7}, {{1}, {2}}), apply.fn());
  auto b = std::make_unique<PushThread>(policy.get(), MakePush(1, 0, {3}, {{1}}), apply.fn());
  const absl::Time deadline = absl::Now() + kPromptly;
  while (!a->done() && !b->done() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_TRUE(a->done() != b->done()) << "exactly one must be refused at once";
  PushThread* refused = a->done() ? a.get() : b.get();
  const int refused_worker = a->done() ? 0 : 1;
  EXPECT_STATUS_MSG(refused->status(), absl::StatusCode::kInvalidArgument,
                    "sync step 0: worker " + std::to_string(refused_worker) +
                        " pushed a different set of chunks than the other workers");
  EXPECT_EQ(apply.calls(), 0);
  // The refused worker retries with the accepted chunk set; the step completes.
  auto retry =
      refused_worker == 0 ? MakePush(0, 0, {3}, {{5}}) : MakePush(1, 0, {3, 7}, {{5}, {6}});
  EXPECT_OK(policy->OnPush(retry->update, apply.fn()));
  EXPECT_OK((refused_worker == 0 ? b : a)->status());
  ASSERT_EQ(apply.calls(), 1);
  EXPECT_EQ(apply.records()[0].chunks,
            (refused_worker == 0 ? std::vector<int64_t>{3} : std::vector<int64_t>{3, 7}));
}

TEST(SyncPolicyTest, BarrierTimeoutAppliesNothingAndNamesMissingWorkers) {
  auto policy = MakePolicy("sync", 3, absl::Milliseconds(200));
  FakeApply apply;
  const absl::Time start = absl::Now();
  PushThread w0(policy.get(), SimplePush(0, 0, 1.0f), apply.fn());
  absl::SleepFor(absl::Milliseconds(50));  // Worker 0 times out first.
  PushThread w2(policy.get(), SimplePush(2, 0, 2.0f), apply.fn());
  const absl::Status s0 = w0.status();
  const absl::Status s2 = w2.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  EXPECT_STATUS_MSG(s0, absl::StatusCode::kFailedPrecondition,
                    "sync barrier for step 0 timed out after 200ms: workers [1] did not push; "
                    "nothing was applied");
  // Worker 2 times out after worker 0 has withdrawn: only worker 1 is missing.
  EXPECT_STATUS_MSG(s2, absl::StatusCode::kFailedPrecondition,
                    "sync barrier for step 0 timed out after 200ms: workers [1] did not push "
                    "(workers [0] pushed but gave up first); nothing was applied");
  EXPECT_EQ(apply.calls(), 0);
  EXPECT_GE(policy->stats().barrier_wait_s, 0.4);  // Two waits of at least 200 ms each.

  // The withdrawn pushes left nothing behind: a complete step 0 works, with the new values.
  PushThread r0(policy.get(), SimplePush(0, 0, 3.0f), apply.fn());
  PushThread r1(policy.get(), SimplePush(1, 0, 6.0f), apply.fn());
  auto last = SimplePush(2, 0, 9.0f);
  EXPECT_OK(policy->OnPush(last->update, apply.fn()));
  EXPECT_OK(r0.status());
  EXPECT_OK(r1.status());
  ASSERT_EQ(apply.calls(), 1);
  const AppliedUpdate a = apply.records()[0];
  const float avg = ((3.0f + 6.0f) + 9.0f) * (1.0f / 3.0f);
  EXPECT_EQ(a.grads, (std::vector<std::vector<float>>{{avg, avg}}));
  ASSERT_EQ(a.requests.size(), 3u);
  EXPECT_EQ(a.requests[1].worker, 1);
}

// ---------------------------------------------------------------------------------------------
// sync barrier groups (SetGroup)

// Worker w's push for `step`: SyncGrads(w) on chunks {3, 7}, base versions {10 + w, w}.
std::unique_ptr<OwnedPush> GroupPush(int32_t w, int64_t step) {
  return MakePush(w, step, {3, 7}, SyncGrads(w), {10 + w, w});
}

// Rank-order average of the given workers' SyncGrads.
std::vector<std::vector<float>> GroupAverage(const std::vector<int32_t>& ranks) {
  std::vector<std::vector<float>> sum = SyncGrads(ranks[0]);
  for (size_t i = 1; i < ranks.size(); ++i) {
    const auto g = SyncGrads(ranks[i]);
    for (size_t c = 0; c < sum.size(); ++c) {
      for (size_t k = 0; k < sum[c].size(); ++k) sum[c][k] += g[c][k];
    }
  }
  const float inv = 1.0f / static_cast<float>(ranks.size());
  for (auto& chunk : sum) {
    for (float& v : chunk) v *= inv;
  }
  return sum;
}

std::vector<int32_t> Workers(const AppliedUpdate& a) {
  std::vector<int32_t> w;
  for (const RequestRef& r : a.requests) w.push_back(r.worker);
  return w;
}

TEST(SyncGroupTest, ShrinkCompletesAWaitingStepWithTheSurvivors) {
  auto policy = MakePolicy("sync", 3);
  FakeApply apply;
  PushThread w2(policy.get(), GroupPush(2, 0), apply.fn());
  EXPECT_FALSE(w2.WaitFor(kStaysBlocked));
  PushThread w0(policy.get(), GroupPush(0, 0), apply.fn());
  EXPECT_FALSE(w0.WaitFor(kStaysBlocked));  // Still waiting for worker 1.
  EXPECT_EQ(apply.calls(), 0);
  ASSERT_OK(policy->SetGroup({2, 0}, 2.0f / 3.0f));
  EXPECT_TRUE(w0.WaitFor(kPromptly));
  EXPECT_TRUE(w2.WaitFor(kPromptly));
  EXPECT_OK(w0.status());
  EXPECT_OK(w2.status());
  ASSERT_EQ(apply.calls(), 1);
  const AppliedUpdate a = apply.records()[0];
  EXPECT_EQ(a.grads, GroupAverage({0, 2}));  // Bit-exact: halves of the survivors' sum.
  // Element 0 of chunk 3: (1e8 + -1e8) / 2 in rank order.
  EXPECT_EQ(a.grads[0][0], 0.0f);
  EXPECT_EQ(a.grads[1][1], ((0.0f - 0.7f) + (2.0f - 0.7f)) * 0.5f);
  EXPECT_EQ(Workers(a), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(a.base_versions, (std::vector<int64_t>{10, 0}));  // Rank 0's view.
  EXPECT_EQ(a.lr_scale, 2.0f / 3.0f);
  EXPECT_EQ(a.chunks, (std::vector<int64_t>{3, 7}));

  // The next step needs only the group, and still carries its lr factor.
  PushThread n2(policy.get(), GroupPush(2, 1), apply.fn());
  EXPECT_FALSE(n2.WaitFor(kStaysBlocked));
  auto n0 = GroupPush(0, 1);
  EXPECT_OK(policy->OnPush(n0->update, apply.fn()));
  EXPECT_OK(n2.status());
  ASSERT_EQ(apply.calls(), 2);
  EXPECT_EQ(Workers(apply.records()[1]), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(apply.records()[1].lr_scale, 2.0f / 3.0f);
}

TEST(SyncGroupTest, BufferedPushOfARemovedWorkerIsDropped) {
  auto policy = MakePolicy("sync", 3);
  FakeApply apply;
  // Rank 0 pushes and is then removed: its base versions must not be used either.
  PushThread w0(policy.get(), GroupPush(0, 4), apply.fn());
  PushThread w1(policy.get(), GroupPush(1, 4), apply.fn());
  EXPECT_FALSE(w0.WaitFor(absl::Milliseconds(300)));
  EXPECT_FALSE(w1.done());
  ASSERT_OK(policy->SetGroup({1, 2}, 0.5f));
  // Worker 0 is told at once; worker 1 still waits for worker 2.
  EXPECT_TRUE(w0.WaitFor(kPromptly));
  EXPECT_STATUS_MSG(w0.status(), absl::StatusCode::kFailedPrecondition,
                    "worker 0 was removed from the sync group of job j (active: [1, 2]) while "
                    "its push for step 4 waited at the barrier; the push was dropped and "
                    "nothing of it was applied");
  EXPECT_FALSE(w1.WaitFor(kStaysBlocked));
  EXPECT_EQ(apply.calls(), 0);
  auto p2 = GroupPush(2, 4);
  EXPECT_OK(policy->OnPush(p2->update, apply.fn()));
  EXPECT_OK(w1.status());
  ASSERT_EQ(apply.calls(), 1);
  const AppliedUpdate a = apply.records()[0];
  EXPECT_EQ(a.grads, GroupAverage({1, 2}));
  EXPECT_EQ(Workers(a), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(a.base_versions, (std::vector<int64_t>{11, 1}));  // Now rank 1's view.
  EXPECT_EQ(a.lr_scale, 0.5f);
}

TEST(SyncGroupTest, ShrinkLeavingNoPushesForgetsTheStep) {
  auto policy = MakePolicy("sync", 3);
  FakeApply apply;
  PushThread w1(policy.get(), GroupPush(1, 0), apply.fn());
  EXPECT_FALSE(w1.WaitFor(absl::Milliseconds(300)));
  ASSERT_OK(policy->SetGroup({0, 2}, 1.0f));
  EXPECT_STATUS_MSG(w1.status(), absl::StatusCode::kFailedPrecondition,
                    "worker 1 was removed from the sync group of job j (active: [0, 2])");
  // Step 0 starts afresh with the new group: 0 and 2 complete it.
  PushThread w0(policy.get(), GroupPush(0, 0), apply.fn());
  EXPECT_FALSE(w0.WaitFor(kStaysBlocked));
  auto p2 = GroupPush(2, 0);
  EXPECT_OK(policy->OnPush(p2->update, apply.fn()));
  EXPECT_OK(w0.status());
  ASSERT_EQ(apply.calls(), 1);
  EXPECT_EQ(Workers(apply.records()[0]), (std::vector<int32_t>{0, 2}));
}

TEST(SyncGroupTest, PushesOfRemovedWorkersAreRefusedAndChangeNothing) {
  auto policy = MakePolicy("sync", 4);
  FakeApply apply;
  ASSERT_OK(policy->SetGroup({3, 0, 2}, 0.75f));
  // Refused whether or not the step exists yet.
  auto early = GroupPush(1, 0);
  EXPECT_STATUS_MSG(policy->OnPush(early->update, apply.fn()),
                    absl::StatusCode::kFailedPrecondition,
                    "worker 1 is not in the sync group of job j (active: [0, 2, 3])");
  PushThread w0(policy.get(), GroupPush(0, 0), apply.fn());
  EXPECT_FALSE(w0.WaitFor(kStaysBlocked));
  auto late = MakePush(1, 0, {5}, {{1.0f}});  // Even with another chunk set.
  EXPECT_STATUS_MSG(policy->OnPush(late->update, apply.fn()), absl::StatusCode::kFailedPrecondition,
                    "worker 1 is not in the sync group of job j (active: [0, 2, 3])");
  EXPECT_FALSE(w0.WaitFor(kStaysBlocked));
  EXPECT_EQ(apply.calls(), 0);
  PushThread w3(policy.get(), MakePush(3, 0, {3, 7}, {{1, 2, 3}, {4, 5}}, {13, 3}), apply.fn());
  EXPECT_FALSE(w3.WaitFor(kStaysBlocked));
  auto p2 = GroupPush(2, 0);
  EXPECT_OK(policy->OnPush(p2->update, apply.fn()));
  EXPECT_OK(w0.status());
  EXPECT_OK(w3.status());
  ASSERT_EQ(apply.calls(), 1);
  const AppliedUpdate a = apply.records()[0];
  EXPECT_EQ(Workers(a), (std::vector<int32_t>{0, 2, 3}));
  const float inv = 1.0f / 3.0f;
  // (1e8 + -1e8) + 1, then / 3.
  EXPECT_EQ(a.grads[0][0], ((kBig[0][0] + kBig[2][0]) + 1.0f) * inv);
  EXPECT_EQ(a.grads[1][0], ((0.1f * 1.0f + 0.1f * 3.0f) + 4.0f) * inv);
  EXPECT_EQ(a.lr_scale, 0.75f);
}

TEST(SyncGroupTest, GrowingAppliesFromTheNextStepWithoutPushes) {
  auto policy = MakePolicy("sync", 3);
  FakeApply apply;
  ASSERT_OK(policy->SetGroup({0, 2}, 2.0f / 3.0f));
  PushThread s0(policy.get(), GroupPush(0, 7), apply.fn());  // Step 7 starts with {0, 2}.
  EXPECT_FALSE(s0.WaitFor(kStaysBlocked));
  ASSERT_OK(policy->SetGroup({0, 1, 2}, 1.0f));
  // Step 7 keeps its group and factor: the new worker cannot join it...
  auto joiner = GroupPush(1, 7);
  EXPECT_STATUS_MSG(policy->OnPush(joiner->update, apply.fn()),
                    absl::StatusCode::kFailedPrecondition,
                    "worker 1 is not in the sync group of job j for step 7 (active: [0, 2]): "
                    "that step was in progress when the worker joined the group, which applies "
                    "from the next step with no pushes yet");
  // ...and it completes without it.
  auto s2 = GroupPush(2, 7);
  EXPECT_OK(policy->OnPush(s2->update, apply.fn()));
  EXPECT_OK(s0.status());
  ASSERT_EQ(apply.calls(), 1);
  EXPECT_EQ(Workers(apply.records()[0]), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(apply.records()[0].lr_scale, 2.0f / 3.0f);
  EXPECT_EQ(apply.records()[0].grads, GroupAverage({0, 2}));

  // Step 8 has the whole group again: 0 and 2 wait for 1.
  PushThread t0(policy.get(), GroupPush(0, 8), apply.fn());
  PushThread t2(policy.get(), GroupPush(2, 8), apply.fn());
  EXPECT_FALSE(t0.WaitFor(kStaysBlocked));
  EXPECT_FALSE(t2.done());
  EXPECT_EQ(apply.calls(), 1);
  auto t1 = GroupPush(1, 8);
  EXPECT_OK(policy->OnPush(t1->update, apply.fn()));
  EXPECT_OK(t0.status());
  EXPECT_OK(t2.status());
  ASSERT_EQ(apply.calls(), 2);
  const AppliedUpdate a = apply.records()[1];
  EXPECT_EQ(Workers(a), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(a.grads, AverageInOrder({0, 1, 2}));
  EXPECT_EQ(a.lr_scale, 1.0f);
}

TEST(SyncGroupTest, BadGroupsAreRejectedAndChangeNothing) {
  auto policy = MakePolicy("sync", 3);
  FakeApply apply;
  ASSERT_OK(policy->SetGroup({0, 1}, 0.5f));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    std::vector<int32_t> active;
    float lr_scale;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{}, 1.0f, "sync group of job j: the group is empty"},
      {{0, 3}, 1.0f, "sync group of job j: rank 3 not in [0, 3)"},
      {{-1}, 1.0f, "sync group of job j: rank -1 not in [0, 3)"},
      {{2, 0, 2}, 1.0f, "sync group of job j: rank 2 appears twice"},
      {{0, 1, 2}, 0.0f, "sync group of job j: lr_scale 0 not in (0, 1]"},
      {{0, 1, 2}, -0.5f, "sync group of job j: lr_scale -0.5 not in (0, 1]"},
      {{0, 1, 2}, 1.5f, "sync group of job j: lr_scale 1.5 not in (0, 1]"},
      {{0, 1, 2}, nan, "sync group of job j: lr_scale nan not in (0, 1]"},
  };
  for (const Case& c : cases) {
    EXPECT_STATUS_MSG(policy->SetGroup(c.active, c.lr_scale), absl::StatusCode::kInvalidArgument,
                      c.message);
  }
  // Still {0, 1} with factor 0.5: worker 2 is refused, 0 and 1 complete a step.
  auto p2 = GroupPush(2, 0);
  EXPECT_STATUS_MSG(policy->OnPush(p2->update, apply.fn()), absl::StatusCode::kFailedPrecondition,
                    "worker 2 is not in the sync group of job j (active: [0, 1])");
  PushThread w1(policy.get(), GroupPush(1, 0), apply.fn());
  EXPECT_FALSE(w1.WaitFor(kStaysBlocked));
  auto p0 = GroupPush(0, 0);
  EXPECT_OK(policy->OnPush(p0->update, apply.fn()));
  EXPECT_OK(w1.status());
  ASSERT_EQ(apply.calls(), 1);
  EXPECT_EQ(apply.records()[0].lr_scale, 0.5f);
  EXPECT_EQ(apply.records()[0].grads, GroupAverage({0, 1}));
}

TEST(SyncGroupTest, SettingTheSameGroupAgainChangesNothing) {
  auto policy = MakePolicy("sync", 3);
  FakeApply apply;
  ASSERT_OK(policy->SetGroup({0, 1, 2}, 1.0f));  // The initial group.
  PushThread w0(policy.get(), GroupPush(0, 0), apply.fn());
  PushThread w1(policy.get(), GroupPush(1, 0), apply.fn());
  EXPECT_FALSE(w0.WaitFor(kStaysBlocked));
  for (int i = 0; i < 3; ++i) ASSERT_OK(policy->SetGroup({2, 1, 0}, 1.0f));
  EXPECT_FALSE(w0.WaitFor(kStaysBlocked));
  EXPECT_FALSE(w1.done());
  auto p2 = GroupPush(2, 0);
  EXPECT_OK(policy->OnPush(p2->update, apply.fn()));
  EXPECT_OK(w0.status());
  EXPECT_OK(w1.status());
  ASSERT_EQ(apply.calls(), 1);
  EXPECT_EQ(apply.records()[0].grads, AverageInOrder({0, 1, 2}));
  EXPECT_EQ(apply.records()[0].lr_scale, 1.0f);
}

TEST(SyncGroupTest, TimeoutNamesOnlyMissingGroupMembers) {
  auto policy = MakePolicy("sync", 4, absl::Milliseconds(200));
  FakeApply apply;
  ASSERT_OK(policy->SetGroup({0, 2}, 0.5f));
  auto p0 = GroupPush(0, 0);
  EXPECT_STATUS_MSG(policy->OnPush(p0->update, apply.fn()), absl::StatusCode::kFailedPrecondition,
                    "sync barrier for step 0 timed out after 200ms: workers [2] did not push; "
                    "nothing was applied");
  EXPECT_EQ(apply.calls(), 0);
}

TEST(SyncGroupTest, AsyncAndSspHaveNoGroup) {
  for (const std::string mode : {"async", "ssp:2"}) {
    auto policy = MakePolicy(mode, 3);
    EXPECT_STATUS_MSG(policy->SetGroup({0, 1}, 0.5f), absl::StatusCode::kFailedPrecondition,
                      "consistency mode " + mode +
                          " has no barrier group; only sync jobs have "
                          "one");
    // Updates keep factor 1.
    FakeApply apply;
    auto p = SimplePush(1, 0);
    ASSERT_OK(policy->OnPush(p->update, apply.fn()));
    EXPECT_EQ(apply.records().at(0).lr_scale, 1.0f);
  }
}

// ---------------------------------------------------------------------------------------------
// ssp

TEST(SspPolicyTest, PushesApplyAtOnceAndPullWaitsForTheSlowest) {
  auto policy = MakePolicy("ssp:1", 2);
  FakeApply apply;
  auto p0 = SimplePush(0, 0);
  EXPECT_OK(policy->OnPush(p0->update, apply.fn()));
  EXPECT_EQ(apply.calls(), 1);
  EXPECT_EQ(apply.records()[0].address, &p0->update);
  EXPECT_OK(policy->BeforePull(0));  // Lead 1 <= 1.
  EXPECT_OK(policy->OnPush(SimplePush(0, 1)->update, apply.fn()));
  EXPECT_EQ(apply.calls(), 2);
  EXPECT_OK(policy->BeforePull(1));  // The slow worker never waits.
  EXPECT_EQ(policy->stats().max_clock_lead, 1);

  PullThread pull(policy.get(), 0);  // Lead 2 > 1: waits.
  EXPECT_FALSE(pull.WaitFor(kStaysBlocked));
  EXPECT_OK(policy->OnPush(SimplePush(1, 0)->update, apply.fn()));
  ASSERT_TRUE(pull.WaitFor(kPromptly));
  EXPECT_OK(pull.status());
  EXPECT_EQ(policy->stats().max_clock_lead, 1);
  EXPECT_GE(policy->stats().barrier_wait_s, 0.05);
  EXPECT_EQ(apply.calls(), 3);
}

TEST(SspPolicyTest, PullTimesOutNamingTheSlowWorkers) {
  auto policy = MakePolicy("ssp:1", 3, absl::Milliseconds(200));
  FakeApply apply;
  for (int64_t s = 0; s < 2; ++s) ASSERT_OK(policy->OnPush(SimplePush(0, s)->update, apply.fn()));
  ASSERT_OK(policy->OnPush(SimplePush(2, 0)->update, apply.fn()));  // Worker 2 is within 1.
  const absl::Time start = absl::Now();
  EXPECT_STATUS_MSG(policy->BeforePull(0), absl::StatusCode::kFailedPrecondition,
                    "ssp:1 pull of worker 0 at clock 2 waited 200ms for workers [1] to catch up");
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  EXPECT_GE(policy->stats().barrier_wait_s, 0.2);
  EXPECT_EQ(policy->stats().max_clock_lead, 0);  // No pull was served at a lead.
}

TEST(SspPolicyTest, FinishedWorkerNoLongerHoldsOthersBack) {
  auto policy = MakePolicy("ssp:1", 2);
  FakeApply apply;
  for (int64_t s = 0; s < 3; ++s) ASSERT_OK(policy->OnPush(SimplePush(0, s)->update, apply.fn()));
  PullThread pull(policy.get(), 0);
  EXPECT_FALSE(pull.WaitFor(kStaysBlocked));
  policy->OnFinish(1);
  ASSERT_TRUE(pull.WaitFor(kPromptly));
  EXPECT_OK(pull.status());
  EXPECT_EQ(policy->stats().max_clock_lead, 0);  // Nobody unfinished is behind.
  // Later pulls do not wait either.
  ASSERT_OK(policy->OnPush(SimplePush(0, 10)->update, apply.fn()));
  EXPECT_OK(policy->BeforePull(0));
}

TEST(SspPolicyTest, RestoredClocksAreHonoured) {
  auto policy = MakePolicy("ssp:2", 2);
  FakeApply apply;
  policy->Restore({5, 2}, {false, false});
  EXPECT_OK(policy->BeforePull(1));
  PullThread pull(policy.get(), 0);  // Lead 5 - 2 = 3 > 2.
  EXPECT_FALSE(pull.WaitFor(kStaysBlocked));
  // A push of an old step does not move the clock back nor forward.
  ASSERT_OK(policy->OnPush(SimplePush(1, 0)->update, apply.fn()));
  EXPECT_FALSE(pull.WaitFor(absl::Milliseconds(50)));
  ASSERT_OK(policy->OnPush(SimplePush(1, 2)->update, apply.fn()));  // Clock 3: lead 2.
  ASSERT_TRUE(pull.WaitFor(kPromptly));
  EXPECT_OK(pull.status());
  EXPECT_EQ(policy->stats().max_clock_lead, 2);
}

TEST(SspPolicyTest, RestoredFinishedWorkerIsIgnored) {
  auto policy = MakePolicy("ssp:0", 2, absl::Milliseconds(200));
  policy->Restore({9, 1}, {false, true});
  EXPECT_OK(policy->BeforePull(0));  // Would wait 200 ms and fail if worker 1 counted.
  EXPECT_LT(policy->stats().barrier_wait_s, 0.1);
}

TEST(SspPolicyTest, FailedApplyDoesNotAdvanceTheClock) {
  auto policy = MakePolicy("ssp:0", 2);
  FakeApply ok_apply;
  FakeApply bad_apply(absl::InternalError("no space"));
  ASSERT_OK(policy->OnPush(SimplePush(1, 0)->update, ok_apply.fn()));
  PullThread pull(policy.get(), 1);  // Worker 1 at clock 1, worker 0 at 0.
  EXPECT_FALSE(pull.WaitFor(absl::Milliseconds(50)));
  EXPECT_EQ(policy->OnPush(SimplePush(0, 0)->update, bad_apply.fn()),
            absl::InternalError("no space"));
  EXPECT_FALSE(pull.WaitFor(kStaysBlocked));
  ASSERT_OK(policy->OnPush(SimplePush(0, 0)->update, ok_apply.fn()));
  ASSERT_TRUE(pull.WaitFor(kPromptly));
  EXPECT_OK(pull.status());
}

TEST(SspPolicyTest, ZeroBoundIsLockStep) {
  auto policy = MakePolicy("ssp:0", 2);
  FakeApply apply;
  ASSERT_OK(policy->OnPush(SimplePush(0, 0)->update, apply.fn()));
  EXPECT_OK(policy->BeforePull(1));  // Behind: never waits.
  PullThread pull(policy.get(), 0);
  EXPECT_FALSE(pull.WaitFor(kStaysBlocked));
  ASSERT_OK(policy->OnPush(SimplePush(1, 0)->update, apply.fn()));
  ASSERT_TRUE(pull.WaitFor(kPromptly));
  EXPECT_OK(pull.status());

  // Two workers running push-pull loops stay in lock-step: when a worker's pull returns after
  // its push of step s, the other worker has pushed step s too.
  constexpr int kSteps = 20;
  std::atomic<int64_t> pushed[2] = {{1}, {1}};
  std::atomic<int> violations{0};
  std::vector<std::thread> threads;
  for (int32_t w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      for (int64_t s = 1; s <= kSteps; ++s) {
        auto p = SimplePush(w, s);
        pushed[w] = s + 1;  // Before the push: a pull of the other must not return earlier.
        if (!policy->OnPush(p->update, apply.fn()).ok()) ++violations;
        if (!policy->BeforePull(w).ok()) ++violations;
        if (pushed[1 - w].load() < s + 1) ++violations;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(violations.load(), 0);
  EXPECT_EQ(apply.calls(), 2 + 2 * kSteps);
  EXPECT_EQ(policy->stats().max_clock_lead, 0);
}

// ---------------------------------------------------------------------------------------------
// Waiting without a thread (StartPush / StartPull), cancellation, the apply outside the lock

// Records the outcome of one StartPush/StartPull completion.
class Outcome {
 public:
  WaitDone fn() {
    return [this](absl::Status st) {
      absl::MutexLock lock(&mu_);
      ++calls_;
      status_ = std::move(st);
      cv_.SignalAll();
    };
  }
  int calls() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return status_;
  }
  // A CondVar rather than a Condition: ThreadSanitizer runs see the hand-off.
  bool WaitFor(absl::Duration d) const {
    const absl::Time deadline = absl::Now() + d;
    absl::MutexLock lock(&mu_);
    while (calls_ == 0) {
      if (cv_.WaitWithDeadline(&mu_, deadline)) return calls_ > 0;
    }
    return true;
  }

 private:
  mutable absl::Mutex mu_;
  mutable absl::CondVar cv_;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// 1,000 pushes wait at one barrier, all parked by the test's own thread: StartPush returns at
// once for each, and the 1,001st releases them all with the rank-order average.
TEST(WaitWithoutThreadTest, ThousandSyncPushesWaitOnNoThreads) {
  constexpr int32_t kWaiting = 1000;
  auto policy = MakePolicy("sync", kWaiting + 1);
  FakeApply apply;
  std::vector<Outcome> outcomes(kWaiting + 1);
  for (int32_t w = 0; w < kWaiting; ++w) {
    auto push = MakePush(w, 0, {0}, {{static_cast<float>(w), 1.0f}});
    policy->StartPush(push->update, apply.fn(), outcomes[w].fn(), nullptr);
  }
  EXPECT_EQ(policy->waiting(), kWaiting);
  for (int32_t w = 0; w < kWaiting; ++w) ASSERT_EQ(outcomes[w].calls(), 0) << w;
  EXPECT_EQ(apply.calls(), 0);
  auto last = MakePush(kWaiting, 0, {0}, {{static_cast<float>(kWaiting), 1.0f}});
  policy->StartPush(last->update, apply.fn(), outcomes[kWaiting].fn(), nullptr);
  // Completed on this thread: every completion has run when StartPush returns.
  for (int32_t w = 0; w <= kWaiting; ++w) {
    ASSERT_EQ(outcomes[w].calls(), 1) << w;
    ASSERT_OK(outcomes[w].status());
  }
  EXPECT_EQ(policy->waiting(), 0);
  ASSERT_EQ(apply.calls(), 1);
  const AppliedUpdate a = apply.records()[0];
  ASSERT_EQ(a.requests.size(), static_cast<size_t>(kWaiting + 1));
  // Rank order: 0 + 1 + ... + 1000 summed in float (exact below 2^24), times 1/1001.
  float sum = 0;
  for (int32_t w = 0; w <= kWaiting; ++w) sum += static_cast<float>(w);
  EXPECT_EQ(a.grads[0][0], sum * (1.0f / static_cast<float>(kWaiting + 1)));
  EXPECT_EQ(a.grads[0][1], static_cast<float>(kWaiting + 1) * (1.0f / (kWaiting + 1)));
}

// A worker's pushes wait one at a time: a push for another step while one of the worker's
// pushes waits is ABORTED and changes nothing (one client cannot park a gradient for every
// future step); once that one has completed, the next step's push is admitted and waits.
TEST(WaitWithoutThreadTest, AWorkersSecondWaitingPushIsRefused) {
  Outcome first, ahead, other, later;  // Outlive the policy, which ends `later`'s wait.
  FakeApply apply;
  auto policy = MakePolicy("sync", 2);
  auto p0 = SimplePush(0, 0);
  policy->StartPush(p0->update, apply.fn(), first.fn(), nullptr);
  auto p0_next = SimplePush(0, 1);
  policy->StartPush(p0_next->update, apply.fn(), ahead.fn(), nullptr);
  ASSERT_EQ(ahead.calls(), 1);
  EXPECT_EQ(ahead.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(ahead.status().message(),
            "sync step 1: worker 0 still waits at step 0 of job j; a worker's pushes wait one at "
            "a time");
  EXPECT_EQ(policy->waiting(), 1);
  EXPECT_EQ(first.calls(), 0);
  auto p1 = SimplePush(1, 0);
  policy->StartPush(p1->update, apply.fn(), other.fn(), nullptr);
  ASSERT_EQ(first.calls(), 1);
  EXPECT_OK(first.status());
  EXPECT_OK(other.status());
  EXPECT_EQ(apply.calls(), 1);
  policy->StartPush(p0_next->update, apply.fn(), later.fn(), nullptr);
  EXPECT_EQ(later.calls(), 0);  // Waits at step 1 for worker 1.
  EXPECT_EQ(policy->waiting(), 1);
}

// A shard restored from an older snapshot (periodic durability) after it completed step 5 and
// answered worker 1 but not worker 0: worker 0 pushes step 5 again, worker 1 is past it and
// pushes step 6. Step 5 goes on without worker 1 (worker 0's gradient alone, its requests
// only) instead of waiting for a push that never comes while worker 1 waits at step 6 for
// worker 0: both used to time out at the barrier, and the job failed. Step 6 then completes
// as usual; the other order (worker 1 already waiting at the later step) too, and a worker
// that finishes releases the steps it has no push in.
TEST(WaitWithoutThreadTest, AStepAWorkerIsPastGoesOnWithoutIt) {
  Outcome w0_step5, w1_step6, w0_step6;
  FakeApply apply;
  auto policy = MakePolicy("sync", 2);
  auto p0 = SimplePush(0, 5, 2.0f);
  policy->StartPush(p0->update, apply.fn(), w0_step5.fn(), nullptr);
  EXPECT_EQ(w0_step5.calls(), 0);
  auto p1 = SimplePush(1, 6, 4.0f);
  policy->StartPush(p1->update, apply.fn(), w1_step6.fn(), nullptr);
  ASSERT_EQ(w0_step5.calls(), 1);
  EXPECT_OK(w0_step5.status());
  EXPECT_EQ(w1_step6.calls(), 0);  // Waits at step 6 for worker 0.
  ASSERT_EQ(apply.calls(), 1);
  const AppliedUpdate step5 = apply.records()[0];
  EXPECT_EQ(step5.grads, (std::vector<std::vector<float>>{{2.0f, 2.0f}}));
  ASSERT_EQ(step5.requests.size(), 1u);
  EXPECT_EQ(step5.requests[0].worker, 0);
  EXPECT_EQ(step5.requests[0].step, 5);
  auto p0_next = SimplePush(0, 6, 2.0f);
  policy->StartPush(p0_next->update, apply.fn(), w0_step6.fn(), nullptr);
  ASSERT_EQ(w1_step6.calls(), 1);
  EXPECT_OK(w1_step6.status());
  EXPECT_OK(w0_step6.status());
  ASSERT_EQ(apply.calls(), 2);
  EXPECT_EQ(apply.records()[1].grads, (std::vector<std::vector<float>>{{3.0f, 3.0f}}));
  EXPECT_EQ(policy->waiting(), 0);

  // The other order: worker 1's push of step 8 waits when worker 0's push of step 7 arrives.
  // Step 7 completes at once with worker 0's push alone.
  Outcome w1_step8, w0_step7, w0_step8;
  auto q1 = SimplePush(1, 8, 4.0f);
  policy->StartPush(q1->update, apply.fn(), w1_step8.fn(), nullptr);
  auto q0 = SimplePush(0, 7, 2.0f);
  policy->StartPush(q0->update, apply.fn(), w0_step7.fn(), nullptr);
  ASSERT_EQ(w0_step7.calls(), 1);
  EXPECT_OK(w0_step7.status());
  ASSERT_EQ(apply.calls(), 3);
  EXPECT_EQ(apply.records()[2].requests.size(), 1u);
  EXPECT_EQ(apply.records()[2].grads, (std::vector<std::vector<float>>{{2.0f, 2.0f}}));
  EXPECT_EQ(w1_step8.calls(), 0);
  auto q0_next = SimplePush(0, 8, 2.0f);
  policy->StartPush(q0_next->update, apply.fn(), w0_step8.fn(), nullptr);
  ASSERT_EQ(w1_step8.calls(), 1);
  EXPECT_OK(w1_step8.status());
  EXPECT_EQ(apply.calls(), 4);
  EXPECT_EQ(policy->waiting(), 0);

  // Worker 1 got step 9 answered and finished; worker 0 waits there with it again.
  Outcome w0_step9;
  auto r0 = SimplePush(0, 9, 2.0f);
  policy->StartPush(r0->update, apply.fn(), w0_step9.fn(), nullptr);
  EXPECT_EQ(w0_step9.calls(), 0);
  policy->OnFinish(1);
  ASSERT_EQ(w0_step9.calls(), 1);
  EXPECT_OK(w0_step9.status());
  EXPECT_EQ(apply.calls(), 5);
  EXPECT_EQ(policy->waiting(), 0);
}

// The step's apply (the log write of a durable job) runs without the policy's lock: while it
// is blocked, stats(), SetGroup and other workers' pushes of the next step go on.
TEST(WaitWithoutThreadTest, ApplyRunsWithoutThePolicyLock) {
  auto policy = MakePolicy("sync", 2);
  absl::Notification in_apply, release;
  std::atomic<int> applied{0};
  ApplyFn blocking = [&](const ChunkUpdate&) {
    in_apply.Notify();
    release.WaitForNotification();
    ++applied;
    return absl::OkStatus();
  };
  Outcome first, second;
  auto p0 = SimplePush(0, 0);
  policy->StartPush(p0->update, blocking, first.fn(), nullptr);
  std::thread completer([&] {
    auto p1 = SimplePush(1, 0);
    policy->StartPush(p1->update, blocking, second.fn(), nullptr);
  });
  ASSERT_TRUE(in_apply.WaitForNotificationWithTimeout(kPromptly));
  // Each of these would wait for `release` if the apply held the policy's lock.
  absl::Notification others_done;
  Outcome next;
  FakeApply unused;
  std::thread others([&] {
    (void)policy->stats();
    EXPECT_OK(policy->SetGroup({0, 1}, 1.0f));
    auto n0 = SimplePush(0, 1);
    policy->StartPush(n0->update, unused.fn(), next.fn(), nullptr);  // Parks.
    others_done.Notify();
  });
  EXPECT_TRUE(others_done.WaitForNotificationWithTimeout(kPromptly));
  EXPECT_EQ(policy->waiting(), 2);  // Worker 0's step-1 push, and step 0's first push.
  // The sealed step is not timed out, cancelled or shrunk meanwhile.
  EXPECT_EQ(first.calls(), 0);
  release.Notify();
  completer.join();
  others.join();
  EXPECT_TRUE(first.WaitFor(kPromptly));
  EXPECT_OK(first.status());
  EXPECT_OK(second.status());
  EXPECT_EQ(applied.load(), 1);
  EXPECT_EQ(next.calls(), 0);  // Step 1 still waits for worker 1.
  policy->AbortWaits(absl::UnavailableError("test over"));
  EXPECT_STATUS_MSG(next.status(), absl::StatusCode::kUnavailable, "test over");
}

// A cancelled waiting push is withdrawn: nothing of it is applied, the step waits for the
// worker again, and its retry completes the step.
TEST(WaitWithoutThreadTest, CancelledSyncPushIsWithdrawn) {
  auto policy = MakePolicy("sync", 2);
  FakeApply apply;
  WaitCancel cancel;
  Outcome cancelled;
  auto p0 = MakePush(0, 0, {0}, {{100.0f, 100.0f}});
  policy->StartPush(p0->update, apply.fn(), cancelled.fn(), &cancel);
  EXPECT_EQ(policy->waiting(), 1);
  cancel.Cancel();
  ASSERT_EQ(cancelled.calls(), 1);
  EXPECT_STATUS_MSG(cancelled.status(), absl::StatusCode::kCancelled,
                    "push of worker 0 for sync step 0 of job j was cancelled by the caller");
  EXPECT_EQ(policy->waiting(), 0);
  cancel.Cancel();  // Again: nothing happens.
  EXPECT_EQ(cancelled.calls(), 1);
  Outcome w1, retry;
  auto p1 = MakePush(1, 0, {0}, {{2.0f, 4.0f}});
  policy->StartPush(p1->update, apply.fn(), w1.fn(), nullptr);
  EXPECT_EQ(w1.calls(), 0);  // Worker 0's withdrawn push does not count.
  auto again = MakePush(0, 0, {0}, {{6.0f, 8.0f}});
  policy->StartPush(again->update, apply.fn(), retry.fn(), nullptr);
  EXPECT_OK(w1.status());
  EXPECT_OK(retry.status());
  ASSERT_EQ(apply.calls(), 1);
  EXPECT_EQ(apply.records()[0].grads, (std::vector<std::vector<float>>{{4.0f, 6.0f}}));
}

TEST(WaitWithoutThreadTest, PushCancelledBeforeItParksFailsAtOnce) {
  auto policy = MakePolicy("sync", 2);
  FakeApply apply;
  WaitCancel cancel;
  cancel.Cancel();
  Outcome o;
  policy->StartPush(SimplePush(0, 0)->update, apply.fn(), o.fn(), &cancel);
  ASSERT_EQ(o.calls(), 1);
  EXPECT_STATUS(o.status(), absl::StatusCode::kCancelled);
  EXPECT_EQ(policy->waiting(), 0);
}

// Timeouts come from the timer: the waiting push is released with the barrier's message.
TEST(WaitWithoutThreadTest, ParkedPushTimesOutOnTheTimer) {
  auto policy = MakePolicy("sync", 3, absl::Milliseconds(100));
  FakeApply apply;
  Outcome o;
  policy->StartPush(SimplePush(1, 5)->update, apply.fn(), o.fn(), nullptr);
  EXPECT_EQ(o.calls(), 0);
  ASSERT_TRUE(o.WaitFor(kPromptly));
  EXPECT_STATUS_MSG(o.status(), absl::StatusCode::kFailedPrecondition,
                    "sync barrier for step 5 timed out after 100ms: workers [0, 2] did not push; "
                    "nothing was applied");
  EXPECT_EQ(policy->waiting(), 0);
  EXPECT_EQ(apply.calls(), 0);
}

TEST(WaitWithoutThreadTest, SspPullParksAndIsReleasedByThePush) {
  auto policy = MakePolicy("ssp:0", 2);
  FakeApply apply;
  policy->StartPush(
      SimplePush(0, 0)->update, apply.fn(), [](absl::Status) {}, nullptr);
  Outcome pull;
  policy->StartPull(0, pull.fn(), nullptr);  // Worker 0 leads by 1 > 0: parks.
  EXPECT_EQ(pull.calls(), 0);
  EXPECT_EQ(policy->waiting(), 1);
  Outcome push1;
  policy->StartPush(SimplePush(1, 0)->update, apply.fn(), push1.fn(), nullptr);
  EXPECT_OK(push1.status());
  ASSERT_EQ(pull.calls(), 1);  // Released on the pushing thread.
  EXPECT_OK(pull.status());
  EXPECT_EQ(policy->waiting(), 0);

  // A cancelled pull completes with CANCELLED and leaves nothing behind.
  policy->StartPush(
      SimplePush(0, 1)->update, apply.fn(), [](absl::Status) {}, nullptr);
  WaitCancel cancel;
  Outcome cancelled;
  policy->StartPull(0, cancelled.fn(), &cancel);
  EXPECT_EQ(policy->waiting(), 1);
  cancel.Cancel();
  EXPECT_STATUS_MSG(cancelled.status(), absl::StatusCode::kCancelled,
                    "ssp:0 pull of worker 0 was cancelled by the caller");
  EXPECT_EQ(policy->waiting(), 0);
}

TEST(WaitWithoutThreadTest, AbortWaitsReleasesEveryWaiter) {
  auto sync = MakePolicy("sync", 3);
  auto ssp = MakePolicy("ssp:0", 2);
  FakeApply apply;
  Outcome push, pull;
  sync->StartPush(SimplePush(0, 0)->update, apply.fn(), push.fn(), nullptr);
  ssp->StartPush(
      SimplePush(0, 0)->update, apply.fn(), [](absl::Status) {}, nullptr);
  ssp->StartPull(0, pull.fn(), nullptr);
  sync->AbortWaits(absl::UnavailableError("shutting down"));
  ssp->AbortWaits(absl::UnavailableError("shutting down"));
  EXPECT_STATUS_MSG(push.status(), absl::StatusCode::kUnavailable, "shutting down");
  EXPECT_STATUS_MSG(pull.status(), absl::StatusCode::kUnavailable, "shutting down");
  EXPECT_EQ(sync->waiting() + ssp->waiting(), 0);
  EXPECT_EQ(apply.calls(), 1);  // The ssp push only.
}

// Policies of many jobs share the shard's timer.
TEST(WaitWithoutThreadTest, PoliciesShareOneTimer) {
  WaitTimer timer;
  auto a = MakePolicy("sync", 2, absl::Milliseconds(50));
  auto b = MakePolicy("ssp:0", 2, absl::Milliseconds(50));
  a->UseTimer(&timer);
  b->UseTimer(&timer);
  FakeApply apply;
  Outcome push, pull;
  a->StartPush(SimplePush(0, 0)->update, apply.fn(), push.fn(), nullptr);
  b->StartPush(
      SimplePush(0, 0)->update, apply.fn(), [](absl::Status) {}, nullptr);
  b->StartPull(0, pull.fn(), nullptr);
  EXPECT_EQ(timer.pending(), 2u);
  ASSERT_TRUE(push.WaitFor(kPromptly));
  ASSERT_TRUE(pull.WaitFor(kPromptly));
  EXPECT_STATUS(push.status(), absl::StatusCode::kFailedPrecondition);
  EXPECT_STATUS_MSG(pull.status(), absl::StatusCode::kFailedPrecondition,
                    "ssp:0 pull of worker 0 at clock 1 waited 50ms for workers [1] to catch up");
}

// The shard's wait counter bounds parked calls over all its jobs; a push that completes its
// step needs no room.
TEST(WaitWithoutThreadTest, WaitCounterBoundsParkedCalls) {
  WaitCounter counter(1);
  auto sync = MakePolicy("sync", 2);
  auto ssp = MakePolicy("ssp:0", 2);
  sync->UseWaitCounter(&counter);
  ssp->UseWaitCounter(&counter);
  FakeApply apply;
  Outcome w0, pull, w1;
  sync->StartPush(SimplePush(0, 0)->update, apply.fn(), w0.fn(), nullptr);
  EXPECT_EQ(counter.waiting(), 1);
  ssp->StartPush(
      SimplePush(0, 0)->update, apply.fn(), [](absl::Status) {}, nullptr);
  ssp->StartPull(0, pull.fn(), nullptr);
  ASSERT_EQ(pull.calls(), 1);
  EXPECT_STATUS_MSG(pull.status(), absl::StatusCode::kResourceExhausted,
                    "Pull: ssp:0 worker 0: 1 requests already wait at barriers on this shard");
  EXPECT_EQ(ssp->waiting(), 0);
  sync->StartPush(SimplePush(1, 0)->update, apply.fn(), w1.fn(), nullptr);  // Completes.
  EXPECT_OK(w0.status());
  EXPECT_OK(w1.status());
  EXPECT_EQ(counter.waiting(), 0);
  // A refused sync push changes nothing: the step still needs it.
  Outcome a, refused, b;
  sync->StartPush(SimplePush(0, 1)->update, apply.fn(), a.fn(), nullptr);
  auto other = MakePolicy("sync", 2);
  other->UseWaitCounter(&counter);
  other->StartPush(SimplePush(0, 0)->update, apply.fn(), refused.fn(), nullptr);
  EXPECT_STATUS_MSG(refused.status(), absl::StatusCode::kResourceExhausted,
                    "Push: job j worker 0 step 0: 1 requests already wait");
  EXPECT_EQ(other->waiting(), 0);
  sync->StartPush(SimplePush(1, 1)->update, apply.fn(), b.fn(), nullptr);
  EXPECT_OK(a.status());
  EXPECT_OK(b.status());
  EXPECT_EQ(apply.calls(), 3);  // Two sync steps and the ssp push.
  EXPECT_EQ(counter.waiting(), 0);
}

}  // namespace
}  // namespace gradmesh
