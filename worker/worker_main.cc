// gradmesh_worker: trains one worker's share (rank) of a job.
//
//   gradmesh_worker --job=job.yaml --servers=127.0.0.1:7001,127.0.0.1:7002 --rank=0   (ps)
//   gradmesh_worker --job=job.yaml --mode=allreduce --peers=127.0.0.1:7101,127.0.0.1:7102 --rank=0
//
// Flags given explicitly override the job spec's fields. Prints one final line
//   event=done ... steps=... samples=... wall_s=... samples_per_s=... accuracy=...
// and exits 0 on success, 1 on a training error (including a spec the shards refuse, such as
// an unknown optimizer or mode), 2 on bad flags or spec detected locally (unknown fields,
// ranges, unknown model or dataset).
// SIGTERM/SIGINT stop the run after the current step (the worker still reports Finish).
//
// Service mode: gradmesh_worker --coordinator=host:port [--peer_port=P --slots=N] registers
// with the coordinator and runs the ranks it places here (worker/worker_agent.h); SIGTERM
// stops them after their current step, reports them stopped (the coordinator moves them) and
// exits 0.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/daemon.h"
#include "common/job_name.h"
#include "common/job_spec.h"
#include "common/logging.h"
#include "common/status.h"
#include "rpc/auth.h"
#include "rpc/grpc_util.h"
#include "rpc/rpc_options.h"
#include "rpc/tls.h"
#include "runtime/daemon_main.h"
#include "runtime/metrics_http.h"
#include "runtime/node_agent.h"
#include "worker/allreduce/collective_service.h"
#include "worker/blas_core.h"
#include "worker/gossip/gossip_service.h"
#include "worker/model_publisher.h"
#include "worker/modes.h"
#include "worker/nccl/nccl_communicator.h"
#include "worker/ps/parameter_client.h"
#include "worker/trainer.h"
#include "worker/worker_agent.h"
#include "worker/worker_metrics.h"

ABSL_FLAG(std::string, job, "", "Job spec file (YAML or JSON). Empty: defaults plus flags.");
ABSL_FLAG(std::string, servers, "",
          "Comma-separated host:port of the shards, shard order (ps modes).");
ABSL_FLAG(std::string, peers, "",
          "gossip/allreduce: comma-separated host:port of every worker's peer service, rank "
          "order; this worker serves on the entry of its rank.");
ABSL_FLAG(std::string, coordinator, "",
          "Service mode: host:port of gradmesh_coordinator. The worker registers, serves its "
          "peer service on --peer_port and runs the tasks the coordinator places on it; no "
          "--job/--servers/--rank then.");
ABSL_FLAG(std::string, auth_token_file, "",
          "Service mode: file holding the token the coordinator takes from daemons (its "
          "--node_token_file, or its API token when it has none).");
ABSL_FLAG(std::string, job_token_file, "",
          "Standalone: file holding the job's token, sent to the shards and the peers and required "
          "by this worker's peer service (gossip, allreduce). Empty: no token (peer service open; "
          "for loopback tests).");
ABSL_FLAG(int, peer_port, 0, "Service mode: peer-service port (0 = any free one).");
ABSL_FLAG(std::string, host, "0.0.0.0", "Service mode: address the peer service listens on.");
ABSL_FLAG(std::string, advertise_host, "",
          "Service mode: host name peers and the coordinator use for this worker (default: "
          "--host, or this host's name when --host is 0.0.0.0).");
ABSL_FLAG(int, slots, 1, "Service mode: ranks this worker runs at once.");
ABSL_FLAG(std::string, port_file, "", "Service mode: write the bound peer port here.");
ABSL_FLAG(std::string, checkpoint_dir, "/var/lib/gradmesh/checkpoints",
          "gossip/allreduce: checkpoint directory when the spec names none.");
ABSL_FLAG(std::string, node_token_store, "",
          "Service mode: file keeping this node's coordinator-issued token across restarts, so "
          "a restarted daemon registers again at once instead of after the coordinator's "
          "heartbeat timeout. Default: <checkpoint_dir>/node-<node>.token; none: memory only.");
ABSL_FLAG(int, metrics_port, -1,
          "Port of the Prometheus endpoint (HTTP GET /metrics, /healthz) on --host: 0 = pick a "
          "free one (see --metrics_port_file), -1 = none.");
ABSL_FLAG(std::string, metrics_port_file, "",
          "If set, the metrics endpoint's bound port is written to this file.");
ABSL_FLAG(int, rank, 0, "This worker's rank in [0, num_workers).");
ABSL_FLAG(std::string, data_dir, "/var/lib/gradmesh/data",
          "Directory holding one folder per dataset (mnist/, fashion-mnist/).");
ABSL_FLAG(int, threads, 1, "LibTorch intra-op threads.");
ABSL_FLAG(std::string, device, "auto",
          "Where forward/backward run: auto (a GPU when this worker's LibTorch has CUDA and "
          "sees one, else the CPU), cpu, or cuda (fail at job start without a GPU).");
ABSL_FLAG(int, gpu, -1, "GPU index for --device=cuda/auto; -1: rank % visible GPUs.");
ABSL_FLAG(std::string, device_codec, "auto",
          "Where a ps push codec (topk, fp16, bf16 and their compositions) runs: auto (on the "
          "GPU when the worker computes there, so only the payload crosses to the host), off "
          "(gradients copied to the host and encoded there), or on (also on the CPU, through "
          "LibTorch's kernels).");
