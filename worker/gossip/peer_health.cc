// PeerHealth (see peer_health.h).
#include "worker/gossip/peer_health.h"

#include <algorithm>

namespace gradmesh {

PeerHealth::PeerHealth(int32_t n, absl::Duration initial, absl::Duration max)
    : initial_(initial), max_(std::max(initial, max)), peers_(n) {}

bool PeerHealth::Available(int32_t peer, absl::Time now) const {
  const Peer& p = peers_[peer];
  return !p.finished && now >= p.retry_at;
}

bool PeerHealth::OnSuccess(int32_t peer) {
  Peer& p = peers_[peer];
  const bool was_down = p.failures > 0;
  p.failures = 0;
  p.doublings = 0;
  p.retry_at = absl::InfinitePast();
  return was_down;
}

bool PeerHealth::OnFailure(int32_t peer, absl::Time now, bool grow) {
  Peer& p = peers_[peer];
  ++p.failures;
  absl::Duration backoff = initial_;
  if (grow) {
    for (int32_t i = 0; i < p.doublings && backoff < max_; ++i) backoff *= 2;
    ++p.doublings;
  }
  p.retry_at = now + std::min(backoff, max_);
  return p.failures == 1;
}

void PeerHealth::OnFinished(int32_t peer) { peers_[peer].finished = true; }

}  // namespace gradmesh
