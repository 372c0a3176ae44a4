#include "worker/ps/backward_overlap.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status.h"

namespace gradmesh {

BackwardOverlap::BackwardOverlap(ParameterClient* client, ModelView* model, bool deferred)
    : client_(client),
      model_(model),
      deferred_(deferred),
      num_shards_(client->num_shards()),
      num_entries_(model->size()),
      tensor_shards_(client->TensorShards()),
      shard_tensors_(num_shards_, 0),
      taken_(num_shards_, true),
      answered_(num_shards_, false),
      background_(std::make_unique<BackgroundTask>()),
      rest_(std::make_unique<BackgroundTask>()) {
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
  // The previous step's answers must all be in (and copied) before its buffers are reused.
  RETURN_IF_ERROR(Settle());
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
    answered_.assign(num_shards_, false);
    closed_ = false;
    failed_ = false;
    failure_ = absl::OkStatus();
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

absl::Status BackwardOverlap::Send(int64_t step, std::vector<int32_t> shards) {
  const std::vector<absl::Span<const float>> grads(grads_.begin(), grads_.end());
  const std::vector<absl::Span<float>> into(staging_.begin(), staging_.end());
  std::sort(shards.begin(), shards.end());
  const absl::Time start = absl::Now();
  absl::Status st = client_->PushPullShards(step, grads, into, shards);
  // Deferred, the error surfaces during the next step: say which step's exchange it was.
  if (deferred_ && !st.ok()) {
    st = Annotate(
        st, absl::StrCat("step ", step, "'s exchange with shards ", absl::StrJoin(shards, ",")));
  }
  const absl::Time end = absl::Now();
  absl::MutexLock lock(&mu_);
  sends_.emplace_back(start, end);
  if (st.ok()) {
    for (int32_t s : shards) answered_[s] = true;
  } else if (!failed_) {
    failed_ = true;
    failure_ = st;
  }
  answer_cv_.SignalAll();
  return st;
}

absl::Status BackwardOverlap::SendReady() {
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
      if (ready_.empty()) return first;  // Closed: Finish took the rest.
      batch.swap(ready_);
      for (int32_t s : batch) taken_[s] = true;
      for (int32_t s : batch) early_ += shard_tensors_[s] > 0 ? 1 : 0;
      step = step_;
    }
    // After a failure nothing more is sent; Finish reports it.
    if (!first.ok()) continue;
    first = Send(step, std::move(batch));
  }
}

absl::Status BackwardOverlap::Finish(absl::Span<const absl::Span<const float>> grads) {
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
  if (deferred_) {
    open_ = true;
    closed_at_ = start;
    waited_s_ = 0;
    copied_.assign(num_entries_, false);
    copied_count_ = 0;
    if (!rest.empty() && !failed) {
      RETURN_IF_ERROR(rest_->Start([this, step, rest] { return Send(step, rest); }));
    }
    if (failed) return Settle();
    return absl::OkStatus();
  }
  absl::Status st;
  if (!rest.empty() && !failed) st = Send(step, rest);
  absl::Status sent_early = background_->Wait();
  {
    absl::MutexLock lock(&mu_);
    CountStepLocked(start, absl::ToDoubleSeconds(absl::Now() - start));
  }
  RETURN_IF_ERROR(Annotate(sent_early, "a shard's part sent during backward"));
  RETURN_IF_ERROR(st);
  for (size_t i = 0; i < staging_.size(); ++i) {
    std::copy(staging_[i].begin(), staging_[i].end(), model_->params[i].begin());
  }
  return absl::OkStatus();
}

void BackwardOverlap::CountStepLocked(absl::Time closed_at, double waited_s) {
  ++totals_.steps;
  totals_.shards_early += early_;
  totals_.shards_total += held_shards_;
  totals_.exposed_s += waited_s;
  if (!deferred_) {
    // What the sends did while backward ran (they are one after another: no overlap).
    for (const auto& [from, to] : sends_) {
      totals_.hidden_s += std::max(0.0, absl::ToDoubleSeconds(std::min(to, closed_at) - from));
    }
    return;
  }
  // Deferred: the step's exchange ran from its first send to its last answer; whatever of it
  // the training thread did not wait for was hidden (behind backward or the next forward).
  if (sends_.empty()) return;
  absl::Time first = sends_[0].first, last = sends_[0].second;
  for (const auto& [from, to] : sends_) {
    first = std::min(first, from);
    last = std::max(last, to);
  }
  totals_.hidden_s += std::max(0.0, absl::ToDoubleSeconds(last - first) - waited_s);
}

bool BackwardOverlap::AnsweredLocked(int begin, int end) const {
  if (failed_) return true;
  for (int i = begin; i < end; ++i) {
    for (int32_t s : tensor_shards_[i]) {
      if (!answered_[s]) return false;
    }
  }
  return true;
}

absl::Status BackwardOverlap::AwaitEntries(int begin, int end) {
  if (!open_) return absl::OkStatus();
  begin = std::max(begin, 0);
  end = std::min(end, num_entries_);
  if (begin >= end) return absl::OkStatus();
  const absl::Time start = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    while (!AnsweredLocked(begin, end)) answer_cv_.Wait(&mu_);
    if (failed_) return failure_;
  }
  waited_s_ += absl::ToDoubleSeconds(absl::Now() - start);
  for (int i = begin; i < end; ++i) {
    if (copied_[i]) continue;
    std::copy(staging_[i].begin(), staging_[i].end(), model_->params[i].begin());
    copied_[i] = true;
    ++copied_count_;
  }
  // Every entry in: the step's sends are all answered; close it (and count it) now.
  return copied_count_ == num_entries_ ? Settle() : absl::OkStatus();
}

absl::Status BackwardOverlap::Settle() {
  if (!open_) return absl::OkStatus();
  const absl::Time start = absl::Now();
  const absl::Status early = background_->Wait();
  const absl::Status rest = rest_->Wait();
  open_ = false;
  waited_s_ += absl::ToDoubleSeconds(absl::Now() - start);
  {
    absl::MutexLock lock(&mu_);
    CountStepLocked(closed_at_, waited_s_);
  }
  RETURN_IF_ERROR(Annotate(early, "a shard's part sent during backward"));
  RETURN_IF_ERROR(rest);
  for (int i = 0; i < num_entries_; ++i) {
    if (copied_[i]) continue;
    std::copy(staging_[i].begin(), staging_[i].end(), model_->params[i].begin());
    copied_[i] = true;
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
  rest_->Wait().IgnoreError();
  open_ = false;
}

}  // namespace gradmesh
