#include "common/optimizer.h"

#include <algorithm>
#include <cmath>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gradmesh {
namespace {

// Flush-to-zero and denormals-are-zero for the duration of an update. With sparse gradients,
// momentum and Adam moments of coordinates that receive nothing decay geometrically into
// float subnormals, and arithmetic on subnormals is ~40x slower on x86 (measured: 0.89 ms vs
// 38 ms per Adam update of 269k elements). Values below FLT_MIN (1.2e-38) become 0, as with
// torch.set_flush_denormal(True); the checks against torch::optim never come near them.
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  const unsigned saved_;
#endif
};

// torch::optim::SGD (1.13): d = g + wd * p; with momentum: buf = d on the first step, else
// buf = momentum * buf + (1 - dampening) * d; d = nesterov ? d + momentum * buf : buf;
// p -= lr * d.
class Sgd final : public Optimizer {
 public:
  explicit Sgd(const OptimizerSpec& s)
      : lr_(static_cast<float>(s.lr())),
        momentum_(static_cast<float>(s.momentum())),
        dampening_(static_cast<float>(s.dampening())),
        weight_decay_(static_cast<float>(s.weight_decay())),
        nesterov_(s.nesterov()) {}

  int num_slots() const override { return momentum_ != 0 ? 1 : 0; }

  void Apply(int64_t step, float lr_scale, const float* grad, float* param, float* const* slots,
             int64_t n) const override {
    const FlushDenormals ftz;
    const float lr = lr_ * lr_scale;
    const float wd = weight_decay_;
    // Separate branch-free loops per variant so each one vectorises.
    if (momentum_ == 0) {
      for (int64_t i = 0; i < n; ++i) param[i] = param[i] - lr * (grad[i] + wd * param[i]);
      return;
    }
    float* buf = slots[0];
    const float m = momentum_;
    const float keep = 1 - dampening_;
    if (step == 1) {
      for (int64_t i = 0; i < n; ++i) buf[i] = grad[i] + wd * param[i];
    } else {
      for (int64_t i = 0; i < n; ++i) buf[i] = m * buf[i] + keep * (grad[i] + wd * param[i]);
    }
    if (nesterov_) {
      for (int64_t i = 0; i < n; ++i) {
        param[i] = param[i] - lr * ((grad[i] + wd * param[i]) + m * buf[i]);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) param[i] = param[i] - lr * buf[i];
    }
  }

 private:
  const float lr_, momentum_, dampening_, weight_decay_;
  const bool nesterov_;
};

struct AdamScalars {
  float keep, wd, b1, b2, one_minus_b1, one_minus_b2, sqrt_bias2, eps, step_size;
};

// One Adam update of n elements. Compiled for AVX-512, AVX2 and the baseline, chosen at load
// time by the CPU (GCC function multi-versioning): a shard spends a fifth of its cycles here
// on the baseline's 4-wide SSE. Every lane computes what the scalar loop does, in the same
// order (no fused multiply-add: -ffp-contract=off), so the results are bit-identical
// whichever version runs. Not under ThreadSanitizer: the clones' resolver runs while the
// library is relocated, before TSan is set up, and its instrumentation would crash there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_THREAD__)
#define GRADMESH_X86_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GRADMESH_X86_CLONES
#endif
GRADMESH_X86_CLONES void AdamKernel(const AdamScalars& k, const float* grad, float* param, float* m,
                                    float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float p = param[i] * k.keep;
    const float g = grad[i] + k.wd * param[i];
    m[i] = m[i] * k.b1 + k.one_minus_b1 * g;
    v[i] = v[i] * k.b2 + k.one_minus_b2 * g * g;
    const float denom = std::sqrt(v[i]) / k.sqrt_bias2 + k.eps;
    param[i] = p - k.step_size * (m[i] / denom);
  }
}

// torch::optim::Adam / AdamW (1.13):
//   adam:  g += wd * p            adamw: p *= 1 - lr * wd
//   m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g * g
//   denom = sqrt(v) / sqrt(1 - b2^t) + eps;  p -= lr / (1 - b1^t) * m / denom
class Adam final : public Optimizer {
 public:
  Adam(const OptimizerSpec& s, bool decoupled)
      : lr_(s.lr()),
        beta1_(s.beta1() != 0 ? s.beta1() : 0.9),
        beta2_(s.beta2() != 0 ? s.beta2() : 0.999),
        eps_(s.eps() != 0 ? s.eps() : 1e-8),
        weight_decay_(static_cast<float>(s.weight_decay())),
        decoupled_(decoupled) {}

  int num_slots() const override { return 2; }

