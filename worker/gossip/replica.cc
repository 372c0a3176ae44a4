// GossipReplica and the final average (see replica.h for the math).
#include "worker/gossip/replica.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/gossip/value_codec.h"

namespace gradmesh {

const char* ExchangeKindName(ExchangeKind kind) {
  switch (kind) {
    case ExchangeKind::kPushSum:
      return "push_sum";
    case ExchangeKind::kAverage:
      return "average";
    case ExchangeKind::kFinal:
      return "final";
  }
  return "unknown";
}

double EstimateConsensus(const ConsensusSample& sample, int32_t num_workers) {
  if (num_workers < 2) return 0;
  if (sample.count == 0) return -1;
  const double n = num_workers;
  return std::sqrt((n - 1) / (2 * n) * sample.sum_sq / static_cast<double>(sample.count));
}

FinalAverage AverageFinals(const std::map<int32_t, ReplicaSnapshot>& finals) {
  FinalAverage out;
  if (finals.empty()) return out;
  const size_t n = finals.begin()->second.values.size();
  std::vector<double> acc(n, 0.0);
  for (const auto& [rank, f] : finals) {
    out.ranks.push_back(rank);
    out.weight_sum += f.weight;
    for (size_t i = 0; i < n; ++i) acc[i] += f.weight * static_cast<double>(f.values[i]);
  }
  out.values.resize(n);
  for (size_t i = 0; i < n; ++i) out.values[i] = static_cast<float>(acc[i] / out.weight_sum);
  double sq = 0;
  for (const auto& [rank, f] : finals) {
    for (size_t i = 0; i < n; ++i) {
      const double d = static_cast<double>(f.values[i]) - out.values[i];
      sq += d * d;
    }
  }
  out.consensus = std::sqrt(sq / static_cast<double>(finals.size()));
  return out;
}

GossipReplica::GossipReplica(Options options, std::vector<float> values, double weight,
                             int64_t step)
    : options_(std::move(options)),
      numel_(static_cast<int64_t>(values.size())),
      x_(std::move(values)),
      w_(weight),
      step_(step),
      root_(options_.root) {}

void GossipReplica::Read(absl::Span<float> out) const {
  absl::MutexLock lock(&mu_);
  std::copy(x_.begin(), x_.end(), out.begin());
}

void GossipReplica::Update(const std::function<void(absl::Span<float> x)>& fn) {
  absl::MutexLock lock(&mu_);
  fn(absl::MakeSpan(x_));
}

void GossipReplica::ApplyStep(const std::function<void(absl::Span<float> x)>& fn) {
  absl::MutexLock lock(&mu_);
  if (w_ == 1.0) {
    fn(absl::MakeSpan(x_));
    return;
  }
  before_step_.assign(x_.begin(), x_.end());
  fn(absl::MakeSpan(x_));
  const double inv = 1.0 / w_;
  for (size_t i = 0; i < x_.size(); ++i) {
    x_[i] = before_step_[i] + static_cast<float>((x_[i] - before_step_[i]) * inv);
  }
}

void GossipReplica::set_step(int64_t step) {
  absl::MutexLock lock(&mu_);
  step_ = step;
}

ReplicaSnapshot GossipReplica::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return ReplicaSnapshot{x_, w_, step_};
}

ReplicaState GossipReplica::State() const {
  absl::MutexLock lock(&mu_);
  return ReplicaState{step_, options_.total_steps, finished_, w_, gathered_};
}

absl::StatusOr<double> GossipReplica::BeginPushSum(std::vector<float>* values, double min_weight) {
  absl::MutexLock lock(&mu_);
  if (stopped_) {
    return absl::FailedPreconditionError(
        absl::StrCat("gossip job ", options_.job, " rank ", options_.rank, " has stopped mixing"));
  }
  if (w_ < min_weight) return 0.0;
  w_ /= 2;
  values->assign(x_.begin(), x_.end());
  return w_;
}

void GossipReplica::EndPushSum(bool delivered, double weight_sent, absl::Span<const float> sent) {
  if (delivered) return;
  absl::MutexLock lock(&mu_);
  const double w = w_ + weight_sent;
  if (static_cast<int64_t>(sent.size()) == numel_ && w > 0) {
    for (int64_t i = 0; i < numel_; ++i) {
      x_[i] = static_cast<float>((w_ * x_[i] + weight_sent * sent[i]) / w);
    }
  }
  w_ = w;
}

