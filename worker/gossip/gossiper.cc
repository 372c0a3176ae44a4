// Gossiper (see gossiper.h).
#include "worker/gossip/gossiper.h"

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status.h"

namespace gradmesh {

absl::StatusOr<std::unique_ptr<Gossiper>> Gossiper::Create(GossiperOptions options,
                                                           std::shared_ptr<GossipReplica> replica,
                                                           std::unique_ptr<Topology> topology,
                                                           GossipTransport* transport) {
  if (replica == nullptr || topology == nullptr || transport == nullptr) {
    return absl::InvalidArgumentError("gossiper: needs a replica, a topology and a transport");
  }
  if (options.timeout <= absl::ZeroDuration() || options.backoff_initial <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("gossiper: timeout and backoff must be > 0");
  }
  auto codec = ValueCodec::Create(options.codec);
  if (!codec.ok()) return codec.status();
  return std::unique_ptr<Gossiper>(new Gossiper(
      std::move(options), *std::move(codec), std::move(replica), std::move(topology), transport));
}

Gossiper::Gossiper(GossiperOptions options, ValueCodec codec,
                   std::shared_ptr<GossipReplica> replica, std::unique_ptr<Topology> topology,
                   GossipTransport* transport)
    : options_(std::move(options)),
      codec_(std::move(codec)),
      replica_(std::move(replica)),
      topology_(std::move(topology)),
      transport_(transport),
      rank_(replica_->options().rank),
      n_(replica_->options().num_workers),
      health_(n_, options_.backoff_initial, options_.backoff_max) {
  // A random incarnation tells this gossiper's shares from those of an earlier run of the
  // rank (a receiver remembers the last (incarnation, sequence) of each sender).
  std::random_device urandom;
  do {
    incarnation_ = urandom();
  } while (incarnation_ == 0);
}

Gossiper::~Gossiper() { Stop(); }

ExchangeHeader Gossiper::Header(int32_t peer, ExchangeKind kind, int64_t round,
                                int64_t step) const {
  ExchangeHeader h;
  h.job = replica_->options().job;
  h.from = rank_;
  h.to = peer;
  h.kind = kind;
  h.round = round;
  h.step = step;
  h.codec = codec_.name();
  h.numel = replica_->numel();
  return h;
}

RoundResult Gossiper::RunRound(int64_t round, int64_t step) {
  const absl::Time start = absl::Now();
  std::optional<int32_t> peer = topology_->Peer(
      rank_, n_, round, [this, start](int32_t p) { return health_.Available(p, start); });
  RoundResult r;
  if (peer.has_value()) {
    r = topology_->mixing() == MixingKind::kPushSum ? PushSum(*peer, round, step)
                                                    : Average(*peer, round, step);
  }
  absl::MutexLock lock(&mu_);
  ++stats_.rounds;
  if (r.outcome == RoundResult::Outcome::kNoPeer) ++stats_.no_peer;
  if (r.outcome == RoundResult::Outcome::kKept) ++stats_.kept;
  stats_.busy_s += absl::ToDoubleSeconds(absl::Now() - start);
  return r;
}

namespace {

// The request was never sent (the transport could not connect): not applied.
bool NotSent(const absl::Status& st) { return st.GetPayload(kGossipNotSentPayload).has_value(); }

// Errors after which the receiver may or may not have applied the request.
bool OutcomeUnknown(const absl::Status& st) {
  if (NotSent(st)) return false;
  return st.code() == absl::StatusCode::kDeadlineExceeded ||
         st.code() == absl::StatusCode::kUnavailable || st.code() == absl::StatusCode::kCancelled ||
         st.code() == absl::StatusCode::kUnknown;
}

// An answer of the receiver itself refusing the share. Its duplicate check comes first, so a
// refusal proves an earlier copy was not absorbed either. (NOT_FOUND: the peer may have
// absorbed it and left since.)
bool ReceiverRefused(const absl::Status& st) {
  return !st.ok() && !NotSent(st) && !OutcomeUnknown(st) &&
         st.code() != absl::StatusCode::kNotFound;
}

}  // namespace

RoundResult Gossiper::PushSum(int32_t peer, int64_t round, int64_t step) {
  // A share whose fate is unknown goes first: nothing new goes to this peer until it is
  // known to be absorbed (keep its weight given) or refused (take the weight back).
  if (pending_.count(peer) > 0) return ResendPending(peer);
  absl::StatusOr<double> weight = replica_->BeginPushSum(&sent_, options_.min_send_weight);
  if (!weight.ok()) return RoundResult{};  // Finished: no more mixing.
  if (*weight == 0) return RoundResult{RoundResult::Outcome::kKept, peer, absl::OkStatus()};
  absl::Status st = codec_.Encode(sent_, &payload_);
  if (st.ok() && !codec_.lossless()) {
    sent_decoded_.resize(sent_.size());
    st = codec_.Decode(payload_, absl::MakeSpan(sent_decoded_));
  }
  if (!st.ok()) {
    // Our own values cannot be sent (diverged to NaN/Inf): keep everything, blame nobody.
    replica_->EndPushSum(false, *weight, sent_);
    LogWarning(options_.logger, "gossip_encode_failed",
               {Kv("job", replica_->options().job), Kv("rank", rank_), Kv("error", st.ToString())});
    return RoundResult{RoundResult::Outcome::kFailed, peer, st};
  }
  ExchangeHeader h = Header(peer, ExchangeKind::kPushSum, round, step);
  h.weight = *weight;
  h.exchange_id = (static_cast<uint64_t>(incarnation_) << 32) | ++share_seq_;
  absl::StatusOr<ExchangeReply> reply = transport_->Exchange(peer, h, payload_, options_.timeout);
  {
    absl::MutexLock lock(&mu_);
    stats_.bytes_sent += static_cast<int64_t>(payload_.size());
    stats_.raw_bytes_sent += static_cast<int64_t>(sent_.size() * sizeof(float));
  }
  if (!reply.ok() && OutcomeUnknown(reply.status())) {
    // The receiver may have absorbed the share and only the reply was lost: ask again with
    // the same id rather than take the weight back and count the share twice.
    absl::StatusOr<ExchangeReply> again = transport_->Exchange(peer, h, payload_, options_.timeout);
    {
      absl::MutexLock lock(&mu_);
      ++stats_.resent;
      if (again.ok() && again->duplicate) ++stats_.resent_duplicate;
    }
    if (!again.ok() && !ReceiverRefused(again.status())) {
      // Still unknown (NOT_FOUND: the peer may have absorbed it and left since; not sent:
      // this copy did not reach it, the first may have). Keep the weight out and settle it
      // before anything else goes to this peer.
      PendingShare& p = pending_[peer];
      p.header = h;
      p.payload = payload_;
      p.weight = *weight;
      p.sent = sent_;  // Taken back with it if refused.
      if (!codec_.lossless()) p.decoded = sent_decoded_;
      {
        absl::MutexLock lock(&mu_);
        ++stats_.pending;
      }
      return Settle(peer, again.status(), false);
    }
    reply = std::move(again);  // Absorbed (now or before), or definitely refused.
  }
  replica_->EndPushSum(reply.ok(), *weight, sent_);
  if (reply.ok() && !codec_.lossless()) replica_->CompensateShare(sent_, sent_decoded_, *weight);
  return Settle(peer, reply.status(), reply.ok());
}

RoundResult Gossiper::ResendPending(int32_t peer) {
  auto it = pending_.find(peer);
  PendingShare& p = it->second;
  absl::StatusOr<ExchangeReply> reply =
      transport_->Exchange(peer, p.header, p.payload, options_.timeout);
  if (!reply.ok() && !ReceiverRefused(reply.status())) {
    return Settle(peer, reply.status(), false);  // Still unknown.
  }
  if (reply.ok()) {
    if (!p.decoded.empty()) replica_->CompensateShare(p.sent, p.decoded, p.weight);
  } else {
    replica_->EndPushSum(false, p.weight, p.sent);  // Refused: it was never absorbed.
  }
  pending_.erase(it);
  {
    absl::MutexLock lock(&mu_);
    --stats_.pending;
    ++(reply.ok() ? stats_.pending_delivered : stats_.pending_returned);
  }
  return Settle(peer, reply.status(), reply.ok());
}

void Gossiper::SettlePending() {
  std::map<int32_t, absl::Time> unknown_since;  // Peers whose share is still unknown.
  std::set<int32_t> given_up;
  absl::Duration backoff = absl::Milliseconds(100);
  while (pending_.size() > given_up.size()) {
    std::vector<int32_t> peers;
    for (const auto& [peer, share] : pending_) {
      if (given_up.count(peer) == 0) peers.push_back(peer);
    }
    for (int32_t peer : peers) {
      ResendPending(peer);
      if (pending_.count(peer) == 0) continue;  // Absorbed or refused: settled.
      const absl::Time now = absl::Now();
      const absl::Time since = unknown_since.try_emplace(peer, now).first->second;
      if (now - since >= options_.dead_after) {
        given_up.insert(peer);
        LogWarning(options_.logger, "gossip_share_lost",
                   {Kv("job", replica_->options().job), Kv("rank", rank_), Kv("peer", peer),
                    Kv("weight", absl::StrFormat("%.6g", pending_.at(peer).weight)),
                    Kv("unknown_s", absl::StrFormat("%.1f", absl::ToDoubleSeconds(now - since)))});
      }
    }
    if (pending_.size() > given_up.size()) {
      absl::SleepFor(backoff);
      backoff = std::min(2 * backoff, absl::Seconds(1));
    }
  }
}

RoundResult Gossiper::Average(int32_t peer, int64_t round, int64_t step) {
  sent_.resize(replica_->numel());
  replica_->Read(absl::MakeSpan(sent_));
  absl::Status st = codec_.Encode(sent_, &payload_);
  // What the peer receives (the rounding of a lossy codec is compensated by the averaging
  // rule; see replica.h).
  const std::vector<float>* arrives = &sent_;
  if (st.ok() && !codec_.lossless()) {
    sent_decoded_.resize(sent_.size());
    st = codec_.Decode(payload_, absl::MakeSpan(sent_decoded_));
    arrives = &sent_decoded_;
  }
  if (!st.ok()) {
    LogWarning(options_.logger, "gossip_encode_failed",
               {Kv("job", replica_->options().job), Kv("rank", rank_), Kv("error", st.ToString())});
    return RoundResult{RoundResult::Outcome::kFailed, peer, st};
  }
  absl::StatusOr<ExchangeReply> reply = transport_->Exchange(
      peer, Header(peer, ExchangeKind::kAverage, round, step), payload_, options_.timeout);
  {
    absl::MutexLock lock(&mu_);
    stats_.bytes_sent += static_cast<int64_t>(payload_.size());
    stats_.raw_bytes_sent += static_cast<int64_t>(sent_.size() * sizeof(float));
    if (reply.ok()) {
      stats_.bytes_received += static_cast<int64_t>(reply->payload.size());
      stats_.raw_bytes_received += reply->numel * static_cast<int64_t>(sizeof(float));
    }
  }
  if (!reply.ok()) return Settle(peer, reply.status(), false);
  // The peer has averaged already; a malformed reply only means we do not.
  absl::Status valid;
  if (reply->codec != codec_.name() || reply->numel != replica_->numel()) {
    valid = absl::DataLossError(absl::StrCat("gossip: rank ", peer, " replied with ", reply->numel,
                                             " values in codec \"", reply->codec, "\"; expected ",
                                             replica_->numel(), " in \"", codec_.name(), "\""));
  } else {
    peer_values_.resize(replica_->numel());
    valid = Annotate(codec_.Decode(reply->payload, absl::MakeSpan(peer_values_)),
                     absl::StrCat("gossip: reply of rank ", peer));
  }
  if (!valid.ok()) return Settle(peer, valid, false);
  replica_->ApplyAverageReply(*arrives, peer_values_);
  return Settle(peer, absl::OkStatus(), true);
}

RoundResult Gossiper::Settle(int32_t peer, const absl::Status& status, bool mixed) {
  const std::string& job = replica_->options().job;
  if (status.ok() && mixed) {
    if (health_.OnSuccess(peer)) {
      LogInfo(options_.logger, "gossip_peer_up",
              {Kv("job", job), Kv("rank", rank_), Kv("peer", peer)});
    }
    absl::MutexLock lock(&mu_);
    ++stats_.mixed;
    return RoundResult{RoundResult::Outcome::kMixed, peer, absl::OkStatus()};
  }
  {
    absl::MutexLock lock(&mu_);
    ++stats_.failed;
  }
  if (status.code() == absl::StatusCode::kFailedPrecondition) {
    health_.OnFinished(peer);
    LogInfo(options_.logger, "gossip_peer_finished",
            {Kv("job", job), Kv("rank", rank_), Kv("peer", peer)});
    return RoundResult{RoundResult::Outcome::kPeerFinished, peer, status};
  }
  const absl::Time now = absl::Now();
  // NOT_FOUND: the peer's process answers but has not started the job yet; retry soon.
  if (health_.OnFailure(peer, now, status.code() != absl::StatusCode::kNotFound)) {
    LogInfo(options_.logger, "gossip_peer_down",
            {Kv("job", job), Kv("rank", rank_), Kv("peer", peer),
             Kv("code", StatusCodeName(status.code())),
             Kv("retry_in_ms", absl::ToInt64Milliseconds(health_.retry_at(peer) - now)),
             Kv("error", std::string(status.message()))});
  }
  return RoundResult{RoundResult::Outcome::kFailed, peer, status};
}

void Gossiper::Start() {
  absl::MutexLock lock(&mu_);
  if (thread_.joinable() || stop_) return;
  thread_ = std::thread([this] { Loop(); });
}

void Gossiper::Loop() {
  while (true) {
    int64_t round = 0, step = 0;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && !has_pending_) wake_.Wait(&mu_);
      if (stop_) return;
      round = pending_round_;
      step = pending_step_;
      has_pending_ = false;
    }
    RunRound(round, step);
  }
}