ABSL_FLAG(std::string, node, "",
          "Node name: in logs, and in service mode this daemon's identity in the coordinator "
          "(keep it across restarts; default: host name, or host:port in service mode).");
ABSL_FLAG(bool, evaluate, true, "Rank 0 waits for all workers, evaluates and saves the model.");
ABSL_FLAG(int64_t, max_message_mb, 256, "Largest gRPC message sent or received, MiB.");
ABSL_FLAG(int64_t, http2_window_kb, 0,
          "HTTP/2 flow control window, KiB: 0 = gRPC's own (windows sized by probing the link), "
          "N = a fixed window of N KiB per stream, no probing (64 to 1048576; see README, "
          "Performance: faster for messages over 1 MiB, slower for 256 KiB-1 MiB ones).");
// Overrides of job spec fields (applied when set).
ABSL_FLAG(std::string, name, "", "Job name.");
ABSL_FLAG(std::string, model, "", "Model: mlp, lenet or torchscript.");
ABSL_FLAG(std::string, model_path, "", "TorchScript file for --model=torchscript.");
ABSL_FLAG(std::string, dataset, "", "Dataset: mnist, fashion-mnist or tensors.");
ABSL_FLAG(std::string, dataset_path, "",
          "Directory of the dataset's files (default: --data_dir/<dataset>); for tensors: "
          "train*.pt and test*.pt written by torch.save({'x': X, 'y': Y}, f).");
ABSL_FLAG(std::string, loss, "", "Loss: cross_entropy (default), mse or module.");
ABSL_FLAG(std::string, mode, "",
          "Training mode: async (or ps), ssp:<s>, sync, gossip or allreduce.");
ABSL_FLAG(std::string, optimizer, "", "Optimizer: sgd, adam or adamw.");
ABSL_FLAG(double, lr, 0, "Learning rate.");
ABSL_FLAG(double, momentum, 0, "SGD momentum (optimizer.momentum; 0: the spec's).");
ABSL_FLAG(std::string, lr_schedule, "", "Learning-rate schedule: constant or cosine.");
ABSL_FLAG(std::string, precision, "", "Job spec precision: fp32 or bf16 (autocast forward).");
ABSL_FLAG(int32_t, accumulation_steps, 0,
          "Job spec accumulation_steps: micro-batches of --batch_size per optimizer step.");
ABSL_FLAG(double, clip_grad_norm, 0, "Job spec clip_grad_norm (0: off).");
ABSL_FLAG(double, clip_grad_value, 0, "Job spec clip_grad_value (0: off).");
ABSL_FLAG(std::string, loss_scale, "",
          "Job spec loss_scale.mode: dynamic (default with --precision=fp16) or none.");
ABSL_FLAG(int32_t, pipeline, 0,
          "Job spec pipeline (async/ssp): 1 = step t's exchange overlaps step t+1's compute.");
ABSL_FLAG(int32_t, overlap, 0,
          "Job spec overlap (async/ssp/sync): 1 = each shard's part of the push leaves as soon "
          "as backward produced it; 2 = also start the next forward at once, each layer "
          "waiting only for its own values (built-in models).");
ABSL_FLAG(std::string, placement, "",
          "Job spec placement (ps modes): greedy (default) or ordered (contiguous ranges of "
          "the model; pair with --overlap=1 or 2).");
ABSL_FLAG(std::string, lr_scaling, "",
          "Job spec lr_scaling.rule: none, linear or sqrt (needs --lr_base_batch_size).");
ABSL_FLAG(int32_t, lr_base_batch_size, 0, "Job spec lr_scaling.base_batch_size.");
ABSL_FLAG(int64_t, lr_warmup_steps, 0, "Job spec lr_scaling.warmup_steps.");
ABSL_FLAG(int32_t, inner_steps, 0, "mode diloco: diloco.inner_steps (local steps per round).");
ABSL_FLAG(std::string, outer_optimizer, "", "mode diloco: diloco.outer_optimizer (nesterov, sgd).");
ABSL_FLAG(double, outer_lr, 0, "mode diloco: diloco.outer_lr.");
ABSL_FLAG(double, outer_momentum, 0, "mode diloco: diloco.outer_momentum.");
ABSL_FLAG(int, batch_size, 0, "Samples per worker per step.");
ABSL_FLAG(int, epochs, 0, "Epochs.");
ABSL_FLAG(int64_t, steps, 0, "Steps per worker (instead of epochs).");
ABSL_FLAG(int, num_workers, 0, "Number of workers.");
ABSL_FLAG(int64_t, chunk_bytes, 0, "Partition chunk size in bytes.");
ABSL_FLAG(int, log_every, 0, "Steps between progress lines.");
ABSL_FLAG(std::string, output, "", "Where rank 0 saves the final model.");
ABSL_FLAG(uint64_t, seed, 0, "Seed for initialisation and data order.");
ABSL_FLAG(std::string, durability, "", "Shard durability: none, periodic or every_update.");
ABSL_FLAG(int64_t, snapshot_every_updates, 0, "Shard snapshot interval in updates.");
ABSL_FLAG(double, snapshot_every_seconds, -1, "Shard snapshot interval in seconds (0: off).");
ABSL_FLAG(double, barrier_timeout_s, 0, "sync/ssp: seconds to wait for other workers.");
ABSL_FLAG(bool, staleness_damping, false, "async: scale lr by 1/(1+staleness).");
ABSL_FLAG(std::string, push_codec, "",
          "Gradient codec: fp16, bf16, topk:<r>, topk_approx:<r>, randomk:<r>, qsgd:<bits>, "
          "or <sparsifier>+fp16|bf16. Empty: dense float32.");
