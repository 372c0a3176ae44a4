// gRPC GossipTransport (see grpc_transport.h).
#include "worker/gossip/grpc_transport.h"

#include <grpcpp/client_context.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "proto/gossip.grpc.pb.h"
#include "rpc/grpc_status.h"
#include "worker/core/peer_token.h"
#include "worker/gossip/wire.h"

namespace gradmesh {
namespace {

class GrpcGossipTransport final : public GossipTransport {
 public:
  GrpcGossipTransport(const std::vector<std::string>& peers, const RpcOptions& rpc,
                      std::string job_token, std::string rank_token)
      : rpc_(rpc), job_token_(std::move(job_token)), rank_token_(std::move(rank_token)) {
    absl::MutexLock lock(&mu_);
    for (const std::string& address : peers) peers_.push_back(Connect(address));
  }

  absl::StatusOr<ExchangeReply> Exchange(int32_t peer, const ExchangeHeader& header,
                                         absl::string_view payload,
                                         absl::Duration timeout) override {
    ASSIGN_OR_RETURN(const Peer p, Get(peer));
    GossipExchangeRequest request;
    HeaderToProto(header, payload, &request);
    GossipExchangeResponse response;
    const absl::Time deadline = absl::Now() + timeout;
    // Only a call on a connected channel can reach the peer: when there is no connection
    // (the peer is down, or has no address: fail at once; or not connected yet: wait for it
    // up to the deadline) say that nothing was sent, so the caller knows the peer cannot have
    // applied it.
    if (p.channel == nullptr) return NotSent(peer, p, "no address (its rank has no node)");
    grpc_connectivity_state state = p.channel->GetState(/*try_to_connect=*/true);
    if (state != GRPC_CHANNEL_READY &&
        (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN ||
         !p.channel->WaitForConnected(absl::ToChronoTime(deadline)))) {
      return NotSent(peer, p, "not connected");
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    AddToken(&ctx);
    grpc::Status st = p.stub->Exchange(&ctx, request, &response);
    if (!st.ok()) return Annotate(FromGrpcStatus(st), Where(peer, p));
    return ReplyFromProto(&response);
  }

  absl::StatusOr<ReplicaState> GetState(int32_t peer, const std::string& job,
                                        absl::Duration timeout, int32_t from) override {
    ASSIGN_OR_RETURN(const Peer p, Get(peer));
    if (p.channel == nullptr) return NotSent(peer, p, "no address (its rank has no node)");
    GossipStateRequest request;
    request.set_job(job);
    request.set_rank(peer);
    if (from >= 0) request.set_from_rank(from);
    GossipStateResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    AddToken(&ctx);
    grpc::Status st = p.stub->GetState(&ctx, request, &response);
    if (!st.ok()) return Annotate(FromGrpcStatus(st), Where(peer, p));
    return ReplicaState{response.step(), response.total_steps(), response.finished(),
                        response.weight(), response.gathered()};
  }

  void SetPeers(const std::vector<std::string>& peers) override {
    absl::MutexLock lock(&mu_);
    if (peers.size() != peers_.size()) return;  // Another job's shape: not ours to take.
    for (size_t i = 0; i < peers.size(); ++i) {
      if (peers[i] != peers_[i].address) peers_[i] = Connect(peers[i]);
    }
  }

 private:
  // A peer's address and its channel (calls in flight keep the old one alive while it is
  // replaced); no channel for an empty address: a rank without a node.
  struct Peer {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::shared_ptr<GossipService::Stub> stub;
  };
  Peer Connect(const std::string& address) const {
    Peer p{address, nullptr, nullptr};
    if (address.empty()) return p;
    p.channel = MakeChannel(address, rpc_);
    p.stub = GossipService::NewStub(p.channel);
    return p;
  }
  absl::StatusOr<Peer> Get(int32_t peer) const {
    absl::MutexLock lock(&mu_);
    if (peer < 0 || peer >= static_cast<int32_t>(peers_.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("gossip: no peer ", peer, " (", peers_.size(), " known)"));
    }
    return peers_[peer];
  }
  static absl::Status NotSent(int32_t peer, const Peer& p, absl::string_view why) {
    absl::Status st =
        absl::UnavailableError(absl::StrCat(Where(peer, p), ": ", why, " (nothing was sent)"));
    st.SetPayload(kGossipNotSentPayload, absl::Cord("1"));
    return st;
  }
  void AddToken(grpc::ClientContext* ctx) const {
    if (!job_token_.empty()) ctx->AddMetadata(kJobTokenMetadata, job_token_);
    if (!rank_token_.empty()) ctx->AddMetadata(kRankTokenMetadata, rank_token_);
  }
  static std::string Where(int32_t peer, const Peer& p) {
    return absl::StrCat("gossip peer ", peer, " (", p.address.empty() ? "-" : p.address, ")");
  }

  const RpcOptions rpc_;
  const std::string job_token_;
  const std::string rank_token_;  // This rank's (coordinator-placed jobs); empty: none.
  mutable absl::Mutex mu_;
  std::vector<Peer> peers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<GossipTransport> NewGrpcGossipTransport(std::vector<std::string> peers,
                                                        const RpcOptions& rpc,
                                                        std::string job_token,
                                                        std::string rank_token) {
  return std::make_unique<GrpcGossipTransport>(peers, rpc, std::move(job_token),
                                               std::move(rank_token));
}

}  // namespace gradmesh
