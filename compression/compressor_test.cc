#include "compression/compressor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "compression/float16.h"
#include "compression/payload.h"
#include "compression/rng.h"
#include "compression/select.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

const auto kInvalid = absl::StatusCode::kInvalidArgument;

std::unique_ptr<Compressor> Make(const std::string& spec) {
  absl::StatusOr<std::unique_ptr<Compressor>> c = CompressorRegistry::WithBuiltins().Create(spec);
  EXPECT_TRUE(c.ok()) << spec << ": " << c.status();
  return c.ok() ? std::move(c).value() : nullptr;
}

std::vector<float> Normal(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> x(n);
  for (float& v : x) {
    const double u1 = (static_cast<double>(rng.Next() >> 40) + 1) / 16777217.0;
    const double u2 = static_cast<double>(rng.Next() >> 40) / 16777216.0;
    v = scale * static_cast<float>(std::sqrt(-2 * std::log(u1)) * std::cos(2 * M_PI * u2));
  }
  return x;
}

std::vector<float> RoundTrip(const Compressor& c, const std::vector<float>& x, uint64_t seed,
                             std::string* payload = nullptr) {
  std::string p;
  EXPECT_OK(c.Encode(x, seed, &p));
  std::vector<float> out(x.size(), 12345.0f);
  EXPECT_OK(c.Decode(p, absl::MakeSpan(out)));
  if (payload) *payload = p;
  return out;
}

const char* const kSpecs[] = {"identity",
                              "fp16",
                              "bf16",
                              "topk:0.01",
                              "topk:0.3",
                              "topk_approx:0.01",
                              "randomk:0.05",
                              "qsgd:1",
                              "qsgd:4",
                              "qsgd:8",
                              "topk:0.01+fp16",
                              "topk:0.2+bf16",
                              "topk_approx:0.02+fp16",
                              "randomk:0.1+bf16"};

TEST(RegistryTest, KnowsTheBuiltinsAndNamesAreCanonical) {
  const CompressorRegistry r = CompressorRegistry::WithBuiltins();
  EXPECT_EQ(r.names(), std::vector<std::string>(
                           {"bf16", "fp16", "identity", "qsgd", "randomk", "topk", "topk_approx"}));
  for (const char* spec : kSpecs) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Compressor> c, r.Create(spec));
    EXPECT_EQ(c->name(), spec);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Compressor> again, r.Create(c->name()));
    EXPECT_EQ(again->name(), spec);
  }
  EXPECT_EQ(Make("topk:1e-3")->name(), "topk:0.001");
  EXPECT_EQ(Make("topk:0.25")->density(), 0.25);
  EXPECT_EQ(Make("fp16")->density(), 1.0);
}

TEST(RegistryTest, RejectsUnknownNamesAndBadParameters) {
  const CompressorRegistry r = CompressorRegistry::WithBuiltins();
  EXPECT_STATUS_MSG(r.Create("zstd"), kInvalid,
                    "unknown codec \"zstd\" (known: bf16, fp16, identity, qsgd, randomk, topk, "
                    "topk_approx)");
  EXPECT_STATUS_MSG(r.Create(""), kInvalid, "unknown codec \"\" (known: bf16");
  EXPECT_STATUS_MSG(r.Create("topk:0.01+zstd"), kInvalid, "unknown codec \"zstd\"");
  EXPECT_STATUS_MSG(r.Create("topk"), kInvalid, "topk needs a ratio in (0, 1]");
  EXPECT_STATUS_MSG(r.Create("topk:"), kInvalid, "empty parameter");
  for (const char* bad : {"topk:0", "topk:-0.1", "topk:1.5", "topk:abc", "topk:nan", "topk:inf",
                          "topk: 0.1", "topk:0.1x", "randomk:2", "topk_approx:0"}) {
    EXPECT_STATUS_MSG(r.Create(bad), kInvalid, "is not a number in (0, 1]") << bad;
  }
  for (const char* bad : {"qsgd", "qsgd:0", "qsgd:9", "qsgd:x", "qsgd:4.5", "qsgd:-1"}) {
    EXPECT_STATUS_MSG(r.Create(bad), kInvalid, "qsgd needs a bit count in [1, 8]") << bad;
  }
  EXPECT_STATUS_MSG(r.Create("fp16:3"), kInvalid, "fp16 takes no parameter");
  EXPECT_STATUS_MSG(r.Create("identity:1"), kInvalid, "identity takes no parameter");
  EXPECT_STATUS_MSG(r.Create("fp16+topk:0.1"), kInvalid,
                    "cannot compose \"fp16+topk:0.1\": '+' combines a sparsifier");
  EXPECT_STATUS_MSG(r.Create("topk:0.1+qsgd:4"), kInvalid, "cannot compose");
  EXPECT_STATUS_MSG(r.Create("topk:0.1+identity"), kInvalid, "cannot compose");
  EXPECT_STATUS_MSG(r.Create("topk:0.1+topk:0.2"), kInvalid, "cannot compose");
  EXPECT_STATUS_MSG(r.Create("topk:0.1+fp16+bf16"), kInvalid, "more than two codecs");
  EXPECT_STATUS_MSG(r.Create("topk:0.1+"), kInvalid, "unknown codec \"\"");
}