ABSL_FLAG(std::string, pull_codec, "",
          "Parameter codec for pulls: fp16, bf16, or changes (only changed entries, exact). "
          "Empty: float32.");
ABSL_FLAG(std::string, error_feedback, "", "true|false: residual accumulation for biased codecs.");
ABSL_FLAG(double, ef_momentum, 0, "DGC momentum correction factor (0: off).");
ABSL_FLAG(int64_t, warmup_steps, 0, "DGC sparsity warm-up steps (0: off).");
ABSL_FLAG(double, link_mbit, 0,
          "Model a link of this many Mbit/s per direction for this worker's tensor traffic "
          "(measurements on loopback; 0 = unlimited).");
ABSL_FLAG(int64_t, ps_spin_wait_us, 300,
          "ps modes: waiting for its shards' answers, the worker first spins (yielding the CPU) "
          "for up to this many µs while its recent waits were under half of it; 0 = always "
          "block (GrpcParameterClientOptions.spin_wait).");
ABSL_FLAG(std::string, ps_transport, "stream",
          "ps modes: how pushes and pulls reach the shards: stream (one gRPC stream per shard), "
          "unary (a call per operation) or shm (shared memory with each shard on this machine, "
          "run by the same user; the stream for the others).");
ABSL_FLAG(int32_t, ps_max_attempts, 0,
          "ps modes: attempts of each call to the shards (first included; 100 ms backoff "
          "doubling to 5 s) before the rank fails. 0: 40 standalone (a shard down for about 3 "
          "min), 400 as a daemon (about 33 min: the coordinator shows the job PAUSED).");
ABSL_FLAG(int64_t, step_delay_ms, 0,
          "Fault injection for tests: sleep this long before every step (a slow worker).");
ABSL_FLAG(std::vector<std::string>, fault_nonfinite_steps, {},
          "Fault injection for tests: steps (comma-separated) after whose backward this rank's "
          "gradient holds a NaN, as an fp16 overflow would leave it.");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain this daemon presents (TLS on with it or --tls_ca_file).");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(std::string, tls_ca_file, "", "PEM CA bundle peers' certificates are verified against.");
ABSL_FLAG(bool, tls_client_auth, false,
          "Require and verify client certificates (mutual TLS; needs --tls_ca_file).");
ABSL_FLAG(bool, allow_insecure, false,
          "Allow tokens over plaintext to non-loopback addresses (no TLS).");