void Gossiper::RequestRound(int64_t round, int64_t step) {
  absl::MutexLock lock(&mu_);
  if (has_pending_) ++stats_.coalesced;
  has_pending_ = true;
  pending_round_ = round;
  pending_step_ = step;
  wake_.Signal();
}

void Gossiper::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    wake_.Signal();
  }
  if (thread_.joinable()) thread_.join();
}

GossiperStats Gossiper::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

absl::Status Gossiper::DeliverFinal(const ReplicaSnapshot& final, int32_t to, bool until_root) {
  const int32_t root = to >= 0 ? to : replica_->root();
  ExchangeHeader h = Header(root, ExchangeKind::kFinal, -1, final.step);
  h.codec = "";  // Finals travel exactly: they are averaged once, for the evaluated model.
  h.weight = final.weight;
  std::string payload(reinterpret_cast<const char*>(final.values.data()),
                      final.values.size() * sizeof(float));
  absl::Duration backoff = absl::Milliseconds(100);
  absl::Time first_failure = absl::InfiniteFuture();
  const absl::Time start = absl::Now();
  while (true) {
    absl::StatusOr<ExchangeReply> reply = transport_->Exchange(root, h, payload, options_.timeout);
    if (reply.ok()) {
      LogInfo(options_.logger, "final_delivered",
              {Kv("job", h.job), Kv("rank", rank_), Kv("to", root), Kv("step", final.step),
               Kv("weight", absl::StrFormat("%.6g", final.weight)),
               Kv("duplicate", reply->duplicate ? "true" : "false")});
      return absl::OkStatus();
    }
    const absl::StatusCode code = reply.status().code();
    const absl::Time now = absl::Now();
    if (until_root && code == absl::StatusCode::kFailedPrecondition &&
        absl::StrContains(reply.status().message(), kFinalsGoToRank)) {
      // It answers: alive, not the root yet.
      if (now - start > options_.max_wait ||
          (options_.cancel != nullptr && options_.cancel->load())) {
        return reply.status();
      }
      first_failure = absl::InfiniteFuture();
    } else if (code == absl::StatusCode::kFailedPrecondition ||
               code == absl::StatusCode::kInvalidArgument) {
      return reply.status();
    } else {
      if (first_failure == absl::InfiniteFuture()) first_failure = now;
      if (now - first_failure >= options_.dead_after) {
        return absl::UnavailableError(absl::StrCat(
            "gossip job ", h.job, " rank ", rank_, ": gave up delivering the final model to rank ",
            root, " after ", absl::FormatDuration(now - first_failure), ": ",
            reply.status().ToString()));
      }
    }
    absl::SleepFor(backoff);
    backoff = std::min(2 * backoff, absl::Seconds(1));
  }
}