TEST(SparseCountTest, CeilWithTolerance) {
  EXPECT_EQ(SparseCount(100, 0.07), 7);  // 0.07 * 100 = 7.000000000000001
  EXPECT_EQ(SparseCount(1000, 0.01), 10);
  EXPECT_EQ(SparseCount(1001, 0.01), 11);
  EXPECT_EQ(SparseCount(3, 0.5), 2);
  EXPECT_EQ(SparseCount(1, 0.001), 1);
  EXPECT_EQ(SparseCount(10, 1.0), 10);
  EXPECT_EQ(SparseCount(0, 0.5), 0);
  EXPECT_EQ(SparseCount(25000000, 0.001), 25000);
}

TEST(CodecTest, IdentityIsExact) {
  const std::vector<float> x = Normal(1000, 1);
  const std::unique_ptr<Compressor> c = Make("identity");
  std::string p;
  EXPECT_EQ(RoundTrip(*c, x, 0, &p), x);
  EXPECT_EQ(p.size(), 16 + 4000u);
  EXPECT_EQ(c->MaxEncodedSize(1000), p.size());
  EXPECT_FALSE(c->biased());
  EXPECT_FALSE(c->stochastic());
}

TEST(CodecTest, Fp16AndBf16AreTheElementwiseConversions) {
  std::vector<float> x = Normal(1001, 2, 100.0f);
  x[0] = 1e6f;     // clamped to 65504 by fp16
  x[1] = -7e4f;    // clamped to -65504
  x[2] = 1e-9f;    // fp16 zero, bf16 keeps it
  x[3] = 3e-6f;    // fp16 subnormal
  x[4] = 3.0e38f;  // bf16 finite
  x[5] = -0.0f;
  for (const char* spec : {"fp16", "bf16"}) {
    const std::unique_ptr<Compressor> c = Make(spec);
    std::string p;
    const std::vector<float> got = RoundTrip(*c, x, 0, &p);
    EXPECT_EQ(p.size(), 16 + 2 * x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      const float want = std::string(spec) == "fp16"
                             ? HalfToFloatScalar(FloatToHalfScalar(x[i]))
                             : BFloat16ToFloatScalar(FloatToBFloat16Scalar(x[i]));
      ASSERT_EQ(got[i], want) << spec << " " << i;
    }
    EXPECT_TRUE(c->biased());
  }
  const std::vector<float> f16 = RoundTrip(*Make("fp16"), x, 0);
  EXPECT_EQ(f16[0], 65504.0f);
  EXPECT_EQ(f16[1], -65504.0f);
  EXPECT_EQ(f16[2], 0.0f);
  EXPECT_EQ(f16[3], std::ldexp(50.0f, -24));  // 3e-6 / 2^-24 = 50.33
  EXPECT_TRUE(std::signbit(f16[5]));
}