namespace gradmesh {
namespace {

// The TLS flags, checked (rpc/tls.h).
absl::StatusOr<TlsOptions> TlsFlags() {
  return MakeTlsOptions(absl::GetFlag(FLAGS_tls_cert_file), absl::GetFlag(FLAGS_tls_key_file),
                        absl::GetFlag(FLAGS_tls_ca_file), absl::GetFlag(FLAGS_tls_client_auth),
                        absl::GetFlag(FLAGS_allow_insecure));
}

// The gRPC options of this worker's channels and servers (--max_message_mb, --link_mbit,
// --http2_window_kb, TLS), checked.
absl::StatusOr<RpcOptions> RpcFlags() {
  RpcOptions rpc;
  rpc.max_message_bytes = absl::GetFlag(FLAGS_max_message_mb) << 20;
  rpc.link_bits_per_s = absl::GetFlag(FLAGS_link_mbit) * 1e6;
  ASSIGN_OR_RETURN(rpc.http2_window_bytes,
                   Http2WindowBytesFromKb(absl::GetFlag(FLAGS_http2_window_kb)));
  ASSIGN_OR_RETURN(rpc.tls, TlsFlags());
  return rpc;
}

// --ps_spin_wait_us, checked: InvalidArgument if negative.
absl::StatusOr<absl::Duration> SpinWaitFlag() {
  const int64_t us = absl::GetFlag(FLAGS_ps_spin_wait_us);
  if (us < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ps_spin_wait_us must be >= 0 (0: always block), got ", us));
  }
  return absl::Microseconds(us);
}

// --ps_transport, checked: InvalidArgument listing the known transports otherwise.
absl::StatusOr<std::string> TransportFlag() {
  const std::string t = absl::GetFlag(FLAGS_ps_transport);
  if (t != "stream" && t != "unary" && t != "shm") {
    return absl::InvalidArgumentError(
        absl::StrCat("--ps_transport: \"", t, "\" is not one of stream, unary, shm"));
  }
  return t;
}

// --ps_max_attempts, checked; 0 is the default for how the worker runs.
absl::StatusOr<int32_t> MaxAttemptsFlag(bool standalone) {
  const int32_t n = absl::GetFlag(FLAGS_ps_max_attempts);
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ps_max_attempts must be >= 0 (0: the default), got ", n));
  }
  return n > 0 ? n : standalone ? 40 : 400;
}

// The parameter client's flags of a standalone worker (--ps_*, RPC), checked.
absl::Status StandaloneClientFlags(GrpcParameterClientOptions* client) {
  ASSIGN_OR_RETURN(client->spin_wait, SpinWaitFlag());
  ASSIGN_OR_RETURN(client->transport, TransportFlag());
  ASSIGN_OR_RETURN(client->max_attempts, MaxAttemptsFlag(/*standalone=*/true));
  ASSIGN_OR_RETURN(client->rpc, RpcFlags());
  return absl::OkStatus();
}

struct WorkerMainOptions {
  TrainerOptions trainer;
  GrpcParameterClientOptions client;
  std::string node;
};

// The job-spec overrides of the training guardrails and DiLoCo (flags of the same names).
void ApplyTrainingFeatureFlags(JobSpec* spec_ptr) {
  JobSpec& spec = *spec_ptr;
  if (!absl::GetFlag(FLAGS_precision).empty()) spec.set_precision(absl::GetFlag(FLAGS_precision));
  if (absl::GetFlag(FLAGS_accumulation_steps) != 0) {
    spec.set_accumulation_steps(absl::GetFlag(FLAGS_accumulation_steps));
  }
  if (absl::GetFlag(FLAGS_clip_grad_norm) != 0) {
    spec.set_clip_grad_norm(absl::GetFlag(FLAGS_clip_grad_norm));
  }
  if (absl::GetFlag(FLAGS_clip_grad_value) != 0) {
    spec.set_clip_grad_value(absl::GetFlag(FLAGS_clip_grad_value));
  }
  if (absl::GetFlag(FLAGS_pipeline) != 0) spec.set_pipeline(absl::GetFlag(FLAGS_pipeline));
  if (absl::GetFlag(FLAGS_overlap) != 0) spec.set_overlap(absl::GetFlag(FLAGS_overlap));
  if (!absl::GetFlag(FLAGS_placement).empty()) spec.set_placement(absl::GetFlag(FLAGS_placement));
  if (!absl::GetFlag(FLAGS_loss_scale).empty()) {
    spec.mutable_loss_scale()->set_mode(absl::GetFlag(FLAGS_loss_scale));
  }
  if (!absl::GetFlag(FLAGS_lr_scaling).empty()) {
    spec.mutable_lr_scaling()->set_rule(absl::GetFlag(FLAGS_lr_scaling));
  }
  if (absl::GetFlag(FLAGS_lr_base_batch_size) != 0) {
    spec.mutable_lr_scaling()->set_base_batch_size(absl::GetFlag(FLAGS_lr_base_batch_size));
  }
  if (absl::GetFlag(FLAGS_inner_steps) != 0) {
    spec.mutable_diloco()->set_inner_steps(absl::GetFlag(FLAGS_inner_steps));
  }
  if (!absl::GetFlag(FLAGS_outer_optimizer).empty()) {
    spec.mutable_diloco()->set_outer_optimizer(absl::GetFlag(FLAGS_outer_optimizer));
  }
  if (absl::GetFlag(FLAGS_outer_lr) != 0) {
    spec.mutable_diloco()->set_outer_lr(absl::GetFlag(FLAGS_outer_lr));
  }
  if (absl::GetFlag(FLAGS_outer_momentum) != 0) {
    spec.mutable_diloco()->set_outer_momentum(absl::GetFlag(FLAGS_outer_momentum));
  }
  if (absl::GetFlag(FLAGS_lr_warmup_steps) != 0) {
    spec.mutable_lr_scaling()->set_warmup_steps(absl::GetFlag(FLAGS_lr_warmup_steps));
  }
}

// Reads the spec file and flags into options; InvalidArgument on anything unusable.
absl::StatusOr<DeviceCodecUse> DeviceCodecFlag() {
  absl::StatusOr<DeviceCodecUse> use = ParseDeviceCodecUse(absl::GetFlag(FLAGS_device_codec));
  if (!use.ok()) return Annotate(use.status(), "--device_codec");
  return *use;
}

absl::StatusOr<WorkerMainOptions> ParseOptions() {
  WorkerMainOptions o;
  JobSpec spec;
  if (!absl::GetFlag(FLAGS_job).empty()) {
    auto loaded = LoadJobSpecFile(absl::GetFlag(FLAGS_job));
    if (!loaded.ok()) return loaded.status();
    spec = *loaded;
  }
  if (!absl::GetFlag(FLAGS_name).empty()) spec.set_name(absl::GetFlag(FLAGS_name));
  if (!absl::GetFlag(FLAGS_model).empty())
    spec.mutable_model()->set_name(absl::GetFlag(FLAGS_model));
  if (!absl::GetFlag(FLAGS_model_path).empty()) {
    spec.mutable_model()->set_path(absl::GetFlag(FLAGS_model_path));
  }
  if (!absl::GetFlag(FLAGS_dataset).empty()) {
    spec.mutable_dataset()->set_name(absl::GetFlag(FLAGS_dataset));
  }
  if (!absl::GetFlag(FLAGS_dataset_path).empty()) {
    spec.mutable_dataset()->set_path(absl::GetFlag(FLAGS_dataset_path));
  }
  if (!absl::GetFlag(FLAGS_loss).empty()) spec.set_loss(absl::GetFlag(FLAGS_loss));
  if (!absl::GetFlag(FLAGS_mode).empty()) spec.set_mode(absl::GetFlag(FLAGS_mode));
  if (!absl::GetFlag(FLAGS_optimizer).empty()) {
    spec.mutable_optimizer()->set_name(absl::GetFlag(FLAGS_optimizer));
  }
  if (absl::GetFlag(FLAGS_lr) != 0) spec.mutable_optimizer()->set_lr(absl::GetFlag(FLAGS_lr));
  if (absl::GetFlag(FLAGS_momentum) != 0) {
    spec.mutable_optimizer()->set_momentum(absl::GetFlag(FLAGS_momentum));
  }
  if (!absl::GetFlag(FLAGS_lr_schedule).empty()) {
    spec.mutable_optimizer()->set_lr_schedule(absl::GetFlag(FLAGS_lr_schedule));
  }
  if (absl::GetFlag(FLAGS_batch_size) != 0) spec.set_batch_size(absl::GetFlag(FLAGS_batch_size));
  ApplyTrainingFeatureFlags(&spec);
  if (absl::GetFlag(FLAGS_epochs) != 0) spec.set_epochs(absl::GetFlag(FLAGS_epochs));
  if (absl::GetFlag(FLAGS_steps) != 0) spec.set_steps(absl::GetFlag(FLAGS_steps));
  if (absl::GetFlag(FLAGS_num_workers) != 0) spec.set_num_workers(absl::GetFlag(FLAGS_num_workers));
  if (absl::GetFlag(FLAGS_chunk_bytes) != 0) spec.set_chunk_bytes(absl::GetFlag(FLAGS_chunk_bytes));
  if (absl::GetFlag(FLAGS_log_every) != 0) spec.set_log_every(absl::GetFlag(FLAGS_log_every));
  if (!absl::GetFlag(FLAGS_output).empty()) spec.set_output(absl::GetFlag(FLAGS_output));
  if (absl::GetFlag(FLAGS_seed) != 0) spec.set_seed(absl::GetFlag(FLAGS_seed));
  if (!absl::GetFlag(FLAGS_durability).empty()) {
    spec.mutable_durability()->set_mode(absl::GetFlag(FLAGS_durability));
  }
  if (absl::GetFlag(FLAGS_snapshot_every_updates) != 0) {
    spec.mutable_durability()->set_snapshot_every_updates(
        absl::GetFlag(FLAGS_snapshot_every_updates));
  }
  if (absl::GetFlag(FLAGS_snapshot_every_seconds) >= 0) {
    spec.mutable_durability()->set_snapshot_every_seconds(
        absl::GetFlag(FLAGS_snapshot_every_seconds));
  }
  if (absl::GetFlag(FLAGS_barrier_timeout_s) != 0) {
    spec.set_barrier_timeout_s(absl::GetFlag(FLAGS_barrier_timeout_s));
  }
  if (absl::GetFlag(FLAGS_staleness_damping)) spec.set_staleness_damping(true);
  CompressionSpec* cs = spec.mutable_compression();
  if (!absl::GetFlag(FLAGS_push_codec).empty()) cs->set_push(absl::GetFlag(FLAGS_push_codec));
  if (!absl::GetFlag(FLAGS_pull_codec).empty()) cs->set_pull(absl::GetFlag(FLAGS_pull_codec));
  if (!absl::GetFlag(FLAGS_error_feedback).empty()) {
    const std::string ef = absl::GetFlag(FLAGS_error_feedback);
    if (ef != "true" && ef != "false") {
      return absl::InvalidArgumentError("--error_feedback must be true or false");
    }
    cs->set_error_feedback(ef == "true");
  }
  if (absl::GetFlag(FLAGS_ef_momentum) != 0) cs->set_momentum(absl::GetFlag(FLAGS_ef_momentum));
  if (absl::GetFlag(FLAGS_warmup_steps) != 0) {
    cs->set_warmup_steps(absl::GetFlag(FLAGS_warmup_steps));
  }
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_servers), ',', absl::SkipEmpty())) {
    o.client.servers.emplace_back(s);
  }
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_peers), ',', absl::SkipEmpty())) {
    o.trainer.peers.emplace_back(s);
  }
  const bool ps = IsPsMode(SpecMode(spec));
  if (ps && o.client.servers.empty()) {
    return absl::InvalidArgumentError("--servers is required (host:port of each shard)");
  }
  ApplyJobSpecDefaults(static_cast<int>(o.client.servers.size()), &spec);
  RETURN_IF_ERROR(ValidateJobSpec(spec));
  if (ps && spec.num_shards() != static_cast<int>(o.client.servers.size())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("job spec asks for %d shards but --servers lists %d", spec.num_shards(),
                        o.client.servers.size()));
  }
  if (!absl::GetFlag(FLAGS_job_token_file).empty()) {
    ASSIGN_OR_RETURN(o.trainer.job_token, ReadTokenFile(absl::GetFlag(FLAGS_job_token_file)));
    o.client.job_token = o.trainer.job_token;
  }
  o.trainer.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  o.trainer.spec = spec;
  o.trainer.rank = absl::GetFlag(FLAGS_rank);
  o.trainer.data_dir = absl::GetFlag(FLAGS_data_dir);
  o.trainer.intra_op_threads = absl::GetFlag(FLAGS_threads);
  ASSIGN_OR_RETURN(o.trainer.device, ParseComputeDevice(absl::GetFlag(FLAGS_device)));
  o.trainer.gpu = absl::GetFlag(FLAGS_gpu);
  ASSIGN_OR_RETURN(o.trainer.device_codec, DeviceCodecFlag());
  o.trainer.evaluate = absl::GetFlag(FLAGS_evaluate) && o.trainer.rank == 0;
  o.trainer.step_delay = absl::Milliseconds(absl::GetFlag(FLAGS_step_delay_ms));
  for (const std::string& s : absl::GetFlag(FLAGS_fault_nonfinite_steps)) {
    int64_t step = 0;
    if (!absl::SimpleAtoi(s, &step) || step < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--fault_nonfinite_steps: \"", s, "\" is not a step number"));
    }
    o.trainer.nonfinite_steps.push_back(step);
  }
  o.client.worker = o.trainer.rank;
  SetClientOptionsFromSpec(spec, &o.client);
  RETURN_IF_ERROR(StandaloneClientFlags(&o.client));
  o.trainer.peer_rpc = o.client.rpc;
  o.trainer.peer_rpc.link_bits_per_s = 0;
  o.node = NodeNameOrHostName(absl::GetFlag(FLAGS_node));
  RETURN_IF_ERROR(CheckName("--node", o.node));
  return o;
}

