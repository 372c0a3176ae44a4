// ClipGradients against hand-computed values (torch.nn.utils.clip_grad_norm_/value_ semantics).
#include "worker/core/grad_clip.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(GradClipTest, NormOverEverySpanScalesAllOfThem) {
  std::vector<float> a = {3, 0}, b = {0, 4};  // Norm 5 over both.
  std::vector<absl::Span<float>> g = {absl::MakeSpan(a), absl::MakeSpan(b)};
  ClipStats s = ClipGradients(g, ClipOptions{1.0, 0});
  EXPECT_DOUBLE_EQ(s.norm, 5.0);
  EXPECT_TRUE(s.clipped);
  const float f = static_cast<float>(1.0 / (5.0 + 1e-6));
  EXPECT_EQ(a, (std::vector<float>{3 * f, 0}));
  EXPECT_EQ(b, (std::vector<float>{0, 4 * f}));
  // Below the bound: untouched.
  s = ClipGradients(g, ClipOptions{10.0, 0});
  EXPECT_FALSE(s.clipped);
  EXPECT_NEAR(s.norm, 1.0, 1e-6);
  EXPECT_EQ(a, (std::vector<float>{3 * f, 0}));
}

TEST(GradClipTest, ValuesAreClampedBeforeTheNorm) {
  std::vector<float> a = {-7, 0.5f, 2};
  std::vector<absl::Span<float>> g = {absl::MakeSpan(a)};
  ClipStats s = ClipGradients(g, ClipOptions{0, 1.0});
  EXPECT_TRUE(s.clipped);
  EXPECT_EQ(a, (std::vector<float>{-1, 0.5f, 1}));
  EXPECT_DOUBLE_EQ(s.norm, 1.5);  // sqrt(1 + 0.25 + 1).
  std::vector<float> b = {-7, 0.5f, 2};
  g = {absl::MakeSpan(b)};
  s = ClipGradients(g, ClipOptions{0.75, 1.0});  // Clamp, then scale 1.5 -> 0.75.
  EXPECT_DOUBLE_EQ(s.norm, 1.5);
  const float f = static_cast<float>(0.75 / (1.5 + 1e-6));
  EXPECT_EQ(b, (std::vector<float>{-1 * f, 0.5f * f, 1 * f}));
}

TEST(GradClipTest, OffAndNonFinite) {
  std::vector<float> a = {100, -100};
  std::vector<absl::Span<float>> g = {absl::MakeSpan(a)};
  ClipStats s = ClipGradients(g, ClipOptions{});
  EXPECT_FALSE(s.clipped);
  EXPECT_EQ(a, (std::vector<float>{100, -100}));
  a[0] = std::numeric_limits<float>::infinity();
  s = ClipGradients(g, ClipOptions{1.0, 0});
  EXPECT_TRUE(std::isinf(s.norm));
  EXPECT_FALSE(s.clipped);
  EXPECT_EQ(a[1], -100);  // Left for the mode's own checks.
}

// The coefficient the sync mode sends with its commit (worker/ps/ps_mode.cc) and ClipGradients
// applies: torch's max_norm / (norm + 1e-6) below 1, else 1.
TEST(GradClipTest, ClipCoefficientIsTorchsAndNeverAboveOne) {
  EXPECT_DOUBLE_EQ(ClipCoefficient(0.5, 5.0), 0.5 / (5.0 + 1e-6));
  EXPECT_EQ(ClipCoefficient(0.5, 0.25), 1.0);
  EXPECT_EQ(ClipCoefficient(0.0, 5.0), 1.0);  // Off.
  EXPECT_EQ(ClipCoefficient(0.5, std::numeric_limits<double>::infinity()), 1.0);
  EXPECT_EQ(ClipCoefficient(0.5, std::nan("")), 1.0);
}

}  // namespace
}  // namespace gradmesh
