#include "worker/gossip/gossip_mode.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "common/optimizer.h"
#include "common/safe_path.h"
#include "common/status.h"
#include "rpc/grpc_util.h"
#include "worker/gossip/checkpoint.h"
#include "worker/gossip/gossip_service.h"
#include "worker/gossip/gossiper.h"
#include "worker/gossip/grpc_transport.h"
#include "worker/gossip/local_step.h"
#include "worker/gossip/replica.h"
#include "worker/gossip/topology.h"
#include "worker/gossip/value_codec.h"

namespace gradmesh {
namespace {

class GossipMode : public TrainingMode {
 public:
  GossipMode(const TrainerOptions& options, GossipServiceImpl* local)
      : options_(options),
        spec_(options.spec),
        gs_(options.spec.gossip()),
        local_(local),
        peers_(options.peers) {}
  ~GossipMode() override;

  absl::StatusOr<int64_t> Start(ModelView* model, const LoopInfo& info) override;
  std::vector<LogField> StartFields() const override;
  absl::Status BeforeForward(int64_t step) override;
  // Loss scaling skipped the step (non-finite gradient): no local update, but the step is
  // still counted and a round due now still mixes (mixing needs no gradient).
  absl::StatusOr<StepOutcome> SkipStep(int64_t step, double loss) override {
    EndStep(step);
    StepOutcome out;
    out.loss = loss;
    out.skipped = true;
    return out;
  }
  // The step's bookkeeping after its (possibly skipped) local update: the replica's step and
  // the gossip round at every_steps boundaries.
  void EndStep(int64_t step);
  absl::StatusOr<StepOutcome> Exchange(int64_t step,
                                       absl::Span<const absl::Span<const float>> grads, double loss,
                                       const StepTiming& timing) override;
  absl::StatusOr<bool> MaybeCheckpoint(int64_t steps_done) override;
  int64_t bytes_sent() const override { return gossiper_->stats().bytes_sent; }
  std::vector<LogField> ProgressFields(int64_t done, int64_t window) override;
  absl::StatusOr<bool> Finish(int64_t step, TrainResult* result) override;
  void OnStopRequested() override { stop_requested_.store(true); }
  void SetPeers(std::vector<std::string> peers) override {
    absl::MutexLock lock(&peers_mu_);
    if (peers.size() != peers_.size()) return;
    peers_ = std::move(peers);
    if (transport_ != nullptr) transport_->SetPeers(peers_);
  }
  std::vector<LogField> EvaluatedFields() const override {
    return {Kv("ranks_averaged", ranks_averaged_)};
  }

 private:
  std::atomic<bool> stop_requested_{false};  // Ends AwaitGathered early.
  // The model's entries (parameters, then buffers) <-> the replica's flat vector.
  // (CopyIn puts the pinned elements' values back.)
  void CopyIn(absl::Span<const float> x);
  void CopyOut(float* x) const;
  // Pins every buffer element of `values` (the model's, flat) that is not finite: a causal
  // mask of -inf registered as a buffer cannot be mixed (-inf - -inf is NaN in a mixing
  // step, and the wire refuses non-finite values). The replica holds 0 there, the model its
  // own value, and the element is never changed by training or mixing.
  void PinNonFiniteBuffers(std::vector<float>* values);
  // Resumes from this rank's checkpoint if there is one: values, slots, weight; the step.
  absl::StatusOr<int64_t> Restore(std::vector<float>* values, double* weight);
  absl::Status WriteCheckpoint(ReplicaSnapshot snap, int64_t step);
  // FailedPrecondition when an exchange of the whole model (`numel` values in gossip.codec)
  // would exceed the peer service's message limit: every exchange would fail and the rank
  // would train alone.
  absl::Status CheckMessageSize(int64_t numel) const;
  // Creates and starts the Gossiper; before a first step (not a resume) it waits up to
  // gossip.start_wait_s for every peer (Gossiper::AwaitPeers).
  absl::Status StartGossiper(std::unique_ptr<Topology> topology, bool first_start);
  void LogStats(const ReplicaSnapshot& final) const;

