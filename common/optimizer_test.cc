// Checks every optimizer against LibTorch's own torch::optim on the same gradients.
#include "common/optimizer.h"

#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

constexpr int64_t kN = 1000;
constexpr int kSteps = 25;

// Runs `steps` updates with our optimizer and with `torch_opt` on identical parameters and
// gradients, and checks at every step that the parameter vectors agree to 1e-6 relative
// (||ours - torch|| / ||torch||), and every element to 1e-6 * max(|p|, 1). The element bound
// is absolute below 1 because ATen's vectorised add_ uses fused multiply-add (one rounding)
// where we round twice: for a parameter that cancels to near zero after an update of size
// ~0.5, the two differ by a few ulps of the update, ~1e-7 absolute.
void CompareWithTorch(
    const OptimizerSpec& spec,
    const std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>&
        make_torch) {
  torch::manual_seed(3);
  torch::Tensor p = torch::randn({kN}).set_requires_grad(true);
  auto torch_opt = make_torch({p});
  std::vector<float> ours(p.data_ptr<float>(), p.data_ptr<float>() + kN);

  auto registry = OptimizerRegistry::WithBuiltins();
  ASSERT_OK_AND_ASSIGN(auto opt, registry.Create(spec));
  std::vector<std::vector<float>> slots(opt->num_slots(), std::vector<float>(kN, 0.0f));
  std::vector<float*> slot_ptrs;
  for (auto& s : slots) slot_ptrs.push_back(s.data());

  for (int step = 1; step <= kSteps; ++step) {
    torch::Tensor g = torch::randn({kN}) * (step % 3 == 0 ? 1.0 : 0.1);
    p.mutable_grad() = g.clone();
    torch_opt->step();
    opt->Apply(step, 1.0f, g.data_ptr<float>(), ours.data(), slot_ptrs.data(), kN);
    const float* want = p.data_ptr<float>();
    double diff2 = 0, norm2 = 0;
    for (int64_t i = 0; i < kN; ++i) {
      const double tol = 1e-6 * std::max<double>(std::fabs(want[i]), 1.0);
      ASSERT_NEAR(ours[i], want[i], tol) << spec.name() << " step " << step << " elem " << i;
      diff2 += (ours[i] - want[i]) * static_cast<double>(ours[i] - want[i]);
      norm2 += want[i] * static_cast<double>(want[i]);
    }
    ASSERT_LE(std::sqrt(diff2 / norm2), 1e-6) << spec.name() << " step " << step;
  }
}

TEST(OptimizerTest, PlainSgdMatchesTorch) {
  OptimizerSpec s;
  s.set_name("sgd");
  s.set_lr(0.05);
  CompareWithTorch(s, [](std::vector<torch::Tensor> ps) {
    return std::make_unique<torch::optim::SGD>(ps, torch::optim::SGDOptions(0.05));
  });
}

TEST(OptimizerTest, SgdMomentumWeightDecayDampeningMatchesTorch) {
  OptimizerSpec s;
  s.set_name("sgd");
  s.set_lr(0.05);
  s.set_momentum(0.9);
  s.set_dampening(0.1);
  s.set_weight_decay(1e-2);
  CompareWithTorch(s, [](std::vector<torch::Tensor> ps) {
    return std::make_unique<torch::optim::SGD>(
        ps, torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.1).weight_decay(1e-2));
  });
}

TEST(OptimizerTest, SgdNesterovMatchesTorch) {
  OptimizerSpec s;
  s.set_name("sgd");
  s.set_lr(0.01);
  s.set_momentum(0.8);
  s.set_nesterov(true);
  s.set_weight_decay(5e-4);
  CompareWithTorch(s, [](std::vector<torch::Tensor> ps) {
    return std::make_unique<torch::optim::SGD>(
        ps, torch::optim::SGDOptions(0.01).momentum(0.8).nesterov(true).weight_decay(5e-4));
  });
}

TEST(OptimizerTest, AdamMatchesTorch) {
  OptimizerSpec s;
  s.set_name("adam");
  s.set_lr(1e-3);
  CompareWithTorch(s, [](std::vector<torch::Tensor> ps) {
    return std::make_unique<torch::optim::Adam>(ps, torch::optim::AdamOptions(1e-3));
  });
}

