// The gRPC GossipTransport: one channel per peer (common/grpc_util.h MakeChannel: explicit
// message limits, fast reconnect backoff), blocking unary calls with a deadline. Used by the
// Gossiper's background thread and the final round.
//
// A call to a peer that is not listening fails fast with UNAVAILABLE (it does not wait for
// the channel to become ready); errors carry the peer's rank and address.
//
// Thread safety: Exchange and GetState may be called concurrently.
#ifndef GRADMESH_WORKER_GOSSIP_GRPC_TRANSPORT_H_
#define GRADMESH_WORKER_GOSSIP_GRPC_TRANSPORT_H_

#include <memory>
#include <string>
#include <vector>

#include "rpc/grpc_util.h"
#include "worker/gossip/exchange.h"

namespace gradmesh {

// `peers[r]` is rank r's GossipService address ("host:port"). Every call carries `job_token`
// as metadata x-gradmesh-job-token (worker/core/peer_token.h) and `rank_token`, this rank's,
// as x-gradmesh-rank-token; empty: none is sent.
std::unique_ptr<GossipTransport> NewGrpcGossipTransport(std::vector<std::string> peers,
                                                        const RpcOptions& rpc,
                                                        std::string job_token = "",
                                                        std::string rank_token = "");

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_GRPC_TRANSPORT_H_