// Service mode: register with the coordinator and run what it places here until SIGTERM.
MetricsEndpointOptions MetricsFlags() {
  MetricsEndpointOptions m;
  m.host = absl::GetFlag(FLAGS_host);
  m.port = absl::GetFlag(FLAGS_metrics_port);
  m.port_file = absl::GetFlag(FLAGS_metrics_port_file);
  return m;
}

// Which OpenBLAS kernels the workers' matrix products run on (worker/blas_core.h), and what
// OpenBLAS had chosen by itself when main() replaced it.
void LogBlasCore(const Logger& logger) {
  const BlasCoreReport blas = ReportBlasCore();
  if (blas.core.empty()) return;
  logger.Info("blas", {Kv("core", blas.core),
                       Kv("detected", blas.detected.empty() ? blas.core : blas.detected)});
}

// What service mode takes from the flags, checked before anything starts.
struct ServiceFlags {
  RpcOptions rpc;
  ComputeDevice device = ComputeDevice::kCpu;
  DeviceCodecUse device_codec = DeviceCodecUse::kAuto;
  absl::Duration spin_wait;
  std::string transport;
  int32_t max_attempts = 400;
};

absl::StatusOr<ServiceFlags> CheckServiceFlags(const std::string& node, const std::string& token) {
  ServiceFlags f;
  ASSIGN_OR_RETURN(f.rpc, RpcFlags());
  RETURN_IF_ERROR(
      CheckTokenTransport(absl::GetFlag(FLAGS_coordinator), f.rpc.tls, token, "node token"));
  if (!node.empty()) RETURN_IF_ERROR(CheckName("--node", node));
  absl::StatusOr<ComputeDevice> device = ParseComputeDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok()) return Annotate(device.status(), "--device");
  f.device = *device;
  ASSIGN_OR_RETURN(f.device_codec, DeviceCodecFlag());
  ASSIGN_OR_RETURN(f.spin_wait, SpinWaitFlag());
  ASSIGN_OR_RETURN(f.transport, TransportFlag());
  ASSIGN_OR_RETURN(f.max_attempts, MaxAttemptsFlag(/*standalone=*/false));
  return f;
}

