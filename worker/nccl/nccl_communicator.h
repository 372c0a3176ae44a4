// NcclCommunicator: sum all-reduce of float buffers across the ranks of one job, one GPU per
// rank, through NCCL. The GPU path of mode "allreduce" (worker/allreduce/ is the gRPC ring).
//
//   // One process (rank 0) makes the id and hands it to every rank (e.g. over gRPC); it must
//   // stay alive until every rank's Create has returned (it hosts NCCL's bootstrap root).
//   ASSIGN_OR_RETURN(std::string id, NcclCommunicator::GetUniqueId());
//   ASSIGN_OR_RETURN(auto comm, NcclCommunicator::Create(rank, world, id, /*device=*/0));
//   RETURN_IF_ERROR(comm->AllReduceSum(grads.data(), grads.size()));  // every rank, same count
//
// Built with --config=cuda this is NCCL; built without it, a stub whose CudaDeviceCount() is 0
// and whose GetUniqueId/Create return UNIMPLEMENTED, so callers can depend on this library
// unconditionally and pick NCCL at run time. The header names no CUDA or NCCL type.
//
// Failure model: a rank that dies or stops calling cannot hang the others. Create and every
// AllReduceSum wait at most NcclOptions::timeout, polling ncclCommGetAsyncError and the stream;
// on an NCCL/CUDA error or at the deadline the communicator is aborted (ncclCommAbort), the
// call returns the error (DEADLINE_EXCEEDED at the deadline), and every later call returns
// FAILED_PRECONDITION. Messages name the rank, the world size, the device and the NCCL/CUDA
// error text (ncclGetErrorString, ncclGetLastError, cudaGetErrorString).
//
// Thread safety: the free functions and GetUniqueId/Create are thread-safe. A communicator's
// methods may be called from any thread; AllReduceSum calls are serialised (a second caller
// blocks until the first returns). As with every collective, all ranks must issue the same
// all-reduces, with the same counts, in the same order.
#ifndef GRADMESH_WORKER_NCCL_NCCL_COMMUNICATOR_H_
#define GRADMESH_WORKER_NCCL_NCCL_COMMUNICATOR_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace gradmesh {

// Size of the id that GetUniqueId returns and Create takes (NCCL_UNIQUE_ID_BYTES).
inline constexpr size_t kNcclUniqueIdBytes = 128;

// Number of CUDA devices this process can use; 0 when there is no driver, no GPU, a driver too
// old for this CUDA runtime, or the build has no CUDA. Never fails.
int CudaDeviceCount();

// True when this binary was built with --config=cuda (NCCL linked in).
bool NcclBuiltIn();

struct NcclOptions {
  // The longest Create waits for all `world` ranks to join, each AllReduceSum for its
  // collective (and staging copies) to finish, and the destructor for NCCL's finalisation.
  // At the deadline the communicator is aborted. Must be > 0. Default: 60 s.
  absl::Duration timeout = absl::Seconds(60);
  // While waiting, the calling thread spins (yielding) for `spin`, then sleeps `poll_interval`
  // between checks: short collectives are not slowed by sleeping, long waits use no CPU.
  // Both >= 0. Defaults: 2 ms and 100 us.
  absl::Duration spin = absl::Milliseconds(2);
  absl::Duration poll_interval = absl::Microseconds(100);
};

class NcclCommunicator {
 public:
  // A fresh NCCL unique id (kNcclUniqueIdBytes raw bytes) for one communicator. Starts NCCL's
  // bootstrap root in this process. UNIMPLEMENTED without --config=cuda; UNAVAILABLE/INTERNAL
  // with NCCL's text if NCCL fails (e.g. no usable network interface).
  static absl::StatusOr<std::string> GetUniqueId();

  // Joins communicator `unique_id` as `rank` of `world` on CUDA device `device` of this
  // process; blocks until all ranks have joined (at most options.timeout).
  // INVALID_ARGUMENT: world < 1, rank outside [0, world), an id that is not
  //   kNcclUniqueIdBytes long, device < 0 or >= CudaDeviceCount(), bad options.
  // FAILED_PRECONDITION: no CUDA device; UNIMPLEMENTED: built without --config=cuda.
  // DEADLINE_EXCEEDED: not every rank joined in time. Others: NCCL/CUDA errors.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      int rank, int world, absl::string_view unique_id, int device,
      const NcclOptions& options = NcclOptions());

  // Finalises the communicator (waiting at most options.timeout for in-flight NCCL work),
  // or aborts it if that fails; frees the staging buffer and the stream.
  virtual ~NcclCommunicator() = default;

  // Replaces data[0..count) by its elementwise sum over all ranks. `data` may be host memory
  // (copied through a device buffer that is reused and grown as needed) or device/managed
  // memory on this communicator's device (reduced in place). Runs on the communicator's own
  // stream and returns once the result is in `data`. count == 0 returns OK at once.
  // INVALID_ARGUMENT: null data with count > 0, or device memory of another device.
  // RESOURCE_EXHAUSTED: the staging buffer cannot be allocated. DEADLINE_EXCEEDED: the
  // collective did not finish within options.timeout (a peer died or stalled): aborted.
  // FAILED_PRECONDITION: the communicator was aborted by an earlier failure.
  // UNAVAILABLE / INTERNAL / ...: NCCL or CUDA reported an error: aborted.
  virtual absl::Status AllReduceSum(float* data, size_t count) = 0;

  virtual int rank() const = 0;
  virtual int world() const = 0;
  virtual int device() const = 0;

 protected:
  NcclCommunicator() = default;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_NCCL_NCCL_COMMUNICATOR_H_
