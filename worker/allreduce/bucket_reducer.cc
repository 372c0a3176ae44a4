// Gradient buckets and the communication thread (see bucket_reducer.h).
#include "worker/allreduce/bucket_reducer.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"

namespace gradmesh {

std::vector<GradBucket> AssignBuckets(const std::vector<int64_t>& numels, int64_t bucket_bytes,
                                      int num_params) {
  const int n = static_cast<int>(numels.size());
  if (num_params < 0 || num_params > n) num_params = n;
  std::vector<GradBucket> out;
  GradBucket cur;
  auto add = [&](int i) {
    cur.params.push_back(i);
    cur.elements += numels[i];
    if (bucket_bytes > 0 && cur.elements * static_cast<int64_t>(sizeof(float)) >= bucket_bytes) {
      out.push_back(std::move(cur));
      cur = GradBucket();
    }
  };
  for (int i = num_params - 1; i >= 0; --i) add(i);
  // Buffers never share a bucket with parameters: their deltas arrive only after backward.
  if (!cur.params.empty()) {
    out.push_back(std::move(cur));
    cur = GradBucket();
  }
  for (int i = num_params; i < n; ++i) add(i);
  if (!cur.params.empty() || out.empty()) out.push_back(std::move(cur));
  return out;
}

BucketReducer::BucketReducer(Collective* collective, const std::vector<int64_t>& numels,
                             int64_t bucket_bytes, int num_params)
    : collective_(collective),
      buckets_(AssignBuckets(numels, bucket_bytes, num_params)),
      bucket_of_(numels.size()),
      offset_(numels.size()),
      numel_(numels),
      seen_(numels.size()),
      missing_(buckets_.size()) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    int64_t at = 0;
    for (int p : buckets_[b].params) {
      bucket_of_[p] = static_cast<int>(b);
      offset_[p] = at;
      at += numels[p];
    }
    flat_.emplace_back(at + (b + 1 == buckets_.size() ? kExtras : 0), 0.0f);
  }
  {
    absl::MutexLock lock(&mu_);
    ready_.assign(buckets_.size(), false);
    launched_ = reduced_ = static_cast<int>(buckets_.size());  // Nothing to do yet.
  }
  thread_ = std::thread([this] { CommLoop(); });
}

BucketReducer::~BucketReducer() { Stop(); }

void BucketReducer::Stop() {
  if (!thread_.joinable()) return;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void BucketReducer::StartStep(std::array<float, kExtras> extras) {
  std::fill(seen_.begin(), seen_.end(), false);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    missing_[b] = static_cast<int>(buckets_[b].params.size());
  }
  std::vector<float>& last = flat_.back();
  std::copy(extras.begin(), extras.end(), last.end() - kExtras);
  absl::MutexLock lock(&mu_);
  std::fill(ready_.begin(), ready_.end(), false);
  launched_ = reduced_ = 0;
  final_.clear();
  error_ = absl::OkStatus();
}

void BucketReducer::ParamReady(int param, const float* grad, int64_t n) {
  const int b = bucket_of_[param];
  float* dst = flat_[b].data() + offset_[param];
  const int64_t count = std::min(n, numel_[param]);
  if (seen_[param]) {
    for (int64_t i = 0; i < count; ++i) dst[i] += grad[i];
    return;
  }
  std::memcpy(dst, grad, count * sizeof(float));
  seen_[param] = true;
  if (--missing_[b] == 0) {
    absl::MutexLock lock(&mu_);
    ready_[b] = true;
    while (launched_ < static_cast<int>(buckets_.size()) && ready_[launched_]) ++launched_;
  }
}

void BucketReducer::LaunchRest() {
  for (size_t p = 0; p < seen_.size(); ++p) {
    if (!seen_[p]) {
      // No gradient reached this parameter (unused in this step): it contributes zeros.
      std::fill_n(flat_[bucket_of_[p]].data() + offset_[p], numel_[p], 0.0f);
      seen_[p] = true;
    }
  }
  absl::MutexLock lock(&mu_);
  std::fill(ready_.begin(), ready_.end(), true);
  launched_ = static_cast<int>(buckets_.size());
}

