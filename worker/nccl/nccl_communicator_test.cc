// Tests of NcclCommunicator on real GPUs (--config=cuda, tag "gpu").
//
// Argument checks and the no-GPU path run everywhere; the rest GTEST_SKIPs when the machine
// has too few CUDA devices: world=1 on one GPU (host and device buffers, a peer that never
// joins), and with >= 2 GPUs two nccl_rank processes (sum; a stalled peer; a dead peer).
#include "worker/nccl/nccl_communicator.h"

#include <cuda_runtime_api.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"

namespace gradmesh {
namespace {

using testutil::LinesWith;
using testutil::LogField;
using testutil::ReadFile;
using testutil::Subprocess;

#define REQUIRE_GPUS(n)                                                                   \
  do {                                                                                    \
    const int have = CudaDeviceCount();                                                   \
    if (have < (n)) {                                                                     \
      GTEST_SKIP() << "needs " << (n) << " CUDA device(s), CudaDeviceCount() = " << have; \
    }                                                                                     \
  } while (0)

const std::string kDummyId(kNcclUniqueIdBytes, '\0');

TEST(NcclCommunicatorTest, BuiltWithNccl) { EXPECT_TRUE(NcclBuiltIn()); }

TEST(NcclCommunicatorTest, CreateRejectsBadArguments) {
  EXPECT_STATUS_MSG(NcclCommunicator::Create(0, 0, kDummyId, 0), absl::StatusCode::kInvalidArgument,
                    "rank 0 of 0");
  EXPECT_STATUS(NcclCommunicator::Create(-1, 2, kDummyId, 0), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(NcclCommunicator::Create(2, 2, kDummyId, 0), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS_MSG(NcclCommunicator::Create(0, 1, "short", 0), absl::StatusCode::kInvalidArgument,
                    "unique id has 5 bytes, want 128");
  EXPECT_STATUS_MSG(NcclCommunicator::Create(0, 1, kDummyId, -1),
                    absl::StatusCode::kInvalidArgument, "negative CUDA device");
  NcclOptions bad;
  bad.timeout = absl::ZeroDuration();
  EXPECT_STATUS_MSG(NcclCommunicator::Create(0, 1, kDummyId, 0, bad),
                    absl::StatusCode::kInvalidArgument, "timeout > 0");
}

TEST(NcclCommunicatorTest, NoGpuIsFailedPrecondition) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "this machine has a CUDA device";
  EXPECT_STATUS_MSG(NcclCommunicator::Create(0, 1, kDummyId, 0),
                    absl::StatusCode::kFailedPrecondition, "no CUDA device");
}

TEST(NcclCommunicatorTest, DeviceOutOfRange) {
  REQUIRE_GPUS(1);
  const int n = CudaDeviceCount();
  EXPECT_STATUS_MSG(NcclCommunicator::Create(0, 1, kDummyId, n), absl::StatusCode::kInvalidArgument,
                    absl::StrCat("this process sees ", n, " CUDA device(s)"));
}

TEST(NcclCommunicatorTest, UniqueIdsAreFreshAndSized) {
  REQUIRE_GPUS(1);
  ASSERT_OK_AND_ASSIGN(std::string a, NcclCommunicator::GetUniqueId());
  ASSERT_OK_AND_ASSIGN(std::string b, NcclCommunicator::GetUniqueId());
  EXPECT_EQ(a.size(), kNcclUniqueIdBytes);
  EXPECT_EQ(b.size(), kNcclUniqueIdBytes);
  EXPECT_NE(a, b);
}

TEST(NcclCommunicatorTest, WorldOneHostBuffers) {
  REQUIRE_GPUS(1);
  ASSERT_OK_AND_ASSIGN(std::string id, NcclCommunicator::GetUniqueId());
  ASSERT_OK_AND_ASSIGN(auto comm, NcclCommunicator::Create(0, 1, id, 0));
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->world(), 1);
  EXPECT_EQ(comm->device(), 0);
  // Growing, then shrinking: the staging buffer is reused and enlarged as needed.
  for (size_t count : {size_t{1}, size_t{1000}, size_t{1} << 22, size_t{7}}) {
    std::vector<float> data(count);
    for (size_t i = 0; i < count; ++i) data[i] = 0.25f * static_cast<float>(i % 1001) - 3.0f;
    const std::vector<float> want = data;  // the sum over one rank
    ASSERT_OK(comm->AllReduceSum(data.data(), count));
    EXPECT_EQ(data, want) << "count " << count;
  }
  EXPECT_OK(comm->AllReduceSum(nullptr, 0));
  EXPECT_STATUS_MSG(comm->AllReduceSum(nullptr, 3), absl::StatusCode::kInvalidArgument,
                    "null pointer");
  float x = 1.5f;
  ASSERT_OK(comm->AllReduceSum(&x, 1));  // still usable after a rejected call
  EXPECT_EQ(x, 1.5f);
}

TEST(NcclCommunicatorTest, WorldOneDeviceBufferInPlace) {
  REQUIRE_GPUS(1);
  ASSERT_OK_AND_ASSIGN(std::string id, NcclCommunicator::GetUniqueId());
  ASSERT_OK_AND_ASSIGN(auto comm, NcclCommunicator::Create(0, 1, id, 0));
  const size_t count = 100003;
  std::vector<float> host(count);
  for (size_t i = 0; i < count; ++i) host[i] = static_cast<float>(i % 977) - 488.0f;
  float* dev = nullptr;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), count * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), count * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  EXPECT_OK(comm->AllReduceSum(dev, count));
  std::vector<float> back(count, -1.0f);
  ASSERT_EQ(cudaMemcpy(back.data(), dev, count * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  cudaFree(dev);
  EXPECT_EQ(back, host);
}

TEST(NcclCommunicatorTest, DeviceBufferOfAnotherDeviceIsRejected) {
  REQUIRE_GPUS(2);
  ASSERT_OK_AND_ASSIGN(std::string id, NcclCommunicator::GetUniqueId());
  ASSERT_OK_AND_ASSIGN(auto comm, NcclCommunicator::Create(0, 1, id, 0));
  float* dev = nullptr;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), 16 * sizeof(float)), cudaSuccess);
  EXPECT_STATUS_MSG(comm->AllReduceSum(dev, 16), absl::StatusCode::kInvalidArgument,
                    "memory of CUDA device 1");
  cudaFree(dev);
}

