// Tests of the NcclCommunicator stub linked without --config=cuda: no device, and a clear
// UNIMPLEMENTED that says how to get NCCL.
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "worker/nccl/nccl_communicator.h"

namespace gradmesh {
namespace {

TEST(NcclStubTest, ReportsNoDeviceAndNoNccl) {
  EXPECT_EQ(CudaDeviceCount(), 0);
  EXPECT_FALSE(NcclBuiltIn());
}

TEST(NcclStubTest, EveryEntryPointIsUnimplemented) {
  EXPECT_STATUS_MSG(NcclCommunicator::GetUniqueId(), absl::StatusCode::kUnimplemented,
                    "--config=cuda");
  EXPECT_STATUS_MSG(NcclCommunicator::Create(1, 2, std::string(kNcclUniqueIdBytes, 'x'), 0),
                    absl::StatusCode::kUnimplemented, "NCCL rank 1 of 2 (CUDA device 0)");
}

}  // namespace
}  // namespace gradmesh
