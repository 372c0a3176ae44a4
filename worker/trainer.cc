#include "worker/trainer.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "compression/compressor.h"
#include "rpc/token_transport.h"
#include "worker/core/dataset.h"
#include "worker/model_names.h"
#include "worker/training_loop.h"

namespace gradmesh {

Trainer::~Trainer() = default;

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(TrainerOptions options,
                                                         const TrainingModeRegistry& modes) {
  const JobSpec& spec = options.spec;
  ASSIGN_OR_RETURN(options.mode, ParseMode(spec.mode().empty() ? "async" : spec.mode()));
  if (options.rank < 0 || options.rank >= spec.num_workers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer: rank ", options.rank, " not in [0, ", spec.num_workers(), ")"));
  }
  if (options.intra_op_threads < 1) {
    return absl::InvalidArgumentError("trainer: intra_op_threads must be >= 1");
  }
  if (!IsPsMode(options.mode) && static_cast<int>(options.peers.size()) != spec.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mode ", spec.mode(), " needs the peer address of every worker (--peers): got ",
        options.peers.size(), " for ", spec.num_workers(), " workers"));
  }
  // The job token rides every peer call: never in plaintext to another machine. A gossip
  // peer without an address (its rank has no node) is unreachable until it gets one.
  for (const std::string& peer : options.peers) {
    if (peer.empty() && options.mode == Mode::kGossip) continue;
    RETURN_IF_ERROR(
        CheckTokenTransport(peer, options.peer_rpc.tls, options.job_token, "job token"));
  }
  // The plain TCP ring links: authenticated when they connect (each rank proves it holds
  // bytes its successor sent over the TLS-protected gRPC ring), but not encrypted or
  // integrity-protected afterwards. Said once per task; transport "grpc" keeps TLS throughout.
  if (options.mode == Mode::kAllreduce && options.peer_rpc.tls.enabled() &&
      spec.allreduce().transport() != "grpc") {
    LogWarning(options.logger, "tcp_ring_plaintext",
               {Kv("job", spec.name()), Kv("rank", options.rank),
                Kv("warning",
                   "allreduce.transport tcp carries gradients unencrypted (links are "
                   "authenticated at connect over the TLS rendezvous); use allreduce.transport: "
                   "grpc on untrusted networks")});
  }
  // The fault injection writes a NaN into the gradient after backward; with overlap the
  // shards' parts have left by then, so the fault would be missed rather than tested.
  if (spec.overlap() > 0 && !options.nonfinite_steps.empty()) {
    return absl::InvalidArgumentError(
        "trainer: --fault_nonfinite_steps poisons the gradient after backward, which overlap: 1 "
        "or 2 has already sent; run the fault injection without overlap");
  }
  // Names are checked here, before any work, so a bad spec fails as bad arguments.
  if (absl::Status st = CheckModelName(spec.model().name()); !st.ok()) {
    return st;
  }
  // The push codec must parse; momentum correction and warm-up need a codec that uses them.
  const CompressionSpec& cs = spec.compression();
  if (cs.push() == "auto") {
    if (cs.momentum() != 0 || cs.warmup_steps() != 0) {
      return absl::InvalidArgumentError(
          "job spec: compression.push auto chooses its own codec; momentum and warmup_steps "
          "need an explicit codec");
    }
  } else if (!cs.push().empty()) {
    auto codec = CompressorRegistry::WithBuiltins().Create(cs.push());
    if (!codec.ok()) return Annotate(codec.status(), "job spec: compression.push");
    const bool feedback = (*codec)->biased() && (!cs.has_error_feedback() || cs.error_feedback());
    if (cs.momentum() != 0 && !feedback) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job spec: compression.momentum needs error feedback on a biased push codec (topk, "
          "topk_approx, fp16, bf16); \"",
          cs.push(), "\" with error_feedback=", feedback ? "true" : "false", " would ignore it"));
    }
    if (cs.warmup_steps() > 0 && (*codec)->density() >= 1.0) {
      return absl::InvalidArgumentError(
          absl::StrCat("job spec: compression.warmup_steps needs a sparsifying push codec, not \"",
                       cs.push(), "\""));
    }
  } else if (cs.momentum() != 0 || cs.warmup_steps() != 0) {
    return absl::InvalidArgumentError(
        "job spec: compression.momentum and warmup_steps need a push codec");
  }
  const std::vector<std::string> datasets = KnownDatasets();
  if (std::find(datasets.begin(), datasets.end(), spec.dataset().name()) == datasets.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown dataset \"", spec.dataset().name(),
                     "\"; known datasets: ", absl::StrJoin(datasets, ", ")));
  }
  ASSIGN_OR_RETURN(const TrainingModeFactory* factory, modes.Find(ModeName(options.mode)));
  std::unique_ptr<Trainer> trainer(new Trainer(std::move(options)));
  ASSIGN_OR_RETURN(trainer->mode_, (*factory)(trainer->options_));
  return trainer;
}

absl::StatusOr<TrainResult> Trainer::Run() {
  return RunTrainingLoop(options_, mode_.get(), stop_requested_);
}

}  // namespace gradmesh