TEST(OptimizerTest, AdamWithL2AndCustomBetasMatchesTorch) {
  OptimizerSpec s;
  s.set_name("adam");
  s.set_lr(2e-3);
  s.set_beta1(0.8);
  s.set_beta2(0.99);
  s.set_eps(1e-6);
  s.set_weight_decay(0.01);
  CompareWithTorch(s, [](std::vector<torch::Tensor> ps) {
    return std::make_unique<torch::optim::Adam>(
        ps, torch::optim::AdamOptions(2e-3).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.01));
  });
}

TEST(OptimizerTest, AdamWMatchesTorch) {
  OptimizerSpec s;
  s.set_name("adamw");
  s.set_lr(1e-3);
  s.set_weight_decay(0.05);
  CompareWithTorch(s, [](std::vector<torch::Tensor> ps) {
    return std::make_unique<torch::optim::AdamW>(
        ps, torch::optim::AdamWOptions(1e-3).weight_decay(0.05));
  });
}

// The Adam kernel runs as the CPU's widest version (AVX-512 / AVX2 / baseline); whichever it
// is, every element must be bit-identical to the scalar formula (no fused multiply-add, same
// operation order), tails included (n not a multiple of any vector width).
TEST(OptimizerTest, AdamIsBitIdenticalToTheScalarFormula) {
  for (const bool decoupled : {false, true}) {
    OptimizerSpec s;
    s.set_name(decoupled ? "adamw" : "adam");
    s.set_lr(3e-3);
    s.set_weight_decay(0.02);
    ASSERT_OK_AND_ASSIGN(auto opt, OptimizerRegistry::WithBuiltins().Create(s));
    constexpr int64_t n = 1037;
    std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n);
    for (int64_t i = 0; i < n; ++i) p[i] = std::sin(0.37f * static_cast<float>(i)) * 3;
    std::vector<float> rp = p, rm = m, rv = v;
    for (int step = 1; step <= 5; ++step) {
      for (int64_t i = 0; i < n; ++i) g[i] = std::cos(0.11f * static_cast<float>(i * step)) / 7;
      std::vector<float*> slots = {m.data(), v.data()};
      opt->Apply(step, 1.0f, g.data(), p.data(), slots.data(), n);
      // The scalar formula (this test is built for the baseline: no FMA contraction).
      const double lr = 3e-3, b1 = 0.9, b2 = 0.999;
      const float step_size = static_cast<float>(lr / (1 - std::pow(b1, step)));
      const float sqrt_bias2 = static_cast<float>(std::sqrt(1 - std::pow(b2, step)));
      const float keep = decoupled ? static_cast<float>(1 - lr * 0.02f) : 1.0f;
      const float wd = decoupled ? 0.0f : 0.02f;
      for (int64_t i = 0; i < n; ++i) {
        const float pk = rp[i] * keep;
        const float gi = g[i] + wd * rp[i];
        rm[i] = rm[i] * 0.9f + static_cast<float>(1 - b1) * gi;
        rv[i] = rv[i] * 0.999f + static_cast<float>(1 - b2) * gi * gi;
        const float denom = std::sqrt(rv[i]) / sqrt_bias2 + 1e-8f;
        rp[i] = pk - step_size * (rm[i] / denom);
      }
      ASSERT_EQ(0, std::memcmp(p.data(), rp.data(), n * sizeof(float))) << s.name() << step;
      ASSERT_EQ(0, std::memcmp(m.data(), rm.data(), n * sizeof(float))) << s.name() << step;
      ASSERT_EQ(0, std::memcmp(v.data(), rv.data(), n * sizeof(float))) << s.name() << step;
    }
  }
}

TEST(OptimizerTest, SubnormalStateIsFlushedToZero) {
  // A coordinate that stops receiving gradient: its moments decay below FLT_MIN and become
  // exactly 0 instead of slow subnormals.
  auto registry = OptimizerRegistry::WithBuiltins();
  OptimizerSpec s;
  s.set_name("adam");
  s.set_lr(1e-3);
  ASSERT_OK_AND_ASSIGN(auto opt, registry.Create(s));
  float p = 1.0f, g = 0.0f, m = 2e-38f, v = 0.0f;
  float* slots[] = {&m, &v};
  opt->Apply(5, 1.0f, &g, &p, slots, 1);  // 0.9 * 2e-38 = 1.8e-38: still normal.
  EXPECT_GT(m, 0.0f);
  opt->Apply(6, 1.0f, &g, &p, slots, 1);  // 1.62e-38: normal.
  for (int step = 7; step < 12; ++step) opt->Apply(step, 1.0f, &g, &p, slots, 1);
  EXPECT_EQ(m, 0.0f) << "m decayed below FLT_MIN and must be flushed";
  EXPECT_TRUE(std::isfinite(p));
}