void GossipReplica::CompensateShare(absl::Span<const float> sent, absl::Span<const float> decoded,
                                    double weight_sent) {
  absl::MutexLock lock(&mu_);
  const float scale = static_cast<float>(weight_sent / w_);
  for (int64_t i = 0; i < numel_; ++i) x_[i] += scale * (sent[i] - decoded[i]);
}

void GossipReplica::AddScaledDifference(absl::Span<const float> a, absl::Span<const float> b,
                                        float scale) {
  absl::MutexLock lock(&mu_);
  for (int64_t i = 0; i < numel_; ++i) x_[i] += scale * (a[i] - b[i]);
}

void GossipReplica::ApplyAverageReply(absl::Span<const float> sent,
                                      absl::Span<const float> peer_before) {
  absl::MutexLock lock(&mu_);
  RecordDistance(sent, peer_before);
  for (int64_t i = 0; i < numel_; ++i) x_[i] += 0.5f * (peer_before[i] - sent[i]);
}

void GossipReplica::RecordDistance(absl::Span<const float> a, absl::Span<const float> b) {
  double sq = 0;
  for (int64_t i = 0; i < numel_; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    sq += d * d;
  }
  consensus_.sum_sq += sq;
  ++consensus_.count;
}

absl::Status GossipReplica::AbsorbPushSum(int32_t from, absl::Span<const float> v, double weight,
                                          uint64_t id, bool* duplicate) {
  absl::MutexLock lock(&mu_);
  // Before the refusal: a share absorbed before Finish/Stop was delivered, and its sender
  // must not take it back.
  if (id != 0) {
    auto it = last_share_.find(from);
    // A resend, or a stale first copy that reaches the lock after a newer share did.
    if (it != last_share_.end() && (it->second >> 32) == (id >> 32) &&
        (id & 0xffffffffu) <= (it->second & 0xffffffffu)) {
      *duplicate = true;
      return absl::OkStatus();
    }
  }
  if (stopped_) return Refusal(from);
  if (id != 0) last_share_[from] = id;
  RecordDistance(x_, v);
  const double total = w_ + weight;
  const float a = static_cast<float>(weight / total);
  for (int64_t i = 0; i < numel_; ++i) x_[i] += a * (v[i] - x_[i]);
  w_ = total;
  return absl::OkStatus();
}

absl::Status GossipReplica::AverageWith(int32_t from, absl::Span<const float> v,
                                        std::vector<float>* before) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return Refusal(from);
  RecordDistance(x_, v);
  before->assign(x_.begin(), x_.end());
  for (int64_t i = 0; i < numel_; ++i) x_[i] = 0.5f * (x_[i] + v[i]);
  return absl::OkStatus();
}

absl::Status GossipReplica::Refusal(int32_t from) const {
  if (finished_) {
    return absl::FailedPreconditionError(
        absl::StrCat("gossip job ", options_.job, " rank ", options_.rank,
                     " has finished its steps and mixes no more (exchange from rank ", from, ")"));
  }
  return absl::AbortedError(absl::StrCat("gossip job ", options_.job, " rank ", options_.rank,
                                         " is stopping (it may resume later); exchange from rank ",
                                         from, " refused"));
}

bool GossipReplica::AcceptFinal(int32_t from, std::vector<float> v, double weight, int64_t step) {
  absl::MutexLock lock(&mu_);
  return finals_.emplace(from, ReplicaSnapshot{std::move(v), weight, step}).second;
}

