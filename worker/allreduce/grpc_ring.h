// The gRPC RingTransport: rank r of a job streams its ring messages to rank (r + 1) mod n
// over CollectiveService.Ring and receives rank (r - 1) mod n's from its own process's
// CollectiveServiceImpl (collective_service.h).
//
// Protocol (proto/collective.proto):
//   * At creation rank r opens its inbox (job, r) in the local service, then one long-lived
//     client stream to peers[(r + 1) mod n] (wait_for_ready: the peer may start later). The
//     stream lives until the transport is destroyed; every ring message is one RingChunk on
//     it with job, from_rank = r, to_rank, world_size and seq = 0, 1, 2, ...; the receiver
//     checks all of them. The stream uses its own TCP connection (one per job and rank).
//   * Wire efficiency: a chunk is a small slice with the serialized header fields and the
//     `data` field's tag and length, followed by the payload: copied behind the header for
//     Send, or referenced in place for SendNoCopy (no user-space copy at all; the ring's own
//     buffer goes to the socket). In-place writes use gRPC's write-through option, so a
//     write completes only once its bytes are in the socket, and Flush waits for that. The
//     receiver parses the chunk in place and hands the received gRPC slices to the ring,
//     which adds them straight into its buffer. Writes are queued and issued back to back by
//     the stream's reactor, so sending overlaps with the ring's receiving and reducing; the
//     receiver's bounded inbox (backpressure through HTTP/2 flow control) bounds memory.
//   * Failure: a receive waits at most the ring's timeout; the outgoing stream's failure
//     (next rank gone) is reported to the next Recv at once, the incoming stream's end
//     (previous rank gone) too, each naming the rank and its address. Destroying the
//     transport half-closes the stream after the queued chunks are written and waits for the
//     receiver's acknowledgement (at most close_timeout, then cancels), and closes the inbox.
//
// Thread safety: Send/Recv from one thread at a time (RingTransport's contract); the gRPC
// callbacks run on gRPC's threads and synchronise internally.
#ifndef GRADMESH_WORKER_ALLREDUCE_GRPC_RING_H_
#define GRADMESH_WORKER_ALLREDUCE_GRPC_RING_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rpc/grpc_util.h"
#include "worker/allreduce/collective_service.h"
#include "worker/allreduce/ring.h"

namespace gradmesh {

struct GrpcRingOptions {
  std::string job;                 // Job name (non-empty).
  int rank = 0;                    // In [0, peers.size()).
  std::vector<std::string> peers;  // host:port of every rank's CollectiveService, rank order.
  CollectiveServiceImpl* local = nullptr;  // This process's service (serving peers[rank]).
  RpcOptions rpc;                          // Channel limits (message size must fit a segment).
  // The job's token: sent on the stream to the next rank (metadata x-gradmesh-job-token) and
  // required from the previous rank's stream (collective_service.h). Empty: none.
  std::string job_token;
  // This rank's token, sent on the stream (x-gradmesh-rank-token), and every rank's token hash
  // (raw SHA-256, by rank): the inbox attaches only a stream with the previous rank's token
  // (worker/core/peer_token.h, "Rank identity"). Empty: not checked.
  std::string rank_token;
  std::vector<std::string> rank_token_hashes;
  // Bound on waiting for the next rank's acknowledgement when the transport is destroyed.
  // Default 30 s.
  absl::Duration close_timeout = absl::Seconds(30);
  // Ends Recv's and Flush's waits early with ABORTED, and closing then waits for nothing
  // (ring.h RingAbort); not owned, outlives the transport. Null: never.
  const RingAbort* abort = nullptr;
};

// INVALID_ARGUMENT for bad options; ALREADY_EXISTS if this rank of this job already has a
// transport in this process. Does not wait for the peers.
absl::StatusOr<std::unique_ptr<RingTransport>> NewGrpcRingTransport(const GrpcRingOptions& options);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_GRPC_RING_H_