  void Apply(int64_t step, float lr_scale, const float* grad, float* param, float* const* slots,
             int64_t n) const override {
    const FlushDenormals ftz;
    const double lr = lr_ * lr_scale;
    // Scalars computed in double, as torch does on the host, then used as float.
    const double bias1 = 1 - std::pow(beta1_, static_cast<double>(step));
    const double bias2 = 1 - std::pow(beta2_, static_cast<double>(step));
    const float step_size = static_cast<float>(lr / bias1);
    const float sqrt_bias2 = static_cast<float>(std::sqrt(bias2));
    const float b1 = static_cast<float>(beta1_), b2 = static_cast<float>(beta2_);
    const float one_minus_b1 = static_cast<float>(1 - beta1_);
    const float one_minus_b2 = static_cast<float>(1 - beta2_);
    const float eps = static_cast<float>(eps_);
    const float decay = static_cast<float>(1 - lr * weight_decay_);
    const AdamScalars k{decoupled_ ? decay : 1.0f,
                        decoupled_ ? 0.0f : weight_decay_,
                        b1,
                        b2,
                        one_minus_b1,
                        one_minus_b2,
                        sqrt_bias2,
                        eps,
                        step_size};
    AdamKernel(k, grad, param, slots[0], slots[1], n);
  }

 private:
  const double lr_, beta1_, beta2_, eps_;
  const float weight_decay_;
  const bool decoupled_;
};

absl::Status CheckRange(const char* name, double v, double lo, double hi) {
  if (!(v >= lo && v < hi)) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.", name, " must be in [", lo, ", ", hi, "), got ", v));
  }
  return absl::OkStatus();
}

absl::Status CheckCommon(const OptimizerSpec& s) {
  if (!(s.lr() > 0) || !std::isfinite(s.lr())) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer.lr must be > 0, got ", s.lr()));
  }
  if (absl::Status st = ValidateLrSchedule(s); !st.ok()) return st;
  return CheckRange("weight_decay", s.weight_decay(), 0, 1e9);
}

constexpr double kPi = 3.14159265358979323846;

}  // namespace

absl::Status ValidateLrSchedule(const OptimizerSpec& s) {
  if (s.lr_schedule() != "" && s.lr_schedule() != "constant" && s.lr_schedule() != "cosine") {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown optimizer.lr_schedule \"", s.lr_schedule(), "\" (known: constant, cosine)"));
  }
  if (s.lr_schedule() == "cosine" && s.decay_updates() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.decay_updates must be > 0 for the cosine schedule, got ", s.decay_updates()));
  }
  if (!(s.min_lr_fraction() >= 0 && s.min_lr_fraction() <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.min_lr_fraction must be in [0, 1], got ", s.min_lr_fraction()));
  }
  if (s.warmup_updates() < 0) {
    return absl::InvalidArgumentError("optimizer.warmup_updates must be >= 0");
  }
  if (!(s.warmup_start_fraction() >= 0 && s.warmup_start_fraction() <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.warmup_start_fraction must be in [0, 1], got ", s.warmup_start_fraction()));
  }
  return absl::OkStatus();
}

float LrScheduleFactor(const OptimizerSpec& s, int64_t update) {
  double f = 1.0;
  if (s.lr_schedule() == "cosine") {
    const double d = static_cast<double>(s.decay_updates());
    const double progress = std::min(static_cast<double>(update), d) / d;
    const double m = s.min_lr_fraction();
    f = m + (1 - m) * 0.5 * (1 + std::cos(kPi * progress));
  }
  if (update < s.warmup_updates()) {
    const double f0 = s.warmup_start_fraction();
    f *= f0 + (1 - f0) * static_cast<double>(update + 1) / static_cast<double>(s.warmup_updates());
  }
  return static_cast<float>(f);
}

OptimizerRegistry OptimizerRegistry::WithBuiltins() {
  OptimizerRegistry r;
  r.Register("sgd", [](const OptimizerSpec& s) -> absl::StatusOr<std::unique_ptr<Optimizer>> {
    if (absl::Status st = CheckCommon(s); !st.ok()) return st;
    if (absl::Status st = CheckRange("momentum", s.momentum(), 0, 1); !st.ok()) return st;
    if (absl::Status st = CheckRange("dampening", s.dampening(), 0, 1); !st.ok()) return st;
    if (s.nesterov() && (s.momentum() <= 0 || s.dampening() != 0)) {
      return absl::InvalidArgumentError("optimizer.nesterov needs momentum > 0 and dampening = 0");
    }
    return std::unique_ptr<Optimizer>(new Sgd(s));
  });
  for (bool decoupled : {false, true}) {
    r.Register(decoupled ? "adamw" : "adam",
               [decoupled](const OptimizerSpec& s) -> absl::StatusOr<std::unique_ptr<Optimizer>> {
                 if (absl::Status st = CheckCommon(s); !st.ok()) return st;
                 if (absl::Status st = CheckRange("beta1", s.beta1(), 0, 1); !st.ok()) return st;
                 if (absl::Status st = CheckRange("beta2", s.beta2(), 0, 1); !st.ok()) return st;
                 if (absl::Status st = CheckRange("eps", s.eps(), 0, 1); !st.ok()) return st;
                 return std::unique_ptr<Optimizer>(new Adam(s, decoupled));
               });
  }
  return r;
}

void OptimizerRegistry::Register(const std::string& name, Factory factory) {
  factories_.Set(name, std::move(factory));
}

std::vector<std::string> OptimizerRegistry::names() const { return factories_.Names(); }

absl::StatusOr<std::unique_ptr<Optimizer>> OptimizerRegistry::Create(
    const OptimizerSpec& spec) const {
  auto factory = factories_.Find(spec.name());
  if (!factory.ok()) return factory.status();
  return (**factory)(spec);
}

}  // namespace gradmesh
