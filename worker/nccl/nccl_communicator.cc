// NcclCommunicator on NCCL and the CUDA runtime (built under --config=cuda only).
//
// Every communicator is non-blocking (ncclConfig_t::blocking = 0) so that no NCCL call can
// block the caller indefinitely: init and collectives return ncclInProgress, and Wait() polls
// ncclCommGetAsyncError and cudaStreamQuery against a deadline, aborting the communicator
// (ncclCommAbort) when a peer is dead or stuck. That is NCCL's documented recipe for fault
// tolerance; a blocking communicator or cudaStreamSynchronize would hang forever instead.
#include "worker/nccl/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"

namespace gradmesh {
namespace {

static_assert(kNcclUniqueIdBytes == NCCL_UNIQUE_ID_BYTES, "NCCL unique id size changed");
static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES, "ncclUniqueId layout changed");

absl::StatusCode CodeForNccl(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return absl::StatusCode::kOk;
    case ncclInvalidArgument:
      return absl::StatusCode::kInvalidArgument;
    case ncclInvalidUsage:
      return absl::StatusCode::kFailedPrecondition;
    case ncclSystemError:  // sockets, shared memory, ...: usually a peer or network failure
    case ncclRemoteError:
      return absl::StatusCode::kUnavailable;
    case ncclUnhandledCudaError:
    case ncclInternalError:
      return absl::StatusCode::kInternal;
    default:
      return absl::StatusCode::kUnknown;
  }
}

absl::StatusCode CodeForCuda(cudaError_t e) {
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
      return absl::StatusCode::kInvalidArgument;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status CudaError(const std::string& where, const char* call, cudaError_t e) {
  return absl::Status(CodeForCuda(e), absl::StrCat(where, ": ", call, ": ", cudaGetErrorString(e),
                                                   " (", cudaGetErrorName(e), ")"));
}

// `comm` may be null (no communicator yet); then NCCL's last-error text is process-wide.
absl::Status NcclError(const std::string& where, const char* call, ncclResult_t r,
                       ncclComm_t comm) {
  std::string msg = absl::StrCat(where, ": ", call, ": ", ncclGetErrorString(r), " (ncclResult ",
                                 static_cast<int>(r), ")");
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&msg, "; NCCL: ", last);
  return absl::Status(CodeForNccl(r), msg);
}

std::string Where(int rank, int world, int device) {
  return absl::StrFormat("NCCL rank %d of %d (CUDA device %d)", rank, world, device);
}

// Spin-then-sleep polling shared by every wait.
class Poller {
 public:
  explicit Poller(const NcclOptions& options)
      : options_(options), spin_until_(absl::Now() + options.spin) {}
  void Pause() {
    if (absl::Now() < spin_until_) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(options_.poll_interval);
    }
  }

 private:
  const NcclOptions& options_;
  const absl::Time spin_until_;
};

class NcclCommunicatorImpl final : public NcclCommunicator {
 public:
  NcclCommunicatorImpl(int rank, int world, int device, const NcclOptions& options)
      : rank_(rank),
        world_(world),
        device_(device),
        options_(options),
        where_(Where(rank, world, device)) {}

  ~NcclCommunicatorImpl() override;

  // Creates the stream and joins the communicator (the body of Create).
  absl::Status Init(const ncclUniqueId& id);

  absl::Status AllReduceSum(float* data, size_t count) override;
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  int device() const override { return device_; }

