// Gossiper: the outgoing half of a rank's gossip, run on a background thread so that training
// never waits for the network.
//
// Protocol (what one rank does; the receiver's side is GossipReplica::Handle):
//   * Every gossip.every_steps local steps the training thread calls RequestRound(t, step)
//     with t = step / every_steps and returns at once. The background thread runs the latest
//     requested round; rounds requested while one is in flight are coalesced (counted as
//     `coalesced`), so a slow network lowers the mixing rate instead of stalling training.
//   * A round asks the Topology for a peer among the available ones (PeerHealth), then does
//     one exchange with it: a push-sum share (exponential) or a pairwise average (random),
//     with values encoded by gossip.codec. The exchange waits at most gossip.timeout_s. A
//     push-sum share whose outcome is unknown (DEADLINE_EXCEEDED, UNAVAILABLE, CANCELLED,
//     UNKNOWN: the receiver may have absorbed it and lost only the reply) is sent once more
//     with the same exchange id, so the round then waits at most twice the timeout; the
//     receiver answers "duplicate" if it had it (see replica.h), and the share counts once.
//     A request the transport could not send at all (kGossipNotSentPayload: no connection)
//     was not applied, so that share's weight is simply taken back, with no resend.
//     If the resend's outcome is unknown too (or NOT_FOUND: the peer may have absorbed it and
//     left), the share becomes pending: its weight stays out, nothing new goes to that peer, and
//     the next round that picks the peer sends it again, until it is absorbed (done) or refused
//     (FAILED_PRECONDITION, ABORTED, INVALID_ARGUMENT: weight taken back; a refusal proves
//     it was never absorbed, since the receiver checks for a duplicate first). So a share is
//     counted at most once. When the rank finishes, SettlePending() resends every pending
//     share until its fate is known; one still unknown after dead_after (a peer dead for
//     good) is lost with its weight, as push-sum loses a dead peer's mass (stats().pending).
//     A pairwise average whose reply is lost is not retried: the callee has moved halfway
//     towards the caller, the caller stays (no weights, so nothing is counted twice).
//   * Failure (unreachable, timeout, NOT_FOUND because the peer has not started the job yet,
//     any error) puts the peer into backoff (peer_health.h; NOT_FOUND is retried after the
//     initial backoff without growing it) and nothing is mixed on this side (a push-sum
//     share's weight is taken back). FAILED_PRECONDITION means the peer finished: it is
//     never contacted again (ABORTED, from a peer stopping to resume later, is a failure).
//     Logged once per transition: event=gossip_peer_down, event=gossip_peer_up.
//   * Final round (after Stop()): every rank calls GossipReplica::Finish(); ranks other than
//     0 DeliverFinal() their (x, w) to rank 0, which GatherFinal()s until every rank has
//     delivered or is unreachable for dead_after (or max_wait passed) and averages them.
//     Ranks other than 0 then AwaitGathered() before they leave, still answering exchanges,
//     so that every pending share can be settled by its sender (the weights sum to n).
//
// Thread safety: RequestRound() and stats() may be called from any thread. Start(), Stop(),
// DeliverFinal() and GatherFinal() from one controlling thread; RunRound() only while the
// background thread is not running (tests).
#ifndef GRADMESH_WORKER_GOSSIP_GOSSIPER_H_
#define GRADMESH_WORKER_GOSSIP_GOSSIPER_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "worker/gossip/exchange.h"
#include "worker/gossip/peer_health.h"
#include "worker/gossip/replica.h"
#include "worker/gossip/topology.h"
#include "worker/gossip/value_codec.h"

