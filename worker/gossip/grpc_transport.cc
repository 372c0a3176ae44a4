// gRPC GossipTransport (see grpc_transport.h).
#include "worker/gossip/grpc_transport.h"

#include <grpcpp/client_context.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
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
  GrpcGossipTransport(std::vector<std::string> peers, const RpcOptions& rpc, std::string job_token,
                      std::string rank_token)
      : peers_(std::move(peers)),
        job_token_(std::move(job_token)),
        rank_token_(std::move(rank_token)) {
    for (const std::string& address : peers_) {
      channels_.push_back(MakeChannel(address, rpc));
      stubs_.push_back(GossipService::NewStub(channels_.back()));
    }
  }

  absl::StatusOr<ExchangeReply> Exchange(int32_t peer, const ExchangeHeader& header,
                                         absl::string_view payload,
                                         absl::Duration timeout) override {
    RETURN_IF_ERROR(CheckPeer(peer));
    GossipExchangeRequest request;
    HeaderToProto(header, payload, &request);
    GossipExchangeResponse response;
    const absl::Time deadline = absl::Now() + timeout;
    // Only a call on a connected channel can reach the peer: when there is no connection
    // (the peer is down: fail at once; or not connected yet: wait for it up to the deadline)
    // say that nothing was sent, so the caller knows the peer cannot have applied it.
    grpc_connectivity_state state = channels_[peer]->GetState(/*try_to_connect=*/true);
    if (state != GRPC_CHANNEL_READY &&
        (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN ||
         !channels_[peer]->WaitForConnected(absl::ToChronoTime(deadline)))) {
      absl::Status st =
          absl::UnavailableError(absl::StrCat(Where(peer), ": not connected (nothing was sent)"));
      st.SetPayload(kGossipNotSentPayload, absl::Cord("1"));
      return st;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    AddToken(&ctx);
    grpc::Status st = stubs_[peer]->Exchange(&ctx, request, &response);
    if (!st.ok()) return Annotate(FromGrpcStatus(st), Where(peer));
    return ReplyFromProto(&response);
  }

  absl::StatusOr<ReplicaState> GetState(int32_t peer, const std::string& job,
                                        absl::Duration timeout, int32_t from) override {
    RETURN_IF_ERROR(CheckPeer(peer));
    GossipStateRequest request;
    request.set_job(job);
    request.set_rank(peer);
    if (from >= 0) request.set_from_rank(from);
    GossipStateResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    AddToken(&ctx);
    grpc::Status st = stubs_[peer]->GetState(&ctx, request, &response);
    if (!st.ok()) return Annotate(FromGrpcStatus(st), Where(peer));
    return ReplicaState{response.step(), response.total_steps(), response.finished(),
                        response.weight(), response.gathered()};
  }

 private:
  void AddToken(grpc::ClientContext* ctx) const {
    if (!job_token_.empty()) ctx->AddMetadata(kJobTokenMetadata, job_token_);
    if (!rank_token_.empty()) ctx->AddMetadata(kRankTokenMetadata, rank_token_);
  }
  absl::Status CheckPeer(int32_t peer) const {
    if (peer < 0 || peer >= static_cast<int32_t>(stubs_.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("gossip: no peer ", peer, " (", stubs_.size(), " known)"));
    }
    return absl::OkStatus();
  }
  std::string Where(int32_t peer) const {
    return absl::StrCat("gossip peer ", peer, " (", peers_[peer], ")");
  }

  const std::vector<std::string> peers_;
  const std::string job_token_;
  const std::string rank_token_;  // This rank's (coordinator-placed jobs); empty: none.
  // Constant after construction.
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<GossipService::Stub>> stubs_;
};

}  // namespace

std::unique_ptr<GossipTransport> NewGrpcGossipTransport(std::vector<std::string> peers,
                                                        const RpcOptions& rpc,
                                                        std::string job_token,
                                                        std::string rank_token) {
  return std::make_unique<GrpcGossipTransport>(std::move(peers), rpc, std::move(job_token),
                                               std::move(rank_token));
}

}  // namespace gradmesh
