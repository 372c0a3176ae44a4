// STUB (to be implemented): the gRPC CollectiveService of a worker process.
#ifndef GRADMESH_WORKER_ALLREDUCE_COLLECTIVE_SERVICE_H_
#define GRADMESH_WORKER_ALLREDUCE_COLLECTIVE_SERVICE_H_

#include "proto/collective.grpc.pb.h"

namespace gradmesh {

class CollectiveServiceImpl final : public CollectiveService::CallbackService {};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_COLLECTIVE_SERVICE_H_
