// The TCP RingTransport: the ring's bytes on one plain TCP connection per link, set up over
// another ring (the job's gRPC ring), the way NCCL, Gloo and Horovod keep a control channel
// for rendezvous and move tensors on raw sockets.
//
// Why: on the gRPC ring every received byte is copied twice in user space (gRPC's receive
// slices, then into the caller's buffer), receive buffers are allocated per read, and the
// bytes cross two threads (gRPC's poller, the ring's). Here the ring's thread does all I/O
// itself (non-blocking sockets, poll), all-gather segments are read straight into their
// final place (RecvInto), and reduce-scatter segments into a few reused buffers. Measured
// in the README (Performance): with 4 processes on 2 cores this is what takes the ring past
// Gloo at large sizes.
//
// Set-up (ConnectTcpRing, every rank at once):
//   1. listen on an ephemeral port on all IPv4/IPv6 addresses of this host;
//   2. all-gather (port, 16 random bytes) over `bootstrap`;
//   3. connect to rank r+1 at the host of its peer address and that port, and send a hello:
//      "GMRING01", from_rank, world_size and rank r+1's random bytes, which only ranks of this
//      ring have learned (a stranger that connects first is dropped, not trusted);
//   4. accept connections until one from rank r-1 presents this rank's bytes (hellos are
//      read side by side; a connection that sends no hello within 1 s is dropped).
//   The all-gather is bounded by `timeout` per step, connecting and accepting together by
//   `timeout` from when it ends. The bootstrap ring is not used afterwards.
//
// Wire format per message: seq (u64 LE, 0, 1, ...) | length (u64 LE) | payload.
//
// Failure: the previous rank's connection closing or resetting is UNAVAILABLE naming it by
// its peer-service address ("ring link from rank 1 (10.0.0.2:7101) ended: connection closed
// (process gone?)"), a failed send UNAVAILABLE naming the next rank; a receive that gets
// nothing within its deadline is DEADLINE_EXCEEDED naming the previous rank; a wrong seq or
// an oversized length is UNAVAILABLE "broke the protocol"; a Flush that times out is
// DEADLINE_EXCEEDED naming the next rank. After any error the transport fails every later
// call. Unlike the gRPC transport, a link to the next rank that breaks while nothing is
// queued for it is noticed at the next send, not by a waiting Recv (a next rank that has
// finished a collective may legitimately close while this one still receives); a dead next
// rank still stops the ring at once, because its own next rank fails and closes in turn.
// Destroying the transport writes queued copies (Send; for at most `timeout`, not after a
// failure), never queued in-place messages (SendNoCopy: their memory may be gone after a
// failed collective), and closes both connections.
//
// Thread safety: one thread at a time (RingTransport's contract). No background threads.
#ifndef GRADMESH_WORKER_ALLREDUCE_TCP_RING_H_
#define GRADMESH_WORKER_ALLREDUCE_TCP_RING_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/allreduce/ring.h"

namespace gradmesh {

struct TcpRingOptions {
  // Bound on connecting (each step of the set-up) and on flushing at destruction.
  absl::Duration timeout = absl::Seconds(30);
  // SO_SNDBUF / SO_RCVBUF of both links (the kernel doubles it). 0: the kernel's
  // auto-tuning. -1 (default): kOversubscribedSocketBuffer when more ranks of the ring run
  // on this rank's host (same host in `peers`) than it has hardware threads, else
  // auto-tuning. Measured (README, Performance): with 4 ranks on 2 cores fixed 512 KiB
  // buffers were 5-15% faster at 4-64 MiB (bytes are taken while still in cache); with 2
  // ranks on 2 cores they were 30% slower than auto-tuning.
  int64_t socket_buffer_bytes = -1;
  // Ends the set-up's and the transport's waits early with ABORTED (ring.h RingAbort); not
  // owned, must outlive the transport. Null: never.
  const RingAbort* abort = nullptr;
};
constexpr int64_t kOversubscribedSocketBuffer = 512 << 10;

// Connects this rank's TCP ring links (see the file comment). `bootstrap` is a working ring
// of the same ranks (rank and size are taken from it); `peers` are the ranks' peer-service
// addresses (host:port or [v6]:port), whose host parts say where each rank is reached.
// Errors: INVALID_ARGUMENT when `peers` does not match the ring; the bootstrap ring's errors;
// UNAVAILABLE when a socket cannot be opened or the next rank cannot be reached;
// DEADLINE_EXCEEDED naming the previous rank when it does not connect within the timeout.
absl::StatusOr<std::unique_ptr<RingTransport>> ConnectTcpRing(RingTransport* bootstrap,
                                                              const std::vector<std::string>& peers,
                                                              const TcpRingOptions& options);

// The socket buffer size ConnectTcpRing uses for rank `rank` (see
// TcpRingOptions::socket_buffer_bytes); `hardware_threads` as std::thread reports it.
int64_t TcpRingSocketBuffer(const std::vector<std::string>& peers, int rank,
                            const TcpRingOptions& options, int hardware_threads);

// The host part of "host:port", "[v6]:port" or a bare host ("" for "").
std::string HostOfAddress(const std::string& address);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_TCP_RING_H_
