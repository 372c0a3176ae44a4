// Ring all-reduce, independent of the transport.
//
// A RingTransport connects one rank of a ring of n ranks to its two neighbours: it sends
// byte messages to rank (r + 1) mod n and receives, in the same order they were sent, the
// messages of rank (r - 1) mod n. The gRPC implementation is in grpc_ring.h, an in-process
// one for tests and single-process use in local_ring.h.
//
// RingAllreduce sums float32 buffers of equal length over the ring (the caller averages):
//   * the buffer is cut into n chunks, chunk c = [c*L/n, (c+1)*L/n) (any length L, chunks
//     may differ by one element or be empty), and each chunk into segments of at most
//     RingOptions::segment_bytes;
//   * reduce-scatter (n-1 steps): at step s rank r sends chunk (r-s) mod n and receives
//     chunk (r-s-1) mod n, adding it into its own; after n-1 steps rank r holds the complete
//     sum of chunk (r+1) mod n;
//   * all-gather (n-1 steps): the complete chunks travel once more around the ring and are
//     copied in place.
//   Each segment is forwarded as soon as it has been received and reduced, so the steps
//   overlap (pipelining): a rank receives segment k+1 while its segment k is on the wire.
//   Every rank sends and receives 2(n-1)/n * L floats in all. Segments are sent in place
//   (SendNoCopy): a segment is only overwritten after it has travelled round the ring, and
//   the function flushes the transport before returning, so `data` is the caller's again. The sum
//   of each element is accumulated in the same order on every rank's behalf and then copied, so all
//   ranks end with bit-identical results. n = 1 returns at once.
//
// Errors: a message of the wrong size (ranks disagree on the buffer) is INTERNAL naming the
// previous rank; transport errors (UNAVAILABLE, DEADLINE_EXCEEDED, ...) are returned as the
// transport reports them, annotated with the step. After an error the ring is unusable (the
// neighbours' streams are out of step): callers fail the job.
//
// Thread safety: a RingTransport is used by one thread at a time (one collective at a time);
// the functions here are re-entrant for distinct transports.
#ifndef GRADMESH_WORKER_ALLREDUCE_RING_H_
#define GRADMESH_WORKER_ALLREDUCE_RING_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace gradmesh {

// One received message: its bytes as consecutive pieces (a transport may hand over the
// buffers it received into, split anywhere, even inside a float), kept alive by `owner`.
struct RingMessage {
  std::vector<absl::Span<const char>> pieces;
  std::shared_ptr<const void> owner;
  size_t size() const;
};

// See the file comment. Implementations document their own thread safety; the ring
// functions call Send and Recv from one thread.
class RingTransport {
 public:
  virtual ~RingTransport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Queues `data` (copied before returning) for rank (rank + 1) mod size. Does not wait for
  // the peer. Errors: the link to the next rank has failed (UNAVAILABLE naming it, or what
  // the link reported).
  virtual absl::Status Send(absl::Span<const char> data) = 0;

  // Like Send, but may send `data` in place instead of copying it. The caller must keep the
  // bytes unchanged until the next rank has received them, and alive until Flush() returns.
  // The default copies (Send).
  virtual absl::Status SendNoCopy(absl::Span<const char> data) { return Send(data); }

  // Waits (until `deadline`) until the transport holds no reference to memory passed to
  // SendNoCopy. DEADLINE_EXCEEDED naming the next rank if it does not take the messages in
  // time; the link's error if it failed. The default returns OK at once.
  virtual absl::Status Flush(absl::Time deadline) { return absl::OkStatus(); }

  // Returns the next message of rank (rank - 1) mod size, waiting until `deadline`.
  // DEADLINE_EXCEEDED naming the previous rank if nothing arrives in time; UNAVAILABLE (or
  // the link's error) if either link has failed or the previous rank closed its stream.
  virtual absl::StatusOr<RingMessage> Recv(absl::Time deadline) = 0;

  // Receives the next message straight into `dst` (no intermediate buffer where the
  // transport can avoid one) and returns its size. When that size differs from dst.size(),
  // dst holds no message and the ring is out of step (the caller fails it). Errors as Recv.
  // The default receives (Recv) and copies.
  virtual absl::StatusOr<size_t> RecvInto(absl::Span<char> dst, absl::Time deadline);

