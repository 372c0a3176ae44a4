// nccl_rank: one rank of a multi-process NCCL test (nccl_communicator_test starts these).
//
// Reads the communicator's unique id (raw kNcclUniqueIdBytes) from --id_file, joins as --rank
// of --world on --device, and then, by --mode:
//   sum    all-reduces a host buffer of --count floats, data[i] = 0.5 * (rank + 1) + i % 13,
//          and checks every element against the exact sum over ranks (small halves: exact in
//          float whatever the summation order); then does it again on device memory.
//   exit   exits right after joining (a dead peer for the others).
//   stall  sleeps after joining without ever calling (a stuck peer).
// Prints one line `nccl_rank rank=R code=CODE [second_code=CODE] message="..."` (code of the
// first failing call, or OK) and exits 0 (OK), 2 (wrong values) or 3 (an error status).
// In sum mode, after a failed all-reduce it calls AllReduceSum once more and reports that
// call's code as second_code (it must be FAILED_PRECONDITION: the communicator is aborted).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status.h"
#include "worker/nccl/nccl_communicator.h"

ABSL_FLAG(int, rank, 0, "This process's rank.");
ABSL_FLAG(int, world, 1, "Number of ranks.");
ABSL_FLAG(int, device, 0, "CUDA device of this rank.");
ABSL_FLAG(std::string, id_file, "", "File holding the raw NCCL unique id.");
ABSL_FLAG(int64_t, count, 1000, "Floats to all-reduce (mode sum).");
ABSL_FLAG(std::string, mode, "sum", "sum | exit | stall");
ABSL_FLAG(int, timeout_ms, 60000, "NcclOptions::timeout in milliseconds.");

namespace gradmesh {
namespace {

int Report(int rank, const absl::Status& status, const std::string& second_code = "") {
  std::printf("nccl_rank rank=%d code=%s%s%s message=\"%s\"\n", rank,
              StatusCodeName(status.code()).c_str(),
              second_code.empty() ? "" : " second_code=", second_code.c_str(),
              std::string(status.message()).c_str());
  std::fflush(stdout);
  return status.ok() ? 0 : 3;
}

float Value(int rank, size_t i) { return 0.5f * static_cast<float>(rank + 1) + (i % 13); }

// Index of the first element that is not the sum over ranks, or -1.
int64_t FirstWrong(const std::vector<float>& data, int world) {
  for (size_t i = 0; i < data.size(); ++i) {
    float want = 0;
    for (int r = 0; r < world; ++r) want += Value(r, i);
    if (data[i] != want) return static_cast<int64_t>(i);
  }
  return -1;
}

int Run() {
  const int rank = absl::GetFlag(FLAGS_rank);
  const int world = absl::GetFlag(FLAGS_world);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  std::ifstream in(absl::GetFlag(FLAGS_id_file), std::ios::binary);
  const std::string id((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  NcclOptions options;
  options.timeout = absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  auto comm = NcclCommunicator::Create(rank, world, id, absl::GetFlag(FLAGS_device), options);
  if (!comm.ok()) return Report(rank, comm.status());
  if (mode == "exit") {
    Report(rank, absl::OkStatus());
    std::_Exit(0);  // no finalisation: like a crash
  }
  if (mode == "stall") {
    Report(rank, absl::OkStatus());
    while (true) absl::SleepFor(absl::Seconds(1));
  }

  const size_t count = static_cast<size_t>(absl::GetFlag(FLAGS_count));
  std::vector<float> data(count);
  for (size_t i = 0; i < count; ++i) data[i] = Value(rank, i);
  absl::Status s = (*comm)->AllReduceSum(data.data(), count);
  if (!s.ok()) {
    absl::Status again = (*comm)->AllReduceSum(data.data(), count);
    return Report(rank, s, StatusCodeName(again.code()));
  }
  int64_t wrong = FirstWrong(data, world);
  if (wrong >= 0) {
    Report(rank, absl::DataLossError("host all-reduce: wrong value at index " +
                                     std::to_string(wrong) + ": " + std::to_string(data[wrong])));
    return 2;
  }

  // The same on device memory, reduced in place.
  for (size_t i = 0; i < count; ++i) data[i] = Value(rank, i);
  float* dev = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&dev), count * sizeof(float)) != cudaSuccess ||
      cudaMemcpy(dev, data.data(), count * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess) {
    return Report(rank, absl::InternalError("cudaMalloc/cudaMemcpy for the device test"));
  }
  s = (*comm)->AllReduceSum(dev, count);
  if (!s.ok()) return Report(rank, s);
  std::vector<float> back(count);
  cudaMemcpy(back.data(), dev, count * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(dev);
  wrong = FirstWrong(back, world);
  if (wrong >= 0) {
    Report(rank,
           absl::DataLossError("device all-reduce: wrong value at index " + std::to_string(wrong)));
    return 2;
  }
  return Report(rank, absl::OkStatus());
}

}  // namespace
}  // namespace gradmesh

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return gradmesh::Run();
}
