#include "compression/select.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

#include "compression/rng.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

uint32_t MagnitudeKey(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u & 0x7fffffffu;
}

// Reference: sort all indices by (magnitude descending, index ascending), keep k, sort.
std::vector<uint32_t> RefTopK(const std::vector<float>& x, size_t k) {
  std::vector<uint32_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), 0u);
  std::stable_sort(idx.begin(), idx.end(),
                   [&](uint32_t a, uint32_t b) { return MagnitudeKey(x[a]) > MagnitudeKey(x[b]); });
  idx.resize(std::min(k, x.size()));
  std::sort(idx.begin(), idx.end());
  return idx;
}

float Normal(Rng& rng) {
  // Box-Muller from two 24-bit uniforms.
  const double u1 = (static_cast<double>(rng.Next() >> 40) + 1) / 16777217.0;
  const double u2 = static_cast<double>(rng.Next() >> 40) / 16777216.0;
  return static_cast<float>(std::sqrt(-2 * std::log(u1)) * std::cos(2 * M_PI * u2));
}

enum class Data { kNormal, kFewValues, kZeros, kSignedZeros, kSubnormal, kMostlyZero, kQuantized };

std::vector<float> MakeData(Data kind, size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    switch (kind) {
      case Data::kNormal:
        x[i] = Normal(rng);
        break;
      case Data::kFewValues: {
        static const float kValues[] = {0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 0.5f, -0.5f, -0.0f};
        x[i] = kValues[rng.Uniform(8)];
        break;
      }
      case Data::kZeros:
        x[i] = 0.0f;
        break;
      case Data::kSignedZeros:
        x[i] = rng.Uniform(2) ? 0.0f : -0.0f;
        break;
      case Data::kSubnormal:
        x[i] = std::ldexp(static_cast<float>(rng.Uniform(1000)) - 500.0f, -140);
        break;
      case Data::kMostlyZero:
        x[i] = rng.Uniform(100) == 0 ? Normal(rng) : 0.0f;
        break;
      case Data::kQuantized:
        x[i] = std::round(Normal(rng) * 4) / 4;  // many exact ties everywhere
        break;
    }
  }
  return x;
}

TEST(TopKTest, MatchesSortReferenceIncludingTies) {
  const Data kinds[] = {Data::kNormal,    Data::kFewValues,  Data::kZeros,    Data::kSignedZeros,
                        Data::kSubnormal, Data::kMostlyZero, Data::kQuantized};
  // Small sizes go through the radix select directly; 50000 and 300000 with small k take
  // the sampled fast path (and fall back to the radix select on heavy ties).
  const size_t sizes[] = {1, 2, 3, 15, 16, 17, 100, 1000, 4103, 50000, 300000};
  uint64_t seed = 1;
  for (Data kind : kinds) {
    for (size_t n : sizes) {
      const std::vector<float> x = MakeData(kind, n, seed++);
      std::set<size_t> ks = {0, 1, 2, n / 1000, n / 100, n / 10, n / 2, n - 1, n, n + 5};
      for (size_t k : ks) {
        std::vector<uint32_t> got = {123};
        EXPECT_TRUE(TopKMagnitude(x, k, &got));
        ASSERT_EQ(got, RefTopK(x, k))
            << "kind " << static_cast<int>(kind) << " n=" << n << " k=" << k;
      }
    }
  }
}

TEST(TopKTest, ManyRandomSmallCases) {
  Rng rng(99);
  for (int trial = 0; trial < 3000; ++trial) {
    const size_t n = 1 + rng.Uniform(300);
    const size_t k = rng.Uniform(n + 1);
    const Data kind = static_cast<Data>(rng.Uniform(7));
    const std::vector<float> x = MakeData(kind, n, rng.Next());
    std::vector<uint32_t> got;
    TopKMagnitude(x, k, &got);
    ASSERT_EQ(got, RefTopK(x, k)) << "trial " << trial;
  }
}

TEST(TopKTest, TiesGoToTheLowerIndex) {
  const std::vector<float> x = {1, -3, 3, 2, -3, 3, 0};
  std::vector<uint32_t> got;
  TopKMagnitude(x, 1, &got);
  EXPECT_EQ(got, std::vector<uint32_t>({1}));
  TopKMagnitude(x, 3, &got);
  EXPECT_EQ(got, std::vector<uint32_t>({1, 2, 4}));
  TopKMagnitude(x, 5, &got);
  EXPECT_EQ(got, std::vector<uint32_t>({1, 2, 3, 4, 5}));
}

TEST(TopKTest, ReportsNonFiniteAndOrdersByBits) {
  for (size_t n : {50u, 300000u}) {
    std::vector<float> x = MakeData(Data::kNormal, n, 5);
    x[7] = std::numeric_limits<float>::infinity();
    x[n - 3] = -std::numeric_limits<float>::quiet_NaN();
    std::vector<uint32_t> got;
    EXPECT_FALSE(TopKMagnitude(x, n / 100 + 2, &got)) << n;
    EXPECT_EQ(got, RefTopK(x, n / 100 + 2)) << n;
    EXPECT_FALSE(TopKMagnitude(x, 0, &got));
    EXPECT_FALSE(TopKMagnitude(x, n, &got));
    EXPECT_FALSE(ApproxTopKMagnitude(x, n / 100 + 2, 1, &got)) << n;
  }
}