  // Description of a neighbour for error messages ("rank 1 (127.0.0.1:7101)").
  virtual std::string PeerName(int rank) const = 0;

  // What carries the bytes, for logs and tests: "grpc", "tcp", "local", ...
  virtual std::string kind() const { return "local"; }
};

// Set by a ring's owner to end its transports' waits early (the coordinator restarts every
// rank: this ring is over, and a rank waiting on a peer that is gone would otherwise hold its
// next run back for a whole timeout). Every wait of the TCP and gRPC transports, set-up
// included, checks it at least every kRingAbortCheck and then fails with ABORTED
// (RingAbortedError). Null: never set.
using RingAbort = std::atomic<bool>;
inline constexpr absl::Duration kRingAbortCheck = absl::Milliseconds(100);
inline bool RingAborted(const RingAbort* abort) {
  return abort != nullptr && abort->load(std::memory_order_relaxed);
}
// Where a wait until `deadline` next wakes up to check `abort`.
inline absl::Time RingAbortSlice(absl::Time deadline, const RingAbort* abort) {
  return abort == nullptr ? deadline : std::min(deadline, absl::Now() + kRingAbortCheck);
}
absl::Status RingAbortedError(absl::string_view where);

enum class RingCodec { kNone, kFp16 };

struct RingOptions {
  // Largest message of the pipelined ring, bytes (> 0, rounded down to whole floats).
  // Default 2 MiB (measured: with 4 processes on 2 cores, fewer larger messages win; with
  // 2 processes it makes no difference).
  int64_t segment_bytes = 2 << 20;
  // A receive that waits longer than this for the previous rank fails with
  // DEADLINE_EXCEEDED. Default 30 s.
  absl::Duration timeout = absl::Seconds(30);
  // What travels on the wire. kFp16 halves the bytes: every message carries IEEE float16
  // (round to nearest even, clamped to +-65504; compression/float16.h), sums are accumulated
  // in float32 and the final sum is rounded to fp16 on every rank (so all ranks still end
  // with the same bits), as Horovod's --fp16-allreduce / DDP's fp16_compress_hook. A
  // non-finite input is INVALID_ARGUMENT. Messages are copied (no in-place sends); all ranks
  // must use the same codec. Default kNone (float32, exact sums).
  RingCodec codec = RingCodec::kNone;
};

// Called with element ranges [begin, end) of an all-reduced buffer as soon as their final
// sums are in place, before the collective has returned (so the caller can start using them,
// e.g. apply the optimizer, while the rest is still on the wire). The ranges are disjoint,
// cover the buffer and come in no particular order; empty ranges are not reported. The
// callee may read data[begin, end) but must not write it until the collective has returned
// (the bytes may still be being sent in place). Runs on the collective's calling thread.
using FinalRangeFn = std::function<void(int64_t begin, int64_t end)>;

// Sums `data` over every rank of `transport`'s ring, in place (see the file comment). Every
// rank must call it with the same length; lengths 0 and < n are fine.
// `bytes_sent`, if not null, is increased by the payload bytes this rank sent. `on_final`, if
// not null, hears of each segment once its sum is final (its own chunk after the
// reduce-scatter, the others as they arrive in the all-gather): see FinalRangeFn.
absl::Status RingAllreduce(RingTransport* transport, absl::Span<float> data,
                           const RingOptions& options, int64_t* bytes_sent = nullptr,
                           const FinalRangeFn* on_final = nullptr);

// Every rank contributes `mine` (any length, may differ between ranks); returns all ranks'
// contributions in rank order. n-1 steps around the ring. Same errors as RingAllreduce.
absl::StatusOr<std::vector<std::string>> RingAllgather(RingTransport* transport,
                                                       absl::string_view mine,
                                                       const RingOptions& options);

// Chunk c of a buffer of `length` elements cut into n chunks: [begin, end).
struct ChunkRange {
  int64_t begin = 0;
  int64_t end = 0;
};
ChunkRange RingChunkRange(int64_t length, int n, int c);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_ALLREDUCE_RING_H_
