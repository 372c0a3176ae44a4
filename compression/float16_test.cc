#include "compression/float16.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

float FromBits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// Reference fp16 decoding in double, straight from the IEEE 754 definition.
double RefHalfValue(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -mag : mag;
}

// Reference narrowing: the nearest of the 31744 non-negative finite fp16 values (computed in
// double, exact for these values), ties to the even pattern; |x| >= 65520 (where RNE gives
// Inf) clamps to 65504.
class RefHalf {
 public:
  RefHalf() {
    for (uint32_t h = 0; h <= 0x7bff; ++h)
      values_.push_back(RefHalfValue(static_cast<uint16_t>(h)));
  }

  uint16_t operator()(float x) const {
    const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    const double a = std::fabs(static_cast<double>(x));
    if (a >= 65520.0) return sign | 0x7bff;
    // values_ is ascending: the first value >= a, and the one below it.
    const size_t hi = std::lower_bound(values_.begin(), values_.end(), a) - values_.begin();
    if (hi == values_.size()) return sign | 0x7bff;
    if (hi == 0 || values_[hi] == a) return sign | static_cast<uint16_t>(hi);
    const size_t lo = hi - 1;
    const double dlo = a - values_[lo];
    const double dhi = values_[hi] - a;
    size_t pick = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) == 0 ? lo : hi);
    return sign | static_cast<uint16_t>(pick);
  }

 private:
  std::vector<double> values_;
};

// Reference bf16 narrowing in double: the nearer of the two bf16 neighbours (truncation and
// the next pattern up, which is 2^128 past the largest finite value), ties to the even
// pattern; a result of Inf (0x7f80) is clamped to 0x7f7f.
uint16_t RefBFloat16(float x) {
  const uint32_t f = Bits(x);
  const uint32_t sign = (f >> 16) & 0x8000;
  const uint32_t a = f & 0x7fffffff;
  const uint32_t lo = a >> 16;
  const double v = static_cast<double>(FromBits(a));
  const double vlo = static_cast<double>(FromBits(lo << 16));
  const double vhi =
      lo + 1 == 0x7f80 ? std::ldexp(1.0, 128) : static_cast<double>(FromBits((lo + 1) << 16));
  uint32_t pick = v - vlo < vhi - v ? lo : vhi - v < v - vlo ? lo + 1 : ((lo & 1) ? lo + 1 : lo);
  if (pick >= 0x7f80) pick = 0x7f7f;
  return static_cast<uint16_t>(sign | pick);
}

// Half of fp16's ulp at |x| (its spacing there; 2^-24 in the subnormal range).
double HalfUlp(double a) {
  if (a < std::ldexp(1.0, -14)) return std::ldexp(1.0, -25);
  int e;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  return std::ldexp(1.0, e - 1 - 10 - 1);
}