 private:
  // Waits until the communicator has no operation in progress and, if `stream_too`, until the
  // stream is idle. Aborts and returns the error on an NCCL/CUDA error or at `deadline`.
  absl::Status Wait(const std::string& what, absl::Time deadline, bool stream_too)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Aborts the communicator (once) and remembers why; returns `error`.
  absl::Status AbortWith(absl::Status error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status EnsureStaging(size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const int rank_;
  const int world_;
  const int device_;
  const NcclOptions options_;
  const std::string where_;

  absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_) = nullptr;
  cudaStream_t stream_ ABSL_GUARDED_BY(mu_) = nullptr;
  void* staging_ ABSL_GUARDED_BY(mu_) = nullptr;  // device buffer for host data
  size_t staging_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status abort_reason_ ABSL_GUARDED_BY(mu_);
};

absl::Status NcclCommunicatorImpl::Init(const ncclUniqueId& id) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = cudaSetDevice(device_);
  if (e != cudaSuccess) return CudaError(where_, "cudaSetDevice", e);
  e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    stream_ = nullptr;
    return CudaError(where_, "cudaStreamCreateWithFlags", e);
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const absl::Time deadline = absl::Now() + options_.timeout;
  ncclResult_t r = ncclCommInitRankConfig(&comm_, world_, id, rank_, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    absl::Status error = NcclError(where_, "ncclCommInitRankConfig", r, comm_);
    if (comm_ != nullptr) return AbortWith(error);
    aborted_ = true;
    abort_reason_ = error;
    return error;
  }
  return Wait(absl::StrCat("joining the communicator (waiting for all ", world_, " ranks)"),
              deadline, /*stream_too=*/false);
}

absl::Status NcclCommunicatorImpl::AbortWith(absl::Status error) {
  if (!aborted_) {
    aborted_ = true;
    abort_reason_ = error;
    if (comm_ != nullptr) {
      // Local and non-blocking by contract; it also stops NCCL kernels stuck on the stream.
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }
  return error;
}

absl::Status NcclCommunicatorImpl::Wait(const std::string& what, absl::Time deadline,
                                        bool stream_too) {
  Poller poller(options_);
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) {
      return AbortWith(NcclError(where_, "ncclCommGetAsyncError", r, comm_));
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      return AbortWith(
          NcclError(absl::StrCat(where_, ", ", what), "asynchronous NCCL error", state, comm_));
    }
    if (state == ncclSuccess) {
      if (!stream_too) return absl::OkStatus();
      cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) {
        return AbortWith(CudaError(absl::StrCat(where_, ", ", what), "cudaStreamQuery", e));
      }
    }
    if (absl::Now() >= deadline) {
      return AbortWith(absl::DeadlineExceededError(absl::StrCat(
          where_, ", ", what, ": not finished within ", absl::FormatDuration(options_.timeout),
          " (a peer died, stalled or never joined); communicator aborted")));
    }
    poller.Pause();
  }
}

absl::Status NcclCommunicatorImpl::EnsureStaging(size_t bytes) {
  if (bytes <= staging_bytes_) return absl::OkStatus();
  if (staging_ != nullptr) {
    // The stream is idle here (every call ends with Wait), so nothing still uses the buffer.
    cudaFree(staging_);
    staging_ = nullptr;
    staging_bytes_ = 0;
  }
  cudaError_t e = cudaMalloc(&staging_, bytes);
  if (e != cudaSuccess) {
    staging_ = nullptr;
    cudaGetLastError();  // reset this thread's last error so later calls do not report it
    return CudaError(where_, absl::StrCat("cudaMalloc(", bytes, " bytes)").c_str(), e);
  }
  staging_bytes_ = bytes;
  return absl::OkStatus();
}

