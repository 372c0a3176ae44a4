// GossipReplica: one rank's copy of the model in a gossip job, shared between its training
// thread, its Gossiper (outgoing exchanges) and its GossipService (incoming exchanges), with
// the mixing math of both topologies. Knows nothing of gRPC or LibTorch.
//
// State: x, the flat parameter vector (every tensor of the model concatenated), and w, the
// push-sum weight (double; 1 at the start). The model the rank trains and evaluates is x; the
// push-sum "mass" is w * x. Storing the de-biased x (not the mass) keeps the local optimizer
// working on the model itself, and makes halving the mass a change of w alone; a local step
// (ApplyStep) moves x by step / w, so that the mass moves by the whole step.
//
// Push-sum (SGP, topology "exponential"), sender i, receiver j:
//   sender    BeginPushSum: w_i /= 2 (x_i unchanged; the half (x_i, w_i/2) travels)
//   receiver  x_j = (w_j x_j + w_s x_s) / (w_j + w_s);  w_j += w_s     (one critical section)
//   sender    delivered: done; not delivered (error, timeout, peer finished): the half comes
//             back as a share would, x_i = (w_i x_i + w_s x_s) / (w_i + w_s); w_i += w_s.
//   A timeout or broken connection leaves the outcome unknown (the receiver may have absorbed
//   the share and lost only the reply), so the sender sends the same share again, with the
//   same exchange id: a receiver that already absorbed it answers "duplicate" and changes
//   nothing. If that is unknown too, the share stays pending at the sender (weight out)
//   until a later resend is answered: absorbed (done) or refused (weight taken back; the
//   duplicate check comes before any refusal, so a refusal proves it was never absorbed).
//   A share is thus counted at most once (gossiper.h).
//   Total weight sum_i w_i and total mass sum_i w_i x_i are conserved by every exchange, so
//   x_i converges to sum(mass) / sum(w), the average of the initial values, for fixed inputs.
//   Weight floor: a rank whose weight is below min_weight keeps its whole mass for the round
//   (an identity column is still a valid push-sum step). Asynchronous rounds can otherwise
//   starve a rank whose in-peers skip it for a while (e.g. while it starts up): it would keep
//   halving its weight to ~0, and its local steps would stop counting. With the floor at 0.5
//   weights stay >= 0.25, and since they sum to n someone is always above it and sends.
// Pairwise averaging (AD-PSGD, topology "random"), caller i, callee j:
//   callee    returns its values p = x_j and sets x_j = (x_j + s) / 2   (one critical section)
//   caller    x_i += (p - s) / 2, where s is the snapshot it sent.
//   Both end at (s + p) / 2 plus whatever local steps each took meanwhile: training continues
//   while an exchange is in flight and its progress is not overwritten. Weights stay 1.
// Lossy codecs (fp16, bf16): whoever sends values v that arrive as d = decode(encode(v))
// adds the rounding back to itself ((w_s / w_i)(v - d) for push-sum, (v - d) / 2 for
// pairwise), so both rules conserve total mass exactly, up to float32 arithmetic.
// Final round: after its last step a rank calls Finish() (later push-sum or pairwise requests
// are refused with FAILED_PRECONDITION, so no mass is absorbed by a rank that stopped mixing)
// and hands (x, w) to rank 0, the gather root, whose replica keeps one final per rank; rank 0
// evaluates sum w_r x_r / sum w_r over the finals it got (FinalAverage). A rank stopping
// early calls Stop() instead: refusals are then ABORTED (retry later), and no final is sent.
//
// Consensus estimate: every mixing records ||x_i - x_j||^2 of the two vectors being mixed (the
// receiver's before the exchange and the sender's as sent). For two distinct ranks drawn
// uniformly, E||x_i - x_j||^2 = 2n/(n-1) * (1/n) sum_i ||x_i - mean||^2, so
//   consensus ~= sqrt((n-1)/(2n) * mean of the recorded squared distances)
// is an unbiased estimate (of the squared distance) for "random"; for "exponential" the pairs
// are the graph's edges, not uniform, so it is an approximation. The exact value over the
// final models is computed by rank 0 in the final round (FinalAverage::consensus).
//
// Thread safety: every public method may be called from any thread; each takes the replica's
// mutex for the whole read-modify-write of x and w, so no reader ever sees a torn vector.
// Calls never block on anything but that mutex (no I/O under it).
#ifndef GRADMESH_WORKER_GOSSIP_REPLICA_H_
#define GRADMESH_WORKER_GOSSIP_REPLICA_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "worker/gossip/exchange.h"

