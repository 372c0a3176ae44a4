#include "compression/error_feedback.h"

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "compression/compressor.h"
#include "compression/rng.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

std::unique_ptr<Compressor> Make(const std::string& spec) {
  return CompressorRegistry::WithBuiltins().Create(spec).value();
}

std::vector<float> Decoded(const Compressor& codec, const std::string& payload, size_t n) {
  std::vector<float> out(n);
  EXPECT_OK(codec.Decode(payload, absl::MakeSpan(out)));
  return out;
}

// Gradients of very different scales (so that fp16 clamps and flushes some of them), with
// exact zeros and negative zeros.
std::vector<float> Gradient(size_t n, Rng& rng) {
  std::vector<float> g(n);
  for (float& v : g) {
    const double u = static_cast<double>(rng.Next() >> 11) * 0x1p-53;
    const int exponent = static_cast<int>(rng.Uniform(60)) - 40;  // 2^-40 .. 2^19
    v = static_cast<float>((u - 0.5) * std::ldexp(1.0, exponent));
    if (rng.Uniform(50) == 0) v = rng.Uniform(2) ? 0.0f : -0.0f;
    if (rng.Uniform(500) == 0) v = static_cast<float>((u - 0.5) * 1e36);
  }
  return g;
}

TEST(ErrorFeedbackTest, ConservesMassExactlyForBiasedCodecs) {
  const size_t n = 2000;
  for (const char* spec : {"topk:0.01", "topk:0.2", "topk_approx:0.05", "fp16", "bf16",
                           "topk:0.05+fp16", "topk:0.01+bf16", "topk_approx:0.02+fp16"}) {
    const std::unique_ptr<Compressor> codec = Make(spec);
    ErrorFeedback ef(n);
    std::vector<float> residual(n, 0.0f);  // the test's own copy
    Rng rng(7);
    for (int step = 0; step < 200; ++step) {
      const std::vector<float> g = Gradient(n, rng);
      std::vector<float> acc(n);
      for (size_t i = 0; i < n; ++i) acc[i] = g[i] + residual[i];
      std::string payload;
      ASSERT_OK(ef.Compress(*codec, g, Rng::Mix(99, step), &payload));
      // The payload is the codec's encoding of acc.
      std::string direct;
      ASSERT_OK(codec->Encode(acc, Rng::Mix(99, step), &direct));
      ASSERT_EQ(payload, direct) << spec << " step " << step;
      std::vector<float> sent(n);
      ASSERT_OK(codec->Decode(payload, absl::MakeSpan(sent)));
      ASSERT_EQ(ef.last_inexact(), 0) << spec;
      for (size_t i = 0; i < n; ++i) {
        // sent + residual == acc, exactly, in float arithmetic.
        ASSERT_EQ(sent[i] + ef.residual()[i], acc[i])
            << spec << " step " << step << " i " << i << " sent " << sent[i] << " residual "
            << ef.residual()[i];
      }
      residual.assign(ef.residual().begin(), ef.residual().end());
    }
  }
}

TEST(ErrorFeedbackTest, ClampedFp16Values) {
  // Below 2^29, acc - 65504 is exact: conserved exactly.
  const std::vector<float> exact = {65536.5f, -65520.0f,    70000.0f,        123456792.0f,
                                    -3.0e8f,  400000000.0f, 0x1.fffffep+28f, 1e6f};
  const std::unique_ptr<Compressor> fp16 = Make("fp16");
  ErrorFeedback ef(exact.size());
  std::string payload;
  ASSERT_OK(ef.Compress(*fp16, exact, 0, &payload));
  EXPECT_EQ(ef.last_inexact(), 0);
  std::vector<float> sent = Decoded(*fp16, payload, exact.size());
  for (size_t i = 0; i < exact.size(); ++i) {
    EXPECT_EQ(std::fabs(sent[i]), 65504.0f);
    EXPECT_EQ(sent[i] + ef.residual()[i], exact[i]) << i;
  }
  // From 2^29 on it can round (and no float residual would be exact: 65504 + r is always
  // a tie that rounds away from these two); the count says so, the error is one ulp.
  const std::vector<float> far = {1e30f, -3.0e38f, 1073741824.0f, 0x1.000802p+29f,
                                  -0x1.f42c42p+29f};
  ErrorFeedback ef2(far.size());
  ASSERT_OK(ef2.Compress(*fp16, far, 0, &payload));
  EXPECT_EQ(ef2.last_inexact(), 2);
  sent = Decoded(*fp16, payload, far.size());
  for (size_t i = 0; i < far.size(); ++i) {
    const float sum = sent[i] + ef2.residual()[i];
    if (i < 3) {
      EXPECT_EQ(sum, far[i]) << i;
    } else {
      EXPECT_EQ(std::fabs(sum - far[i]), std::fabs(std::nextafter(far[i], 0.0f) - far[i])) << i;
    }
  }
}