namespace gradmesh {

struct GossiperOptions {
  std::string codec;  // ValueCodec name: "" (float32), "fp16", "bf16". Default "".
  // Bound on one exchange (gossip.timeout_s). Default 2 s.
  absl::Duration timeout = absl::Seconds(2);
  // Backoff of a failing peer: first, and largest (see peer_health.h). Defaults 250 ms, 4 s.
  absl::Duration backoff_initial = absl::Milliseconds(250);
  absl::Duration backoff_max = absl::Seconds(4);
  // Push-sum: a rank whose weight is below this keeps its mass for the round (replica.h,
  // "Weight floor"). Default 0.5 (weights start at 1).
  double min_send_weight = 0.5;
  // Final round: a rank unreachable for this long is given up. Default 10 s.
  absl::Duration dead_after = absl::Seconds(10);
  // Final round at the root: the longest wait for the finals of live ranks. Default 30 min.
  absl::Duration max_wait = absl::Minutes(30);
  const Logger* logger = nullptr;  // Not owned; may be null.
  // AwaitGathered returns once this is true (a stop was requested). Not owned; may be null.
  const std::atomic<bool>* cancel = nullptr;
};

// What one round did.
struct RoundResult {
  enum class Outcome {
    kNoPeer,        // No available peer (or the replica has finished): nothing sent.
    kKept,          // Push-sum weight below min_send_weight: kept the mass, nothing sent.
    kMixed,         // Exchange done and mixed.
    kFailed,        // Exchange failed: peer backing off, nothing mixed here.
    kPeerFinished,  // Peer refused because it finished: never contacted again.
  };
  Outcome outcome = Outcome::kNoPeer;
  int32_t peer = -1;
  absl::Status error;  // kFailed, kPeerFinished: the peer's answer.
};

struct GossiperStats {
  int64_t rounds = 0;              // Rounds run.
  int64_t coalesced = 0;           // Requested rounds dropped because a later one superseded them.
  int64_t mixed = 0;               // Exchanges that mixed.
  int64_t failed = 0;              // Exchanges that failed.
  int64_t no_peer = 0;             // Rounds without an available peer.
  int64_t kept = 0;                // Push-sum rounds skipped by the weight floor.
  int64_t resent = 0;              // Push-sum shares sent again after an unknown outcome ...
  int64_t resent_duplicate = 0;    // ... of which the receiver had absorbed the first copy.
  int64_t pending = 0;             // Shares whose fate is still unknown (their weight is out).
  int64_t pending_delivered = 0;   // Pending shares later found absorbed ...
  int64_t pending_returned = 0;    // ... or refused (weight taken back).
  int64_t bytes_sent = 0;          // Payload bytes sent (requests) ...
  int64_t bytes_received = 0;      // ... and received (pairwise replies).
  int64_t raw_bytes_sent = 0;      // The same as float32 ...
  int64_t raw_bytes_received = 0;  // ... both ways.
  double busy_s = 0;               // Seconds spent in rounds.
};

class Gossiper {
 public:
  // InvalidArgument for a bad codec. `transport` is not owned and must outlive the Gossiper.
  static absl::StatusOr<std::unique_ptr<Gossiper>> Create(GossiperOptions options,
                                                          std::shared_ptr<GossipReplica> replica,
                                                          std::unique_ptr<Topology> topology,
                                                          GossipTransport* transport);
  ~Gossiper();  // Stop()s.

  Gossiper(const Gossiper&) = delete;
  Gossiper& operator=(const Gossiper&) = delete;

  // One round now, on the calling thread.
  RoundResult RunRound(int64_t round, int64_t step);

  // Before the first step: asks every other rank's service for its state (every 50 ms, each
  // call bounded by the timeout) until each has answered once, or `bound` passes, or
  // options.cancel becomes true; logs event=gossip_peers_ready. Returns the ranks that never
  // answered (they join in when they come: rounds skip an unreachable peer).
  std::vector<int32_t> AwaitPeers(absl::Duration bound);

  // Starts the background thread.
  void Start();
  // Asks the background thread to run `round` (non-blocking; see the protocol above).
  void RequestRound(int64_t round, int64_t step);
  // Lets the round in flight finish (bounded by the timeout), drops pending ones and joins.
  // Idempotent.
  void Stop();

  GossiperStats stats() const;