int RunService() {
  // The node name is the daemon's identity in the coordinator; by default its advertised
  // peer address (host:port), known once the peer service is bound below.
  std::string node = absl::GetFlag(FLAGS_node);
  Logger boot_logger({Kv("node", node.empty() ? HostName() : node), Kv("role", "worker")});
  Logger* log = &boot_logger;
  LogBlasCore(boot_logger);
  std::string token;
  if (!absl::GetFlag(FLAGS_auth_token_file).empty()) {
    auto t = ReadTokenFile(absl::GetFlag(FLAGS_auth_token_file));
    if (!t.ok()) {
      log->Error("bad_arguments", {Kv("error", t.status().ToString())});
      return 2;
    }
    token = *t;
  }
  absl::StatusOr<ServiceFlags> flags = CheckServiceFlags(node, token);
  if (!flags.ok()) {
    log->Error("bad_arguments", {Kv("error", flags.status().ToString())});
    return 2;
  }
  const RpcOptions rpc = flags->rpc;
  CollectiveServiceImpl collective;
  GossipServiceImpl gossip;
  const std::string host = absl::GetFlag(FLAGS_host);
  DaemonOptions daemon_options;
  daemon_options.address = absl::StrCat(host, ":", absl::GetFlag(FLAGS_peer_port));
  daemon_options.port_file = absl::GetFlag(FLAGS_port_file);
  daemon_options.rpc = rpc;
  daemon_options.shutdown_grace = absl::Seconds(2);
  daemon_options.metrics = MetricsFlags();
  Daemon daemon(daemon_options, log);
  if (absl::Status st = daemon.Serve({&collective, &gossip}); !st.ok()) {
    log->Error("listen_failed",
               {Kv("port", absl::GetFlag(FLAGS_peer_port)), Kv("error", st.ToString())});
    return kExitFailed;
  }
  std::string advertise = absl::GetFlag(FLAGS_advertise_host);
  if (advertise.empty()) advertise = AdvertisedHost(host);
  const std::string address = absl::StrCat(advertise, ":", daemon.port());
  if (node.empty()) node = address;
  Logger logger({Kv("node", node), Kv("role", "worker")});
  daemon.set_logger(&logger);
  logger.Info("peer_service", {Kv("address", address)});
  LogListenSecurity(daemon.ListenAddress(), rpc.tls, &logger);

  WorkerAgentOptions wo;
  wo.base.data_dir = absl::GetFlag(FLAGS_data_dir);
  wo.base.intra_op_threads = absl::GetFlag(FLAGS_threads);
  wo.base.device = flags->device;
  wo.base.gpu = absl::GetFlag(FLAGS_gpu);
  wo.base.device_codec = flags->device_codec;
  wo.base.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  wo.base.step_delay = absl::Milliseconds(absl::GetFlag(FLAGS_step_delay_ms));
  wo.base.logger = &logger;
  wo.base.peer_rpc = rpc;
  wo.base.peer_rpc.link_bits_per_s = 0;
  wo.client.rpc = rpc;
  wo.client.logger = &logger;
  wo.client.spin_wait = flags->spin_wait;
  wo.client.transport = flags->transport;
  // A shard that is down pauses the job (the coordinator says PAUSED) until it is back: keep
  // retrying for about half an hour (5 s apart) by default.
  wo.client.max_attempts = flags->max_attempts;
  wo.peer_services = PeerServices{&collective, &gossip};
  wo.logger = &logger;
  // The node's own token, obtained by the NodeAgent below, authenticates rank 0's model
  // uploads as this node (the coordinator takes them only from rank 0's node).
  auto node_token = std::make_shared<NodeTokenHolder>();
  ModelPublisherOptions po;
  po.coordinator = absl::GetFlag(FLAGS_coordinator);
  po.auth_token = token;
  po.rpc = rpc;
  po.rpc.link_bits_per_s = 0;
  po.node = node;
  po.node_token = node_token;
  ModelPublisher publisher(std::move(po));
  wo.publisher = &publisher;
  WorkerAgent worker_agent(wo);
  MetricsRegistry metrics;
  metrics.AddCollector(
      [&worker_agent](MetricsWriter* w) { CollectWorkerMetrics(worker_agent.Reports(), w); });
  if (!daemon.StartMetrics(&metrics).ok()) return kExitFailed;

  NodeAgentOptions ao;
  ao.coordinator = absl::GetFlag(FLAGS_coordinator);
  ao.auth_token = token;
  ao.rpc = rpc;
  ao.rpc.link_bits_per_s = 0;
  ao.logger = &logger;
  ao.node_token = node_token;
  ao.node.set_name(node);
  ao.node.set_role(WORKER);
  ao.node.set_address(address);
  ao.node.set_cores(static_cast<int>(std::thread::hardware_concurrency()));
  ao.node.set_gpus(CudaDeviceCount());  // 0 without --config=cuda or without a GPU.
  ao.node.set_slots(absl::GetFlag(FLAGS_slots));
  ao.node.set_host(HostName());
  ao.token_store = OpenNodeTokenStore(absl::GetFlag(FLAGS_node_token_store),
                                      absl::GetFlag(FLAGS_checkpoint_dir), node, &logger);
  NodeAgent node_agent(
      ao, [&worker_agent](const std::vector<Task>& desired) { worker_agent.Reconcile(desired); },
      [&worker_agent] { return worker_agent.Reports(); });
  node_agent.Start();
  ShutdownSteps steps;
  // Preemption: every task stops after its current step (leaving its position on the shards
  // or its checkpoint); the last heartbeat reports them stopped so they move elsewhere. The
  // metrics endpoint then stops before worker_agent, which its collector reads.
  steps.before_server_stop = [&worker_agent, &node_agent] {
    worker_agent.StopAll();
    node_agent.Stop(/*leaving=*/true);
  };
  return daemon.WaitForSignalAndShutdown(steps);
}

