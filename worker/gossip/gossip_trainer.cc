// RunGossip: the training loop of mode "gossip" (see gossip_trainer.h). The only file of
// worker/gossip/ that uses LibTorch.
#include "worker/gossip/gossip_trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/grpc_util.h"
#include "common/optimizer.h"
#include "common/status.h"
#include "worker/dataset.h"
#include "worker/gossip/checkpoint.h"
#include "worker/gossip/gossip_service.h"
#include "worker/gossip/gossiper.h"
#include "worker/gossip/grpc_transport.h"
#include "worker/gossip/replica.h"
#include "worker/gossip/topology.h"
#include "worker/model.h"

namespace gradmesh {
namespace {

// The model's parameters as one flat vector: offsets into it, in model order.
struct FlatLayout {
  std::vector<torch::Tensor> params;
  std::vector<int64_t> offsets;  // offsets[i]: first element of params[i].
  int64_t numel = 0;

  void CopyIn(absl::Span<const float> x) {
    for (size_t i = 0; i < params.size(); ++i) {
      std::memcpy(params[i].data_ptr<float>(), x.data() + offsets[i],
                  params[i].numel() * sizeof(float));
    }
  }
  void CopyOut(float* x) const {
    for (size_t i = 0; i < params.size(); ++i) {
      std::memcpy(x + offsets[i], params[i].data_ptr<float>(), params[i].numel() * sizeof(float));
    }
  }
};

}  // namespace

absl::StatusOr<TrainResult> RunGossip(const TrainerOptions& options, GossipServiceImpl* local,
                                      const std::atomic<bool>& stop) {
  const JobSpec& spec = options.spec;
  const Logger* log = options.logger;
  const int32_t n = spec.num_workers();
  const int32_t rank = options.rank;
  if (local == nullptr) return absl::InvalidArgumentError("gossip: no local GossipService");
  if (rank < 0 || rank >= n || static_cast<int32_t>(options.peers.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("gossip: rank ", rank, " of ", n,
                                                   " workers with ", options.peers.size(),
                                                   " peer addresses"));
  }
  const GossipSpec& gs = spec.gossip();
  if (!(gs.timeout_s() > 0) || gs.every_steps() <= 0) {
    return absl::InvalidArgumentError(
        "gossip: gossip.timeout_s and gossip.every_steps must be > 0 (defaults not applied?)");
  }
  torch::set_num_threads(options.intra_op_threads);

  ASSIGN_OR_RETURN(DatasetFiles data, LoadJobData(spec, options.data_dir));
  ASSIGN_OR_RETURN(std::unique_ptr<Model> model, CreateModel(spec.model(), spec.seed()));
  FlatLayout flat;
  flat.params = model->Parameters();
  const std::vector<std::string> names = model->ParameterNames();
  for (size_t i = 0; i < flat.params.size(); ++i) {
    if (flat.params[i].scalar_type() != torch::kFloat || !flat.params[i].is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gossip: parameter ", names[i], " must be a contiguous float32 tensor"));
    }
    flat.offsets.push_back(flat.numel);
    flat.numel += flat.params[i].numel();
  }
  std::vector<float> values(flat.numel);
  flat.CopyOut(values.data());

  BatchLoader::Options lo = LoaderOptions(spec, rank);
  ASSIGN_OR_RETURN(std::unique_ptr<BatchLoader> loader,
                   BatchLoader::Create(&data.train, data.mean, data.stddev, lo));
  const int64_t total = loader->total_steps();

  const OptimizerSpec ospec = WithDecayUpdates(spec.optimizer(), total);  // One per local step.
  RETURN_IF_ERROR(ValidateLrSchedule(ospec));
  ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> optimizer,
                   OptimizerRegistry::WithBuiltins().Create(ospec));
  const int num_slots = optimizer->num_slots();
  std::vector<float> slots(static_cast<size_t>(num_slots) * flat.numel, 0.0f);
  std::vector<float*> slot_ptrs(num_slots);
  for (int s = 0; s < num_slots; ++s) slot_ptrs[s] = slots.data() + s * flat.numel;

