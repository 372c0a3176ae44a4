// STUB (to be implemented): the gRPC GossipService of a worker process.
#ifndef GRADMESH_WORKER_GOSSIP_GOSSIP_SERVICE_H_
#define GRADMESH_WORKER_GOSSIP_GOSSIP_SERVICE_H_

#include "proto/gossip.grpc.pb.h"

namespace gradmesh {

class GossipServiceImpl final : public GossipService::CallbackService {};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_GOSSIP_SERVICE_H_