int Run() {
  if (!absl::GetFlag(FLAGS_coordinator).empty()) return RunService();
  auto parsed = ParseOptions();
  if (!parsed.ok()) {
    Logger({Kv("role", "worker")})
        .Error("bad_arguments", {Kv("error", parsed.status().ToString())});
    return 2;
  }
  WorkerMainOptions o = std::move(parsed).value();
  // Shared with the detached signal thread below, which may outlive Run().
  auto shared_logger =
      std::make_shared<Logger>(std::vector<LogField>{Kv("node", o.node), Kv("role", "worker")});
  Logger& logger = *shared_logger;
  LogBlasCore(logger);
  o.trainer.logger = &logger;
  o.client.logger = &logger;
  // Metrics: the latest progress of this rank, as a service-mode daemon would report it.
  absl::Mutex progress_mu;
  TaskReport latest =
      ReportFromProgress(o.trainer.spec.name(), o.trainer.rank, "running", TrainProgress());
  o.trainer.on_progress = [&progress_mu, &latest, name = o.trainer.spec.name(),
                           rank = o.trainer.rank](const TrainProgress& p) {
    absl::MutexLock lock(&progress_mu);
    const int64_t checkpoint = latest.checkpoint_step();
    latest = ReportFromProgress(name, rank, "running", p);
    // The final (evaluation) report carries no checkpoint step: keep the last one.
    if (p.checkpoint_step < 0) latest.set_checkpoint_step(checkpoint);
  };
  MetricsRegistry metrics;
  metrics.AddCollector([&progress_mu, &latest](MetricsWriter* w) {
    absl::MutexLock lock(&progress_mu);
    CollectWorkerMetrics({latest}, w);
  });
  auto metrics_server = StartMetricsEndpoint(MetricsFlags(), &metrics, &logger);
  if (!metrics_server.ok()) {
    logger.Error("listen_failed", {Kv("error", metrics_server.status().ToString())});
    return 1;
  }
  logger.Info("job_spec",
              {Kv("job", o.trainer.spec.name()), Kv("spec", JobSpecToJson(o.trainer.spec))});
  const GrpcParameterClientOptions client_options = o.client;
  CollectiveServiceImpl collective;
  GossipServiceImpl gossip;
  auto trainer = Trainer::Create(o.trainer, BuiltinTrainingModes(
                                                [&client_options](JobLayout layout) {
                                                  return NewGrpcParameterClient(std::move(layout),
                                                                                client_options);
                                                },
                                                PeerServices{&collective, &gossip}));
  if (!trainer.ok()) {
    logger.Error("bad_arguments", {Kv("error", trainer.status().ToString())});
    return 2;
  }
  std::unique_ptr<grpc::Server> peer_server;
  // gossip/allreduce: serve this rank's peer service before training starts (after
  // Trainer::Create has checked the rank and that --peers names every worker).
  if (!o.trainer.peers.empty() && !IsPsMode(SpecMode(o.trainer.spec))) {
    const std::string& address = o.trainer.peers[o.trainer.rank];
    RpcOptions rpc = o.trainer.peer_rpc;
    int port = 0;
    auto started = StartGrpcServer(address, {&collective, &gossip}, rpc, "", &port);
    if (!started.ok()) {
      logger.Error("bad_arguments", {Kv("error", "cannot serve the peer service on " + address),
                                     Kv("cause", started.status().ToString())});
      return 2;
    }
    peer_server = std::move(started).value();
    logger.Info("peer_service", {Kv("address", address), Kv("rank", o.trainer.rank)});
    LogListenSecurity(address, rpc.tls, &logger);
  }
  // Stop after the current step on SIGTERM/SIGINT. The detached thread shares ownership of
  // what it touches, so a signal that arrives after Run() has returned (while the process
  // shuts down) finds them alive.
  std::shared_ptr<Trainer> shared_trainer = std::move(*trainer);
  StartTerminationSignalThread([shared_trainer, shared_logger](const std::string& sig) {
    shared_logger->Info("signal", {Kv("signal", sig)});
    shared_trainer->RequestStop();
  });
  auto result = shared_trainer->Run();
  if (peer_server != nullptr)
    peer_server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  if (!result.ok()) {
    logger.Error("failed",
                 {Kv("job", o.trainer.spec.name()), Kv("error", result.status().ToString())});
    return 1;
  }
  const TrainResult& r = *result;
  logger.Info("done", {Kv("job", o.trainer.spec.name()),
                       Kv("steps", r.steps),
                       Kv("samples", r.samples),
                       Kv("wall_s", absl::StrFormat("%.2f", r.wall_s)),
                       Kv("samples_per_s", absl::StrFormat("%.1f", r.samples_per_s)),
                       Kv("loss", absl::StrFormat("%.4f", r.final_loss)),
                       Kv("accuracy", absl::StrFormat("%.4f", r.test_accuracy)),
                       Kv("test_loss", absl::StrFormat("%.4f", r.test_loss)),
                       Kv("perplexity", absl::StrFormat("%.3f", r.perplexity)),
                       Kv("data_s", absl::StrFormat("%.2f", r.data_s)),
                       Kv("compute_s", absl::StrFormat("%.2f", r.compute_s)),
                       Kv("comm_s", absl::StrFormat("%.2f", r.comm_s)),
                       Kv("bytes_pushed", r.bytes_pushed),
                       Kv("bytes_pulled", r.bytes_pulled),
                       Kv("raw_bytes_pushed", r.raw_bytes_pushed),
                       Kv("raw_bytes_pulled", r.raw_bytes_pulled),
                       Kv("codec_s", absl::StrFormat("%.2f", r.codec_s)),
                       Kv("stopped_early", r.stopped_early ? "true" : "false"),
                       Kv("first_step", r.first_step),
                       Kv("skipped_steps", r.skipped_steps)});
  return 0;
}

}  // namespace
}  // namespace gradmesh

int main(int argc, char** argv) {
  // Before anything else (no threads yet): OpenBLAS chose its kernels when it loaded.
  gradmesh::ReexecWithBetterBlasCore(argv);
  gradmesh::ProcessOptions process;
  process.tune_allocator_for_large_messages = true;
  gradmesh::InitDaemonProcess(argc, argv, process);
  // OpenBLAS sizes its thread pool when the library loads, before main(): launchers set
  // OPENBLAS_NUM_THREADS=1 when several processes share the cores (see deploy/).
  return gradmesh::Run();
}
