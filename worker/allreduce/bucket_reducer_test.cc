// Tests of gradient bucketing and the overlapped bucket all-reduce (bucket_reducer.h) over an
// in-process ring, one thread per rank.
#include "worker/allreduce/bucket_reducer.h"

#include <cmath>
#include <thread>

#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "worker/allreduce/local_ring.h"

namespace gradmesh {
namespace {

TEST(AssignBucketsTest, ReverseOrderClosedAtBucketBytes) {
  // Floats: 100 elements are 400 bytes. From the last parameter: 20 + 10 + 300 elements
  // reach 400 bytes, then 50 + 100.
  std::vector<GradBucket> b = AssignBuckets({100, 50, 300, 10, 20}, 400);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].params, (std::vector<int>{4, 3, 2}));
  EXPECT_EQ(b[0].elements, 330);
  EXPECT_EQ(b[1].params, (std::vector<int>{1, 0}));
  EXPECT_EQ(b[1].elements, 150);
  // One large parameter is a bucket of its own; the rest stays together at the end.
  b = AssignBuckets({10, 1000, 5}, 400);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].params, (std::vector<int>{2, 1}));
  EXPECT_EQ(b[1].params, (std::vector<int>{0}));
  b = AssignBuckets({10, 1000, 5}, 0);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].params, (std::vector<int>{2, 1, 0}));
}

TEST(AssignBucketsTest, BuffersGetBucketsOfTheirOwnAfterTheParameters) {
  // Parameters 0..2 from the last: 300 elements close a bucket, then 50 + 100. The buffers
  // 3 and 4 (never mixed with parameters: their deltas come after backward) follow, first
  // to last, in a bucket of their own although 30 elements are below bucket_bytes.
  std::vector<GradBucket> b = AssignBuckets({100, 50, 300, 10, 20}, 400, 3);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].params, (std::vector<int>{2}));
  EXPECT_EQ(b[1].params, (std::vector<int>{1, 0}));
  EXPECT_EQ(b[2].params, (std::vector<int>{3, 4}));
  EXPECT_EQ(b[2].elements, 30);
  // Buffers are bucketed by the same rule.
  b = AssignBuckets({10, 200, 300}, 400, 1);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].params, (std::vector<int>{0}));
  EXPECT_EQ(b[1].params, (std::vector<int>{1}));
  EXPECT_EQ(b[2].params, (std::vector<int>{2}));
  // bucket_bytes 0: one bucket of parameters, one of buffers.
  b = AssignBuckets({10, 1000, 5}, 0, 2);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].params, (std::vector<int>{1, 0}));
  EXPECT_EQ(b[1].params, (std::vector<int>{2}));
  // No parameters (num_params 0) or no buffers (num_params = size or -1).
  EXPECT_EQ(AssignBuckets({4, 4}, 0, 0).size(), 1u);
  EXPECT_EQ(AssignBuckets({4, 4}, 0, 2)[0].params, (std::vector<int>{1, 0}));
  EXPECT_EQ(AssignBuckets({4, 4}, 0, -1)[0].params, (std::vector<int>{1, 0}));
}

