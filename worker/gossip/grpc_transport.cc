// gRPC GossipTransport (see grpc_transport.h).
#include "worker/gossip/grpc_transport.h"

#include <grpcpp/client_context.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "proto/gossip.grpc.pb.h"
#include "worker/gossip/wire.h"

namespace gradmesh {
namespace {

class GrpcGossipTransport final : public GossipTransport {
 public:
  GrpcGossipTransport(std::vector<std::string> peers, const RpcOptions& rpc)
      : peers_(std::move(peers)) {
    for (const std::string& address : peers_) {
      stubs_.push_back(GossipService::NewStub(MakeChannel(address, rpc)));
    }
  }

  absl::StatusOr<ExchangeReply> Exchange(int32_t peer, const ExchangeHeader& header,
                                         absl::string_view payload,
                                         absl::Duration timeout) override {
    RETURN_IF_ERROR(CheckPeer(peer));
    GossipExchangeRequest request;
    HeaderToProto(header, payload, &request);
    GossipExchangeResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    grpc::Status st = stubs_[peer]->Exchange(&ctx, request, &response);
    if (!st.ok()) return Annotate(FromGrpcStatus(st), Where(peer));
    return ReplyFromProto(&response);
  }

  absl::StatusOr<ReplicaState> GetState(int32_t peer, const std::string& job,
                                        absl::Duration timeout) override {
    RETURN_IF_ERROR(CheckPeer(peer));
    GossipStateRequest request;
    request.set_job(job);
    request.set_rank(peer);
    GossipStateResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    grpc::Status st = stubs_[peer]->GetState(&ctx, request, &response);
    if (!st.ok()) return Annotate(FromGrpcStatus(st), Where(peer));
    return ReplicaState{response.step(), response.total_steps(), response.finished(),
                        response.weight()};
  }

 private:
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
  std::vector<std::unique_ptr<GossipService::Stub>> stubs_;  // Constant after construction.
};

}  // namespace

std::unique_ptr<GossipTransport> NewGrpcGossipTransport(std::vector<std::string> peers,
                                                        const RpcOptions& rpc) {
  return std::make_unique<GrpcGossipTransport>(std::move(peers), rpc);
}

}  // namespace gradmesh