TEST(Float16Test, TieCasesRoundToEven) {
  struct Case {
    float in;
    uint16_t out;
  };
  const Case cases[] = {
      {1.0f, 0x3c00},
      {1.0f + 0x1p-11f, 0x3c00},             // halfway 1 / 1+2^-10: even is 1
      {1.0f + 3 * 0x1p-11f, 0x3c02},         // halfway 1+2^-10 / 1+2^-9: even is 1+2^-9
      {1.0f + 0x1p-11f + 0x1p-23f, 0x3c01},  // just above the tie
      {0x1p-25f, 0x0000},                    // halfway 0 / smallest subnormal: 0
      {3 * 0x1p-25f, 0x0002},                // halfway 1 / 2 subnormal steps: 2
      {5 * 0x1p-25f, 0x0002},                // halfway 2 / 3: 2
      {0x1p-25f + 0x1p-40f, 0x0001},         // just above the first tie
      {0x1p-14f - 0x1p-25f, 0x0400},         // halfway largest subnormal / smallest normal
      {0x1p-14f, 0x0400},
      {0x1p-24f, 0x0001},
      {0x1p-26f, 0x0000},
      {std::numeric_limits<float>::denorm_min(), 0x0000},
      {-std::numeric_limits<float>::denorm_min(), 0x8000},
      {-0.0f, 0x8000},
      {0.0f, 0x0000},
      {65504.0f, 0x7bff},
      {65519.0f, 0x7bff},  // RNE gives 65504 below 65520
      {65520.0f, 0x7bff},  // RNE would give Inf: clamped
      {1e6f, 0x7bff},
      {-1e6f, 0xfbff},
      {std::numeric_limits<float>::max(), 0x7bff},
      {-std::numeric_limits<float>::max(), 0xfbff},
      {2048.0f + 1.0f, 0x6800},  // halfway 2048 / 2050: even is 2048
      {2048.0f + 3.0f, 0x6802},  // halfway 2050 / 2052: even is 2052
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FloatToHalfScalar(c.in), c.out) << c.in;
    for (Float16Backend b : {Float16Backend::kPortable, Float16Backend::kF16c}) {
      // Through the bulk paths too (with a vector-sized buffer so the SIMD loop runs).
      std::vector<float> in(19, c.in);
      std::vector<uint16_t> out(19);
      EXPECT_EQ(FloatToHalf(in.data(), 19, out.data(), b), -1);
      for (uint16_t h : out) EXPECT_EQ(h, c.out) << c.in << " backend " << static_cast<int>(b);
    }
  }
  EXPECT_EQ(kFloat16Max, 65504.0f);
  EXPECT_EQ(Bits(kBFloat16Max), 0x7f7f0000u);
}

TEST(Float16Test, DecodesEveryPatternExactly) {
  std::vector<uint16_t> all(65536);
  for (uint32_t h = 0; h < 65536; ++h) all[h] = static_cast<uint16_t>(h);
  for (Float16Backend b : {Float16Backend::kPortable, Float16Backend::kF16c}) {
    std::vector<float> out(65536);
    // The first special pattern is +Inf, 0x7c00.
    EXPECT_EQ(HalfToFloat(all.data(), 65536, out.data(), b), 0x7c00);
    for (uint32_t h = 0; h < 65536; ++h) {
      if ((h & 0x7c00) == 0x7c00) continue;
      ASSERT_EQ(static_cast<double>(out[h]), RefHalfValue(static_cast<uint16_t>(h))) << h;
      ASSERT_EQ(out[h], HalfToFloatScalar(static_cast<uint16_t>(h)));
      ASSERT_EQ(std::signbit(out[h]), (h & 0x8000) != 0);
    }
    // Finite patterns only: -1.
    std::vector<uint16_t> finite;
    for (uint32_t h = 0; h < 65536; ++h) {
      if ((h & 0x7c00) != 0x7c00) finite.push_back(static_cast<uint16_t>(h));
    }
    EXPECT_EQ(HalfToFloat(finite.data(), static_cast<int64_t>(finite.size()), out.data(), b), -1);
    // Every finite pattern survives a round trip through float.
    std::vector<uint16_t> back(finite.size());
    std::vector<float> widened(finite.size());
    HalfToFloat(finite.data(), static_cast<int64_t>(finite.size()), widened.data(), b);
    EXPECT_EQ(FloatToHalf(widened.data(), static_cast<int64_t>(widened.size()), back.data(), b),
              -1);
    EXPECT_EQ(back, finite);
  }
}

TEST(Float16Test, SubnormalsAreMultiplesOf2ToTheMinus24) {
  for (uint16_t m = 0; m < 1024; ++m) {
    const float v = std::ldexp(static_cast<float>(m), -24);
    EXPECT_EQ(HalfToFloatScalar(m), v);
    EXPECT_EQ(FloatToHalfScalar(v), m);
    EXPECT_EQ(FloatToHalfScalar(-v), 0x8000 | m);
  }
}