TEST(BucketReducerTest, AveragesGradientsSumsExtrasZeroFillsMissing) {
  constexpr int n = 3;
  const std::vector<int64_t> numels = {5, 7, 3};
  auto ring = NewLocalRing(n);
  std::vector<std::unique_ptr<Collective>> coll;
  for (auto& t : ring) coll.push_back(NewRingCollective(std::move(t), RingOptions()));
  std::vector<std::vector<std::vector<float>>> got(n);
  std::vector<std::array<float, 2>> extras(n);
  std::vector<absl::Status> st(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      BucketReducer reducer(coll[r].get(), numels, 16);  // Buckets {2, 1} and {0}.
      EXPECT_EQ(reducer.buckets().size(), 2u);
      for (int step = 0; step < 3; ++step) {
        reducer.StartStep({r == 1 && step == 2 ? 1.0f : 0.0f, 0.5f * (r + 1)});
        for (int p = 2; p >= 0; --p) {
          // Rank 2 has no gradient for parameter 1 in step 1 (an unused parameter).
          if (r == 2 && step == 1 && p == 1) continue;
          std::vector<float> g(numels[p]);
          for (int64_t i = 0; i < numels[p]; ++i) g[i] = 3.0f * (r + 1) * (p + 1) + i + step;
          reducer.ParamReady(p, g.data(), numels[p]);
        }
        st[r] = reducer.FinishStep();
        if (!st[r].ok()) return;
        if (step == 1 || step == 2) {
          if (step == 2) got[r].clear();
          for (int p = 0; p < 3; ++p) {
            auto s = reducer.grad(p);
            got[r].emplace_back(s.begin(), s.end());
          }
          extras[r] = reducer.extras();
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    ASSERT_OK(st[r]);
    // Step 2: every rank had every gradient. Mean of 3(r+1)(p+1) + i + 2 over r = 6(p+1) + i + 2.
    for (int p = 0; p < 3; ++p) {
      for (int64_t i = 0; i < numels[p]; ++i) {
        EXPECT_FLOAT_EQ(got[r][p][i], 6.0f * (p + 1) + i + 2) << r << " " << p << " " << i;
      }
    }
    EXPECT_EQ(extras[r][0], 1.0f);            // Rank 1 voted to stop.
    EXPECT_FLOAT_EQ(extras[r][1], 0.5f * 6);  // Losses summed, not averaged.
  }
}

TEST(BucketReducerTest, MissingGradientCountsAsZero) {
  constexpr int n = 2;
  auto ring = NewLocalRing(n);
  std::vector<std::unique_ptr<Collective>> coll;
  for (auto& t : ring) coll.push_back(NewRingCollective(std::move(t), RingOptions()));
  std::vector<std::vector<float>> got(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      BucketReducer reducer(coll[r].get(), {4, 4}, 1 << 20);
      reducer.StartStep({0, 0});
      std::vector<float> g(4, 2.0f);
      reducer.ParamReady(1, g.data(), 4);
      if (r == 0) reducer.ParamReady(0, g.data(), 4);
      ASSERT_OK(reducer.FinishStep());
      auto s = reducer.grad(0);
      got[r].assign(s.begin(), s.end());
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(got[r], (std::vector<float>(4, 1.0f))) << r;
}

// The streaming FinishStep: ring segments of 2 floats cut parameters and buckets apart; each
// element of each parameter is handed over once, averaged, and the extras are summed.
TEST(BucketReducerTest, StreamingFinishStepHandsOverEveryElementOnceAveraged) {
  constexpr int n = 3;
  const std::vector<int64_t> numels = {5, 7, 3};
  auto ring = NewLocalRing(n);
  std::vector<std::unique_ptr<Collective>> coll;
  RingOptions ro;
  ro.segment_bytes = 8;
  for (auto& t : ring) coll.push_back(NewRingCollective(std::move(t), ro));
  // got[r][p][i]: the value handed over (NaN: never), count[r][p][i]: how often.
  std::vector<std::vector<std::vector<float>>> got(n);
  std::vector<std::vector<std::vector<int>>> count(n);
  std::vector<std::array<float, 2>> extras(n);
  std::vector<absl::Status> st(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      BucketReducer reducer(coll[r].get(), numels, 16);  // Buckets {2, 1} and {0}.
      for (int step = 0; step < 2; ++step) {
        got[r].assign(3, {});
        count[r].assign(3, {});
        for (int p = 0; p < 3; ++p) {
          got[r][p].assign(numels[p], std::nanf(""));
          count[r][p].assign(numels[p], 0);
        }
        reducer.StartStep({0.0f, 1.0f + r});
        for (int p = 2; p >= 0; --p) {
          std::vector<float> g(numels[p]);
          for (int64_t i = 0; i < numels[p]; ++i) g[i] = 3.0f * (r + 1) * (p + 1) + i + step;
          reducer.ParamReady(p, g.data(), numels[p]);
        }
        st[r] = reducer.FinishStep([&, r](int p, int64_t begin, absl::Span<const float> g) {
          for (size_t k = 0; k < g.size(); ++k) {
            got[r][p][begin + k] = g[k];
            ++count[r][p][begin + k];
          }
        });
        if (!st[r].ok()) return;
        extras[r] = reducer.extras();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    ASSERT_OK(st[r]);
    // Step 1: mean of 3(r+1)(p+1) + i + 1 over r = 6(p+1) + i + 1.
    for (int p = 0; p < 3; ++p) {
      for (int64_t i = 0; i < numels[p]; ++i) {
        EXPECT_EQ(count[r][p][i], 1) << r << " " << p << " " << i;
        EXPECT_FLOAT_EQ(got[r][p][i], 6.0f * (p + 1) + i + 1) << r << " " << p << " " << i;
      }
    }
    EXPECT_EQ(extras[r][1], 6.0f);  // 1 + 2 + 3, summed.
  }
}

TEST(BucketReducerTest, CollectiveErrorIsReturnedNamingTheBucket) {
  auto ring = NewLocalRing(2);
  std::unique_ptr<Collective> c0 = NewRingCollective(std::move(ring[0]), [] {
    RingOptions o;
    o.timeout = absl::Milliseconds(100);
    return o;
  }());
  ring[1].reset();  // Rank 1 is gone.
  BucketReducer reducer(c0.get(), {8, 8}, 16);
  reducer.StartStep({0, 0});
  std::vector<float> g(8, 1.0f);
  reducer.ParamReady(1, g.data(), 8);
  reducer.ParamReady(0, g.data(), 8);
  EXPECT_STATUS_MSG(reducer.FinishStep(), absl::StatusCode::kUnavailable,
                    "all-reduce of gradient bucket 0 of 2");
}

}  // namespace
}  // namespace gradmesh
