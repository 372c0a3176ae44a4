#include "worker/blas_core.h"

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(BlasCoreTest, PreAvx2CoresAreUpgradedToWhatTheCpuCanDo) {
  const CpuVectorSupport avx512{true, true}, avx2{true, false}, none{false, false};
  EXPECT_EQ(BetterBlasCore("Prescott", avx512), "SkylakeX");
  EXPECT_EQ(BetterBlasCore("prescott", avx2), "Haswell");
  EXPECT_EQ(BetterBlasCore("Nehalem", avx512), "SkylakeX");
  EXPECT_EQ(BetterBlasCore("Sandybridge", avx2), "Haswell");
  EXPECT_EQ(BetterBlasCore("Prescott", none), "");
}

TEST(BlasCoreTest, AGoodOrUnknownChoiceIsKept) {
  const CpuVectorSupport avx512{true, true};
  EXPECT_EQ(BetterBlasCore("Haswell", avx512), "");  // The user's machine may disable AVX-512.
  EXPECT_EQ(BetterBlasCore("SkylakeX", avx512), "");
  EXPECT_EQ(BetterBlasCore("Cooperlake", avx512), "");
  EXPECT_EQ(BetterBlasCore("Zen", avx512), "");
  EXPECT_EQ(BetterBlasCore("", avx512), "");  // No OpenBLAS.
}

// The worker binary links OpenBLAS through LibTorch; this test links no BLAS, so there is
// nothing to report, and nothing to re-exec.
TEST(BlasCoreTest, WithoutOpenBlasNothingIsLoadedOrReexecuted) {
  EXPECT_EQ(LoadedBlasCore(), "");
  char arg0[] = "blas_core_test";
  char* argv[] = {arg0, nullptr};
  ReexecWithBetterBlasCore(argv);  // Returns: nothing to do.
  EXPECT_EQ(ReportBlasCore().core, "");
}

}  // namespace
}  // namespace gradmesh
