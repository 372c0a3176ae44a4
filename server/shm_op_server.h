// ShmOpServer: the shard's side of one shared-memory channel (rpc/shm_region.h), opened by a
// worker on the same machine through ParameterService.OpenShm. A thread of its own takes each
// request the worker writes into the region and runs it as a Stream operation would run: the
// Stream's decoder (a push's values copied once into the shard's memory and scanned there, so
// nothing the worker changes afterwards reaches the optimizer), the job-token check against the
// token the opening call presented, the shard's limits, waits (a sync push at its barrier, an
// ssp pull) and status codes. It then writes the encoded StreamResponse into the response area.
// A request that does not decode is answered INVALID_ARGUMENT and the channel goes on; a
// length past the area closes the channel. Each request is copied out of the region before it
// is read, so nothing a worker writes can crash the shard or change it other than through
// operations its token may perform.
//
// Thread safety: the constructor starts the thread; the destructor closes the channel,
// withdraws an operation still waiting (nothing of it applied; its answer is not written, so
// the worker sees the channel close and retries it, as after a broken Stream) and joins: it
// returns once an operation being applied has finished (a wait ends at once).
#ifndef GRADMESH_SERVER_SHM_OP_SERVER_H_
#define GRADMESH_SERVER_SHM_OP_SERVER_H_

#include <grpcpp/support/byte_buffer.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/spin_wait.h"
#include "rpc/shm_region.h"
#include "server/job_tokens.h"
#include "server/shard.h"

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

  // Makes the region and starts serving it. Errors: ShmRegion::Create's.
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
  ShmOpServer(Shard* shard, Options options, std::unique_ptr<ShmRegion> region);
  void Run();
  // Runs the request of `bytes` bytes in the request area; returns the encoded answer.
  grpc::ByteBuffer Serve(uint64_t bytes, uint32_t seq);

  Shard* const shard_;
  const Options options_;
  const std::unique_ptr<ShmRegion> region_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> served_{0};
  AdaptiveSpin spin_;
  const int fd_;
  const std::unique_ptr<char[]> request_copy_;  // The request being served, out of the region.
  absl::Mutex cancel_mu_;
  WaitCancel* cancel_ ABSL_GUARDED_BY(cancel_mu_) = nullptr;  // The operation in flight's.
  std::thread thread_;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_SHM_OP_SERVER_H_
