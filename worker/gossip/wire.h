// Mapping between the gossip core's structs (exchange.h) and proto/gossip.proto, shared by the
// two gRPC adapters (GossipServiceImpl and the gRPC transport).
//
// Thread safety: pure functions.
#ifndef GRADMESH_WORKER_GOSSIP_WIRE_H_
#define GRADMESH_WORKER_GOSSIP_WIRE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/gossip.pb.h"
#include "worker/gossip/exchange.h"

namespace gradmesh {

// InvalidArgument for a kind this build does not know (proto3 enums are open).
absl::StatusOr<ExchangeHeader> HeaderFromProto(const GossipExchangeRequest& request);
// Copies `payload` into the request.
void HeaderToProto(const ExchangeHeader& header, absl::string_view payload,
                   GossipExchangeRequest* request);

// Moves reply.payload into the response.
void ReplyToProto(ExchangeReply reply, GossipExchangeResponse* response);
// Moves the response's data into the reply.
ExchangeReply ReplyFromProto(GossipExchangeResponse* response);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_WIRE_H_