absl::StatusOr<ExchangeReply> GossipReplica::Handle(const ExchangeHeader& h,
                                                    absl::string_view payload,
                                                    absl::Time deadline) {
  const std::string where = absl::StrCat("gossip job ", options_.job, " rank ", options_.rank, ", ",
                                         ExchangeKindName(h.kind), " from rank ", h.from);
  if (h.job != options_.job || h.to != options_.rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": request is for job ", h.job, " rank ", h.to));
  }
  if (h.from < 0 || h.from >= options_.num_workers || h.from == options_.rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": sender rank must be in [0, ", options_.num_workers, ") and not ", options_.rank));
  }
  if (h.kind != ExchangeKind::kFinal && !options_.in_neighbours.empty() &&
      (static_cast<size_t>(h.from) >= options_.in_neighbours.size() ||
       !options_.in_neighbours[h.from])) {
    return absl::PermissionDeniedError(
        absl::StrCat(where, ": rank ", h.from, " is not an in-neighbour of rank ", options_.rank,
                     " in this job's gossip topology"));
  }
  if (h.numel != numel_) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", h.numel,
                                                   " parameters sent, this replica has ", numel_,
                                                   " (a different model?)"));
  }
  // Push-sum weights start at 1 per worker and are only split and merged, so they sum to
  // about num_workers (a rank resumed from a checkpoint may bring back some twice): far more
  // (a broken or hostile peer) would swamp this replica's values, and a few such messages
  // overflow its weight to inf and its values to NaN.
  const double max_weight = 4.0 * options_.num_workers;
  if (h.kind != ExchangeKind::kAverage &&
      !(std::isfinite(h.weight) && h.weight > 0 && h.weight <= max_weight)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": push-sum weight must be finite, > 0 and at most 4x the number of workers (",
        max_weight, "), got ", h.weight));
  }
  if (const int32_t root = this->root(); h.kind == ExchangeKind::kFinal && options_.rank != root) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": ", kFinalsGoToRank, root));
  }
  auto codec = ValueCodec::Create(h.codec);
  if (!codec.ok()) return Annotate(codec.status(), where);
  std::vector<float> v(numel_);
  RETURN_IF_ERROR(Annotate(codec->Decode(payload, absl::MakeSpan(v)), where));
  if (absl::Now() > deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat(where, ": the request's deadline passed before it was applied"));
  }
  ExchangeReply reply;
  switch (h.kind) {
    case ExchangeKind::kPushSum:
      RETURN_IF_ERROR(AbsorbPushSum(h.from, v, h.weight, h.exchange_id, &reply.duplicate));
      break;
    case ExchangeKind::kAverage: {
      std::vector<float> before;
      RETURN_IF_ERROR(AverageWith(h.from, v, &before));
      reply.codec = h.codec;
      reply.numel = numel_;
      RETURN_IF_ERROR(Annotate(codec->Encode(before, &reply.payload),
                               absl::StrCat(where, ": encoding the reply")));
      if (!codec->lossless()) {
        // The caller gets decode(encode(before)); keep the rounding here (see replica.h).
        std::vector<float> arrives(numel_);
        RETURN_IF_ERROR(codec->Decode(reply.payload, absl::MakeSpan(arrives)));
        AddScaledDifference(before, arrives, 0.5f);
      }
      break;
    }
    case ExchangeKind::kFinal:
      reply.duplicate = !AcceptFinal(h.from, std::move(v), h.weight, h.step);
      break;
  }
  reply.step = State().step;
  return reply;
}

ReplicaSnapshot GossipReplica::Finish() {
  absl::MutexLock lock(&mu_);
  finished_ = true;
  stopped_ = true;
  ReplicaSnapshot mine{x_, w_, step_};
  if (options_.rank == root_) finals_.emplace(options_.rank, mine);
  return mine;
}

int32_t GossipReplica::root() const {
  absl::MutexLock lock(&mu_);
  return root_;
}

void GossipReplica::BecomeRoot() {
  absl::MutexLock lock(&mu_);
  root_ = options_.rank;
  if (finished_) finals_.emplace(options_.rank, ReplicaSnapshot{x_, w_, step_});
}

ReplicaSnapshot GossipReplica::Stop() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
  return ReplicaSnapshot{x_, w_, step_};
}

void GossipReplica::MarkGathered() {
  absl::MutexLock lock(&mu_);
  gathered_ = true;
}

ReplicaState GossipReplica::StateForPeer(std::optional<int32_t> from) {
  absl::MutexLock lock(&mu_);
  if (from.has_value()) callers_.insert(*from);
  if (gathered_) ++gathered_seen_;
  return ReplicaState{step_, options_.total_steps, finished_, w_, gathered_};
}

std::set<int32_t> GossipReplica::Callers() const {
  absl::MutexLock lock(&mu_);
  return callers_;
}

bool GossipReplica::AwaitGatheredSeen(int64_t peers, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto seen = [this, peers]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return gathered_seen_ >= peers; };
  return mu_.AwaitWithTimeout(absl::Condition(&seen), timeout);
}

std::map<int32_t, ReplicaSnapshot> GossipReplica::Finals() const {
  absl::MutexLock lock(&mu_);
  return finals_;
}

ConsensusSample GossipReplica::TakeConsensus() {
  absl::MutexLock lock(&mu_);
  ConsensusSample s = consensus_;
  consensus_ = ConsensusSample{};
  return s;
}

}  // namespace gradmesh
