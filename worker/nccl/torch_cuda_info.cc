// torch_cuda_info: which LibTorch this build linked, and whether it sees CUDA. Checks the
// --repo_env=GRADMESH_TORCH_CUDA flag (bazel/cuda.bzl):
//
//   bazel run --config=cuda --repo_env=GRADMESH_TORCH_CUDA=/opt/libtorch \
//       //worker/nccl:torch_cuda_info
//
// prints one JSON line, e.g. {"torch_version":"1.13.1","torch_cuda_available":true,
// "torch_cuda_devices":1,"cuda_devices":1}; with Debian's CPU LibTorch torch_cuda_available is
// false while cuda_devices (the CUDA runtime's count) may be > 0.
#include <cstdio>

#include "torch/torch.h"
#include "worker/nccl/nccl_communicator.h"

int main() {
  bool available = false;
  int torch_devices = 0;
  try {
    available = torch::cuda::is_available();
    torch_devices = static_cast<int>(torch::cuda::device_count());
  } catch (const c10::Error& e) {
    std::printf("{\"error\":\"%s\"}\n", e.what_without_backtrace());
    return 1;
  }
  std::printf(
      "{\"torch_version\":\"%s\",\"torch_cuda_available\":%s,\"torch_cuda_devices\":%d,"
      "\"cuda_devices\":%d}\n",
      TORCH_VERSION, available ? "true" : "false", torch_devices, gradmesh::CudaDeviceCount());
  return 0;
}
