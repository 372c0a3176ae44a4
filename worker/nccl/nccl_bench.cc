// nccl_bench: NcclCommunicator::AllReduceSum throughput on the GPUs of this machine.
//
//   bazel run --config=cuda //worker/nccl:nccl_bench [-- --gpus=2 --min_bytes=4096 ...]
//
// One thread and one communicator per GPU (world = number of GPUs used), all in this process.
// For each size from --min_bytes to --max_bytes (doubling) and each buffer kind ("device":
// in place; "host": staged through the communicator's device buffer) prints one JSON line:
//   {"bench":"nccl_allreduce","world":2,"buffer":"device","bytes":4096,"iters":200,
//    "time_us":9.8,"algbw_gbps":0.42,"busbw_gbps":0.42}
// time_us: mean time of one all-reduce (slowest rank); algbw = bytes / time; busbw = algbw *
// 2 (world - 1) / world, as nccl-tests reports it (0 for world = 1). GB = 1e9 bytes.
// Without a GPU it prints one {"bench":"nccl_allreduce","skipped":"..."} line and exits 0.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "worker/nccl/nccl_communicator.h"

ABSL_FLAG(int, gpus, 0, "GPUs to use (0: all).");
ABSL_FLAG(int64_t, min_bytes, 4 << 10, "Smallest buffer, bytes.");
ABSL_FLAG(int64_t, max_bytes, 64 << 20, "Largest buffer, bytes.");
ABSL_FLAG(int, iters, 0, "Timed iterations per size (0: about 1 GiB moved, 5..200).");
ABSL_FLAG(int, warmup, 5, "Untimed iterations per size.");

namespace gradmesh {
namespace {

void PrintJsonError(const std::string& what, const absl::Status& s) {
  std::printf("{\"bench\":\"nccl_allreduce\",\"error\":\"%s: %s\"}\n", what.c_str(),
              std::string(s.message()).c_str());
}

int Run() {
  const int have = CudaDeviceCount();
  if (have == 0) {
    std::printf(
        "{\"bench\":\"nccl_allreduce\",\"skipped\":"
        "\"no CUDA device (CudaDeviceCount() == 0%s)\"}\n",
        NcclBuiltIn() ? "" : "; built without --config=cuda");
    return 0;
  }
  const int world =
      absl::GetFlag(FLAGS_gpus) > 0 ? std::min(absl::GetFlag(FLAGS_gpus), have) : have;
  auto id = NcclCommunicator::GetUniqueId();
  if (!id.ok()) {
    PrintJsonError("GetUniqueId", id.status());
    return 1;
  }
  std::vector<std::unique_ptr<NcclCommunicator>> comms(world);
  std::vector<absl::Status> errors(world);
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        auto c = NcclCommunicator::Create(r, world, *id, r);
        if (c.ok()) {
          comms[r] = std::move(*c);
        } else {
          errors[r] = c.status();
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  for (int r = 0; r < world; ++r) {
    if (!errors[r].ok()) {
      PrintJsonError("Create", errors[r]);
      return 1;
    }
  }

  const size_t max_count = static_cast<size_t>(absl::GetFlag(FLAGS_max_bytes)) / sizeof(float);
  std::vector<std::vector<float>> host(world, std::vector<float>(max_count, 1.0f));
  std::vector<float*> dev(world, nullptr);
  for (int r = 0; r < world; ++r) {
    cudaSetDevice(r);
    if (cudaMalloc(reinterpret_cast<void**>(&dev[r]), max_count * sizeof(float)) != cudaSuccess) {
      PrintJsonError("cudaMalloc", absl::ResourceExhaustedError("device buffer"));
      return 1;
    }
    cudaMemset(dev[r], 0, max_count * sizeof(float));
  }

  for (const char* buffer : {"device", "host"}) {
    const bool on_device = std::string(buffer) == "device";
    for (int64_t bytes = absl::GetFlag(FLAGS_min_bytes); bytes <= absl::GetFlag(FLAGS_max_bytes);
         bytes *= 2) {
      const size_t count = static_cast<size_t>(bytes) / sizeof(float);
      int iters = absl::GetFlag(FLAGS_iters);
      if (iters <= 0) iters = static_cast<int>(std::clamp<int64_t>((1LL << 30) / bytes, 5, 200));
      std::vector<absl::Duration> took(world);
      std::vector<std::thread> threads;
      for (int r = 0; r < world; ++r) {
        threads.emplace_back([&, r] {
          float* data = on_device ? dev[r] : host[r].data();
          for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
            errors[r].Update(comms[r]->AllReduceSum(data, count));
          }
          const absl::Time start = absl::Now();
          for (int i = 0; i < iters && errors[r].ok(); ++i) {
            errors[r].Update(comms[r]->AllReduceSum(data, count));
          }
          took[r] = absl::Now() - start;
        });
      }
      for (auto& t : threads) t.join();
      for (int r = 0; r < world; ++r) {
        if (!errors[r].ok()) {
          PrintJsonError("AllReduceSum", errors[r]);
          return 1;
        }
      }
      const double seconds =
          absl::ToDoubleSeconds(*std::max_element(took.begin(), took.end())) / iters;
      const double algbw = static_cast<double>(bytes) / seconds / 1e9;
      const double busbw = algbw * 2.0 * (world - 1) / world;
      std::printf(
          "{\"bench\":\"nccl_allreduce\",\"world\":%d,\"buffer\":\"%s\",\"bytes\":%lld,"
          "\"iters\":%d,\"time_us\":%.2f,\"algbw_gbps\":%.3f,\"busbw_gbps\":%.3f}\n",
          world, buffer, static_cast<long long>(bytes), iters, seconds * 1e6, algbw, busbw);
      std::fflush(stdout);
    }
  }
  for (int r = 0; r < world; ++r) {
    cudaSetDevice(r);
    cudaFree(dev[r]);
  }
  // Every rank finalises at once: one rank's finalisation may wait for the others'.
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { comms[r].reset(); });
  for (auto& t : threads) t.join();
  return 0;
}

}  // namespace
}  // namespace gradmesh

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return gradmesh::Run();
}