TEST(NcclCommunicatorTest, PeerThatNeverJoinsTimesOut) {
  REQUIRE_GPUS(1);
  ASSERT_OK_AND_ASSIGN(std::string id, NcclCommunicator::GetUniqueId());
  NcclOptions options;
  options.timeout = absl::Seconds(2);
  const absl::Time start = absl::Now();
  EXPECT_STATUS_MSG(NcclCommunicator::Create(0, 2, id, 0, options),
                    absl::StatusCode::kDeadlineExceeded, "NCCL rank 0 of 2 (CUDA device 0)");
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Seconds(2));
  EXPECT_LT(took, absl::Seconds(20));
}

// Two nccl_rank processes on devices 0 and 1; this process makes the id (and so hosts NCCL's
// bootstrap root, as rank 0's worker would).
class TwoProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_GPUS(2);
    const char* test_name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    ASSERT_OK_AND_ASSIGN(dir_, testutil::MakeTestDir(test_name));
    ASSERT_OK_AND_ASSIGN(binary_, testutil::RunfilePath("worker/nccl/nccl_rank"));
    ASSERT_OK_AND_ASSIGN(std::string id, NcclCommunicator::GetUniqueId());
    id_file_ = dir_ + "/id";
    std::ofstream(id_file_, std::ios::binary) << id;
  }

  std::unique_ptr<Subprocess> Start(int rank, const std::string& mode, int timeout_ms) {
    auto p = Subprocess::Start(
        {binary_, absl::StrCat("--rank=", rank), "--world=2", absl::StrCat("--device=", rank),
         "--id_file=" + id_file_, "--count=1000003", "--mode=" + mode,
         absl::StrCat("--timeout_ms=", timeout_ms)},
        {}, absl::StrCat(dir_, "/rank", rank, ".log"));
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }

  // The rank's result line field `key`.
  static std::string Field(Subprocess* p, const std::string& key) {
    std::vector<std::string> lines = LinesWith(ReadFile(p->log_path()), "nccl_rank rank=");
    if (lines.empty()) return "<no result line in " + p->log_path() + ">";
    return LogField(lines.back(), key).value_or("<no " + key + ">");
  }

  std::string dir_, binary_, id_file_;
};

TEST_F(TwoProcessTest, SumsAcrossProcesses) {
  auto r0 = Start(0, "sum", 60000);
  auto r1 = Start(1, "sum", 60000);
  ASSERT_TRUE(r0 && r1);
  ASSERT_OK_AND_ASSIGN(int c0, r0->Wait(absl::Seconds(120)));
  ASSERT_OK_AND_ASSIGN(int c1, r1->Wait(absl::Seconds(120)));
  EXPECT_EQ(c0, 0) << ReadFile(r0->log_path());
  EXPECT_EQ(c1, 0) << ReadFile(r1->log_path());
  EXPECT_EQ(Field(r0.get(), "code"), "OK");
  EXPECT_EQ(Field(r1.get(), "code"), "OK");
}

TEST_F(TwoProcessTest, StalledPeerGivesDeadlineExceeded) {
  auto r0 = Start(0, "sum", 3000);
  auto r1 = Start(1, "stall", 3000);
  ASSERT_TRUE(r0 && r1);
  ASSERT_OK_AND_ASSIGN(int c0, r0->Wait(absl::Seconds(60)));
  EXPECT_EQ(c0, 3) << ReadFile(r0->log_path());
  EXPECT_EQ(Field(r0.get(), "code"), "DEADLINE_EXCEEDED") << ReadFile(r0->log_path());
  EXPECT_EQ(Field(r0.get(), "second_code"), "FAILED_PRECONDITION");
  EXPECT_TRUE(r1->Running());  // stalled, not dead; killed by its Subprocess
}

TEST_F(TwoProcessTest, DeadPeerGivesAnErrorNotAHang) {
  auto r0 = Start(0, "sum", 5000);
  auto r1 = Start(1, "exit", 5000);
  ASSERT_TRUE(r0 && r1);
  ASSERT_OK_AND_ASSIGN(int c0, r0->Wait(absl::Seconds(60)));
  EXPECT_EQ(c0, 3) << ReadFile(r0->log_path());
  // NCCL may notice the closed connection (UNAVAILABLE) before the deadline does.
  const std::string code = Field(r0.get(), "code");
  EXPECT_TRUE(code == "DEADLINE_EXCEEDED" || code == "UNAVAILABLE") << ReadFile(r0->log_path());
  EXPECT_EQ(Field(r0.get(), "second_code"), "FAILED_PRECONDITION");
}

}  // namespace
}  // namespace gradmesh
