// What every training mode shares: the options a worker's rank runs with, the figures it
// reports, loading the job's data and the learning-rate schedule's length.
//
// Every mode (worker/ps/, worker/gossip/, worker/allreduce/) runs in the one training loop
// (worker/training_loop.h) from TrainerOptions and returns TrainResult, so worker_main and the
// coordinator agent treat them alike. Free of LibTorch and gRPC.
//
// Thread safety: plain data and pure functions.
#ifndef GRADMESH_WORKER_TRAIN_UTIL_H_
#define GRADMESH_WORKER_TRAIN_UTIL_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/mode.h"
#include "proto/gradmesh.pb.h"
#include "rpc/rpc_options.h"
#include "worker/core/dataset.h"
#include "worker/core/examples.h"

namespace gradmesh {

// Live figures of a running rank, for the coordinator's progress view.
struct TrainProgress {
  int64_t step = 0;  // Steps done (absolute, including resumed ones).
  int64_t total_steps = 0;
  int32_t epoch = 0;         // 1-based.
  double loss = 0;           // Mean over the last log window.
  double samples_per_s = 0;  // Over the last log window.
  double accuracy = -1;      // Set once evaluated (classification).
  double test_loss = -1;     // Set once evaluated.
  double perplexity = -1;    // Set once evaluated (sequence models).
  int64_t checkpoint_step = -1;
  double grad_norm = -1;         // Clipping jobs: mean pre-clip norm over the last window.
  double clipped_fraction = -1;  // Clipping jobs: fraction of the window's steps clipped.
  int64_t skipped_steps = -1;    // Loss scaling: steps skipped so far in this run (-1: off).
  double loss_scale = -1;        // Loss scaling: the current scale (-1: off).
};

// Where a rank runs forward and backward (worker flag --device). The modes never see it: they
// always exchange host float32 spans (ModelView); on a GPU the loop copies the parameters in
// before each forward and the gradients out after backward.
enum class ComputeDevice {
  kAuto,  // "auto": CUDA when this worker's LibTorch has CUDA and sees a GPU, else the CPU.
  kCpu,   // "cpu"
  kCuda,  // "cuda": FAILED_PRECONDITION at job start when there is no GPU to use.
};

// "auto", "cpu", "cuda"; INVALID_ARGUMENT listing them otherwise.
absl::StatusOr<ComputeDevice> ParseComputeDevice(const std::string& name);
const char* ComputeDeviceName(ComputeDevice device);

// Whether a push codec runs where backward left the gradients (worker flag --device_codec;
// worker/core/device_gradients.h says when a mode takes it).
enum class DeviceCodecUse {
  kAuto,  // "auto": on a GPU, where the mode and its push codec allow.
  kOff,   // "off": every gradient is copied to the host and encoded there.
  kOn,    // "on": also on the CPU (LibTorch's kernels), where the mode and codec allow.
};

// "auto", "off", "on"; INVALID_ARGUMENT listing them otherwise.
absl::StatusOr<DeviceCodecUse> ParseDeviceCodecUse(const std::string& name);
const char* DeviceCodecUseName(DeviceCodecUse use);

// Seconds elapsed since `since` (the training loop's and the modes' timers).
double SecondsSince(absl::Time since);

// The training loops' batch fetch: sleeps `step_delay` (fault injection; zero: none), then
// takes the loader's next batch and adds the time that took to *data_s. nullopt (nothing
// added) once the loader is done.
std::optional<Batch> NextBatch(BatchLoader* loader, absl::Duration step_delay, double* data_s);

// The proto element type of a model tensor's ElemType (TensorSpec.dtype, ModelTensorInfo.dtype).
DType ToProtoDType(ElemType type);

// The model's values at a consistent point (a checkpoint, the end of the job), for export:
// parameters then buffers, as ModelView has them (values as float32; dtypes says what the
// model holds).
struct ModelSnapshot {
  int64_t step = 0;    // Steps done (absolute).
  bool final = false;  // The job's final model.
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<ElemType> dtypes;
  std::vector<bool> buffer;
  std::vector<std::vector<float>> values;
};

struct TrainerOptions {
  JobSpec spec;              // Defaults applied and validated by the caller.
  Mode mode = Mode::kAsync;  // spec.mode(), parsed once by Trainer::Create.
  int32_t rank = 0;          // In [0, spec.num_workers()).
  // Daemon: the task's generation (the coordinator's count of its placements and restarts);
  // 0 standalone. An allreduce ring links only ranks of one generation, so a rank restarted
  // for a new generation never joins a peer's run of the old one.
  int64_t generation = 0;
  std::string data_dir;          // Parent of <dataset name>/ when spec.dataset.path is empty.
  bool evaluate = true;          // Wait for all workers, evaluate and save at the end.
  int32_t intra_op_threads = 1;  // torch::set_num_threads; 1 avoids oversubscription.
  ComputeDevice device = ComputeDevice::kAuto;  // Where forward/backward run.
  int32_t gpu = -1;  // kCuda/kAuto on a GPU: the device index; -1: rank % visible GPUs.
  DeviceCodecUse device_codec = DeviceCodecUse::kAuto;  // Push codecs on the device.
  absl::Duration wait_for_workers = absl::Minutes(30);  // Bound on the final wait (ps modes).
  // Fault injection for tests: sleep this long before every step (a slow worker).
  absl::Duration step_delay = absl::ZeroDuration();
  // Fault injection for tests: after backward of these steps (absolute), this rank's gradient
  // holds a NaN, as an fp16 overflow would leave it (exercises the loss-scaling skips).
  std::vector<int64_t> nonfinite_steps;
  // gossip/allreduce: peer-service address (host:port) of every rank, in rank order.
  std::vector<std::string> peers;
  // gossip/allreduce: options of the channels to the peers' services (limits, TLS).
  RpcOptions peer_rpc;
  // gossip/allreduce: where checkpoints go when spec.checkpoint.dir is empty.
  std::string checkpoint_dir;
  // The job's secret (empty: none, open). ps modes: sent to the shards, which check it.
  // gossip/allreduce: sent on every peer call and required by this rank's peer services
  // (worker/core/peer_token.h). Service mode: the coordinator's task; standalone:
  // --job_token_file.
  std::string job_token;
  // gossip/allreduce jobs placed by the coordinator: this rank's own token, sent on every peer
  // call, and the SHA-256 (raw) of every rank's, by rank, which this rank's peer services
  // check against the rank a call claims (worker/core/peer_token.h, "Rank identity"). Empty
  // (standalone): ranks are not told apart.
  std::string rank_token;
  std::vector<std::string> rank_token_hashes;
  // sync jobs re-formed after losing workers (empty: all ranks), and the lr factor for them.
  std::vector<int32_t> active_ranks;
  // Called with live figures at every progress line and at the end (may be empty).
  std::function<void(const TrainProgress&)> on_progress;
  // Called once the run knows where it starts, before its first step: the step it resumes
  // at (0 for a fresh start) and the job's total steps. May be empty.
  std::function<void(int64_t step, int64_t total_steps)> on_start;
  // gossip/allreduce, rank 0 only: called with the model after every checkpoint, at most every
  // model_publish_interval otherwise, and with the final model (may be empty). Service-mode
  // workers publish it to the coordinator, where `gradmesh export` reads it.
  std::function<void(const ModelSnapshot&)> on_model;
  absl::Duration model_publish_interval = absl::Seconds(60);
  const Logger* logger = nullptr;  // Not owned; may be null.
};

struct TrainResult {
  int64_t steps = 0;          // Steps this worker ran.
  int64_t samples = 0;        // Training samples this worker processed.
  double wall_s = 0;          // Seconds from the first step to the last exchange.
  double samples_per_s = 0;   // samples / wall_s.
  double final_loss = 0;      // Mean training loss over the last log window.
  double test_accuracy = -1;  // In [0, 1]; -1 if this worker did not evaluate or not a
                              // classification (token accuracy for sequence models).
  double test_loss = -1;      // Mean test loss; -1 if this worker did not evaluate.
  double perplexity = -1;     // exp(test_loss) for sequence models; -1 otherwise.
  double data_s = 0, compute_s = 0, comm_s = 0;        // Time split of the steps.
  int64_t bytes_pushed = 0, bytes_pulled = 0;          // On the wire (compressed).
  int64_t raw_bytes_pushed = 0, raw_bytes_pulled = 0;  // As float32.
  double codec_s = 0;                                  // Encoding pushes, decoding pulls.
  bool stopped_early = false;      // RequestStop() ended the run before the last step.
  int64_t first_step = 0;          // > 0 when the run resumed from a checkpoint or the shards.
  double consensus_distance = -1;  // gossip: last measured (see worker/gossip/).
  // Gradient clipping (clip_grad_norm / clip_grad_value): steps clipped at, and of those the
  // steps where something was clipped (as logged in progress lines).
  int64_t clip_steps = 0, clipped_steps = 0;
  // Dynamic loss scaling: steps skipped for a non-finite gradient, and the final scale.
  int64_t skipped_steps = 0;
  double loss_scale = 1;
};

// Opens the job's dataset from spec.dataset.path, or <data_dir>/<dataset name>: IDX files for
// mnist / fashion-mnist, train*.pt / test*.pt files for "tensors" (worker/core/tensor_files.h).
absl::StatusOr<JobData> LoadJobData(const JobSpec& spec, const std::string& data_dir);

// BatchLoader options for `rank` of the job (data sharded by rank, seeded order).
BatchLoader::Options LoaderOptions(const JobSpec& spec, int32_t rank);

// The job's optimizer spec with a decaying lr schedule's length filled in when the spec leaves
// it 0: `updates` (the number of optimizer updates the job makes, at least 1).
OptimizerSpec WithDecayUpdates(const OptimizerSpec& spec, int64_t updates);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_TRAIN_UTIL_H_
