#include "worker/trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "common/status.h"
#include "compression/compressor.h"
#include "worker/allreduce/allreduce_trainer.h"
#include "worker/gossip/gossip_trainer.h"
#include "worker/auto_codec.h"
#include "worker/dataset.h"
#include "worker/model.h"

namespace gradmesh {

Trainer::Trainer(TrainerOptions options, ClientFactory client_factory,
                 PeerServices peer_services)
    : options_(std::move(options)),
      client_factory_(std::move(client_factory)),
      peer_services_(peer_services),
      active_ranks_(options_.active_ranks),
      evaluate_(options_.evaluate) {}

void Trainer::SetGroup(std::vector<int32_t> active_ranks, bool evaluate) {
  absl::MutexLock lock(&group_mu_);
  active_ranks_ = std::move(active_ranks);
  evaluate_ = evaluate;
}
Trainer::~Trainer() = default;

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(TrainerOptions options,
                                                         ClientFactory client_factory,
                                                         PeerServices peer_services) {
  const JobSpec& spec = options.spec;
  if (options.rank < 0 || options.rank >= spec.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat("trainer: rank ", options.rank,
                                                   " not in [0, ", spec.num_workers(), ")"));
  }
  if (options.intra_op_threads < 1) {
    return absl::InvalidArgumentError("trainer: intra_op_threads must be >= 1");
  }
  const bool ps = IsPsMode(spec.mode());
  if (ps && !client_factory) return absl::InvalidArgumentError("trainer: no client factory");
  if (!ps) {
    if (static_cast<int>(options.peers.size()) != spec.num_workers()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mode ", spec.mode(), " needs the peer address of every worker (--peers): got ",
          options.peers.size(), " for ", spec.num_workers(), " workers"));
    }
    if ((spec.mode() == "gossip" && peer_services.gossip == nullptr) ||
        (spec.mode() == "allreduce" && peer_services.collective == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("trainer: mode ", spec.mode(), " needs this process's peer service"));
    }
  }
  // Names are checked here, before any work, so a bad spec fails as bad arguments.
  if (absl::Status st = ModelRegistry::WithBuiltins().Check(spec.model().name()); !st.ok()) {
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
          "topk_approx, fp16, bf16); \"", cs.push(), "\" with error_feedback=",
          feedback ? "true" : "false", " would ignore it"));
    }
    if (cs.warmup_steps() > 0 && (*codec)->density() >= 1.0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job spec: compression.warmup_steps needs a sparsifying push codec, not \"",
          cs.push(), "\""));
    }
  } else if (cs.momentum() != 0 || cs.warmup_steps() != 0) {
    return absl::InvalidArgumentError(
        "job spec: compression.momentum and warmup_steps need a push codec");
  }
  const std::vector<std::string> datasets = KnownDatasets();
  if (std::find(datasets.begin(), datasets.end(), spec.dataset().name()) == datasets.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown dataset \"", spec.dataset().name(),
                                                   "\"; known datasets: ",
                                                   absl::StrJoin(datasets, ", ")));
  }
  return std::unique_ptr<Trainer>(
      new Trainer(std::move(options), std::move(client_factory), peer_services));
}

absl::StatusOr<TrainResult> Trainer::Run() {
  const std::string& mode = options_.spec.mode();
  if (mode == "gossip") return RunGossip(options_, peer_services_.gossip, stop_requested_);
  if (mode == "allreduce") {
    return RunAllreduce(options_, peer_services_.collective, stop_requested_);
  }
  return RunPs();
}

