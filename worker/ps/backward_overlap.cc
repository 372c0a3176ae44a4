#include "worker/ps/backward_overlap.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"
#include "common/status.h"

namespace gradmesh {

BackwardOverlap::BackwardOverlap(ParameterClient* client, const ModelView* model)
    : client_(client),
      num_shards_(client->num_shards()),
      num_entries_(model->size()),
      tensor_shards_(client->TensorShards()),
      shard_tensors_(num_shards_, 0),
      taken_(num_shards_, true),
      background_(std::make_unique<BackgroundTask>()) {
  for (const std::vector<int32_t>& shards : tensor_shards_) {
    for (int32_t s : shards) ++shard_tensors_[s];
  }
  held_shards_ =
      std::count_if(shard_tensors_.begin(), shard_tensors_.end(), [](int32_t n) { return n > 0; });
  for (int i = 0; i < model->size(); ++i) {
    grads_.emplace_back(model->params[i].size(), 0.0f);
    staging_.emplace_back(model->params[i].begin(), model->params[i].end());
  }
}

BackwardOverlap::~BackwardOverlap() { Abort(); }

absl::Status BackwardOverlap::BeginStep(int64_t step) {
  // A step begun and never finished (not reachable from the training loop) ends here, so no
  // send of it takes this step's shards.
  if (background_->pending()) Abort();
  {
    absl::MutexLock lock(&mu_);
    step_ = step;
    waiting_ = shard_tensors_;
    produced_.assign(num_entries_, false);
    ready_.clear();
    taken_.assign(num_shards_, false);
    closed_ = false;
    failed_ = false;
    sends_.clear();
    early_ = 0;
    // A shard that holds nothing still counts the worker's step.
    for (int32_t s = 0; s < num_shards_; ++s) {
      if (waiting_[s] == 0) ready_.push_back(s);
    }
  }
  return background_->Start([this] { return SendReady(); });
}

void BackwardOverlap::OnGradient(int param, absl::Span<const float> grad) {
  if (param < 0 || param >= num_entries_ || grad.size() != grads_[param].size()) return;
  {
    absl::MutexLock lock(&mu_);
    // Once per parameter and step: a shard may already be sending this copy.
    if (closed_ || produced_[param]) return;
    produced_[param] = true;
  }
  std::copy(grad.begin(), grad.end(), grads_[param].begin());
  absl::MutexLock lock(&mu_);
  for (int32_t s : tensor_shards_[param]) {
    if (--waiting_[s] == 0 && !taken_[s]) ready_.push_back(s);
  }
}

absl::Status BackwardOverlap::SendReady() {
  const std::vector<absl::Span<const float>> grads(grads_.begin(), grads_.end());
  const std::vector<absl::Span<float>> into(staging_.begin(), staging_.end());
  absl::Status first;
  while (true) {
    std::vector<int32_t> batch;
    int64_t step;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](BackwardOverlap* o)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(o->mu_) { return !o->ready_.empty() || o->closed_; },
          this));
      if (ready_.empty()) return first;  // Closed: the training thread sent the rest.
      batch.swap(ready_);
      for (int32_t s : batch) taken_[s] = true;
      for (int32_t s : batch) early_ += shard_tensors_[s] > 0 ? 1 : 0;
      step = step_;
    }
    // After a failure nothing more is sent; Finish reports it.
    if (!first.ok()) continue;
    std::sort(batch.begin(), batch.end());
    const absl::Time start = absl::Now();
    first = client_->PushPullShards(step, grads, into, batch);
    const absl::Time end = absl::Now();
    absl::MutexLock lock(&mu_);
    sends_.emplace_back(start, end);
    failed_ = failed_ || !first.ok();
  }
}

absl::Status BackwardOverlap::Finish(absl::Span<const absl::Span<const float>> grads,
                                     ModelView* model) {
  const absl::Time start = absl::Now();
  std::vector<int32_t> rest;
  int64_t step;
  bool failed;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    ready_.clear();
    for (int32_t s = 0; s < num_shards_; ++s) {
      if (!taken_[s]) rest.push_back(s);
      taken_[s] = true;
    }
    step = step_;
    failed = failed_;
    // Every entry is normally produced by now; one that was not (no hook call) is taken
    // from `grads`. Its shards cannot have been sent.
    for (int i = 0; i < num_entries_; ++i) {
      if (produced_[i]) continue;
      std::copy(grads[i].begin(), grads[i].end(), grads_[i].begin());
      produced_[i] = true;
    }
  }
  const std::vector<absl::Span<const float>> copies(grads_.begin(), grads_.end());
  const std::vector<absl::Span<float>> into(staging_.begin(), staging_.end());
  absl::Status st;
  if (!rest.empty() && !failed) st = client_->PushPullShards(step, copies, into, rest);
  absl::Status sent_early = background_->Wait();
  const absl::Time end = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    ++totals_.steps;
    totals_.shards_early += early_;
    totals_.shards_total += held_shards_;
    // What the sends did while backward ran (they are one after another: no overlap).
    for (const auto& [from, to] : sends_) {
      totals_.hidden_s += std::max(0.0, absl::ToDoubleSeconds(std::min(to, start) - from));
    }
    totals_.exposed_s += absl::ToDoubleSeconds(end - start);
  }
  RETURN_IF_ERROR(Annotate(sent_early, "a shard's part sent during backward"));
  RETURN_IF_ERROR(st);
  for (size_t i = 0; i < staging_.size(); ++i) {
    std::copy(staging_[i].begin(), staging_[i].end(), model->params[i].begin());
  }
  return absl::OkStatus();
}

void BackwardOverlap::Abort() {
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    ready_.clear();
    taken_.assign(num_shards_, true);
  }
  background_->Wait().IgnoreError();
}

}  // namespace gradmesh