  // After Stop(), before the replica's Finish()/Stop(): resends every pending share (same
  // exchange id, backoff 100 ms to 1 s) until the peer absorbs it (weight stays given) or
  // refuses it (weight taken back), or its outcome has stayed unknown for dead_after (lost,
  // logged as event=gossip_share_lost, still counted in stats().pending).
  void SettlePending();

  // Non-root: sends `final` to rank `to` (-1: the replica's root), retrying with backoff until
  // it is acknowledged or `to` has been unreachable for dead_after. OK when delivered (or
  // already there); UNAVAILABLE when given up; the receiver's error when it refused. With
  // `until_root` (a fallback root: a lower rank that has not given up on its own lower ranks
  // yet), its "finals go to rank R" refusal is retried too, up to max_wait.
  absl::Status DeliverFinal(const ReplicaSnapshot& final, int32_t to = -1, bool until_root = false);

  // Non-root, after DeliverFinal: keeps this rank (its replica still registered, refusing new
  // shares with FAILED_PRECONDITION and answering resends as duplicates) until the root
  // reports every final gathered, or its job is gone (NOT_FOUND), or it has been unreachable
  // for dead_after, or max_wait passes, or options.cancel becomes true. A peer whose share to this
  // rank is still pending settles it in its SettlePending before its own final, so it must find
  // this rank there: had this rank left, the peer could not tell an absorbed share from a lost one.
  void AwaitGathered(int32_t root = -1);  // -1: the replica's root.

  // Root (after Finish()): waits for every other rank's final until all have arrived, or the
  // missing ones have been unreachable (GetState fails) for dead_after, or max_wait passes;
  // then averages the finals received (AverageFinals). Ranks in `given_up` are not waited for
  // (a fallback root already gave up on its lower ranks).
  FinalAverage GatherFinal(const std::set<int32_t>& given_up = {});

 private:
  // Sends peer's pending share again; settles it if the answer says what became of it.
  RoundResult ResendPending(int32_t peer);

  Gossiper(GossiperOptions options, ValueCodec codec, std::shared_ptr<GossipReplica> replica,
           std::unique_ptr<Topology> topology, GossipTransport* transport);
  void Loop();
  RoundResult PushSum(int32_t peer, int64_t round, int64_t step);
  RoundResult Average(int32_t peer, int64_t round, int64_t step);
  // Records the outcome of an exchange with `peer` in health_ and logs transitions.
  RoundResult Settle(int32_t peer, const absl::Status& status, bool mixed);
  ExchangeHeader Header(int32_t peer, ExchangeKind kind, int64_t round, int64_t step) const;

  // Constant after construction.
  const GossiperOptions options_;
  const ValueCodec codec_;
  const std::shared_ptr<GossipReplica> replica_;
  const std::unique_ptr<Topology> topology_;
  GossipTransport* const transport_;
  const int32_t rank_, n_;

  // Used by whichever thread runs rounds (one at a time).
  PeerHealth health_;
  std::vector<float> sent_, sent_decoded_, peer_values_;
  std::string payload_;
  // Push-sum exchange ids: incarnation (random, non-zero) << 32 | sequence (1, 2, ...).
  uint32_t incarnation_ = 0;
  uint32_t share_seq_ = 0;
  // Shares whose fate is unknown, by peer (at most one each; see the file comment).
  struct PendingShare {
    ExchangeHeader header;
    std::string payload;
    double weight = 0;
    std::vector<float> sent;     // What it carried (taken back if refused).
    std::vector<float> decoded;  // Lossy codecs: as it arrives (the rounding to compensate).
  };
  std::map<int32_t, PendingShare> pending_;

  mutable absl::Mutex mu_;
  absl::CondVar wake_;
  bool has_pending_ ABSL_GUARDED_BY(mu_) = false;
  int64_t pending_round_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t pending_step_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  GossiperStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // Started by Start(), joined by Stop().
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_GOSSIPER_H_