TEST(Float16Test, MatchesDoubleReferenceWithinHalfUlp) {
  const RefHalf ref;
  // A stride through every float32 bit pattern (both signs, every exponent).
  std::vector<float> in;
  for (uint64_t u = 0; u < (1ULL << 32); u += 4099) {
    const uint32_t bits = static_cast<uint32_t>(u);
    if ((bits & 0x7f800000u) == 0x7f800000u) continue;
    in.push_back(FromBits(bits));
  }
  // And a dense sweep of the interesting range [2^-26, 2^17) at random-ish mantissas.
  for (uint32_t bits = 0x32800000u; bits < 0x48000000u; bits += 97) in.push_back(FromBits(bits));
  std::vector<uint16_t> out(in.size());
  ASSERT_EQ(FloatToHalf(in.data(), static_cast<int64_t>(in.size()), out.data()), -1);
  std::vector<float> back(in.size());
  ASSERT_EQ(HalfToFloat(out.data(), static_cast<int64_t>(out.size()), back.data()), -1);
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(out[i], ref(in[i])) << "x=" << in[i] << " bits=" << std::hex << Bits(in[i]);
    const double a = std::fabs(static_cast<double>(in[i]));
    if (a <= 65504.0) {
      ASSERT_LE(std::fabs(static_cast<double>(back[i]) - in[i]), HalfUlp(a)) << in[i];
    } else {
      ASSERT_EQ(std::fabs(back[i]), 65504.0f);
    }
  }
}

TEST(Float16Test, F16cAndPortableAgreeOnEveryFiniteFloat) {
  if (!Float16BackendAvailable(Float16Backend::kF16c)) {
    GTEST_SKIP() << "no F16C on this CPU";
  }
  // Every finite float32, one (sign, exponent) block of 2^23 at a time.
  std::vector<float> in(1u << 23);
  std::vector<uint16_t> a(in.size()), b(in.size());
  for (uint32_t top = 0; top < 512; ++top) {
    if ((top & 0xff) == 0xff) continue;  // Inf/NaN
    for (uint32_t m = 0; m < (1u << 23); ++m) in[m] = FromBits((top << 23) | m);
    ASSERT_EQ(FloatToHalf(in.data(), static_cast<int64_t>(in.size()), a.data(),
                          Float16Backend::kPortable),
              -1);
    ASSERT_EQ(
        FloatToHalf(in.data(), static_cast<int64_t>(in.size()), b.data(), Float16Backend::kF16c),
        -1);
    if (a != b) {
      for (size_t i = 0; i < in.size(); ++i) {
        ASSERT_EQ(a[i], b[i]) << "bits " << std::hex << Bits(in[i]);
      }
    }
  }
}

TEST(Float16Test, ReportsFirstNonFiniteInput) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t n : {1, 8, 9, 33}) {
    for (int64_t pos = 0; pos < n; ++pos) {
      for (float bad : {nan, inf, -inf}) {
        std::vector<float> in(n, 1.5f);
        in[pos] = bad;
        if (pos + 1 < n) in[n - 1] = bad;
        std::vector<uint16_t> out(n);
        for (Float16Backend b : {Float16Backend::kPortable, Float16Backend::kF16c}) {
          EXPECT_EQ(FloatToHalf(in.data(), n, out.data(), b), pos);
        }
        EXPECT_EQ(FloatToBFloat16(in.data(), n, out.data()), pos);
        std::vector<uint16_t> h(n, 0x3c00);
        h[pos] = 0x7e00;  // fp16 NaN
        std::vector<float> f(n);
        for (Float16Backend b : {Float16Backend::kPortable, Float16Backend::kF16c}) {
          EXPECT_EQ(HalfToFloat(h.data(), n, f.data(), b), pos);
        }
        std::vector<uint16_t> bf(n, 0x3f80);
        bf[pos] = 0xff80;  // bf16 -Inf
        EXPECT_EQ(BFloat16ToFloat(bf.data(), n, f.data()), pos);
      }
    }
  }
}