  // Resume from this rank's checkpoint if there is one.
  const int64_t ckpt_every = spec.checkpoint().every_steps();
  const std::string ckpt_path = GossipCheckpointPath(
      spec.checkpoint().dir().empty() ? options.checkpoint_dir : spec.checkpoint().dir(),
      spec.name(), rank);
  double weight = 1.0;
  if (ckpt_every > 0) {
    absl::StatusOr<GossipCheckpoint> c = ReadGossipCheckpoint(ckpt_path);
    if (c.ok()) {
      if (static_cast<int64_t>(c->values.size()) != flat.numel || c->num_slots != num_slots ||
          c->rank != rank || c->num_workers != n) {
        return absl::FailedPreconditionError(absl::StrCat(
            "gossip: checkpoint ", ckpt_path, " holds rank ", c->rank, " of ", c->num_workers,
            " with ", c->values.size(), " values and ", c->num_slots,
            " optimizer slots; this is rank ", rank, " of ", n, " with ", flat.numel, " and ",
            num_slots));
      }
      values = std::move(c->values);
      std::copy(c->slots.begin(), c->slots.end(), slots.begin());
      weight = c->weight;
      lo.first_step = std::min(c->step, total);
      ASSIGN_OR_RETURN(loader, BatchLoader::Create(&data.train, data.mean, data.stddev, lo));
      LogInfo(log, "resuming", {Kv("job", spec.name()), Kv("rank", rank), Kv("step", lo.first_step),
                                Kv("weight", absl::StrFormat("%.6g", weight)),
                                Kv("checkpoint", ckpt_path)});
    } else if (c.status().code() != absl::StatusCode::kNotFound) {
      return c.status();
    }
  }

  GossipReplica::Options ro;
  ro.job = spec.name();
  ro.rank = rank;
  ro.num_workers = n;
  ro.total_steps = total;
  ro.root = 0;
  auto replica = std::make_shared<GossipReplica>(ro, std::move(values), weight, lo.first_step);
  RETURN_IF_ERROR(local->Register(replica));
  absl::Cleanup unregister = [local, &spec, rank] { local->Unregister(spec.name(), rank); };

  std::unique_ptr<GossipTransport> transport = NewGrpcGossipTransport(options.peers, RpcOptions{});
  ASSIGN_OR_RETURN(std::unique_ptr<Topology> topology,
                   TopologyRegistry::WithBuiltins().Create(gs.topology(), spec.seed()));
  GossiperOptions go;
  go.codec = gs.codec();
  go.timeout = absl::Seconds(gs.timeout_s());
  go.dead_after = std::max(3 * go.timeout, absl::Seconds(5));
  go.max_wait = options.wait_for_workers;
  go.logger = log;
  ASSIGN_OR_RETURN(std::unique_ptr<Gossiper> gossiper,
                   Gossiper::Create(go, replica, std::move(topology), transport.get()));
  gossiper->Start();

  const auto& img = data.train;
  const int64_t epochs = spec.steps() > 0
                             ? (total + loader->steps_per_epoch() - 1) / loader->steps_per_epoch()
                             : spec.epochs();
  LogInfo(log, "train_start",
          {Kv("job", spec.name()), Kv("rank", rank), Kv("model", spec.model().name()),
           Kv("dataset", spec.dataset().name()), Kv("params", flat.numel), Kv("steps", total),
           Kv("steps_per_epoch", loader->steps_per_epoch()), Kv("batch", spec.batch_size()),
           Kv("mode", "gossip"), Kv("topology", gs.topology()),
           Kv("every_steps", gs.every_steps()),
           Kv("codec", gs.codec().empty() ? "float32" : gs.codec())});

