#include "common/rate_limiter.h"

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(RateLimiterTest, PacesToTheRate) {
  RateLimiter limiter(/*bytes_per_second=*/1e6, /*burst_bytes=*/1000);
  const absl::Time start = absl::Now();
  // 1000 burst + 200 KB at 1 MB/s: ~0.2 s.
  for (int i = 0; i < 201; ++i) limiter.Acquire(1000);
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  EXPECT_GE(secs, 0.195);
  EXPECT_LT(secs, 0.5);
}

TEST(RateLimiterTest, UnlimitedNeverWaits) {
  RateLimiter limiter(0);
  EXPECT_EQ(limiter.Acquire(1 << 30), absl::ZeroDuration());
}

TEST(RateLimiterTest, LargeRequestWaitsForItsDeficit) {
  RateLimiter limiter(1e6, 1000);
  const absl::Duration w = limiter.Acquire(101000);  // 100 KB beyond the burst: 0.1 s.
  EXPECT_GE(w, absl::Milliseconds(99));
  EXPECT_LT(w, absl::Milliseconds(101));
}

}  // namespace
}  // namespace gradmesh
