// The model side of an allreduce step (see model_updater.h).
#include "worker/allreduce/model_updater.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"

namespace gradmesh {

absl::StatusOr<std::unique_ptr<ModelUpdater>> ModelUpdater::Create(
    std::vector<absl::Span<float>> entries, std::vector<std::string> names, int num_params,
    const OptimizerSpec& optimizer_spec) {
  if (num_params < 0 || num_params > static_cast<int>(entries.size())) {
    return absl::InvalidArgumentError(absl::StrCat("allreduce: model view with ", entries.size(),
                                                   " entries has num_params ", num_params));
  }
  absl::StatusOr<std::unique_ptr<Optimizer>> optimizer =
      OptimizerRegistry::WithBuiltins().Create(optimizer_spec);
  if (!optimizer.ok()) return Annotate(optimizer.status(), "allreduce");
  return std::unique_ptr<ModelUpdater>(new ModelUpdater(std::move(entries), std::move(names),
                                                        num_params, optimizer_spec,
                                                        std::move(optimizer).value()));
}

ModelUpdater::ModelUpdater(std::vector<absl::Span<float>> entries, std::vector<std::string> names,
                           int num_params, const OptimizerSpec& optimizer_spec,
                           std::unique_ptr<Optimizer> optimizer)
    : entries_(std::move(entries)),
      names_(std::move(names)),
      optimizer_spec_(optimizer_spec),
      optimizer_(std::move(optimizer)),
      num_params_(num_params),
      num_slots_(optimizer_->num_slots()),
      slot_ptrs_(num_slots_) {
  for (absl::Span<float> p : entries_) numels_.push_back(static_cast<int64_t>(p.size()));
  for (int p = 0; p < num_params_; ++p) {
    slots_.emplace_back(num_slots_, std::vector<float>(numels_[p], 0.0f));
  }
  for (size_t i = num_params_; i < entries_.size(); ++i) {
    before_.emplace_back(entries_[i].begin(), entries_[i].end());
  }
}

std::string ModelUpdater::EntryName(size_t i) const {
  return i < names_.size() ? names_[i] : absl::StrCat("entry ", i);
}

void ModelUpdater::ApplyBufferMean(int p, int64_t begin, absl::Span<const float> mean) {
  float* value = entries_[p].data() + begin;
  float* before = before_[p - num_params_].data() + begin;
  for (size_t i = 0; i < mean.size(); ++i) value[i] = before[i] = before[i] + mean[i];
}

absl::Status ModelUpdater::FinishStep(BucketReducer* reducer, int64_t step,
                                      absl::Span<const absl::Span<const float>> grads) {
  // The buffers' deltas exist only now, after backward: their bucket(s) come after every
  // parameter bucket (bucket_reducer.h), which may be on the wire already.
  for (int i = num_params_; i < static_cast<int>(numels_.size()); ++i) {
    reducer->ParamReady(i, grads[i].data(), static_cast<int64_t>(grads[i].size()));
  }
  // Same update on every rank, from bit-identical averages, applied piece by piece as the
  // all-reduce finishes them.
  const float lr_factor = LrScheduleFactor(optimizer_spec_, step);
  skipped_ = false;
  if (clip_.enabled() || scaling_) return FinishGatheredStep(reducer, step, lr_factor);
  return reducer->FinishStep([&](int p, int64_t begin, absl::Span<const float> mean) {
    if (p >= num_params_) {
      ApplyBufferMean(p, begin, mean);
      return;
    }
    const absl::Time o0 = absl::Now();
    for (int k = 0; k < num_slots_; ++k) slot_ptrs_[k] = slots_[p][k].data() + begin;
    optimizer_->Apply(step + 1, lr_factor, mean.data(), entries_[p].data() + begin,
                      slot_ptrs_.data(), static_cast<int64_t>(mean.size()));
    opt_s_ += absl::ToDoubleSeconds(absl::Now() - o0);
  });
}

absl::Status ModelUpdater::FinishGatheredStep(BucketReducer* reducer, int64_t step,
                                              float lr_factor) {
  // With loss scaling the buffers' mean deltas wait too: a skipped step leaves them as they
  // were before its forward (an overflowing forward may have made them Inf/NaN).
  const int gathered = scaling_ ? static_cast<int>(numels_.size()) : num_params_;
  means_.resize(gathered);
  for (int p = 0; p < gathered; ++p) means_[p].resize(numels_[p]);
  RETURN_IF_ERROR(reducer->FinishStep([&](int p, int64_t begin, absl::Span<const float> mean) {
    if (p >= gathered) {
      ApplyBufferMean(p, begin, mean);
      return;
    }
    std::copy(mean.begin(), mean.end(), means_[p].begin() + begin);
  }));
  std::vector<absl::Span<float>> spans(means_.begin(), means_.begin() + num_params_);
  if (scaling_) {
    bool finite = UnscaleAndCheck(spans, loss_scale_);
    for (int p = num_params_; p < gathered; ++p) {
      for (float v : means_[p]) finite &= std::isfinite(v);
    }
    if (!finite) {
      // GradScaler: no optimizer step; the buffers go back to their values before the step.
      skipped_ = true;
      for (int p = num_params_; p < gathered; ++p) {
        const std::vector<float>& before = before_[p - num_params_];
        std::copy(before.begin(), before.end(), entries_[p].begin());
      }
      return absl::OkStatus();
    }
    for (int p = num_params_; p < gathered; ++p) ApplyBufferMean(p, 0, means_[p]);
  }
  if (clip_.enabled()) clip_counters_.Add(ClipGradients(spans, clip_));
  const absl::Time o0 = absl::Now();
  for (int p = 0; p < num_params_; ++p) {
    for (int k = 0; k < num_slots_; ++k) slot_ptrs_[k] = slots_[p][k].data();
    optimizer_->Apply(step + 1, lr_factor, means_[p].data(), entries_[p].data(), slot_ptrs_.data(),
                      numels_[p]);
  }
  opt_s_ += absl::ToDoubleSeconds(absl::Now() - o0);
  return absl::OkStatus();
}

std::vector<absl::Span<const float>> ModelUpdater::CheckpointArrays() const {
  std::vector<absl::Span<const float>> arrays;
  for (absl::Span<float> p : entries_) arrays.emplace_back(p);
  for (int p = 0; p < num_params_; ++p) {
    for (int k = 0; k < num_slots_; ++k) arrays.emplace_back(slots_[p][k]);
  }
  return arrays;
}

bool ModelUpdater::Fits(const RankCheckpoint& c) const {
  return c.arrays.size() ==
         numels_.size() + static_cast<size_t>(num_params_) * static_cast<size_t>(num_slots_);
}

absl::Status ModelUpdater::Restore(const RankCheckpoint& c, const std::string& path) {
  if (!Fits(c)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "allreduce: checkpoint ", path, " holds ", c.arrays.size(), " arrays, the model needs ",
        numels_.size(), " entries and ", num_params_ * num_slots_, " optimizer slot arrays"));
  }
  // Check every size first, so a bad checkpoint changes nothing.
  for (size_t a = 0; a < c.arrays.size(); ++a) {
    const size_t entry =
        a < numels_.size() ? a : static_cast<size_t>((a - numels_.size()) / num_slots_);
    if (static_cast<int64_t>(c.arrays[a].size()) != numels_[entry]) {
      return absl::FailedPreconditionError(
          absl::StrCat("allreduce: checkpoint ", path, " holds ", c.arrays[a].size(),
                       " values for ", a < numels_.size() ? "" : "an optimizer slot of ",
                       EntryName(entry), ", the model has ", numels_[entry]));
    }
  }
  for (size_t i = 0; i < numels_.size(); ++i) {
    std::copy(c.arrays[i].begin(), c.arrays[i].end(), entries_[i].begin());
    if (static_cast<int>(i) >= num_params_) before_[i - num_params_] = c.arrays[i];
  }
  size_t a = numels_.size();
  for (int p = 0; p < num_params_; ++p) {
    for (int k = 0; k < num_slots_; ++k, ++a) slots_[p][k] = c.arrays[a];
  }
  return absl::OkStatus();
}

}  // namespace gradmesh