absl::Status BucketReducer::FinishStep() {
  LaunchRest();
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](BucketReducer* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) {
          return r->reduced_ == static_cast<int>(r->buckets_.size());
        },
        this));
    final_.clear();
    if (!error_.ok()) return error_;
  }
  // Every collective has returned: nothing reads the buckets any more, so average in place.
  const float scale = 1.0f / static_cast<float>(collective_->size());
  for (size_t b = 0; b < flat_.size(); ++b) {
    const size_t grads = b + 1 == flat_.size() ? flat_[b].size() - kExtras : flat_[b].size();
    float* buf = flat_[b].data();
    for (size_t i = 0; i < grads; ++i) buf[i] *= scale;
  }
  return absl::OkStatus();
}

absl::Status BucketReducer::FinishStep(const PieceFn& on_piece) {
  LaunchRest();
  std::deque<FinalRange> ranges;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](BucketReducer* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) {
            return !r->final_.empty() || r->reduced_ == static_cast<int>(r->buckets_.size());
          },
          this));
      if (final_.empty()) return error_;  // Everything reduced and handed over.
      ranges.swap(final_);
    }
    for (const FinalRange& f : ranges) DeliverPiece(f.bucket, f.begin, f.end, on_piece);
    ranges.clear();
  }
}

void BucketReducer::DeliverPiece(int b, int64_t begin, int64_t end, const PieceFn& on_piece) {
  const float scale = 1.0f / static_cast<float>(collective_->size());
  const float* src = flat_[b].data();
  // Parameters sit in the bucket in order, back to back; the extras (last bucket) follow.
  for (int p : buckets_[b].params) {
    const int64_t lo = std::max(begin, offset_[p]);
    const int64_t hi = std::min(end, offset_[p] + numel_[p]);
    if (lo >= hi) continue;
    // The bucket may still be read by the collective (sent in place): average into a copy.
    if (static_cast<int64_t>(scratch_.size()) < hi - lo) scratch_.resize(hi - lo);
    for (int64_t i = lo; i < hi; ++i) scratch_[i - lo] = src[i] * scale;
    on_piece(p, lo - offset_[p], absl::Span<const float>(scratch_.data(), hi - lo));
  }
}

void BucketReducer::CommLoop() {
  while (true) {
    int b;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](BucketReducer* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) {
            return r->stop_ || r->reduced_ < r->launched_;
          },
          this));
      if (reduced_ >= launched_) return;  // stop_ and nothing in flight.
      b = reduced_;
      if (!error_.ok()) {
        // After a failure the ring is out of step: skip the rest of the step's buckets.
        ++reduced_;
        continue;
      }
    }
    const absl::Time start = absl::Now();
    std::vector<float>& buf = flat_[b];
    absl::Status st = collective_->AllreduceSumStreaming(absl::MakeSpan(buf),
                                                         [this, b](int64_t begin, int64_t end) {
                                                           absl::MutexLock lock(&mu_);
                                                           final_.push_back({b, begin, end});
                                                         });
    absl::MutexLock lock(&mu_);
    comm_s_ += absl::ToDoubleSeconds(absl::Now() - start);
    if (!st.ok() && error_.ok()) {
      error_ =
          Annotate(st, absl::StrCat("all-reduce of gradient bucket ", b, " of ", buckets_.size()));
    }
    ++reduced_;
  }
}

absl::Span<const float> BucketReducer::grad(int param) const {
  return absl::Span<const float>(flat_[bucket_of_[param]].data() + offset_[param], numel_[param]);
}

std::array<float, BucketReducer::kExtras> BucketReducer::extras() const {
  std::array<float, kExtras> e;
  std::copy(flat_.back().end() - kExtras, flat_.back().end(), e.begin());
  return e;
}

double BucketReducer::comm_seconds() const {
  absl::MutexLock lock(&mu_);
  return comm_s_;
}

}  // namespace gradmesh
