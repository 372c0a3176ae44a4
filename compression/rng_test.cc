#include "compression/rng.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(RngTest, SplitMix64ReferenceValues) {
  // SplitMix64 with seed 1234567 (reference values from the public-domain C implementation).
  Rng rng(1234567);
  EXPECT_EQ(rng.Next(), 6457827717110365317ULL);
  EXPECT_EQ(rng.Next(), 3203168211198807973ULL);
  EXPECT_EQ(rng.Next(), 9817491932198370423ULL);
}

TEST(RngTest, MixIsTheIthOutput) {
  for (uint64_t seed : {0ULL, 1ULL, 0xdeadbeefULL}) {
    Rng rng(seed);
    for (uint64_t i = 0; i < 100; ++i) EXPECT_EQ(Rng::Mix(seed, i), rng.Next());
  }
}

TEST(RngTest, UniformIsInRangeAndCoversIt) {
  Rng rng(7);
  for (uint64_t bound : {1ULL, 2ULL, 3ULL, 10ULL, 1000ULL}) {
    std::vector<int> seen(bound, 0);
    for (int i = 0; i < 20000; ++i) {
      const uint64_t v = rng.Uniform(bound);
      ASSERT_LT(v, bound);
      ++seen[v];
    }
    for (uint64_t v = 0; v < bound; ++v) EXPECT_GT(seen[v], 0) << "bound " << bound;
  }
  // Counts of a 10-valued uniform over 100000 draws: mean 10000, sd ~95; 6 sd margin.
  std::vector<int> counts(10, 0);
  for (int i = 0; i < 100000; ++i) ++counts[rng.Uniform(10)];
  for (int c : counts) EXPECT_NEAR(c, 10000, 600);
}

TEST(RngTest, UniformFloatIsOnTheGridInUnitInterval) {
  Rng rng(3);
  double sum = 0;
  for (int i = 0; i < 100000; ++i) {
    const float u = rng.UniformFloat();
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    EXPECT_EQ(u * 16777216.0f, static_cast<float>(static_cast<int64_t>(u * 16777216.0f)));
    sum += u;
  }
  // Mean of 100000 U[0,1): sd 0.00091; 6 sd margin.
  EXPECT_NEAR(sum / 100000, 0.5, 0.0055);
}

}  // namespace
}  // namespace gradmesh
