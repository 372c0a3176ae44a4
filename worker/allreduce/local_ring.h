// An in-process RingTransport: n ranks connected by queues, for tests and for running
// several ranks as threads of one process.
//
// Thread safety: each returned transport is used by one thread at a time; different ranks'
// transports may be used concurrently (that is the point). The ring's shared state lives
// until the last transport is destroyed.
#ifndef GRADMESH_WORKER_ALLREDUCE_LOCAL_RING_H_
#define GRADMESH_WORKER_ALLREDUCE_LOCAL_RING_H_

#include <memory>
#include <vector>

#include "worker/allreduce/ring.h"

namespace gradmesh {

// Transports of ranks 0..n-1 (n >= 1). Send copies the bytes into the next rank's queue;
// Recv waits on its own queue (DEADLINE_EXCEEDED naming the previous rank at the deadline).
// Destroying a transport closes its outgoing queue: the next rank's Recv then fails with
// UNAVAILABLE once the queue is drained.
std::vector<std::unique_ptr<RingTransport>> NewLocalRing(int n);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_LOCAL_RING_H_