TEST(BFloat16Test, TieCasesAndClamping) {
  struct Case {
    uint32_t in;
    uint16_t out;
  };
  const Case cases[] = {
      {0x3f800000u, 0x3f80},  // 1
      {0x3f808000u, 0x3f80},  // tie, even below
      {0x3f818000u, 0x3f82},  // tie, even above
      {0x3f808001u, 0x3f81},  // above the tie
      {0x3f807fffu, 0x3f80},  // below the tie
      {0x00008000u, 0x0000},  // subnormal tie to even 0
      {0x00018000u, 0x0002},  // subnormal tie to even 2
      {0x007fffffu, 0x0080},  // largest subnormal rounds up to the smallest normal
      {0x80000000u, 0x8000},  // -0
      {0x7f7f0000u, 0x7f7f},  // largest finite bf16
      {0x7f7f7fffu, 0x7f7f},  // rounds down
      {0x7f7f8000u, 0x7f7f},  // tie: RNE would give Inf: clamped
      {0x7f7fffffu, 0x7f7f},  // FLT_MAX: clamped
      {0xff7fffffu, 0xff7f},  // -FLT_MAX: clamped
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FloatToBFloat16Scalar(FromBits(c.in)), c.out) << std::hex << c.in;
    std::vector<float> in(21, FromBits(c.in));
    std::vector<uint16_t> out(21);
    EXPECT_EQ(FloatToBFloat16(in.data(), 21, out.data()), -1);
    for (uint16_t h : out) EXPECT_EQ(h, c.out) << std::hex << c.in;
  }
}

TEST(BFloat16Test, MatchesDoubleReferenceWithinHalfUlp) {
  std::vector<float> in;
  for (uint64_t u = 0; u < (1ULL << 32); u += 3001) {
    const uint32_t bits = static_cast<uint32_t>(u);
    if ((bits & 0x7f800000u) == 0x7f800000u) continue;
    in.push_back(FromBits(bits));
  }
  for (uint32_t bits = 0x7f7e0000u; bits < 0x7f800000u; bits += 7) in.push_back(FromBits(bits));
  std::vector<uint16_t> out(in.size());
  ASSERT_EQ(FloatToBFloat16(in.data(), static_cast<int64_t>(in.size()), out.data()), -1);
  std::vector<float> back(in.size());
  ASSERT_EQ(BFloat16ToFloat(out.data(), static_cast<int64_t>(out.size()), back.data()), -1);
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(out[i], RefBFloat16(in[i])) << std::hex << Bits(in[i]);
    ASSERT_EQ(back[i], BFloat16ToFloatScalar(out[i]));
    const uint32_t a = Bits(in[i]) & 0x7fffffffu;
    if (a < 0x7f7f8000u) {
      // Within half a bf16 ulp: the spacing at |x| is 2^(exponent - 7) (2^-133 below 2^-126).
      const int e = static_cast<int>(a >> 23);
      const double half_ulp = std::ldexp(1.0, std::max(e, 1) - 127 - 7 - 1);
      ASSERT_LE(std::fabs(static_cast<double>(back[i]) - in[i]), half_ulp) << in[i];
    } else {
      ASSERT_EQ(std::fabs(back[i]), kBFloat16Max);
    }
  }
}

TEST(BFloat16Test, DecodesEveryPattern) {
  std::vector<uint16_t> all(65536);
  for (uint32_t h = 0; h < 65536; ++h) all[h] = static_cast<uint16_t>(h);
  std::vector<float> out(65536);
  EXPECT_EQ(BFloat16ToFloat(all.data(), 65536, out.data()), 0x7f80);
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7f80) == 0x7f80) continue;
    ASSERT_EQ(Bits(out[h]), h << 16);
  }
}

}  // namespace
}  // namespace gradmesh
