#include "compression/error_feedback.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace gradmesh {
namespace {

// residual = acc - decoded; returns the number of elements where decoded + residual != acc
// (the subtraction rounded).
int64_t Residual(const float* acc, const float* decoded, float* residual, size_t n) {
  int64_t inexact = 0;
  for (size_t i = 0; i < n; ++i) {  // vectorised
    const float r = acc[i] - decoded[i];
    residual[i] = r;
    inexact += decoded[i] + r != acc[i];
  }
  return inexact;
}

}  // namespace

absl::Status ValidateErrorFeedbackOptions(const ErrorFeedbackOptions& options) {
  if (!(options.momentum >= 0.0f && options.momentum < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("error feedback momentum ", options.momentum, " is outside [0, 1)"));
  }
  return absl::OkStatus();
}

ErrorFeedback::ErrorFeedback(size_t size, ErrorFeedbackOptions options)
    : options_(options), residual_(size, 0.0f), acc_(size) {
  if (!ValidateErrorFeedbackOptions(options_).ok()) options_.momentum = 0.0f;
  if (options_.momentum > 0.0f) {
    momentum_.assign(size, 0.0f);
    next_momentum_.resize(size);
  }
}

void ErrorFeedback::Reset() {
  std::fill(residual_.begin(), residual_.end(), 0.0f);
  std::fill(momentum_.begin(), momentum_.end(), 0.0f);
  last_inexact_ = 0;
}

absl::Status ErrorFeedback::Compress(const Compressor& codec, absl::Span<const float> grad,
                                     uint64_t seed, std::string* out) {
  const size_t n = residual_.size();
  if (grad.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("error feedback: gradient has ", grad.size(), " elements, the residual ", n));
  }
  const bool momentum = options_.momentum > 0.0f;
  if (momentum) {
    const float m = options_.momentum;
    for (size_t i = 0; i < n; ++i) {
      next_momentum_[i] = m * momentum_[i] + grad[i];
      acc_[i] = residual_[i] + next_momentum_[i];
    }
  } else {
    for (size_t i = 0; i < n; ++i) acc_[i] = grad[i] + residual_[i];
  }
  // Nothing is committed before the payload exists and decodes.
  absl::Status s = codec.Encode(acc_, seed, out);
  if (!s.ok()) return s;

  if (codec.density() < 1.0) {
    // A sparsifier: the residual is acc except at the k sent elements, so only those are
    // touched (O(k) after the O(n) accumulation and encoding).
    s = codec.DecodeSparse(*out, n, &sent_indices_, &sent_values_);
    if (!s.ok()) {
      return absl::InternalError(
          absl::StrCat(codec.name(), " cannot decode its own payload: ", s.message()));
    }
    residual_.swap(acc_);
    int64_t inexact = 0;
    for (size_t j = 0; j < sent_indices_.size(); ++j) {
      float& r = residual_[sent_indices_[j]];
      const float a = r;
      const float d = sent_values_[j];
      r = a - d;
      inexact += d + r != a;
    }
    last_inexact_ = inexact;
    if (momentum) {
      momentum_.swap(next_momentum_);
      if (options_.momentum_masking) {
        for (size_t j = 0; j < sent_indices_.size(); ++j) {
          if (sent_values_[j] != 0.0f) momentum_[sent_indices_[j]] = 0.0f;
        }
      }
    }
    return absl::OkStatus();
  }

  decoded_.resize(n);
  s = codec.Decode(*out, absl::MakeSpan(decoded_));
  if (!s.ok()) {
    return absl::InternalError(
        absl::StrCat(codec.name(), " cannot decode its own payload: ", s.message()));
  }
  last_inexact_ = Residual(acc_.data(), decoded_.data(), residual_.data(), n);
  if (momentum) {
    if (options_.momentum_masking) {
      for (size_t i = 0; i < n; ++i) {
        momentum_[i] = decoded_[i] != 0.0f ? 0.0f : next_momentum_[i];
      }
    } else {
      momentum_.swap(next_momentum_);
    }
  }
  return absl::OkStatus();
}

double WarmupDensity(double target, const WarmupSchedule& schedule, int64_t step) {
  if (schedule.steps <= 0 || schedule.stages < 1 || step >= schedule.steps || target >= 1.0) {
    return target;
  }
  const int64_t t = step < 0 ? 0 : step;
  const int64_t stage =
      static_cast<int64_t>((static_cast<unsigned __int128>(t) * schedule.stages) / schedule.steps);
  const double d = std::pow(target, static_cast<double>(stage + 1) / (schedule.stages + 1));
  return d < target ? target : d;
}

}  // namespace gradmesh
