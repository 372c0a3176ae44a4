// PeerHealth: which peers a rank may contact now. A peer that failed (unreachable, timed out,
// not running the job yet) is skipped until its backoff expires: initial after the first
// failure, doubling with every further consecutive failure up to max; one success resets it.
// So a dead peer costs one quick failed attempt per backoff period, and a peer that starts
// late or comes back is included again within `max` of being reachable. A failure that says
// "reachable, but not running the job yet" (grow = false: a rank still starting up) is retried
// after `initial` without growing the backoff, so slow starters are not shut out for long. A
// peer that said it has finished its steps is never contacted again.
//
// Time is passed in (no clock inside), so tests drive it exactly.
//
// Thread safety: not thread-safe; owned and used by one Gossiper thread.
#ifndef GRADMESH_WORKER_GOSSIP_PEER_HEALTH_H_
#define GRADMESH_WORKER_GOSSIP_PEER_HEALTH_H_

#include <cstdint>
#include <vector>

#include "absl/time/time.h"

namespace gradmesh {

class PeerHealth {
 public:
  // `n` peers (ranks); `initial` > 0, `max` >= initial.
  PeerHealth(int32_t n, absl::Duration initial, absl::Duration max);

  // Not finished and not backing off at `now`.
  bool Available(int32_t peer, absl::Time now) const;

  // Returns true when the peer had been failing (it is back).
  bool OnSuccess(int32_t peer);
  // Returns true on the first failure of a run of failures (it just went down). `grow`: false
  // retries after `initial` and leaves the backoff where it was.
  bool OnFailure(int32_t peer, absl::Time now, bool grow = true);
  void OnFinished(int32_t peer);

  int32_t consecutive_failures(int32_t peer) const { return peers_[peer].failures; }
  absl::Time retry_at(int32_t peer) const { return peers_[peer].retry_at; }
  bool finished(int32_t peer) const { return peers_[peer].finished; }

 private:
  struct Peer {
    int32_t failures = 0;   // Consecutive failures.
    int32_t doublings = 0;  // Growing failures among them, minus one.
    absl::Time retry_at = absl::InfinitePast();
    bool finished = false;
  };
  const absl::Duration initial_, max_;
  std::vector<Peer> peers_;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_PEER_HEALTH_H_
