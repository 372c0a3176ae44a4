// The built-in training modes, bound to this process's services: the composition root that
// worker_main and the WorkerAgent use to build a TrainingModeRegistry (worker/training_mode.h).
//
//   async, ssp, sync  worker/ps/ps_mode.h (through parameter-server shards)
//   gossip            worker/gossip/gossip_mode.h
//   allreduce         worker/allreduce/allreduce_mode.h
//
// Thread safety: the registry is a plain value; see common/registry.h.
#ifndef GRADMESH_WORKER_MODES_H_
#define GRADMESH_WORKER_MODES_H_

#include "worker/core/training_mode.h"
#include "worker/ps/ps_mode.h"

namespace gradmesh {

class CollectiveServiceImpl;  // worker/allreduce/collective_service.h
class GossipServiceImpl;      // worker/gossip/gossip_service.h

// This process's peer services (serving on options.peers[rank]), used by the gossip and
// allreduce modes; not owned. A null service makes that mode fail with INVALID_ARGUMENT.
struct PeerServices {
  CollectiveServiceImpl* collective = nullptr;
  GossipServiceImpl* gossip = nullptr;
};

// A registry of the built-in modes: the ps modes make their ParameterClient with
// `ps_client` (empty: they fail with INVALID_ARGUMENT), gossip and allreduce use `peers`.
TrainingModeRegistry BuiltinTrainingModes(ParameterClientFactory ps_client, PeerServices peers);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_MODES_H_
