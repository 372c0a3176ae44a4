// ShmOpServer: the shard's side of one shared-memory channel (rpc/shm_region.h), opened by a
// worker on the same machine through ParameterService.OpenShm. A thread of its own takes each
// request the worker writes into the region (one operation, or a batch of up to
// kMaxStreamBatch as on the Stream, rpc/tensor_wire.h) and runs it as a Stream operation would
// run: the
// Stream's decoder (a push's values copied once into the shard's memory and scanned there, so
// nothing the worker changes afterwards reaches the optimizer), the job-token check against the
// token the opening call presented, the shard's limits, waits (a sync push at its barrier, an
// ssp pull) and status codes. A batch's operations start in order without waiting for each
// other, as the Stream starts them; once all have completed, the thread writes the encoded
// StreamResponse (for a batch, a batch of them in the same order) into the response area.
// A request that does not decode is answered INVALID_ARGUMENT and the channel goes on; a batch
// is checked whole first (each element decodes, one chunk budget for all, no nested batch, no
// call id twice, each a push or a pull), and one bad element refuses it all, nothing of it
// started. A length past the area closes the channel. Each request is copied out of the region
// before it is read, so nothing a worker writes can crash the shard or change it other than through
// operations its token may perform.
//
// Thread safety: the constructor starts the thread; the destructor closes the channel,
// withdraws the operations still waiting (nothing of them applied; no answer is written, so
// the worker sees the channel close and retries them, as after a broken Stream) and joins: it
// returns once an operation being applied has finished (a wait ends at once).
#ifndef GRADMESH_SERVER_SHM_OP_SERVER_H_
#define GRADMESH_SERVER_SHM_OP_SERVER_H_

#include <grpcpp/support/byte_buffer.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/spin_wait.h"
#include "rpc/shm_region.h"
#include "rpc/tensor_wire.h"
#include "server/job_tokens.h"
#include "server/shard.h"
#include "server/shard_limits.h"

namespace gradmesh {

class ShmOpServer {
 public:
  struct Options {
    size_t area_bytes = 0;              // Of each area (ShmRegion::Create's bounds).
    std::string token;                  // The job token the opening call presented ("" if none).
    const JobTokens* tokens = nullptr;  // Not owned; null: no per-job check.
    std::string peer;                   // For logs.
    const Logger* logger = nullptr;     // Not owned; may be null.
    // Waiting for the next request, the thread first spins (yielding the CPU) for up to this
    // long while its recent waits were under half of it (common/spin_wait.h): back-to-back
    // small operations then find it running. Off by default: measured in training on 2 shared
    // cores, it cost some runs a fifth of their speed (--shm_spin_us).
    absl::Duration spin = absl::ZeroDuration();
  };

  // Makes the region and starts serving it. The region and the shard's request copy (about
  // three areas) are reserved in the shard's --max_memory_bytes budget until the server is
  // destroyed: RESOURCE_EXHAUSTED when they do not fit; otherwise ShmRegion::Create's errors.
  static absl::StatusOr<std::unique_ptr<ShmOpServer>> Start(Shard* shard, Options options);
  ~ShmOpServer();
  ShmOpServer(const ShmOpServer&) = delete;
  ShmOpServer& operator=(const ShmOpServer&) = delete;

  const ShmRegion& region() const { return *region_; }
  // The region's descriptor, for the worker to open (closed by the serving thread once the
  // first request came, or after kShmAttachWindow).
  int fd() const { return fd_; }
  // Operations answered so far.
  int64_t served() const { return served_.load(); }

 private:
  struct Op;     // One operation of a request.
  struct Tally;  // The operations of a request not yet completed.

  ShmOpServer(Shard* shard, Options options, std::unique_ptr<ShmRegion> region,
              MemoryReservation memory);
  void Run();
  // Runs the request of `bytes` bytes copied out of the request area; returns the encoded
  // answer and, in `*operations`, how many operations it answered.
  grpc::ByteBuffer Serve(uint64_t bytes, uint32_t seq, int64_t* operations);
  // Decodes `in` (one operation or a batch) into `ops`, or says why it is refused whole.
  absl::Status Decode(const grpc::ByteBuffer& in, const std::string& where,
                      std::vector<std::unique_ptr<Op>>* ops, bool* batch) const;
  // Starts each of `ops` on the shard in order (the token checked first), then waits until all
  // have completed; ~ShmOpServer withdraws those still waiting.
  void RunAll(const std::vector<std::unique_ptr<Op>>& ops);
  // Records `status` as `op`'s outcome and counts it done in `tally`.
  static void Completed(Op* op, const std::shared_ptr<Tally>& tally, absl::Status status);
  // The encoded StreamResponse answering `op` once it completed.
  static grpc::ByteBuffer AnswerOf(Op* op);

  Shard* const shard_;
  const Options options_;
  const MemoryReservation memory_;  // The region and request copy, in the shard's budget.
  const std::unique_ptr<ShmRegion> region_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> served_{0};
  AdaptiveSpin spin_;
  const int fd_;
  const std::unique_ptr<char[]> request_copy_;  // The request being served, out of the region,
  char* const request_at_;                      // at this place in it.
  ScannedCopy scanned_;                         // Of that copy (the serving thread's).
  absl::Mutex cancel_mu_;
  // The operations in flight's (not owned), cancelled by the destructor.
  std::vector<WaitCancel*> cancels_ ABSL_GUARDED_BY(cancel_mu_);
  bool stopping_ ABSL_GUARDED_BY(cancel_mu_) = false;  // The destructor cancelled cancels_.
  std::thread thread_;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_SHM_OP_SERVER_H_