TEST(ErrorFeedbackTest, EverythingIsEventuallySent) {
  // A constant gradient under top-k: each coordinate's residual grows until it is sent, so
  // over many steps the sum of what was sent approaches steps * g for every coordinate.
  const size_t n = 100;
  std::vector<float> g(n);
  for (size_t i = 0; i < n; ++i) g[i] = 0.01f * static_cast<float>(i + 1);
  const std::unique_ptr<Compressor> topk = Make("topk:0.05");
  ErrorFeedback ef(n);
  std::vector<double> sent(n, 0.0);
  const int steps = 2000;
  for (int t = 0; t < steps; ++t) {
    std::string payload;
    ASSERT_OK(ef.Compress(*topk, g, 0, &payload));
    const std::vector<float> d = Decoded(*topk, payload, n);
    for (size_t i = 0; i < n; ++i) sent[i] += d[i];
  }
  for (size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(sent[i] + ef.residual()[i], steps * static_cast<double>(g[i]), 1e-3 * steps * g[i]);
    EXPECT_GT(sent[i], 0.8 * steps * g[i]) << i;
  }
}

TEST(ErrorFeedbackTest, MomentumCorrectionFollowsDgc) {
  const size_t n = 500;
  // A sparsifier (O(k) path), a dense codec and a sparsifier at density 1 (dense path).
  for (const char* spec : {"topk:0.02+fp16", "fp16", "topk:1"}) {
    for (bool masking : {true, false}) {
      SCOPED_TRACE(std::string(spec) + (masking ? " masking" : ""));
      ErrorFeedbackOptions options;
      options.momentum = 0.9f;
      options.momentum_masking = masking;
      ErrorFeedback ef(n, options);
      const std::unique_ptr<Compressor> codec = Make(spec);
      // Reference, straight from DGC's algorithm.
      std::vector<float> u(n, 0.0f), v(n, 0.0f);
      Rng rng(3);
      for (int step = 0; step < 100; ++step) {
        std::vector<float> g(n);
        for (float& x : g)
          x = static_cast<float>(static_cast<int64_t>(rng.Uniform(2001)) - 1000) / 256;
        for (size_t i = 0; i < n; ++i) {
          u[i] = 0.9f * u[i] + g[i];
          v[i] = v[i] + u[i];
        }
        std::string want;
        ASSERT_OK(codec->Encode(v, step, &want));
        std::vector<float> sent(n);
        ASSERT_OK(codec->Decode(want, absl::MakeSpan(sent)));
        std::string payload;
        ASSERT_OK(ef.Compress(*codec, g, step, &payload));
        ASSERT_EQ(payload, want) << step;
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(sent[i] + ef.residual()[i], v[i]);
          v[i] = v[i] - sent[i];  // exact here (fp16 rounding error)
          if (masking && sent[i] != 0) u[i] = 0;
          ASSERT_EQ(ef.residual()[i], v[i]) << step << " " << i;
          ASSERT_EQ(ef.momentum()[i], u[i]) << step << " " << i;
        }
      }
    }
  }
}

TEST(ErrorFeedbackTest, UnbiasedCodecsKeepTheRoundedDifference) {
  const size_t n = 1000;
  Rng rng(4);
  for (const char* spec : {"qsgd:2", "randomk:0.1"}) {
    ErrorFeedback ef(n);
    const std::unique_ptr<Compressor> codec = Make(spec);
    std::vector<float> residual(n, 0.0f);
    for (int step = 0; step < 5; ++step) {
      // Moderate values: with randomk the residual of a sent element is -(n/k - 1) times its
      // value, so error feedback makes it grow geometrically (one more reason to use the
      // unbiased codecs without it).
      std::vector<float> g(n);
      for (float& v : g) v = static_cast<float>(static_cast<int64_t>(rng.Uniform(2001)) - 1000) / 3;
      std::string payload;
      ASSERT_OK(ef.Compress(*codec, g, step, &payload));
      const std::vector<float> decoded = Decoded(*codec, payload, n);
      int64_t inexact = 0;
      for (size_t i = 0; i < n; ++i) {
        const float acc = g[i] + residual[i];
        const float sent = decoded[i];
        inexact += sent + ef.residual()[i] != acc;
        EXPECT_EQ(ef.residual()[i], acc - sent);  // the rounded difference
      }
      EXPECT_EQ(inexact, ef.last_inexact()) << spec;
      residual.assign(ef.residual().begin(), ef.residual().end());
    }
  }
}