absl::Status NcclCommunicatorImpl::AllReduceSum(float* data, size_t count) {
  absl::MutexLock lock(&mu_);
  if (aborted_) {
    return absl::FailedPreconditionError(absl::StrCat(
        where_, ": communicator was aborted by an earlier failure: ", abort_reason_.message()));
  }
  if (count == 0) return absl::OkStatus();
  if (data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(where_, ": AllReduceSum of ", count, " floats at a null pointer"));
  }
  if (count > SIZE_MAX / sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat(where_, ": count ", count, " too large"));
  }
  const size_t bytes = count * sizeof(float);
  const absl::Time deadline = absl::Now() + options_.timeout;
  const std::string what = absl::StrCat("all-reduce of ", count, " floats");

  cudaError_t e = cudaSetDevice(device_);
  if (e != cudaSuccess) return CudaError(where_, "cudaSetDevice", e);

  cudaPointerAttributes attr;
  std::memset(&attr, 0, sizeof(attr));
  e = cudaPointerGetAttributes(&attr, data);
  if (e != cudaSuccess) {
    cudaGetLastError();  // pre-CUDA-11 runtimes report plain host memory as an error
    attr.type = cudaMemoryTypeUnregistered;
  }
  const bool on_device = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  if (attr.type == cudaMemoryTypeDevice && attr.device != device_) {
    return absl::InvalidArgumentError(
        absl::StrCat(where_, ": AllReduceSum got memory of CUDA device ", attr.device,
                     "; pass host memory or memory of device ", device_));
  }

  float* buffer = data;
  if (!on_device) {
    RETURN_IF_ERROR(EnsureStaging(bytes));
    buffer = static_cast<float*>(staging_);
    // From pageable memory the copy is staged by the driver; the stream is idle, so this
    // cannot wait on anything a peer controls.
    e = cudaMemcpyAsync(buffer, data, bytes, cudaMemcpyHostToDevice, stream_);
    if (e != cudaSuccess) {
      return AbortWith(
          CudaError(absl::StrCat(where_, ", ", what), "cudaMemcpyAsync(host to device)", e));
    }
  }
  ncclResult_t r = ncclAllReduce(buffer, buffer, count, ncclFloat32, ncclSum, comm_, stream_);
  if (r != ncclSuccess && r != ncclInProgress) {
    // Peers may already be inside this collective; only an abort keeps them from waiting.
    return AbortWith(NcclError(where_, "ncclAllReduce", r, comm_));
  }
  RETURN_IF_ERROR(Wait(what, deadline, /*stream_too=*/true));
  if (!on_device) {
    // Only now: a copy into pageable memory can block the host until the stream gets to it,
    // which would make a stuck collective hang here instead of timing out in Wait.
    e = cudaMemcpyAsync(data, buffer, bytes, cudaMemcpyDeviceToHost, stream_);
    if (e != cudaSuccess) {
      return AbortWith(
          CudaError(absl::StrCat(where_, ", ", what), "cudaMemcpyAsync(device to host)", e));
    }
    RETURN_IF_ERROR(Wait(what + " (copy back)", deadline, /*stream_too=*/true));
  }
  return absl::OkStatus();
}

NcclCommunicatorImpl::~NcclCommunicatorImpl() {
  absl::MutexLock lock(&mu_);
  cudaSetDevice(device_);
  if (!aborted_ && comm_ != nullptr) {
    const absl::Time deadline = absl::Now() + options_.timeout;
    ncclResult_t r = ncclCommFinalize(comm_);
    absl::Status s = (r == ncclSuccess || r == ncclInProgress)
                         ? Wait("finalising", deadline, /*stream_too=*/false)
                         : AbortWith(NcclError(where_, "ncclCommFinalize", r, comm_));
    if (s.ok()) {
      ncclCommDestroy(comm_);
      comm_ = nullptr;
    }
  }
  if (staging_ != nullptr) cudaFree(staging_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // no driver / no device is not an error here
    return 0;
  }
  return n;
}

bool NcclBuiltIn() { return true; }

absl::StatusOr<std::string> NcclCommunicator::GetUniqueId() {
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return NcclError("NCCL", "ncclGetUniqueId", r, nullptr);
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    int rank, int world, absl::string_view unique_id, int device, const NcclOptions& options) {
  const std::string where = Where(rank, world, device);
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": rank must be in [0, world) and world >= 1"));
  }
  if (unique_id.size() != kNcclUniqueIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": unique id has ", unique_id.size(),
                                                   " bytes, want ", kNcclUniqueIdBytes));
  }
  if (options.timeout <= absl::ZeroDuration() || options.spin < absl::ZeroDuration() ||
      options.poll_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": NcclOptions need timeout > 0, spin >= 0 and poll_interval >= 0 (got ",
        absl::FormatDuration(options.timeout), ", ", absl::FormatDuration(options.spin), ", ",
        absl::FormatDuration(options.poll_interval), ")"));
  }
  if (device < 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": negative CUDA device"));
  }
  const int devices = CudaDeviceCount();
  if (devices == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": no CUDA device (no GPU, or no/too old NVIDIA driver)"));
  }
  if (device >= devices) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": device out of range, this process sees ", devices, " CUDA device(s)"));
  }
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), kNcclUniqueIdBytes);
  auto comm = std::make_unique<NcclCommunicatorImpl>(rank, world, device, options);
  RETURN_IF_ERROR(comm->Init(id));
  return std::unique_ptr<NcclCommunicator>(std::move(comm));
}

}  // namespace gradmesh
