// GossipServiceImpl (see gossip_service.h).
#include "worker/gossip/gossip_service.h"

#include <chrono>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/job_name.h"
#include "common/status.h"
#include "rpc/grpc_status.h"
#include "worker/core/peer_token.h"
#include "worker/gossip/wire.h"

namespace gradmesh {

absl::Status GossipServiceImpl::Register(std::shared_ptr<GossipReplica> replica,
                                         std::string job_token,
                                         std::vector<std::string> rank_token_hashes) {
  const auto key = std::make_pair(replica->options().job, replica->options().rank);
  absl::MutexLock lock(&mu_);
  if (!replicas_
           .emplace(key,
                    Entry{std::move(replica), std::move(job_token), std::move(rank_token_hashes)})
           .second) {
    return absl::AlreadyExistsError(absl::StrCat("gossip job ", key.first, " rank ", key.second,
                                                 " is already served by this process"));
  }
  return absl::OkStatus();
}

void GossipServiceImpl::Unregister(const std::string& job, int32_t rank) {
  absl::MutexLock lock(&mu_);
  replicas_.erase(std::make_pair(job, rank));
}

absl::StatusOr<std::shared_ptr<GossipReplica>> GossipServiceImpl::Find(
    grpc::CallbackServerContext* context, const char* method, const std::string& job, int32_t rank,
    std::optional<int64_t> from) const {
  RETURN_IF_ERROR(CheckName(absl::StrCat("GossipService.", method, ": job"), job));
  Entry entry;
  {
    absl::MutexLock lock(&mu_);
    auto it = replicas_.find(std::make_pair(job, rank));
    if (it == replicas_.end()) {
      return absl::NotFoundError(
          absl::StrCat("gossip job ", job, " rank ", rank, " is not running in this process"));
    }
    entry = it->second;
  }
  std::optional<absl::string_view> presented;
  const auto& md = context->client_metadata();
  if (auto it = md.find(kJobTokenMetadata); it != md.end()) {
    presented = absl::string_view(it->second.data(), it->second.size());
  }
  const std::string where =
      absl::StrCat("GossipService.", method, " to gossip job ", job, " rank ", rank);
  RETURN_IF_ERROR(CheckPeerToken(entry.token, presented, where));
  if (from.has_value()) {
    std::optional<absl::string_view> rank_token;
    if (auto it = md.find(kRankTokenMetadata); it != md.end()) {
      rank_token = absl::string_view(it->second.data(), it->second.size());
    }
    RETURN_IF_ERROR(CheckRankToken(entry.rank_hashes, *from, rank_token, where));
  }
  return entry.replica;
}

grpc::ServerUnaryReactor* GossipServiceImpl::Exchange(grpc::CallbackServerContext* context,
                                                      const GossipExchangeRequest* request,
                                                      GossipExchangeResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto replica =
      Find(context, "Exchange", request->job(), request->to_rank(), request->from_rank());
  if (!replica.ok()) {
    reactor->Finish(ToGrpcStatus(replica.status()));
    return reactor;
  }
  const auto deadline = context->deadline();
  const absl::Time until = deadline == std::chrono::system_clock::time_point::max()
                               ? absl::InfiniteFuture()
                               : absl::FromChrono(deadline);
  absl::StatusOr<ExchangeHeader> header = HeaderFromProto(*request);
  if (!header.ok()) {
    reactor->Finish(ToGrpcStatus(header.status()));
    return reactor;
  }
  absl::StatusOr<ExchangeReply> reply =
      (*replica)->Handle(*header, request->values().data(), until);
  if (reply.ok()) ReplyToProto(*std::move(reply), response);
  reactor->Finish(ToGrpcStatus(reply.status()));
  return reactor;
}

grpc::ServerUnaryReactor* GossipServiceImpl::GetState(grpc::CallbackServerContext* context,
                                                      const GossipStateRequest* request,
                                                      GossipStateResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  std::optional<int64_t> from;
  if (request->has_from_rank()) from = request->from_rank();
  auto replica = Find(context, "GetState", request->job(), request->rank(), from);
  if (replica.ok() && from.has_value() &&
      (*from < 0 || *from >= (*replica)->options().num_workers || *from == request->rank())) {
    replica = absl::InvalidArgumentError(absl::StrCat(
        "GossipService.GetState to gossip job ", request->job(), " rank ", request->rank(),
        ": from_rank ", *from, " is not another rank of its ", (*replica)->options().num_workers));
  }
  if (replica.ok()) {
    const ReplicaState s = (*replica)->StateForPeer(
        from.has_value() ? std::optional<int32_t>(static_cast<int32_t>(*from)) : std::nullopt);
    response->set_step(s.step);
    response->set_total_steps(s.total_steps);
    response->set_finished(s.finished);
    response->set_weight(s.weight);
    response->set_gathered(s.gathered);
  }
  reactor->Finish(ToGrpcStatus(replica.status()));
  return reactor;
}

}  // namespace gradmesh