namespace gradmesh {

// One rank's values and weight (a final contribution, or a snapshot for a checkpoint).
struct ReplicaSnapshot {
  std::vector<float> values;
  double weight = 1;
  int64_t step = 0;
};

// Sum of squared distances between mixed vectors and how many there were (see above).
struct ConsensusSample {
  double sum_sq = 0;
  int64_t count = 0;
};

// sqrt((n-1)/(2n) * sum_sq / count); -1 when count == 0; 0 when n < 2.
double EstimateConsensus(const ConsensusSample& sample, int32_t num_workers);

// The result of the final round at rank 0.
struct FinalAverage {
  std::vector<float> values;   // sum_r w_r x_r / sum_r w_r over `ranks`.
  double weight_sum = 0;       // sum_r w_r.
  std::vector<int32_t> ranks;  // Ranks whose finals were averaged, ascending.
  // Exact consensus distance of the finals: sqrt(mean_r ||x_r - values||^2).
  double consensus = 0;
};

// Weighted average of `finals` (rank -> final). Empty `finals` gives empty values.
FinalAverage AverageFinals(const std::map<int32_t, ReplicaSnapshot>& finals);

class GossipReplica {
 public:
  struct Options {
    std::string job;
    int32_t rank = 0;  // In [0, num_workers).
    int32_t num_workers = 1;
    int64_t total_steps = 0;  // Reported by GetState.
    int32_t root = 0;         // The rank that gathers finals.
    // The ranks allowed to send push-sum / pairwise exchanges here (the topology's
    // in-neighbours, topology.h InNeighbours): in_neighbours[r] false means rank r's
    // exchanges are refused with PERMISSION_DENIED before anything changes. Empty: any rank.
    // Finals (to the root) are accepted from any rank.
    std::vector<bool> in_neighbours;
  };

  // `values`: initial x; `weight` > 0: initial push-sum weight; `step`: steps already done.
  GossipReplica(Options options, std::vector<float> values, double weight = 1.0, int64_t step = 0);

  GossipReplica(const GossipReplica&) = delete;
  GossipReplica& operator=(const GossipReplica&) = delete;

  const Options& options() const { return options_; }
  int64_t numel() const { return numel_; }

  // ---- Training thread.
  // Copies x into `out` (size numel()).
  void Read(absl::Span<float> out) const;
  // Runs fn(x) under the mutex (e.g. copying x into the model); fn must not call the replica.
  void Update(const std::function<void(absl::Span<float> x)>& fn);
  // A local step: fn changes x as the optimizer changes a model (and adds the buffers'
  // deltas), under the mutex; the change is then divided by w, so that the push-sum mass
  // w x moves by the whole step, as SGP applies the step to the numerator. Applied to x
  // as it stands, a step taken while the rank holds weight w counted w-fold in the final
  // average sum w_r x_r / sum w_r: progress made at low weight (a rank whose share is in
  // flight, a straggler) was partly lost. Weights stay 1 in pairwise averaging, where
  // this is the plain step. fn must not call the replica.
  void ApplyStep(const std::function<void(absl::Span<float> x)>& fn);
  void set_step(int64_t step);
  // x, w and step, consistent with each other.
  ReplicaSnapshot Snapshot() const;
  ReplicaState State() const;

  // ---- Sender side (the Gossiper).
  // Push-sum: halves w, copies x into *values and returns the weight sent (the half). Returns
  // 0 and sends nothing when w < min_weight (see "Weight floor" above). FAILED_PRECONDITION
  // once finished.
  absl::StatusOr<double> BeginPushSum(std::vector<float>* values, double min_weight = 0);
  // Ends a BeginPushSum: if the share (`sent`, `weight_sent`) was not delivered, takes it back
  // as a receiver would absorb it: x = (w x + weight_sent sent) / (w + weight_sent), w +=
  // weight_sent. (Adding the weight alone would count the local steps taken while it was out,
  // which ApplyStep scaled by 1 / w, once more.)
  void EndPushSum(bool delivered, double weight_sent, absl::Span<const float> sent);
  // A lossy codec's share was absorbed as `decoded`, not `sent`: adds the missing mass back,
  // x += (weight_sent / w) (sent - decoded).
  void CompensateShare(absl::Span<const float> sent, absl::Span<const float> decoded,
                       double weight_sent);
  // x += scale * (a - b) (pairwise codec compensation; see above).
  void AddScaledDifference(absl::Span<const float> a, absl::Span<const float> b, float scale);
  // Pairwise caller, after the reply: x += (peer_before - sent) / 2. Records the distance.
  void ApplyAverageReply(absl::Span<const float> sent, absl::Span<const float> peer_before);