TEST(OptimizerTest, LrScaleScalesTheStep) {
  auto registry = OptimizerRegistry::WithBuiltins();
  OptimizerSpec s;
  s.set_name("sgd");
  s.set_lr(0.5);
  ASSERT_OK_AND_ASSIGN(auto opt, registry.Create(s));
  float p = 1.0f, g = 2.0f;
  opt->Apply(1, 0.25f, &g, &p, nullptr, 1);
  EXPECT_FLOAT_EQ(p, 1.0f - 0.5f * 0.25f * 2.0f);
}

TEST(OptimizerTest, RegistryRejectsUnknownNamesAndBadHyperParameters) {
  auto registry = OptimizerRegistry::WithBuiltins();
  OptimizerSpec s;
  s.set_name("adagrad");
  s.set_lr(0.1);
  EXPECT_STATUS_MSG(registry.Create(s), absl::StatusCode::kInvalidArgument,
                    "unknown optimizer \"adagrad\" (known: adam, adamw, sgd)");
  s.set_name("sgd");
  s.set_lr(0);
  EXPECT_STATUS_MSG(registry.Create(s), absl::StatusCode::kInvalidArgument,
                    "optimizer.lr must be > 0, got 0");
  s.set_lr(0.1);
  s.set_momentum(1.5);
  EXPECT_STATUS_MSG(registry.Create(s), absl::StatusCode::kInvalidArgument, "momentum");
  s.set_momentum(0);
  s.set_nesterov(true);
  EXPECT_STATUS_MSG(registry.Create(s), absl::StatusCode::kInvalidArgument, "nesterov");
  s.set_name("adam");
  s.set_nesterov(false);
  s.set_beta2(1.0);
  EXPECT_STATUS_MSG(registry.Create(s), absl::StatusCode::kInvalidArgument, "beta2");
}

TEST(LrScheduleTest, ConstantCosineAndWarmup) {
  OptimizerSpec s;
  s.set_lr(0.1);
  EXPECT_EQ(LrScheduleFactor(s, 0), 1.0f);
  EXPECT_EQ(LrScheduleFactor(s, 123456), 1.0f);
  s.set_lr_schedule("cosine");
  s.set_decay_updates(100);
  ASSERT_OK(ValidateLrSchedule(s));
  EXPECT_FLOAT_EQ(LrScheduleFactor(s, 0), 1.0f);
  EXPECT_FLOAT_EQ(LrScheduleFactor(s, 50), 0.5f);
  EXPECT_NEAR(LrScheduleFactor(s, 25), 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-7);
  EXPECT_FLOAT_EQ(LrScheduleFactor(s, 100), 0.0f);
  EXPECT_FLOAT_EQ(LrScheduleFactor(s, 1000), 0.0f);
  s.set_min_lr_fraction(0.1);
  EXPECT_FLOAT_EQ(LrScheduleFactor(s, 100), 0.1f);
  EXPECT_FLOAT_EQ(LrScheduleFactor(s, 50), 0.55f);
  s.set_warmup_updates(4);
  EXPECT_NEAR(LrScheduleFactor(s, 0), 0.25 * (0.1 + 0.9 * 0.5 * (1 + std::cos(0.0))), 1e-7);
  EXPECT_NEAR(LrScheduleFactor(s, 3), 1.0 * (0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 0.03))), 1e-6);
}

TEST(LrScheduleTest, Validation) {
  OptimizerSpec s;
  s.set_name("adam");
  s.set_lr(0.1);
  s.set_lr_schedule("exponential");
  EXPECT_STATUS_MSG(OptimizerRegistry::WithBuiltins().Create(s), absl::StatusCode::kInvalidArgument,
                    "unknown optimizer.lr_schedule \"exponential\" (known: constant, cosine)");
  s.set_lr_schedule("cosine");
  EXPECT_STATUS_MSG(ValidateLrSchedule(s), absl::StatusCode::kInvalidArgument,
                    "decay_updates must be > 0");
  s.set_decay_updates(10);
  s.set_min_lr_fraction(1.5);
  EXPECT_STATUS_MSG(ValidateLrSchedule(s), absl::StatusCode::kInvalidArgument, "min_lr_fraction");
  s.set_min_lr_fraction(0);
  s.set_warmup_updates(-1);
  EXPECT_STATUS_MSG(ValidateLrSchedule(s), absl::StatusCode::kInvalidArgument, "warmup_updates");
}

}  // namespace
}  // namespace gradmesh