absl::StatusOr<TrainResult> Trainer::RunPs() {
  const JobSpec& spec = options_.spec;
  const Logger* log = options_.logger;
  torch::set_num_threads(options_.intra_op_threads);

  ASSIGN_OR_RETURN(DatasetFiles data, LoadJobData(spec, options_.data_dir));
  ASSIGN_OR_RETURN(std::unique_ptr<Model> model, CreateModel(spec.model(), spec.seed()));
  std::vector<torch::Tensor> params = model->Parameters();
  const std::vector<std::string> names = model->ParameterNames();

  BatchLoader::Options lo = LoaderOptions(spec, options_.rank);
  ASSIGN_OR_RETURN(std::unique_ptr<BatchLoader> loader,
                   BatchLoader::Create(&data.train, data.mean, data.stddev, lo));
  JobLayout layout;
  layout.job = spec.name();
  layout.chunk_elems = spec.chunk_bytes() / static_cast<int64_t>(sizeof(float));
  // Every worker derives the same schedule length: chunk updates over the whole job (one per
  // step in sync mode, where a step's pushes are averaged; one per push of any worker
  // otherwise).
  layout.optimizer = WithDecayUpdates(
      spec.optimizer(), loader->total_steps() * (spec.mode() == "sync" ? 1 : spec.num_workers()));
  layout.consistency = spec.mode();
  layout.num_workers = spec.num_workers();
  layout.durability = spec.durability();
  layout.staleness_damping = spec.staleness_damping();
  layout.barrier_timeout_s = spec.barrier_timeout_s();
  std::vector<absl::Span<float>> param_spans;
  std::vector<absl::Span<const float>> initial;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].scalar_type() != torch::kFloat || !params[i].is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "trainer: parameter ", names[i], " must be a contiguous float32 tensor"));
    }
    TensorSpec t;
    t.set_name(names[i]);
    for (int64_t d : params[i].sizes()) t.add_shape(d);
    layout.tensors.push_back(t);
    param_spans.emplace_back(params[i].data_ptr<float>(), params[i].numel());
    initial.emplace_back(params[i].data_ptr<float>(), params[i].numel());
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ParameterClient> client, client_factory_(layout));
  // compression.push: auto starts dense and lets AutoCodec decide (worker/auto_codec.h).
  std::optional<AutoCodec> auto_codec;
  if (spec.compression().push() == "auto") auto_codec.emplace();

  // Every worker offers the same seeded initial values; the first InitJob wins, the rest see
  // the job already exists. Then everyone starts from the shards' values.
  RETURN_IF_ERROR(client->InitJob(initial));
  {
    torch::NoGradGuard no_grad;
    RETURN_IF_ERROR(client->Pull(param_spans));
  }
  // Resume where the shards say this rank got to (0 for a new job).
  int64_t first_step = std::numeric_limits<int64_t>::max();
  {
    ASSIGN_OR_RETURN(std::vector<JobInfoResponse> infos, client->GetJobInfo());
    for (const JobInfoResponse& info : infos) {
      first_step = std::min(first_step, info.workers(options_.rank).last_step() + 1);
    }
  }
  if (first_step > 0) {
    lo.first_step = std::min(first_step, loader->total_steps());
    ASSIGN_OR_RETURN(loader, BatchLoader::Create(&data.train, data.mean, data.stddev, lo));
    LogInfo(log, "resuming", {Kv("job", spec.name()), Kv("rank", options_.rank),
                              Kv("step", lo.first_step)});
  }

  const int64_t total = loader->total_steps();
  const auto& img = data.train;
  LogInfo(log, "train_start",
          {Kv("job", spec.name()), Kv("rank", options_.rank), Kv("model", spec.model().name()),
           Kv("dataset", spec.dataset().name()), Kv("params", [&] {
             int64_t n = 0;
             for (auto& p : params) n += p.numel();
             return n;
           }()),
           Kv("steps", total), Kv("steps_per_epoch", loader->steps_per_epoch()),
           Kv("batch", spec.batch_size()), Kv("mode", spec.mode())});

  TrainResult result;
  model->SetTraining(true);
  const absl::Time start = absl::Now();
  absl::Time window_start = start;
  double window_loss = 0;
  int64_t window_steps = 0;
  int64_t step = lo.first_step;
  result.first_step = lo.first_step;
  std::vector<absl::Span<const float>> grads(params.size());
  while (true) {
    if (stop_requested_.load()) {
      result.stopped_early = true;
      LogInfo(log, "stop_requested", {Kv("job", spec.name()), Kv("step", step)});
      break;
    }
    std::optional<Batch> batch = NextBatch(loader.get(), options_.step_delay, &result.data_s);
    if (!batch.has_value()) break;

    absl::Time t0 = absl::Now();
    const absl::Time compute_start = t0;
    torch::Tensor x = torch::from_blob(batch->x.data(), {batch->size, 1, img.rows, img.cols},
                                       torch::kFloat);
    torch::Tensor y = torch::from_blob(batch->y.data(), {batch->size}, torch::kLong);
    for (auto& p : params) p.mutable_grad() = torch::Tensor();
    ASSIGN_OR_RETURN(torch::Tensor loss, CrossEntropyLoss(model.get(), x, y));
    try {
      loss.backward();
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("trainer: backward failed at step ", step, ": ",
                                              e.what_without_backtrace()));
    }
    const double loss_value = loss.item<double>();
    for (size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor& g = params[i].grad();
      if (!g.defined()) {
        return absl::InternalError(absl::StrCat("trainer: no gradient for ", names[i]));
      }
      grads[i] = absl::Span<const float>(g.data_ptr<float>(), g.numel());
    }
    const absl::Time compute_end = absl::Now();
    result.compute_s += absl::ToDoubleSeconds(compute_end - compute_start);

    t0 = absl::Now();
    RETURN_IF_ERROR(Annotate(client->Push(step, grads), absl::StrCat("step ", step)));
    {
      torch::NoGradGuard no_grad;
      RETURN_IF_ERROR(Annotate(client->Pull(param_spans), absl::StrCat("step ", step)));
    }
    result.comm_s += SecondsSince(t0);

    if (auto_codec.has_value()) {
      const absl::Duration comm = absl::Now() - t0;
      std::optional<std::string> next = auto_codec->Observe(
          loss_value, absl::ToDoubleSeconds(compute_end - compute_start),
          absl::ToDoubleSeconds(comm));
      if (next.has_value()) {
        RETURN_IF_ERROR(client->SetPushCodec(*next));
        LogInfo(log, auto_codec->fell_back() ? "auto_codec_fallback" : "auto_codec",
                {Kv("job", spec.name()), Kv("rank", options_.rank), Kv("step", step),
                 Kv("codec", next->empty() ? "dense" : *next),
                 Kv("comm_over_compute", absl::StrFormat("%.2f", auto_codec->ratio()))});
      }
    }
    ++step;
    result.samples += batch->size;
    window_loss += loss_value;
    ++window_steps;
    if (spec.log_every() > 0 && (step % spec.log_every() == 0 || step == total)) {
      const double dt = SecondsSince(window_start);
      result.final_loss = window_loss / window_steps;
      LogInfo(log, "progress",
              {Kv("job", spec.name()), Kv("rank", options_.rank), Kv("step", step),
               Kv("total", total), Kv("epoch", batch->epoch + 1),
               Kv("epochs", spec.steps() > 0 ? (total + loader->steps_per_epoch() - 1) /
                                                   loader->steps_per_epoch()
                                             : spec.epochs()),
               Kv("loss", absl::StrFormat("%.4f", result.final_loss)),
               Kv("samples_per_s",
                  absl::StrFormat("%.0f", window_steps * spec.batch_size() / dt)),
               Kv("data_ms", absl::StrFormat("%.1f", 1e3 * result.data_s / (step - lo.first_step))),
               Kv("compute_ms",
                  absl::StrFormat("%.1f", 1e3 * result.compute_s / (step - lo.first_step))),
               Kv("comm_ms", absl::StrFormat("%.1f", 1e3 * result.comm_s / (step - lo.first_step))),
               Kv("push_bytes_per_step", client->bytes_pushed() / (step - lo.first_step)),
               Kv("codec_ms", absl::StrFormat("%.2f", 1e3 * client->codec_seconds() /
                                                          (step - lo.first_step))),
               Kv("push_ratio", absl::StrFormat("%.1f", client->bytes_pushed() > 0
                                                          ? static_cast<double>(
                                                                client->raw_bytes_pushed()) /
                                                                client->bytes_pushed()
                                                          : 1.0))});
      if (options_.on_progress) {
        TrainProgress p;
        p.step = step;
        p.total_steps = total;
        p.epoch = static_cast<int32_t>(batch->epoch + 1);
        p.loss = result.final_loss;
        p.samples_per_s = window_steps * spec.batch_size() / dt;
        options_.on_progress(p);
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
  result.bytes_pushed = client->bytes_pushed();
  result.bytes_pulled = client->bytes_pulled();
  result.raw_bytes_pushed = client->raw_bytes_pushed();
  result.raw_bytes_pulled = client->raw_bytes_pulled();
  result.codec_s = client->codec_seconds();
  // A worker stopped early (SIGTERM) has not finished the job: it may be resumed, and the
  // shards must keep waiting for (and counting) its clock.
  if (!result.stopped_early) RETURN_IF_ERROR(client->Finish(step));

  bool evaluate;
  {
    absl::MutexLock lock(&group_mu_);
    evaluate = evaluate_;
  }
  if (evaluate && !result.stopped_early) {
    // Wait for every worker so the evaluated model is the job's final one.
    const absl::Time deadline = absl::Now() + options_.wait_for_workers;
    while (true) {
      ASSIGN_OR_RETURN(std::vector<JobInfoResponse> infos, client->GetJobInfo());
      // A sync job re-formed after losing workers waits only for the ranks still in it.
      std::vector<int32_t> active;
      {
        absl::MutexLock lock(&group_mu_);
        active = active_ranks_;
      }
      const int32_t needed =
          active.empty() ? spec.num_workers() : static_cast<int32_t>(active.size());
      int32_t finished = 0;
      for (const WorkerState& w : infos[0].workers()) {
        const bool counted =
            active.empty() || std::find(active.begin(), active.end(), w.worker()) != active.end();
        finished += counted && w.finished() ? 1 : 0;
      }
      if (finished == needed) break;
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "trainer: only ", finished, " of ", needed,
            " workers finished job ", spec.name(), " within the wait bound"));
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
    {
      torch::NoGradGuard no_grad;
      RETURN_IF_ERROR(client->Pull(param_spans));
    }
    ASSIGN_OR_RETURN(result.test_accuracy, EvaluateAccuracy(model.get(), data));
    LogInfo(log, "evaluated", {Kv("job", spec.name()), Kv("rank", options_.rank),
                               Kv("accuracy", absl::StrFormat("%.4f", result.test_accuracy)),
                               Kv("test_samples", data.test.size)});
    if (options_.on_progress) {
      TrainProgress p;
      p.step = step;
      p.total_steps = total;
      p.epoch = static_cast<int32_t>((total + loader->steps_per_epoch() - 1) /
                                     std::max<int64_t>(1, loader->steps_per_epoch()));
      p.loss = result.final_loss;
      p.samples_per_s = result.samples_per_s;
      p.accuracy = result.test_accuracy;
      options_.on_progress(p);
    }
    if (!spec.output().empty()) {
      RETURN_IF_ERROR(model->Save(spec.output()));
      LogInfo(log, "model_saved", {Kv("job", spec.name()), Kv("path", spec.output())});
    }
  }
  return result;
}

}  // namespace gradmesh