  int64_t last_checkpoint = -1;
  auto write_checkpoint = [&](ReplicaSnapshot snap, int64_t step) -> absl::Status {
    GossipCheckpoint c;
    c.rank = rank;
    c.num_workers = n;
    c.step = step;
    c.weight = snap.weight;
    c.values = std::move(snap.values);
    c.num_slots = num_slots;
    c.slots = slots;  // Only the training thread touches the slots.
    RETURN_IF_ERROR(WriteGossipCheckpoint(ckpt_path, c));
    last_checkpoint = step;
    LogInfo(log, "checkpoint", {Kv("job", spec.name()), Kv("rank", rank), Kv("step", step),
                                Kv("path", ckpt_path)});
    return absl::OkStatus();
  };

  TrainResult result;
  result.first_step = lo.first_step;
  model->SetTraining(true);
  const absl::Time start = absl::Now();
  absl::Time window_start = start;
  double window_loss = 0;
  int64_t window_steps = 0;
  int64_t step = lo.first_step;
  int64_t epoch = 0;
  std::vector<float> grad(flat.numel);
  while (true) {
    if (stop.load()) {
      result.stopped_early = true;
      LogInfo(log, "stop_requested", {Kv("job", spec.name()), Kv("step", step)});
      break;
    }
    std::optional<Batch> batch = NextBatch(loader.get(), options.step_delay, &result.data_s);
    if (!batch.has_value()) break;

    absl::Time t0 = absl::Now();
    {
      // The latest mixed values, copied under the replica's lock (never torn).
      torch::NoGradGuard no_grad;
      replica->Update([&flat](absl::Span<float> x) { flat.CopyIn(x); });
    }
    torch::Tensor x =
        torch::from_blob(batch->x.data(), {batch->size, 1, img.rows, img.cols}, torch::kFloat);
    torch::Tensor y = torch::from_blob(batch->y.data(), {batch->size}, torch::kLong);
    for (auto& p : flat.params) p.mutable_grad() = torch::Tensor();
    ASSIGN_OR_RETURN(torch::Tensor loss, CrossEntropyLoss(model.get(), x, y));
    try {
      loss.backward();
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("gossip: backward failed at step ", step, ": ",
                                              e.what_without_backtrace()));
    }
    const double loss_value = loss.item<double>();
    for (size_t i = 0; i < flat.params.size(); ++i) {
      const torch::Tensor& g = flat.params[i].grad();
      if (!g.defined()) {
        return absl::InternalError(absl::StrCat("gossip: no gradient for ", names[i]));
      }
      std::memcpy(grad.data() + flat.offsets[i], g.data_ptr<float>(), g.numel() * sizeof(float));
    }
    // The local optimizer step, on the shared values (which may have been mixed since the
    // forward pass: AD-PSGD applies the gradient to the current model).
    const float lr_scale = LrScheduleFactor(ospec, step);
    replica->Update([&](absl::Span<float> xs) {
      optimizer->Apply(step + 1, lr_scale, grad.data(), xs.data(), slot_ptrs.data(), flat.numel);
    });
    result.compute_s += SecondsSince(t0);
    ++step;
    replica->set_step(step);
    if (step % gs.every_steps() == 0) gossiper->RequestRound(step / gs.every_steps(), step);
    if (ckpt_every > 0 && step % ckpt_every == 0) {
      RETURN_IF_ERROR(write_checkpoint(replica->Snapshot(), step));
    }

