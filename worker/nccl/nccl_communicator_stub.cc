// NcclCommunicator without --config=cuda: no CUDA device, and no communicator can be made.
// Lets worker code depend on //worker/nccl:nccl_communicator in every build.
#include "absl/strings/str_cat.h"
#include "worker/nccl/nccl_communicator.h"

namespace gradmesh {

int CudaDeviceCount() { return 0; }

bool NcclBuiltIn() { return false; }

absl::StatusOr<std::string> NcclCommunicator::GetUniqueId() {
  return absl::UnimplementedError(
      "NCCL is not built in: rebuild with --config=cuda (see bazel/cuda.bzl)");
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    int rank, int world, absl::string_view unique_id, int device, const NcclOptions& options) {
  (void)unique_id;
  (void)options;
  return absl::UnimplementedError(
      absl::StrCat("NCCL rank ", rank, " of ", world, " (CUDA device ", device,
                   "): NCCL is not built in: rebuild with --config=cuda (see bazel/cuda.bzl)"));
}

}  // namespace gradmesh