void Gossiper::AwaitGathered(int32_t to) {
  const std::string& job = replica_->options().job;
  const int32_t root = to >= 0 ? to : replica_->root();
  const absl::Time start = absl::Now();
  absl::Time unreachable_since = absl::InfiniteFuture();
  std::string why = "gathered";
  while (true) {
    absl::StatusOr<ReplicaState> st = transport_->GetState(root, job, options_.timeout, rank_);
    const absl::Time now = absl::Now();
    if (st.ok()) {
      if (st->gathered) break;
      unreachable_since = absl::InfiniteFuture();
    } else if (st.status().code() == absl::StatusCode::kNotFound) {
      why = "root_left";  // The root's job is over in its process.
      break;
    } else {
      if (unreachable_since == absl::InfiniteFuture()) unreachable_since = now;
      if (now - unreachable_since >= options_.dead_after) {
        why = "root_unreachable";
        break;
      }
    }
    if (now - start > options_.max_wait) {
      why = "max_wait";
      break;
    }
    if (options_.cancel != nullptr && options_.cancel->load()) {
      why = "stop_requested";
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  LogInfo(options_.logger, "final_linger",
          {Kv("job", job), Kv("rank", rank_), Kv("until", why),
           Kv("waited_s", absl::StrFormat("%.2f", absl::ToDoubleSeconds(absl::Now() - start)))});
}

std::vector<int32_t> Gossiper::AwaitPeers(absl::Duration bound) {
  const std::string& job = replica_->options().job;
  const absl::Time start = absl::Now();
  std::vector<int32_t> missing;
  for (int32_t p = 0; p < n_; ++p) {
    if (p != rank_) missing.push_back(p);
  }
  std::string why = "all_answered";
  while (!missing.empty()) {
    // A peer is up once it answered, or once it asked this rank (a late rank asks the early
    // ones at once; the early ones' channels to it may be in reconnect backoff for seconds).
    const std::set<int32_t> callers = replica_->Callers();
    std::vector<int32_t> still;
    for (int32_t p : missing) {
      if (callers.count(p) == 0 && !transport_->GetState(p, job, options_.timeout, rank_).ok()) {
        still.push_back(p);
      }
    }
    missing = std::move(still);
    if (missing.empty()) break;
    if (absl::Now() - start >= bound) {
      why = "start_wait";
      break;
    }
    if (options_.cancel != nullptr && options_.cancel->load()) {
      why = "stop_requested";
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  std::vector<LogField> fields = {
      Kv("job", job), Kv("rank", rank_), Kv("until", why),
      Kv("waited_s", absl::StrFormat("%.2f", absl::ToDoubleSeconds(absl::Now() - start)))};
  if (missing.empty()) {
    LogInfo(options_.logger, "gossip_peers_ready", fields);
  } else {
    fields.push_back(Kv("missing", absl::StrJoin(missing, ",")));
    LogWarning(options_.logger, "gossip_peers_ready", fields);
  }
  return missing;
}

FinalAverage Gossiper::GatherFinal(const std::set<int32_t>& gone) {
  const std::string& job = replica_->options().job;
  const absl::Time start = absl::Now();
  std::vector<absl::Time> unreachable_since(n_, absl::InfiniteFuture());
  std::vector<absl::Time> next_probe(n_, absl::InfinitePast());
  std::vector<bool> given_up(n_, false);
  for (int32_t p : gone) {
    if (p >= 0 && p < n_) given_up[p] = true;
  }
  while (true) {
    const std::map<int32_t, ReplicaSnapshot> finals = replica_->Finals();
    bool waiting = false;
    for (int32_t p = 0; p < n_; ++p) {
      if (p == rank_ || finals.count(p) > 0 || given_up[p]) continue;
      const absl::Time now = absl::Now();
      if (now >= next_probe[p]) {
        next_probe[p] = now + absl::Milliseconds(500);
        absl::StatusOr<ReplicaState> st = transport_->GetState(p, job, options_.timeout, rank_);
        if (st.ok()) {
          unreachable_since[p] = absl::InfiniteFuture();
        } else {
          if (unreachable_since[p] == absl::InfiniteFuture()) unreachable_since[p] = now;
          if (absl::Now() - unreachable_since[p] >= options_.dead_after) {
            given_up[p] = true;
            LogWarning(options_.logger, "final_peer_given_up",
                       {Kv("job", job), Kv("rank", rank_), Kv("peer", p),
                        Kv("error", st.status().ToString())});
            continue;
          }
        }
      }
      waiting = true;
    }
    if (!waiting) break;
    if (absl::Now() - start > options_.max_wait) {
      LogWarning(options_.logger, "final_wait_timeout",
                 {Kv("job", job), Kv("rank", rank_),
                  Kv("waited_s", absl::ToDoubleSeconds(absl::Now() - start))});
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  const std::map<int32_t, ReplicaSnapshot> finals = replica_->Finals();
  FinalAverage avg = AverageFinals(finals);
  replica_->MarkGathered();
  // Every rank that delivered a final lingers until it sees this; stay until they have (a
  // dead one costs at most the timeout).
  const int64_t lingering = static_cast<int64_t>(finals.size()) - (finals.count(rank_) ? 1 : 0);
  if (!replica_->AwaitGatheredSeen(lingering, options_.timeout)) {
    LogWarning(options_.logger, "final_gathered_unseen",
               {Kv("job", job), Kv("rank", rank_), Kv("peers", lingering)});
  }
  LogInfo(options_.logger, "final_average",
          {Kv("job", job), Kv("rank", rank_), Kv("ranks", absl::StrJoin(avg.ranks, ",")),
           Kv("weight_sum", absl::StrFormat("%.6g", avg.weight_sum)),
           Kv("consensus", absl::StrFormat("%.6g", avg.consensus)),
           Kv("waited_s", absl::StrFormat("%.2f", absl::ToDoubleSeconds(absl::Now() - start)))});
  return avg;
}

}  // namespace gradmesh