TEST(CodecTest, EncodeRejectsNonFiniteInput) {
  for (const char* spec : kSpecs) {
    const std::unique_ptr<Compressor> c = Make(spec);
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()}) {
      for (size_t n : {10u, 5000u}) {
        std::vector<float> x = Normal(n, 3);
        x[7] = bad;
        std::string p;
        EXPECT_STATUS_MSG(c->Encode(x, 1, &p), kInvalid, "input element 7 is ") << spec;
      }
    }
  }
}

// The top-k reference: sort by (|x| desc, index asc).
std::vector<uint32_t> RefTopK(const std::vector<float>& x, size_t k) {
  std::vector<uint32_t> idx(x.size());
  for (uint32_t i = 0; i < x.size(); ++i) idx[i] = i;
  std::stable_sort(idx.begin(), idx.end(),
                   [&](uint32_t a, uint32_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

TEST(CodecTest, TopKSendsExactlyTheKLargest) {
  for (size_t n : {1u, 10u, 999u, 100000u}) {
    std::vector<float> x = Normal(n, n);
    for (size_t i = 0; i < n; i += 3) x[i] = std::round(x[i]);  // ties
    for (double ratio : {0.001, 0.01, 0.3, 1.0}) {
      const std::unique_ptr<Compressor> c =
          CompressorRegistry::WithBuiltins().Create("topk:" + std::to_string(ratio)).value();
      const size_t k = static_cast<size_t>(SparseCount(static_cast<int64_t>(n), ratio));
      const std::vector<float> got = RoundTrip(*c, x, 0);
      std::vector<float> want(n, 0.0f);
      for (uint32_t i : RefTopK(x, k)) want[i] = x[i];
      ASSERT_EQ(got, want) << "n=" << n << " ratio=" << ratio;
    }
  }
}

TEST(CodecTest, CompositionEqualsSelectionThenRounding) {
  const std::vector<float> x = Normal(20000, 4, 1000.0f);
  for (const char* values : {"fp16", "bf16"}) {
    for (const char* sparsifier : {"topk:0.01", "topk_approx:0.01", "randomk:0.01"}) {
      const std::unique_ptr<Compressor> plain = Make(sparsifier);
      const std::unique_ptr<Compressor> composed = Make(std::string(sparsifier) + "+" + values);
      std::string pp, pc;
      const std::vector<float> a = RoundTrip(*plain, x, 9, &pp);
      const std::vector<float> b = RoundTrip(*composed, x, 9, &pc);
      for (size_t i = 0; i < x.size(); ++i) {
        const float want = std::string(values) == "fp16"
                               ? HalfToFloatScalar(FloatToHalfScalar(a[i]))
                               : BFloat16ToFloatScalar(FloatToBFloat16Scalar(a[i]));
        ASSERT_EQ(b[i], want) << sparsifier << "+" << values << " " << i;
      }
      // Same indices, values in 2 bytes instead of 4.
      const uint64_t k = GetU64(pp.data() + 16);
      EXPECT_EQ(GetU64(pc.data() + 16), k);
      EXPECT_EQ(pp.size() - pc.size(), 2 * k);
      EXPECT_TRUE(composed->biased());
    }
  }
}

TEST(CodecTest, IndexEncodingFollowsDensity) {
  const std::vector<float> x = Normal(10000, 5);
  struct Case {
    const char* spec;
    IndexEncoding encoding;
  };
  for (Case c :
       {Case{"topk:0.01", IndexEncoding::kDeltaVarint}, Case{"topk:0.5", IndexEncoding::kBitmap},
        Case{"randomk:0.3", IndexEncoding::kBitmap}, Case{"topk:1", IndexEncoding::kAll}}) {
    std::string p;
    ASSERT_OK(Make(c.spec)->Encode(x, 1, &p));
    EXPECT_EQ(p[3], static_cast<char>(c.encoding)) << c.spec;
    const uint64_t index_bytes = GetU64(p.data() + 24);
    const uint64_t k = GetU64(p.data() + 16);
    EXPECT_EQ(p.size(), 32 + index_bytes + 4 * k);
  }
}

TEST(CodecTest, TopKApproxIsTheApproxSelection) {
  const std::vector<float> x = Normal(200000, 6);
  const std::unique_ptr<Compressor> c = Make("topk_approx:0.01");
  EXPECT_TRUE(c->stochastic());
  for (uint64_t seed : {1u, 2u}) {
    std::vector<uint32_t> idx;
    ApproxTopKMagnitude(x, 2000, seed, &idx);
    std::vector<float> want(x.size(), 0.0f);
    for (uint32_t i : idx) want[i] = x[i];
    EXPECT_EQ(RoundTrip(*c, x, seed), want);
  }
}

TEST(CodecTest, RandomKSendsScaledRandomSubset) {
  const std::vector<float> x = Normal(1000, 7);
  const std::unique_ptr<Compressor> c = Make("randomk:0.05");
  EXPECT_FALSE(c->biased());
  std::vector<uint32_t> idx;
  RandomKIndices(1000, 50, 77, &idx);
  std::vector<float> want(x.size(), 0.0f);
  for (uint32_t i : idx) want[i] = x[i] * 20.0f;
  EXPECT_EQ(RoundTrip(*c, x, 77), want);
  EXPECT_NE(RoundTrip(*c, x, 78), want);
}

// Mean of Decode(Encode(x, seed)) over `trials` seeds, per element.
std::vector<double> MeanDecode(const Compressor& c, const std::vector<float>& x, int trials) {
  std::vector<double> mean(x.size(), 0.0);
  for (int t = 0; t < trials; ++t) {
    const std::vector<float> d = RoundTrip(c, x, Rng::Mix(12345, t));
    for (size_t i = 0; i < x.size(); ++i) mean[i] += d[i];
  }
  for (double& m : mean) m /= trials;
  return mean;
}

TEST(CodecTest, RandomKIsUnbiased) {
  // Element i is sent with probability p = k/n as x_i / p: Var = x_i^2 (1/p - 1). The mean of
  // T decodes has sd |x_i| sqrt((1/p - 1) / T); allow 5 sd (64 elements: a false failure
  // has probability ~4e-5) plus float rounding of the scaled value.
  const std::vector<float> x = Normal(64, 8);
  const int trials = 2000;
  const std::vector<double> mean = MeanDecode(*Make("randomk:0.125"), x, trials);
  const double p = 8.0 / 64.0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double sd = std::fabs(x[i]) * std::sqrt((1 / p - 1) / trials);
    EXPECT_NEAR(mean[i], x[i], 5 * sd + 1e-6 * std::fabs(x[i])) << i;
  }
}

TEST(CodecTest, QsgdIsUnbiasedAndOnItsGrid) {
  const std::vector<float> x = Normal(64, 9);
  for (int bits : {1, 2, 4, 8}) {
    const std::unique_ptr<Compressor> c = Make("qsgd:" + std::to_string(bits));
    std::string p;
    const std::vector<float> d = RoundTrip(*c, x, 3, &p);
    EXPECT_EQ(p.size(), 24 + (64 * (bits + 1) + 7) / 8);
    EXPECT_EQ(c->MaxEncodedSize(64), p.size());
    float norm;
    std::memcpy(&norm, p.data() + 16, 4);
    double sumsq = 0;
    for (float v : x) sumsq += static_cast<double>(v) * v;
    EXPECT_GE(static_cast<double>(norm), std::sqrt(sumsq));
    EXPECT_LE(static_cast<double>(norm), std::sqrt(sumsq) * (1 + 1e-7));
    const int s = (1 << bits) - 1;
    for (size_t i = 0; i < x.size(); ++i) {
      // On the grid sign * norm * l / s with the same sign as x (or 0), and one of the two
      // levels around |x|.
      const double level = std::fabs(d[i]) / norm * s;
      EXPECT_NEAR(level, std::round(level), 1e-4) << i;
      const double exact = std::fabs(x[i]) / norm * s;
      EXPECT_GE(std::round(level), std::floor(exact) - 1e-9);
      EXPECT_LE(std::round(level), std::ceil(exact) + 1e-9);
      if (d[i] != 0) {
        EXPECT_EQ(std::signbit(d[i]), std::signbit(x[i]));
      }
    }
    // Unbiased: the level is floor(e) + Bernoulli(frac(e)), e = s |x| / norm, so decode has
    // Var = (norm / s)^2 frac (1 - frac). 5 sd of the mean of T decodes, plus float rounding.
    const int trials = 2000;
    const std::vector<double> mean = MeanDecode(*c, x, trials);
    for (size_t i = 0; i < x.size(); ++i) {
      const double e = std::fabs(x[i]) / norm * s;
      const double frac = e - std::floor(e);
      const double sd = norm / s * std::sqrt(frac * (1 - frac) / trials);
      EXPECT_NEAR(mean[i], x[i], 5 * sd + 1e-6 * norm) << "bits " << bits << " i " << i;
    }
  }
}

TEST(CodecTest, QsgdOfZerosAndEmpty) {
  const std::unique_ptr<Compressor> c = Make("qsgd:4");
  EXPECT_EQ(RoundTrip(*c, std::vector<float>(100, 0.0f), 1), std::vector<float>(100, 0.0f));
  EXPECT_EQ(RoundTrip(*c, {}, 1), std::vector<float>());
  // Huge values: the norm overflows float32.
  std::string p;
  EXPECT_STATUS_MSG(c->Encode(std::vector<float>(4, 3e38f), 1, &p), kInvalid,
                    "does not fit in float32");
}

TEST(CodecTest, EveryCodecHandlesEmptyAndTinyInputs) {
  for (const char* spec : kSpecs) {
    const std::unique_ptr<Compressor> c = Make(spec);
    for (size_t n : {0u, 1u, 2u, 3u}) {
      const std::vector<float> x = Normal(n, n + 100);
      std::string p;
      ASSERT_OK(c->Encode(x, 5, &p)) << spec;
      EXPECT_LE(p.size(), c->MaxEncodedSize(n)) << spec;
      std::vector<float> out(n, 7.0f);
      ASSERT_OK(c->Decode(p, absl::MakeSpan(out))) << spec;
    }
  }
}

TEST(CodecTest, MaxEncodedSizeBoundsEveryPayload) {
  const std::vector<float> x = Normal(5000, 10);
  for (const char* spec : kSpecs) {
    const std::unique_ptr<Compressor> c = Make(spec);
    for (uint64_t seed = 0; seed < 5; ++seed) {
      std::string p;
      ASSERT_OK(c->Encode(x, seed, &p));
      EXPECT_LE(p.size(), c->MaxEncodedSize(x.size())) << spec;
    }
  }
}

TEST(CodecTest, DecodeAddAccumulatesAndIsAllOrNothing) {
  const std::vector<float> x = Normal(3000, 11);
  const std::vector<float> base = Normal(3000, 12);
  for (const char* spec : kSpecs) {
    const std::unique_ptr<Compressor> c = Make(spec);
    std::string p;
    ASSERT_OK(c->Encode(x, 4, &p));
    std::vector<float> decoded(x.size());
    ASSERT_OK(c->Decode(p, absl::MakeSpan(decoded)));
    std::vector<float> acc = base;
    ASSERT_OK(c->DecodeAdd(p, absl::MakeSpan(acc)));
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(acc[i], base[i] + decoded[i]) << spec;
    // A corrupted payload changes nothing.
    for (size_t cut : {p.size() - 1, p.size() / 2, size_t{3}}) {
      std::vector<float> untouched = base;
      EXPECT_STATUS(c->DecodeAdd(p.substr(0, cut), absl::MakeSpan(untouched)), kInvalid);
      EXPECT_EQ(untouched, base) << spec;
    }
  }
}

TEST(CodecTest, DecodeSparseListsTheSentElements) {
  const std::vector<float> x = Normal(3000, 17);
  for (const char* spec : kSpecs) {
    const std::unique_ptr<Compressor> c = Make(spec);
    std::string p;
    ASSERT_OK(c->Encode(x, 6, &p));
    std::vector<float> dense(x.size());
    ASSERT_OK(c->Decode(p, absl::MakeSpan(dense)));
    std::vector<uint32_t> idx = {5};
    std::vector<float> values = {5};
    ASSERT_OK(c->DecodeSparse(p, x.size(), &idx, &values));
    ASSERT_EQ(idx.size(), values.size());
    ASSERT_TRUE(std::is_sorted(idx.begin(), idx.end()));
    std::vector<float> rebuilt(x.size(), 0.0f);
    for (size_t j = 0; j < idx.size(); ++j) rebuilt[idx[j]] = values[j];
    EXPECT_EQ(rebuilt, dense) << spec;
    if (c->density() < 1) {
      EXPECT_EQ(idx.size(), GetU64(p.data() + 16)) << spec;
    } else {
      EXPECT_EQ(idx.size(), x.size()) << spec;
    }
    EXPECT_STATUS(c->DecodeSparse(p.substr(1), x.size(), &idx, &values), kInvalid);
    EXPECT_STATUS(c->DecodeSparse(p, x.size() + 1, &idx, &values), kInvalid);
  }
}

TEST(CodecTest, ReceiverDecodesAnyDensity) {
  const std::vector<float> x = Normal(4000, 13);
  const std::unique_ptr<Compressor> target = Make("topk:0.01+fp16");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Compressor> warm, target->WithDensity(0.25));
  EXPECT_EQ(warm->name(), "topk:0.25+fp16");
  EXPECT_EQ(warm->density(), 0.25);
  std::string p;
  ASSERT_OK(warm->Encode(x, 1, &p));
  std::vector<float> a(x.size()), b(x.size());
  ASSERT_OK(warm->Decode(p, absl::MakeSpan(a)));
  ASSERT_OK(target->Decode(p, absl::MakeSpan(b)));
  EXPECT_EQ(a, b);
  EXPECT_EQ(std::count_if(a.begin(), a.end(), [](float v) { return v != 0; }), 1000);
  EXPECT_STATUS_MSG(Make("fp16")->WithDensity(0.5), kInvalid, "fp16 is not a sparsifier");
  EXPECT_STATUS_MSG(target->WithDensity(0), kInvalid, "outside (0, 1]");
  EXPECT_STATUS_MSG(target->WithDensity(1.5), kInvalid, "outside (0, 1]");
}

TEST(CodecTest, DecodeRejectsMismatchesWithClearMessages) {
  const std::vector<float> x = Normal(100, 14);
  std::string p16, pbf, ptop, ptop16;
  ASSERT_OK(Make("fp16")->Encode(x, 0, &p16));
  ASSERT_OK(Make("bf16")->Encode(x, 0, &pbf));
  ASSERT_OK(Make("topk:0.1")->Encode(x, 0, &ptop));
  ASSERT_OK(Make("topk:0.1+fp16")->Encode(x, 0, &ptop16));
  std::vector<float> out(100);
  auto o = absl::MakeSpan(out);
  EXPECT_STATUS_MSG(Make("bf16")->Decode(p16, o), kInvalid,
                    "bf16: payload was encoded by fp16 with fp16 values; this decoder takes "
                    "bf16 with bf16");
  EXPECT_STATUS_MSG(Make("topk:0.1+fp16")->Decode(ptop, o), kInvalid,
                    "payload was encoded by topk with float32 values; this decoder takes topk "
                    "with fp16");
  EXPECT_STATUS_MSG(Make("randomk:0.1")->Decode(ptop, o), kInvalid, "encoded by topk");
  std::vector<float> wrong(99);
  EXPECT_STATUS_MSG(Make("fp16")->Decode(p16, absl::MakeSpan(wrong)), kInvalid,
                    "fp16: payload has 100 elements, the output has 99");
  EXPECT_STATUS_MSG(Make("fp16")->Decode(p16.substr(0, 215), o), kInvalid,
                    "payload is 215 bytes, its header implies 216 (truncated)");
  EXPECT_STATUS_MSG(Make("fp16")->Decode(p16 + "x", o), kInvalid, "(trailing bytes)");
  EXPECT_STATUS_MSG(Make("fp16")->Decode("", o), kInvalid, "shorter than its 16-byte header");
  // Inf/NaN values.
  std::string bad = p16;
  bad[16 + 2 * 5 + 1] = 0x7c;
  bad[16 + 2 * 5] = 0;
  EXPECT_STATUS_MSG(Make("fp16")->Decode(bad, o), kInvalid, "value 5 is Inf or NaN (fp16)");
  std::string pid;
  ASSERT_OK(Make("identity")->Encode(x, 0, &pid));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(&pid[16 + 4 * 9], &nan, 4);
  EXPECT_STATUS_MSG(Make("identity")->Decode(pid, o), kInvalid, "value 9 is Inf or NaN (float32)");
  // Sparse: k > n, index section past the end, an index out of range, NaN value.
  std::string s = ptop;
  PutU64(101, &s[16]);
  EXPECT_STATUS_MSG(Make("topk:0.1")->Decode(s, o), kInvalid, "sends k=101 of n=100");
  s = ptop;
  PutU64(1000, &s[24]);
  EXPECT_STATUS_MSG(Make("topk:0.1")->Decode(s, o), kInvalid, "index section of 1000 bytes");
  ASSERT_EQ(ptop[3], static_cast<char>(IndexEncoding::kDeltaVarint));
  s = ptop;
  s[32] = 0x7f;  // first index 127 >= 100
  EXPECT_STATUS_MSG(Make("topk:0.1")->Decode(s, o), kInvalid,
                    "topk:0.1: delta-varint indices: index 127 (entry 0) out of range [0, 100)");
  s = ptop;
  std::memcpy(&s[s.size() - 4], &nan, 4);
  EXPECT_STATUS_MSG(Make("topk:0.1")->Decode(s, o), kInvalid, "value 9 is Inf or NaN");
  // QSGD: negative or NaN norm, bad bit count, non-zero padding.
  std::string q;
  ASSERT_OK(Make("qsgd:4")->Encode(std::vector<float>(3, 1.0f), 0, &q));
  std::vector<float> three(3);
  s = q;
  const float neg = -1.0f;
  std::memcpy(&s[16], &neg, 4);
  EXPECT_STATUS_MSG(Make("qsgd:4")->Decode(s, absl::MakeSpan(three)), kInvalid,
                    "norm -1 is not a finite non-negative number");
  s = q;
  s[3] = 9;
  EXPECT_STATUS_MSG(Make("qsgd:4")->Decode(s, absl::MakeSpan(three)), kInvalid, "9 bits per level");
  s = q;
  s.back() = static_cast<char>(s.back() | 0x80);  // 15 bits used of 16
  EXPECT_STATUS_MSG(Make("qsgd:4")->Decode(s, absl::MakeSpan(three)), kInvalid, "padding bits");
  // A qsgd:2 payload decodes with a qsgd:4 codec (the bit count is in the header).
  ASSERT_OK(Make("qsgd:2")->Encode(std::vector<float>(3, 1.0f), 0, &q));
  EXPECT_OK(Make("qsgd:4")->Decode(q, absl::MakeSpan(three)));
}

TEST(CodecTest, DecodesFromUnalignedMemory) {
  const std::vector<float> x = Normal(1000, 15);
  for (const char* spec : kSpecs) {
    const std::unique_ptr<Compressor> c = Make(spec);
    std::string p;
    ASSERT_OK(c->Encode(x, 2, &p));
    std::vector<float> aligned(x.size()), shifted(x.size());
    ASSERT_OK(c->Decode(p, absl::MakeSpan(aligned)));
    const std::string buffer = "z" + p;
    ASSERT_OK(c->Decode(absl::string_view(buffer).substr(1), absl::MakeSpan(shifted)));
    EXPECT_EQ(aligned, shifted) << spec;
  }
}

TEST(CodecTest, CompressesAsExpected) {
  const std::vector<float> x = Normal(100000, 16);
  auto size = [&](const char* spec) {
    std::string p;
    EXPECT_OK(Make(spec)->Encode(x, 1, &p));
    return p.size();
  };
  EXPECT_EQ(size("fp16"), 16 + 200000u);
  EXPECT_EQ(size("qsgd:4"), 24 + 62500u);
  // 1000 values of 4 bytes plus ~1.5 index bytes each.
  EXPECT_LT(size("topk:0.01"), 32 + 1000 * 6u);
  EXPECT_EQ(size("topk:0.01") - size("topk:0.01+fp16"), 2000u);
}

}  // namespace
}  // namespace gradmesh