    result.samples += batch->size;
    epoch = batch->epoch;
    window_loss += loss_value;
    ++window_steps;
    if (spec.log_every() > 0 && (step % spec.log_every() == 0 || step == total)) {
      const double dt = SecondsSince(window_start);
      result.final_loss = window_loss / window_steps;
      const double consensus = EstimateConsensus(replica->TakeConsensus(), n);
      if (consensus >= 0) result.consensus_distance = consensus;
      const GossiperStats gst = gossiper->stats();
      LogInfo(log, "progress",
              {Kv("job", spec.name()), Kv("rank", rank), Kv("step", step), Kv("total", total),
               Kv("epoch", epoch + 1), Kv("epochs", epochs),
               Kv("loss", absl::StrFormat("%.4f", result.final_loss)),
               Kv("samples_per_s", absl::StrFormat("%.0f", window_steps * spec.batch_size() / dt)),
               Kv("consensus", absl::StrFormat("%.5g", consensus)),
               Kv("weight", absl::StrFormat("%.4g", replica->State().weight)),
               Kv("mixed", gst.mixed), Kv("failed", gst.failed), Kv("coalesced", gst.coalesced)});
      if (options.on_progress) {
        TrainProgress p;
        p.step = step;
        p.total_steps = total;
        p.epoch = static_cast<int32_t>(epoch + 1);
        p.loss = result.final_loss;
        p.samples_per_s = window_steps * spec.batch_size() / dt;
        p.checkpoint_step = last_checkpoint;
        options.on_progress(p);
      }
      window_start = absl::Now();
      window_loss = 0;
      window_steps = 0;
    }
  }
  if (window_steps > 0) result.final_loss = window_loss / window_steps;
  result.steps = step - lo.first_step;
  result.wall_s = SecondsSince(start);
  result.samples_per_s = result.wall_s > 0 ? result.samples / result.wall_s : 0;

  // No more mixing in or out: a finished rank hands its final to rank 0; a stopped one keeps
  // its state for a resume (refusing exchanges with ABORTED, so peers retry it later).
  const absl::Time final_start = absl::Now();
  gossiper->Stop();
  const ReplicaSnapshot final = result.stopped_early ? replica->Stop() : replica->Finish();
  const GossiperStats gst = gossiper->stats();
  result.bytes_pushed = gst.bytes_sent;
  result.bytes_pulled = gst.bytes_received;
  result.raw_bytes_pushed = gst.raw_bytes_sent;
  result.raw_bytes_pulled = gst.raw_bytes_received;
  LogInfo(log, "gossip_stats",
          {Kv("job", spec.name()), Kv("rank", rank), Kv("rounds", gst.rounds),
           Kv("mixed", gst.mixed), Kv("failed", gst.failed), Kv("no_peer", gst.no_peer),
           Kv("kept", gst.kept), Kv("coalesced", gst.coalesced),
           Kv("resent", gst.resent), Kv("resent_duplicate", gst.resent_duplicate),
           Kv("unresolved_shares", gst.pending), Kv("bytes_sent", gst.bytes_sent),
           Kv("busy_s", absl::StrFormat("%.2f", gst.busy_s)),
           Kv("weight", absl::StrFormat("%.6g", final.weight))});
  if (result.stopped_early) {
    if (ckpt_every > 0) RETURN_IF_ERROR(write_checkpoint(final, step));
    return result;
  }
  if (rank != ro.root) {
    absl::Status st = gossiper->DeliverFinal(final);
    if (!st.ok()) {
      LogWarning(log, "final_not_delivered",
                 {Kv("job", spec.name()), Kv("rank", rank), Kv("error", st.ToString())});
    }
    result.comm_s = SecondsSince(final_start);
    return result;
  }
  FinalAverage avg = gossiper->GatherFinal();
  result.comm_s = SecondsSince(final_start);
  result.consensus_distance = avg.consensus;
  {
    torch::NoGradGuard no_grad;
    flat.CopyIn(avg.values);
  }
  if (options.evaluate) {
    ASSIGN_OR_RETURN(result.test_accuracy, EvaluateAccuracy(model.get(), data));
    LogInfo(log, "evaluated", {Kv("job", spec.name()), Kv("rank", rank),
                               Kv("accuracy", absl::StrFormat("%.4f", result.test_accuracy)),
                               Kv("test_samples", data.test.size),
                               Kv("ranks_averaged", avg.ranks.size())});
    if (!spec.output().empty()) {
      RETURN_IF_ERROR(model->Save(spec.output()));
      LogInfo(log, "model_saved", {Kv("job", spec.name()), Kv("path", spec.output())});
    }
    if (options.on_progress) {
      TrainProgress p;
      p.step = step;
      p.total_steps = total;
      p.epoch = static_cast<int32_t>(epoch + 1);
      p.loss = result.final_loss;
      p.samples_per_s = result.samples_per_s;
      p.accuracy = result.test_accuracy;
      options.on_progress(p);
    }
  }
  return result;
}

}  // namespace gradmesh
