// Proto <-> struct mapping of the gossip messages (see wire.h).
#include "worker/gossip/wire.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace gradmesh {
namespace {

GossipKind KindToProto(ExchangeKind kind) {
  switch (kind) {
    case ExchangeKind::kAverage:
      return GOSSIP_AVERAGE;
    case ExchangeKind::kFinal:
      return GOSSIP_FINAL;
    case ExchangeKind::kPushSum:
      break;
  }
  return GOSSIP_PUSH_SUM;
}

}  // namespace

absl::StatusOr<ExchangeHeader> HeaderFromProto(const GossipExchangeRequest& request) {
  ExchangeHeader h;
  switch (request.kind()) {
    case GOSSIP_PUSH_SUM:
      h.kind = ExchangeKind::kPushSum;
      break;
    case GOSSIP_AVERAGE:
      h.kind = ExchangeKind::kAverage;
      break;
    case GOSSIP_FINAL:
      h.kind = ExchangeKind::kFinal;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("gossip: unknown exchange kind ",
                                                     static_cast<int>(request.kind()),
                                                     " from rank ", request.from_rank()));
  }
  h.job = request.job();
  h.from = request.from_rank();
  h.to = request.to_rank();
  h.round = request.round();
  h.step = request.step();
  h.weight = request.weight();
  h.exchange_id = request.exchange_id();
  h.codec = request.values().codec();
  h.numel = request.values().numel();
  return h;
}

void HeaderToProto(const ExchangeHeader& header, absl::string_view payload,
                   GossipExchangeRequest* request) {
  request->set_job(header.job);
  request->set_from_rank(header.from);
  request->set_to_rank(header.to);
  request->set_kind(KindToProto(header.kind));
  request->set_round(header.round);
  request->set_step(header.step);
  request->set_weight(header.weight);
  request->set_exchange_id(header.exchange_id);
  GossipValues* v = request->mutable_values();
  v->set_numel(header.numel);
  v->set_codec(header.codec);
  v->set_data(payload.data(), payload.size());
}

void ReplyToProto(ExchangeReply reply, GossipExchangeResponse* response) {
  response->set_step(reply.step);
  response->set_duplicate(reply.duplicate);
  if (!reply.payload.empty() || reply.numel > 0) {
    GossipValues* v = response->mutable_values();
    v->set_numel(reply.numel);
    v->set_codec(reply.codec);
    v->set_data(std::move(reply.payload));
  }
}

ExchangeReply ReplyFromProto(GossipExchangeResponse* response) {
  ExchangeReply r;
  r.step = response->step();
  r.duplicate = response->duplicate();
  r.numel = response->values().numel();
  r.codec = response->values().codec();
  r.payload = std::move(*response->mutable_values()->mutable_data());
  return r;
}

}  // namespace gradmesh