TEST(ErrorFeedbackTest, FailuresLeaveTheStateUnchanged) {
  ErrorFeedbackOptions options;
  options.momentum = 0.5f;
  ErrorFeedback ef(4, options);
  const std::unique_ptr<Compressor> codec = Make("topk:0.25");
  std::string payload;
  ASSERT_OK(ef.Compress(*codec, std::vector<float>{1, 2, 3, 4}, 0, &payload));
  const std::vector<float> residual(ef.residual().begin(), ef.residual().end());
  const std::vector<float> momentum(ef.momentum().begin(), ef.momentum().end());
  EXPECT_EQ(residual, std::vector<float>({1, 2, 3, 0}));
  EXPECT_EQ(momentum, std::vector<float>({1, 2, 3, 0}));
  EXPECT_STATUS_MSG(
      ef.Compress(*codec, std::vector<float>{1, std::numeric_limits<float>::quiet_NaN(), 3, 4}, 0,
                  &payload),
      absl::StatusCode::kInvalidArgument, "input element 1 is nan");
  EXPECT_STATUS_MSG(ef.Compress(*codec, std::vector<float>{1, 2, 3}, 0, &payload),
                    absl::StatusCode::kInvalidArgument, "gradient has 3 elements, the residual 4");
  EXPECT_EQ(std::vector<float>(ef.residual().begin(), ef.residual().end()), residual);
  EXPECT_EQ(std::vector<float>(ef.momentum().begin(), ef.momentum().end()), momentum);
  ef.Reset();
  EXPECT_EQ(std::vector<float>(ef.residual().begin(), ef.residual().end()),
            std::vector<float>(4, 0.0f));
  EXPECT_EQ(std::vector<float>(ef.momentum().begin(), ef.momentum().end()),
            std::vector<float>(4, 0.0f));
}

TEST(ErrorFeedbackTest, ValidatesOptions) {
  ErrorFeedbackOptions options;
  EXPECT_OK(ValidateErrorFeedbackOptions(options));
  options.momentum = 0.99f;
  EXPECT_OK(ValidateErrorFeedbackOptions(options));
  for (float bad : {-0.1f, 1.0f, std::numeric_limits<float>::quiet_NaN()}) {
    options.momentum = bad;
    EXPECT_STATUS_MSG(ValidateErrorFeedbackOptions(options), absl::StatusCode::kInvalidArgument,
                      "outside [0, 1)");
  }
}

TEST(WarmupTest, ExponentialFromDenseToTarget) {
  // DGC: 25%, 6.25%, 1.5625%, 0.390625%, then the target 0.25^5.
  const double target = std::pow(0.25, 5);
  WarmupSchedule w;
  w.steps = 8;
  w.stages = 4;
  const double want[] = {0.25,     0.25,       0.0625,     0.0625, 0.015625,
                         0.015625, 0.00390625, 0.00390625, target, target};
  for (int t = 0; t < 10; ++t) {
    EXPECT_NEAR(WarmupDensity(target, w, t), want[t], 1e-12 * want[t]) << t;
  }
  // Target 0.1%: 0.001^(1/5) = 25.1%, ...
  EXPECT_NEAR(WarmupDensity(0.001, w, 0), 0.251188643, 1e-9);
  EXPECT_NEAR(WarmupDensity(0.001, w, 7), 0.003981072, 1e-9);
  EXPECT_EQ(WarmupDensity(0.001, w, 8), 0.001);
  EXPECT_EQ(WarmupDensity(0.001, w, 1000000), 0.001);
  EXPECT_NEAR(WarmupDensity(0.001, w, -5), 0.251188643, 1e-9);
  // Uneven stages: 10 steps in 4 stages -> stage floor(t * 4 / 10).
  w.steps = 10;
  const int stage_of[] = {0, 0, 0, 1, 1, 2, 2, 2, 3, 3};
  for (int t = 0; t < 10; ++t) {
    EXPECT_NEAR(WarmupDensity(target, w, t), std::pow(0.25, stage_of[t] + 1), 1e-15) << t;
  }
  // No warm-up.
  EXPECT_EQ(WarmupDensity(0.01, WarmupSchedule(), 0), 0.01);
  w.stages = 0;
  EXPECT_EQ(WarmupDensity(0.01, w, 0), 0.01);
  EXPECT_EQ(WarmupDensity(1.0, WarmupSchedule{10, 4}, 0), 1.0);
  // Monotone, never below the target, and usable as a codec density.
  w.steps = 1000;
  w.stages = 7;
  double prev = 1.0;
  const std::unique_ptr<Compressor> codec = Make("topk:0.003");
  for (int t = 0; t < 1200; ++t) {
    const double d = WarmupDensity(0.003, w, t);
    EXPECT_LE(d, prev);
    EXPECT_GE(d, 0.003);
    prev = d;
    EXPECT_OK(codec->WithDensity(d));
  }
}

}  // namespace
}  // namespace gradmesh