  const TrainerOptions& options_;
  const JobSpec& spec_;
  const GossipSpec& gs_;
  GossipServiceImpl* const local_;
  ModelView* model_ = nullptr;
  int64_t numel_ = 0;        // Every entry: parameters, then buffers.
  int64_t param_numel_ = 0;  // The parameters' elements, first in the flat vector.
  int64_t total_ = 0;
  OptimizerSpec optimizer_spec_;
  std::unique_ptr<Optimizer> optimizer_;
  // num_slots * param_numel_ (buffers have none); only the training thread touches them.
  std::vector<float> slots_;
  std::vector<float*> slot_ptrs_;
  std::vector<float> grad_;
  std::string checkpoint_path_;
  std::shared_ptr<GossipReplica> replica_;
  bool registered_ = false;
  // The peers' current addresses (SetPeers, any thread) and the transport using them.
  absl::Mutex peers_mu_;
  std::vector<std::string> peers_ ABSL_GUARDED_BY(peers_mu_);
  std::unique_ptr<GossipTransport> transport_ ABSL_GUARDED_BY(peers_mu_);
  std::unique_ptr<Gossiper> gossiper_;
  double consensus_ = -1;
  size_t ranks_averaged_ = 0;
  struct Pinned {
    int64_t flat;     // Index in the replica's flat vector (which holds 0 there).
    float* in_model;  // The loop's element (its buffer mirror).
    float value;      // What the model holds there, for good.
  };
  std::vector<Pinned> pinned_;
};

GossipMode::~GossipMode() {
  if (gossiper_ != nullptr) gossiper_->Stop();
  if (registered_) local_->Unregister(spec_.name(), options_.rank);
}

void GossipMode::CopyIn(absl::Span<const float> x) {
  const float* src = x.data();
  for (absl::Span<float> p : model_->params) {
    std::memcpy(p.data(), src, p.size() * sizeof(float));
    src += p.size();
  }
  for (const Pinned& p : pinned_) *p.in_model = p.value;
}

void GossipMode::PinNonFiniteBuffers(std::vector<float>* values) {
  int64_t flat = 0;
  for (absl::Span<float> p : model_->params) {
    for (size_t j = 0; j < p.size(); ++j, ++flat) {
      if (flat < param_numel_ || std::isfinite((*values)[flat])) continue;
      pinned_.push_back(Pinned{flat, &p[j], (*values)[flat]});
      (*values)[flat] = 0.0f;
    }
  }
  if (!pinned_.empty()) {
    LogInfo(
        options_.logger, "gossip_pinned",
        {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("elements", pinned_.size()),
         Kv("why", "non-finite buffer elements (a -inf mask) are kept as they are, not mixed")});
  }
}

void GossipMode::CopyOut(float* x) const {
  for (absl::Span<float> p : model_->params) {
    std::memcpy(x, p.data(), p.size() * sizeof(float));
    x += p.size();
  }
}

absl::StatusOr<int64_t> GossipMode::Restore(std::vector<float>* values, double* weight) {
  if (spec_.checkpoint().every_steps() <= 0) return 0;
  const int32_t rank = options_.rank, n = spec_.num_workers();
  const int num_slots = optimizer_->num_slots();
  absl::StatusOr<GossipCheckpoint> c = ReadGossipCheckpoint(checkpoint_path_);
  if (!c.ok()) {
    if (c.status().code() == absl::StatusCode::kNotFound) return 0;
    return c.status();
  }
  const int64_t buffer_numel = numel_ - param_numel_;
  if (static_cast<int64_t>(c->values.size()) != numel_ || c->buffer_values != buffer_numel ||
      c->num_slots != num_slots || c->rank != rank || c->num_workers != n) {
    return absl::FailedPreconditionError(
        absl::StrCat("gossip: checkpoint ", checkpoint_path_, " holds rank ", c->rank, " of ",
                     c->num_workers, " with ", c->values.size(), " values (", c->buffer_values,
                     " of buffers) and ", c->num_slots, " optimizer slots; this is rank ", rank,
                     " of ", n, " with ", numel_, " (", buffer_numel, ") and ", num_slots));
  }
  *values = std::move(c->values);
  std::copy(c->slots.begin(), c->slots.end(), slots_.begin());
  *weight = c->weight;
  const int64_t step = std::min(c->step, total_);
  LogInfo(options_.logger, "resuming",
          {Kv("job", spec_.name()), Kv("rank", rank), Kv("step", step),
           Kv("weight", absl::StrFormat("%.6g", *weight)), Kv("checkpoint", checkpoint_path_)});
  return step;
}

absl::Status GossipMode::StartGossiper(std::unique_ptr<Topology> topology, bool first_start) {
  GossipTransport* transport;  // Lives as long as this mode; the Gossiper holds it.
  {
    absl::MutexLock lock(&peers_mu_);
    transport_ =
        NewGrpcGossipTransport(peers_, options_.peer_rpc, options_.job_token, options_.rank_token);
    transport = transport_.get();
  }
  GossiperOptions go;
  go.codec = gs_.codec();
  go.timeout = absl::Seconds(gs_.timeout_s());
  go.dead_after = std::max(3 * go.timeout, absl::Seconds(5));
  go.max_wait = options_.wait_for_workers;
  go.cancel = &stop_requested_;
  go.logger = options_.logger;
  ASSIGN_OR_RETURN(gossiper_, Gossiper::Create(go, replica_, std::move(topology), transport));
  // Ranks started seconds apart (process start, data loading, a busy machine) would otherwise
  // train apart: the first would mix with nobody, the last with finished peers.
  if (first_start) gossiper_->AwaitPeers(absl::Seconds(gs_.start_wait_s()));
  gossiper_->Start();
  return absl::OkStatus();
}

absl::Status GossipMode::CheckMessageSize(int64_t numel) const {
  ASSIGN_OR_RETURN(const ValueCodec codec, ValueCodec::Create(gs_.codec()));
  const int64_t encoded = static_cast<int64_t>(codec.EncodedSize(static_cast<size_t>(numel)));
  // Room for the request's other fields (job, ranks, weight, ids).
  constexpr int64_t kSlack = 64 << 10;
  const int64_t limit = options_.peer_rpc.max_message_bytes;
  if (encoded + kSlack > limit) {
    return absl::FailedPreconditionError(absl::StrCat(
        "gossip: every exchange carries the whole model, ", encoded, " bytes as ",
        codec.name().empty() ? "float32" : codec.name(), ", which exceeds the ", limit,
        "-byte message limit less 64 KiB for the rest of the request: raise --max_message_mb "
        "on every rank",
        codec.lossless() ? " or set gossip.codec: bf16 (half the bytes)" : "",
        ", or train this model in mode allreduce or a ps mode (they send it in pieces)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> GossipMode::Start(ModelView* model, const LoopInfo& info) {
  model_ = model;
  numel_ = model->numel();
  for (int i = 0; i < model->num_params; ++i) param_numel_ += model->params[i].size();
  total_ = info.total_steps;
  optimizer_spec_ =
      WithDecayUpdates(ScaledOptimizer(spec_, spec_.num_workers()), total_);  // One per local step.
  RETURN_IF_ERROR(ValidateLrSchedule(optimizer_spec_));
  ASSIGN_OR_RETURN(optimizer_, OptimizerRegistry::WithBuiltins().Create(optimizer_spec_));
  const int num_slots = optimizer_->num_slots();
  slots_.assign(static_cast<size_t>(num_slots) * param_numel_, 0.0f);
  for (int s = 0; s < num_slots; ++s) slot_ptrs_.push_back(slots_.data() + s * param_numel_);
  grad_.resize(numel_);
  ASSIGN_OR_RETURN(checkpoint_path_,
                   RankCheckpointPath(spec_.checkpoint().dir().empty() ? options_.checkpoint_dir
                                                                       : spec_.checkpoint().dir(),
                                      spec_.name(), options_.rank));

  std::vector<float> values(numel_);
  CopyOut(values.data());
  PinNonFiniteBuffers(&values);
  RETURN_IF_ERROR(CheckMessageSize(numel_));
  double weight = 1.0;
  ASSIGN_OR_RETURN(const int64_t first_step, Restore(&values, &weight));

  GossipReplica::Options ro;
  ro.job = spec_.name();
  ro.rank = options_.rank;
  ro.num_workers = spec_.num_workers();
  ro.total_steps = total_;
  ro.root = 0;
  ASSIGN_OR_RETURN(std::unique_ptr<Topology> topology,
                   TopologyRegistry::WithBuiltins().Create(gs_.topology(), spec_.seed()));
  ro.in_neighbours = InNeighbours(*topology, options_.rank, spec_.num_workers());
  replica_ = std::make_shared<GossipReplica>(ro, std::move(values), weight, first_step);
  RETURN_IF_ERROR(local_->Register(replica_, options_.job_token, options_.rank_token_hashes));
  registered_ = true;
  RETURN_IF_ERROR(StartGossiper(std::move(topology), first_step == 0));
  return first_step;
}

std::vector<LogField> GossipMode::StartFields() const {
  return {Kv("topology", gs_.topology()), Kv("every_steps", gs_.every_steps()),
          Kv("codec", gs_.codec().empty() ? "float32" : gs_.codec())};
}

absl::Status GossipMode::BeforeForward(int64_t step) {
  // The latest mixed values, copied under the replica's lock (never torn).
  replica_->Update([this](absl::Span<float> x) { CopyIn(x); });
  return absl::OkStatus();
}

absl::StatusOr<StepOutcome> GossipMode::Exchange(int64_t step,
                                                 absl::Span<const absl::Span<const float>> grads,
                                                 double loss, const StepTiming& timing) {
  float* g = grad_.data();
  for (absl::Span<const float> p : grads) {
    std::memcpy(g, p.data(), p.size() * sizeof(float));
    g += p.size();
  }
  for (const Pinned& p : pinned_) grad_[p.flat] = 0.0f;
  // The local step, on the shared values (which may have been mixed since the forward pass:
  // AD-PSGD applies the gradient to the current model): the optimizer on the parameters, the
  // forward's deltas added to the buffers (local_step.h), scaled by 1 / w for push-sum
  // (GossipReplica::ApplyStep).
  const float lr_scale = LrScheduleFactor(optimizer_spec_, step);
  replica_->ApplyStep([&](absl::Span<float> xs) {
    ApplyLocalStep(*optimizer_, step + 1, lr_scale, grad_, param_numel_, slot_ptrs_.data(), xs);
  });
  EndStep(step);
  StepOutcome out;
  out.loss = loss;
  return out;
}

void GossipMode::EndStep(int64_t step) {
  replica_->set_step(step + 1);
  if ((step + 1) % gs_.every_steps() == 0) {
    gossiper_->RequestRound((step + 1) / gs_.every_steps(), step + 1);
  }
}

absl::Status GossipMode::WriteCheckpoint(ReplicaSnapshot snap, int64_t step) {
  GossipCheckpoint c;
  c.rank = options_.rank;
  c.num_workers = spec_.num_workers();
  c.step = step;
  c.weight = snap.weight;
  c.values = std::move(snap.values);
  c.buffer_values = numel_ - param_numel_;
  c.num_slots = optimizer_->num_slots();
  c.slots = slots_;
  RETURN_IF_ERROR(WriteGossipCheckpoint(checkpoint_path_, c));
  LogInfo(options_.logger, "checkpoint",
          {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("step", step),
           Kv("path", checkpoint_path_)});
  return absl::OkStatus();
}

absl::StatusOr<bool> GossipMode::MaybeCheckpoint(int64_t steps_done) {
  const int64_t every = spec_.checkpoint().every_steps();
  if (every <= 0 || steps_done % every != 0) return false;
  RETURN_IF_ERROR(WriteCheckpoint(replica_->Snapshot(), steps_done));
  return true;
}

std::vector<LogField> GossipMode::ProgressFields(int64_t done, int64_t window) {
  const double consensus = EstimateConsensus(replica_->TakeConsensus(), spec_.num_workers());
  if (consensus >= 0) consensus_ = consensus;
  const GossiperStats gst = gossiper_->stats();
  return {Kv("consensus", absl::StrFormat("%.5g", consensus)),
          Kv("weight", absl::StrFormat("%.4g", replica_->State().weight)), Kv("mixed", gst.mixed),
          Kv("failed", gst.failed), Kv("coalesced", gst.coalesced)};
}

void GossipMode::LogStats(const ReplicaSnapshot& final) const {
  const GossiperStats gst = gossiper_->stats();
  LogInfo(options_.logger, "gossip_stats",
          {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("rounds", gst.rounds),
           Kv("mixed", gst.mixed), Kv("failed", gst.failed), Kv("no_peer", gst.no_peer),
           Kv("kept", gst.kept), Kv("coalesced", gst.coalesced), Kv("resent", gst.resent),
           Kv("resent_duplicate", gst.resent_duplicate), Kv("unresolved_shares", gst.pending),
           Kv("bytes_sent", gst.bytes_sent), Kv("busy_s", absl::StrFormat("%.2f", gst.busy_s)),
           Kv("weight", absl::StrFormat("%.6g", final.weight))});
}

absl::StatusOr<bool> GossipMode::Finish(int64_t step, TrainResult* result) {
  result->consensus_distance = consensus_;
  // No more mixing in or out: a finished rank hands its final to rank 0; a stopped one keeps
  // its state for a resume (refusing exchanges with ABORTED, so peers retry it later).
  const absl::Time final_start = absl::Now();
  gossiper_->Stop();
  gossiper_->SettlePending();  // Shares whose reply was lost: absorbed or taken back.
  const ReplicaSnapshot final = result->stopped_early ? replica_->Stop() : replica_->Finish();
  const GossiperStats gst = gossiper_->stats();
  result->bytes_pushed = gst.bytes_sent;
  result->bytes_pulled = gst.bytes_received;
  result->raw_bytes_pushed = gst.raw_bytes_sent;
  result->raw_bytes_pulled = gst.raw_bytes_received;
  LogStats(final);
  if (result->stopped_early) {
    if (spec_.checkpoint().every_steps() > 0) RETURN_IF_ERROR(WriteCheckpoint(final, step));
    return false;
  }
  std::set<int32_t> gone;  // Lower ranks this one gave up delivering its final to.
  for (int32_t to = 0; to < options_.rank; ++to) {
    // To rank 0, the root; if it is gone, to the lowest rank that gathers in its place (it
    // may still be trying the ranks below it: its refusal is retried); if every lower rank is
    // gone, this rank gathers (a lost rank 0 left the survivors without a model, the job
    // without an end).
    absl::Status st = gossiper_->DeliverFinal(final, to, /*until_root=*/to > 0);
    if (st.ok()) {
      gossiper_->AwaitGathered(to);
      result->comm_s += SecondsSince(final_start);
      return false;
    }
    LogWarning(options_.logger, "final_not_delivered",
               {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("to", to),
                Kv("error", st.ToString())});
    if (st.code() != absl::StatusCode::kUnavailable || stop_requested_.load()) {
      result->comm_s += SecondsSince(final_start);
      return false;  // Refused for another reason, or stopping: no fallback.
    }
    gone.insert(to);
  }
  if (options_.rank != 0) {
    replica_->BecomeRoot();
    LogWarning(
        options_.logger, "final_root_fallback",
        {Kv("job", spec_.name()), Kv("rank", options_.rank), Kv("gone", absl::StrJoin(gone, ","))});
  }
  FinalAverage avg = gossiper_->GatherFinal(gone);
  result->comm_s += SecondsSince(final_start);
  result->consensus_distance = avg.consensus;
  ranks_averaged_ = avg.ranks.size();
  CopyIn(avg.values);
  return options_.evaluate || options_.rank != 0;  // A fallback root evaluates and publishes.
}

}  // namespace

absl::StatusOr<std::unique_ptr<TrainingMode>> NewGossipMode(const TrainerOptions& options,
                                                            GossipServiceImpl* local) {
  const JobSpec& spec = options.spec;
  const int32_t n = spec.num_workers();
  if (local == nullptr) return absl::InvalidArgumentError("gossip: no local GossipService");
  if (options.rank < 0 || options.rank >= n || static_cast<int32_t>(options.peers.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("gossip: rank ", options.rank, " of ", n,
                                                   " workers with ", options.peers.size(),
                                                   " peer addresses"));
  }
  if (!(spec.gossip().timeout_s() > 0) || spec.gossip().every_steps() <= 0) {
    return absl::InvalidArgumentError(
        "gossip: gossip.timeout_s and gossip.every_steps must be > 0 (defaults not applied?)");
  }
  return std::unique_ptr<TrainingMode>(new GossipMode(options, local));
}

}  // namespace gradmesh
