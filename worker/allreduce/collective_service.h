// CollectiveServiceImpl: the receiving half of the gRPC ring (proto/collective.proto),
// served by every worker process on its --peers address. The sending half and the protocol
// are in grpc_ring.h.
//
// The service keeps one inbox per (job, rank) served in this process, opened by that rank's
// ring transport (OpenInbox). Each inbox is fed by exactly one Ring stream, from the previous
// rank of the same job; arriving chunks are queued without copying (the gRPC receive buffers
// themselves are handed to the ring, which reduces straight out of them). Backpressure: while
// an inbox holds more than Options::inbox_bytes, the stream is not read, so HTTP/2 flow
// control stops the sender. A stream that arrives before its inbox is opened is held (its
// first chunk kept, nothing more read) until the inbox opens, so ranks may start in any
// order. Several jobs, and several ranks of one job, may share one service.
//
// Errors never crash the process and never touch another job's inbox: a malformed chunk or
// one that contradicts its stream's first chunk ends that stream with INVALID_ARGUMENT; a
// second stream for an inbox that already has one ends with FAILED_PRECONDITION (the inbox's
// timeout errors then mention it); too many held streams, RESOURCE_EXHAUSTED.
//
// Authentication (worker/core/peer_token.h): an inbox opened with the job's token accepts only
// a stream whose call carries it (metadata `x-gradmesh-job-token`), compared in constant time
// when the stream would be attached (at once, or when the inbox opens for a held stream):
// none is UNAUTHENTICATED, another token (a stranger, a rank of another job) PERMISSION_DENIED.
// A refused stream is never attached: the inbox stays unconnected, its queue and sequence
// untouched, so the real previous rank still gets it (only the inbox's "a stream was refused"
// note, shown in its timeout error, records the refusal). An inbox opened without a token is
// open. The ring chunk's job must start with a valid job name (common/job_name.h; sub-rings
// add "/..."), else INVALID_ARGUMENT. A stream from a rank to a rank it does not precede in
// the ring (to_rank != from_rank + 1 mod world_size) is PERMISSION_DENIED. Ranks of one job
// share its token, so a rank of the same job that lies about its own from_rank is not told
// apart by the token (the shared-token trust boundary is the job).
//
// Thread safety: all methods may be called from any thread; one mutex guards every inbox
// and stream. Receive() blocks (up to its deadline); nothing else does.
#ifndef GRADMESH_WORKER_ALLREDUCE_COLLECTIVE_SERVICE_H_
#define GRADMESH_WORKER_ALLREDUCE_COLLECTIVE_SERVICE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/collective.grpc.pb.h"
#include "worker/allreduce/ring.h"

namespace gradmesh {

class CollectiveServiceImpl final
    : public CollectiveService::WithRawCallbackMethod_Ring<CollectiveService::Service> {
 public:
  struct Options {
    // Bytes queued in one inbox above which its stream is no longer read. Default 32 MiB.
    int64_t inbox_bytes = 32 << 20;
    // Streams held for inboxes that are not open yet, at most. Default 64.
    int max_held_streams = 64;
    // Bytes of their first chunks held at once, at most (one stream is always held, whatever
    // its size). Default 64 MiB. A held stream's token is checked only once its inbox opens,
    // so this bounds what callers without one can make the service keep.
    int64_t max_held_bytes = int64_t{64} << 20;
  };

  // An open inbox; opaque outside the service.
  class Inbox;
  class RingReader;  // The reactor of one incoming Ring stream.

  CollectiveServiceImpl();
  explicit CollectiveServiceImpl(Options options);
  // The server must be shut down (no streams left) before the service is destroyed.
  ~CollectiveServiceImpl() override;

  grpc::ServerReadReactor<grpc::ByteBuffer>* Ring(grpc::CallbackServerContext* context,
                                                  grpc::ByteBuffer* response) override;

  // --- Used by the ring transport of a rank served in this process (grpc_ring.h). ---

  // Opens the inbox of rank `rank` of `job` in a ring of `world_size`, fed by `prev_name`
  // (for error messages, e.g. "rank 0 (127.0.0.1:7101)"). A held stream for it is attached.
  // ALREADY_EXISTS if that inbox is open.
  // Only streams carrying `job_token` are attached (empty: any), and, when `prev_rank_hash`
  // (raw SHA-256 of the previous rank's token) is not empty, only with that rank's token
  // (metadata x-gradmesh-rank-token; worker/core/peer_token.h, "Rank identity").
  absl::StatusOr<std::shared_ptr<Inbox>> OpenInbox(const std::string& job, int rank, int world_size,
                                                   const std::string& prev_name,
                                                   const std::string& job_token = "",
                                                   const std::string& prev_rank_hash = "");

  // Closes `inbox`: queued chunks are dropped, its stream (if any) is ended with
  // FAILED_PRECONDITION when it sends more, and Receive on it fails with CANCELLED.
  void CloseInbox(const std::shared_ptr<Inbox>& inbox);

  // Makes every later Receive on `inbox` (and one in progress) fail with `error` (the rank's
  // outgoing link failed, so waiting for the previous rank is pointless).
  void FailInbox(const std::shared_ptr<Inbox>& inbox, const absl::Status& error);

  // The next chunk's payload, in order, waiting until `deadline`. Errors: the FailInbox
  // error; UNAVAILABLE naming the previous rank when its stream ended (after the queued
  // chunks are consumed) or broke the protocol; DEADLINE_EXCEEDED naming it when nothing
  // arrives in time (saying whether its stream ever connected); CANCELLED once closed;
  // ABORTED once `abort` is set (ring.h RingAbort; null: never).
  absl::StatusOr<RingMessage> Receive(const std::shared_ptr<Inbox>& inbox, absl::Time deadline,
                                      const RingAbort* abort = nullptr);

 private:
  // Held stream count and parse/deliver steps; see the .cc file.
  friend class RingReader;
  enum class Next { kRead, kWait, kFinish };
  Next Deliver(RingReader* reader, RingChunk header, RingMessage payload) ABSL_LOCKS_EXCLUDED(mu_);
  void StreamEnded(RingReader* reader, bool cancelled) ABSL_LOCKS_EXCLUDED(mu_);
  void StreamDone(RingReader* reader) ABSL_LOCKS_EXCLUDED(mu_);
  Next AttachLocked(RingReader* reader, const std::shared_ptr<Inbox>& inbox, RingChunk header,
                    RingMessage payload) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues an accepted chunk's payload in `inbox`: read on, or wait while it is full.
  Next EnqueueLocked(RingReader* reader, Inbox* inbox, RingMessage payload)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Lets go of a held stream's place in held_ and its first chunk (no-op if not held).
  void UnholdLocked(RingReader* reader) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  absl::Mutex mu_;
  std::map<std::pair<std::string, int>, std::shared_ptr<Inbox>> inboxes_ ABSL_GUARDED_BY(mu_);
  // Streams whose first chunk names an inbox that is not open, with that chunk.
  std::multimap<std::pair<std::string, int>, RingReader*> held_ ABSL_GUARDED_BY(mu_);
  int64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // Of their first chunks' payloads.
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_COLLECTIVE_SERVICE_H_