// Every selected magnitude is >= every unselected one, apart from zeros (never selected).
void ExpectThresholdSet(const std::vector<float>& x, const std::vector<uint32_t>& sel) {
  ASSERT_TRUE(std::is_sorted(sel.begin(), sel.end()));
  ASSERT_EQ(std::adjacent_find(sel.begin(), sel.end()), sel.end());
  std::vector<bool> in(x.size(), false);
  uint32_t min_selected = 0xffffffffu;
  for (uint32_t i : sel) {
    ASSERT_LT(i, x.size());
    in[i] = true;
    min_selected = std::min(min_selected, MagnitudeKey(x[i]));
  }
  for (size_t i = 0; i < x.size(); ++i) {
    if (!in[i]) {
      EXPECT_LE(MagnitudeKey(x[i]), min_selected) << i;
    }
  }
  EXPECT_GT(min_selected, 0u);
}

TEST(ApproxTopKTest, SelectsAllAboveAThresholdCloseToK) {
  const std::vector<float> x = MakeData(Data::kNormal, 1000000, 11);
  for (size_t k : {2000u, 10000u}) {  // samples of 128000 and 25600
    double total_error = 0;
    for (uint64_t seed = 0; seed < 10; ++seed) {
      std::vector<uint32_t> got;
      EXPECT_TRUE(ApproxTopKMagnitude(x, k, seed, &got));
      ExpectThresholdSet(x, got);
      // The count's relative sd is ~1/sqrt(256) = 6%; 5 sd.
      EXPECT_NEAR(static_cast<double>(got.size()), static_cast<double>(k), 0.32 * k) << seed;
      total_error += std::fabs(static_cast<double>(got.size()) - k) / k;
      std::vector<uint32_t> again;
      ApproxTopKMagnitude(x, k, seed, &again);
      EXPECT_EQ(got, again) << "not a function of the seed";
    }
    EXPECT_LT(total_error / 10, 0.12);
  }
}

TEST(ApproxTopKTest, NeverMoreThanTwiceKAndExactForSmallInputs) {
  // Heavy ties: the threshold lands on a value shared by many elements.
  const std::vector<float> q = MakeData(Data::kFewValues, 1000000, 12);
  std::vector<uint32_t> got;
  ApproxTopKMagnitude(q, 1000, 3, &got);
  EXPECT_LE(got.size(), 2000u);
  EXPECT_EQ(got, RefTopK(q, 1000));  // over 2k passed: the exact top k
  // Mostly zeros with fewer non-zeros than k: zeros are never selected.
  const std::vector<float> z = MakeData(Data::kMostlyZero, 1000000, 13);
  const size_t nonzero =
      static_cast<size_t>(std::count_if(z.begin(), z.end(), [](float v) { return v != 0; }));
  ApproxTopKMagnitude(z, nonzero * 2, 3, &got);
  EXPECT_EQ(got.size(), nonzero);
  ExpectThresholdSet(z, got);
  // Sample would be more than n/4: exact.
  const std::vector<float> s = MakeData(Data::kNormal, 5000, 14);
  ApproxTopKMagnitude(s, 50, 3, &got);
  EXPECT_EQ(got, RefTopK(s, 50));
  ApproxTopKMagnitude(s, 0, 3, &got);
  EXPECT_TRUE(got.empty());
  ApproxTopKMagnitude(s, 6000, 3, &got);
  EXPECT_EQ(got.size(), 5000u);
}

void ExpectValidSubset(const std::vector<uint32_t>& got, size_t n, size_t k) {
  ASSERT_EQ(got.size(), std::min(n, k));
  ASSERT_TRUE(std::is_sorted(got.begin(), got.end()));
  ASSERT_EQ(std::adjacent_find(got.begin(), got.end()), got.end());
  if (!got.empty()) {
    ASSERT_LT(got.back(), n);
  }
}

TEST(RandomKTest, DistinctSortedDeterministic) {
  // k * 512 < n: sort path; otherwise the bitmap, and its complement for k > n/2.
  for (size_t n : {1u, 2u, 10u, 64u, 65u, 1000u, 100000u}) {
    for (size_t k : {0u, 1u, 2u, 5u, 32u, 64u, 500u, 999u, 1000u, 1001u}) {
      std::vector<uint32_t> a, b, c;
      RandomKIndices(n, k, 42, &a);
      ExpectValidSubset(a, n, k);
      RandomKIndices(n, k, 42, &b);
      EXPECT_EQ(a, b);
      RandomKIndices(n, k, 43, &c);
      if (k > 2 && k + 2 < n) {
        EXPECT_NE(a, c) << n << " " << k;
      }
    }
  }
}

TEST(RandomKTest, EveryIndexEquallyLikely) {
  // Each index is chosen with probability k/n; over T seeds its count is Binomial(T, k/n).
  struct Case {
    size_t n, k;
  };
  for (Case c : {Case{5000, 5}, Case{200, 20}, Case{200, 150}}) {
    const int trials = 4000;
    std::vector<int> count(c.n, 0);
    for (int t = 0; t < trials; ++t) {
      std::vector<uint32_t> got;
      RandomKIndices(c.n, c.k, static_cast<uint64_t>(t) * 7919 + 1, &got);
      for (uint32_t i : got) ++count[i];
    }
    const double p = static_cast<double>(c.k) / c.n;
    const double mean = trials * p;
    const double sd = std::sqrt(trials * p * (1 - p));
    // Max over n indices of |count - mean| / sd: 5.5 sd keeps a false failure below 1e-4.
    for (size_t i = 0; i < c.n; ++i) {
      ASSERT_NEAR(count[i], mean, 5.5 * sd) << "n=" << c.n << " k=" << c.k << " i=" << i;
    }
  }
}

}  // namespace
}  // namespace gradmesh