  // ---- Receiver side (the service calls Handle).
  // Validates and applies one incoming exchange (see proto/gossip.proto for the errors). Each
  // check happens before anything changes; DEADLINE_EXCEEDED if `deadline` has passed when
  // the request would be applied.
  absl::StatusOr<ExchangeReply> Handle(const ExchangeHeader& header, absl::string_view payload,
                                       absl::Time deadline);

  // ---- Final round.
  // Marks the replica finished (later push-sum / pairwise exchanges are refused) and returns
  // its final (x, w, step). The root also records it as its own final. Idempotent.
  ReplicaSnapshot Finish();
  // A rank stopping before its last step (to be resumed from a checkpoint): like Finish, later
  // push-sum / pairwise exchanges are refused, but with ABORTED (senders retry later, so the
  // resumed rank is included again), and nothing is recorded as a final. Returns (x, w, step)
  // for the checkpoint: every share absorbed before the call is in it.
  ReplicaSnapshot Stop();
  // The rank that gathers finals: options().root, or this rank once BecomeRoot ran.
  int32_t root() const;
  // A rank whose every lower rank is gone (gave up delivering its final to each) gathers the
  // finals itself: from now on finals are accepted here, and (once finished) its own final
  // is recorded as one of them. Idempotent.
  void BecomeRoot();
  // Root: the finals received so far (including its own after Finish), by rank.
  std::map<int32_t, ReplicaSnapshot> Finals() const;
  // Root: every final is in (or given up); reported by State().gathered.
  void MarkGathered();
  // State() for a peer's GetState: once gathered, also counts the answer. A lingering peer
  // stops asking at its first answer that says gathered, so the count is the peers that know.
  // `from`: the caller's rank if it said (recorded for Callers()).
  ReplicaState StateForPeer(std::optional<int32_t> from = std::nullopt);
  // The ranks that have asked for this rank's state (the start rendezvous counts them as up).
  std::set<int32_t> Callers() const;
  // Root: waits until `peers` GetState answers said gathered, or `timeout`; true if they did.
  // Keeps the root (and its peer service) up until the lingering peers have seen it gather:
  // a root that evaluates and exits quickly would otherwise leave them polling a dead address.
  bool AwaitGatheredSeen(int64_t peers, absl::Duration timeout);

  // Squared distances recorded since the last call; resets them.
  ConsensusSample TakeConsensus();

 private:
  // Receiver rules on decoded values `v` (the lock is taken inside).
  // Sets *duplicate (and changes nothing) when `id` is a share from `from` absorbed before:
  // same incarnation as the newest one absorbed and a sequence not above it.
  absl::Status AbsorbPushSum(int32_t from, absl::Span<const float> v, double weight, uint64_t id,
                             bool* duplicate);
  absl::Status AverageWith(int32_t from, absl::Span<const float> v, std::vector<float>* before);
  // FAILED_PRECONDITION (finished) or ABORTED (stopped) for an exchange from `from`.
  absl::Status Refusal(int32_t from) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AcceptFinal(int32_t from, std::vector<float> v, double weight, int64_t step);
  void RecordDistance(absl::Span<const float> a, absl::Span<const float> b)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const Options options_;
  const int64_t numel_;

  mutable absl::Mutex mu_;
  std::vector<float> x_ ABSL_GUARDED_BY(mu_);
  std::vector<float> before_step_ ABSL_GUARDED_BY(mu_);  // ApplyStep's copy of x.
  double w_ ABSL_GUARDED_BY(mu_);
  // The id of the newest push-sum share absorbed from each sender: a share of the same
  // incarnation (id >> 32) with a sequence (low 32 bits) not above it is a duplicate.
  std::map<int32_t, uint64_t> last_share_ ABSL_GUARDED_BY(mu_);
  int64_t step_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;      // Finish() was called.
  std::set<int32_t> callers_ ABSL_GUARDED_BY(mu_);  // StateForPeer's `from`s.
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;       // Finish() or Stop() was called.
  bool gathered_ ABSL_GUARDED_BY(mu_) = false;      // MarkGathered() was called.
  int64_t gathered_seen_ ABSL_GUARDED_BY(mu_) = 0;  // GetState answers that said gathered.
  std::map<int32_t, ReplicaSnapshot> finals_ ABSL_GUARDED_BY(mu_);  // Root only.
  int32_t root_ ABSL_GUARDED_BY(mu_);                               // See root().
  ConsensusSample consensus_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_REPLICA_H_
