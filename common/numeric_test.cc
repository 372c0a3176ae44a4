#include "common/numeric.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(NumericTest, FirstNonFinite) {
  std::vector<float> x(1001, 1.0f);
  x[3] = std::numeric_limits<float>::max();
  x[4] = std::numeric_limits<float>::denorm_min();
  x[5] = -0.0f;
  EXPECT_EQ(FirstNonFinite(x.data(), 0), -1);
  EXPECT_EQ(FirstNonFinite(x.data(), static_cast<int64_t>(x.size())), -1);
  for (int64_t pos : {0, 7, 999, 1000}) {
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()}) {
      std::vector<float> y = x;
      y[pos] = bad;
      EXPECT_EQ(FirstNonFinite(y.data(), static_cast<int64_t>(y.size())), pos);
      y[1000] = bad;
      EXPECT_EQ(FirstNonFinite(y.data(), static_cast<int64_t>(y.size())), pos);
    }
  }
}

}  // namespace
}  // namespace gradmesh
