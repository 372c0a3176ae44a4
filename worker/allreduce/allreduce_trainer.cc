// RunAllreduce: synchronous data-parallel training over a Collective (see the header).
#include "worker/allreduce/allreduce_trainer.h"

#include <torch/torch.h>

#include <cstring>
#include <limits>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/optimizer.h"
#include "common/status.h"
#include "worker/allreduce/bucket_reducer.h"
#include "worker/allreduce/checkpoint.h"
#include "worker/allreduce/collective.h"
#include "worker/allreduce/collective_service.h"
#include "worker/dataset.h"
#include "worker/model.h"

namespace gradmesh {
namespace {

// What every rank must agree on before the first collective.
std::string Fingerprint(const JobSpec& spec, const std::vector<int64_t>& numels,
                        int64_t total_steps) {
  return absl::StrCat("model=", spec.model().name(), " params=", absl::StrJoin(numels, ","),
                      " steps=", total_steps, " batch=", spec.batch_size(),
                      " seed=", spec.seed(), " bucket_bytes=", spec.allreduce().bucket_bytes(),
                      " optimizer=", spec.optimizer().name());
}

}  // namespace

absl::StatusOr<TrainResult> RunAllreduce(const TrainerOptions& options,
                                         CollectiveServiceImpl* local,
                                         const std::atomic<bool>& stop) {
  const JobSpec& spec = options.spec;
  const Logger* log = options.logger;
  const int rank = options.rank;
  const int n = spec.num_workers();
  if (local == nullptr) return absl::InvalidArgumentError("allreduce: no CollectiveService");
  if (static_cast<int>(options.peers.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("allreduce: ", options.peers.size(),
                                                   " peer addresses for ", n, " workers"));
  }
  torch::set_num_threads(options.intra_op_threads);

  ASSIGN_OR_RETURN(DatasetFiles data, LoadJobData(spec, options.data_dir));
  ASSIGN_OR_RETURN(std::unique_ptr<Model> model, CreateModel(spec.model(), spec.seed()));
  std::vector<torch::Tensor> params = model->Parameters();
  const std::vector<std::string> names = model->ParameterNames();
  std::vector<int64_t> numels;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].scalar_type() != torch::kFloat || !params[i].is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "allreduce: parameter ", names[i], " must be a contiguous float32 tensor"));
    }
    numels.push_back(params[i].numel());
  }

  BatchLoader::Options lo = LoaderOptions(spec, rank);
  ASSIGN_OR_RETURN(std::unique_ptr<BatchLoader> loader,
                   BatchLoader::Create(&data.train, data.mean, data.stddev, lo));
  const int64_t total = loader->total_steps();

  // The optimizer runs here, on every rank, on the averaged gradient: one update per step.
  const OptimizerSpec opt_spec = WithDecayUpdates(spec.optimizer(), total);
  ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> optimizer,
                   OptimizerRegistry::WithBuiltins().Create(opt_spec));
  const int num_slots = optimizer->num_slots();
  std::vector<std::vector<std::vector<float>>> slots(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    slots[i].assign(num_slots, std::vector<float>(numels[i], 0.0f));
  }

  // Connect the ring (or another backend).
  CollectiveContext ctx;
  ctx.job = spec.name();
  ctx.rank = rank;
  ctx.peers = options.peers;
  ctx.local = local;
  ctx.timeout = absl::Seconds(spec.allreduce().timeout_s() > 0 ? spec.allreduce().timeout_s()
                                                                : 30);
  ctx.transport = spec.allreduce().transport().empty() ? "tcp" : spec.allreduce().transport();
  const std::string backend = ResolveBackend(spec.allreduce().backend());
  ASSIGN_OR_RETURN(std::unique_ptr<Collective> collective,
                   CollectiveRegistry::WithBuiltins().Create(backend, ctx));

  // Every rank must run the same model and schedule, or the ring would mix garbage.
  const std::string fingerprint = Fingerprint(spec, numels, total);
  {
    absl::StatusOr<std::vector<std::string>> gathered = collective->Allgather(fingerprint);
    if (!gathered.ok()) return Annotate(gathered.status(), "allreduce: handshake");
    const std::vector<std::string>& all = *gathered;
    for (int r = 0; r < n; ++r) {
      if (all[r] != fingerprint) {
        return absl::FailedPreconditionError(
            absl::StrCat("allreduce: rank ", r, " runs a different job (", all[r],
                         ") than rank ", rank, " (", fingerprint, ")"));
      }
    }
  }

  // Resume: the newest checkpoint step every rank has.
  const std::string ckpt_dir =
      spec.checkpoint().dir().empty() ? options.checkpoint_dir : spec.checkpoint().dir();
  const std::string ckpt_path = CheckpointPath(ckpt_dir, spec.name(), rank);
  const bool checkpoints = spec.checkpoint().every_steps() > 0;
  int64_t first_step = 0;
  if (checkpoints) {
    std::vector<RankCheckpoint> available = ReadAvailableCheckpoints(ckpt_path);
    std::string mine;
    for (const RankCheckpoint& c : available) {
      if (c.arrays.size() != params.size() * (1 + num_slots)) continue;  // Another model.
      absl::StrAppend(&mine, mine.empty() ? "" : ",", c.step);
    }
    absl::StatusOr<std::vector<std::string>> gathered = collective->Allgather(mine);
    if (!gathered.ok()) return Annotate(gathered.status(), "allreduce: checkpoint handshake");
    const std::vector<std::string>& all = *gathered;
    std::vector<std::vector<int64_t>> steps(n);
    for (int r = 0; r < n; ++r) {
      for (absl::string_view s : absl::StrSplit(all[r], ',', absl::SkipEmpty())) {
        int64_t v;
        if (absl::SimpleAtoi(s, &v)) steps[r].push_back(v);
      }
    }
    ASSIGN_OR_RETURN(first_step, ResumeStep(steps));
    if (first_step > 0) {
      const RankCheckpoint* use = nullptr;
      for (const RankCheckpoint& c : available) {
        if (c.step == first_step) use = &c;
      }
      if (use == nullptr) return absl::InternalError("allreduce: chosen checkpoint vanished");
      torch::NoGradGuard no_grad;
      size_t a = 0;
      for (size_t i = 0; i < params.size(); ++i, ++a) {
        if (static_cast<int64_t>(use->arrays[a].size()) != numels[i]) {
          return absl::FailedPreconditionError(absl::StrCat(
              "allreduce: checkpoint ", ckpt_path, " holds ", use->arrays[a].size(),
              " values for ", names[i], ", the model has ", numels[i]));
        }
        std::memcpy(params[i].data_ptr<float>(), use->arrays[a].data(),
                    numels[i] * sizeof(float));
      }
      for (size_t i = 0; i < params.size(); ++i) {
        for (int k = 0; k < num_slots; ++k, ++a) {
          if (static_cast<int64_t>(use->arrays[a].size()) != numels[i]) {
            return absl::FailedPreconditionError(
                absl::StrCat("allreduce: checkpoint ", ckpt_path, " has bad optimizer slots"));
          }
          slots[i][k] = use->arrays[a];
        }
      }
      lo.first_step = std::min(first_step, total);
      loader.reset();  // Its prefetch thread first.
      ASSIGN_OR_RETURN(loader, BatchLoader::Create(&data.train, data.mean, data.stddev, lo));
      LogInfo(log, "resuming", {Kv("job", spec.name()), Kv("rank", rank),
                                Kv("step", first_step), Kv("checkpoint", ckpt_path)});
    }
  }

  BucketReducer reducer(collective.get(), numels, spec.allreduce().bucket_bytes());
  // On every return: stop the communication thread, then close the collective, and only then
  // free the buckets (declared first, destroyed last): after a failed all-reduce the ring's
  // transport may still hold in-place references to them until it is closed.
  absl::Cleanup close_collective_first = [&reducer, &collective] {
    reducer.Stop();
    collective.reset();
  };
  // Gradient hooks: each parameter's gradient goes to its bucket the moment backward has it.
  for (size_t i = 0; i < params.size(); ++i) {
    const int index = static_cast<int>(i);
    const int64_t numel = numels[i];
    params[i].register_hook([&reducer, index, numel](const torch::Tensor& grad) {
      const torch::Tensor g = grad.contiguous();
      reducer.ParamReady(index, g.data_ptr<float>(), std::min<int64_t>(g.numel(), numel));
    });
  }

  LogInfo(log, "train_start",
          {Kv("job", spec.name()), Kv("rank", rank), Kv("model", spec.model().name()),
           Kv("dataset", spec.dataset().name()), Kv("steps", total),
           Kv("steps_per_epoch", loader->steps_per_epoch()), Kv("batch", spec.batch_size()),
           Kv("mode", "allreduce"), Kv("backend", collective->backend()),
           Kv("transport", collective->transport()), Kv("workers", n),
           Kv("buckets", reducer.buckets().size()),
           Kv("bucket_bytes", spec.allreduce().bucket_bytes())});

  TrainResult result;
  result.first_step = first_step;
  TrainProgress progress;
  progress.total_steps = total;
  model->SetTraining(true);
  const absl::Time start = absl::Now();
  absl::Time window_start = start;
  double window_loss = 0;
  int64_t window_steps = 0;
  int64_t step = first_step;
  double comm_busy_at_window = 0;
  std::vector<float*> slot_ptrs(num_slots);
  double opt_s = 0;  // Inside the optimizer (part of comm_s: it overlaps the all-reduce).
  while (step < total) {
    std::optional<Batch> batch = NextBatch(loader.get(), options.step_delay, &result.data_s);
    if (!batch.has_value()) break;

    absl::Time t0 = absl::Now();
    torch::Tensor x = torch::from_blob(batch->x.data(),
                                       {batch->size, 1, data.train.rows, data.train.cols},
                                       torch::kFloat);
    torch::Tensor y = torch::from_blob(batch->y.data(), {batch->size}, torch::kLong);
    for (auto& p : params) p.mutable_grad() = torch::Tensor();
    ASSIGN_OR_RETURN(torch::Tensor loss, CrossEntropyLoss(model.get(), x, y));
    const double loss_value = loss.item<double>();
    // A stop request travels with this step's last bucket: every rank stops after it.
    reducer.StartStep({stop.load() ? 1.0f : 0.0f, static_cast<float>(loss_value)});
    try {
      loss.backward();
    } catch (const c10::Error& e) {
      (void)reducer.FinishStep();
      return absl::InternalError(absl::StrCat("allreduce: backward failed at step ", step, ": ",
                                              e.what_without_backtrace()));
    }
    const absl::Time backward_end = absl::Now();
    result.compute_s += absl::ToDoubleSeconds(backward_end - t0);
    // Same update on every rank, from bit-identical averaged gradients, applied piece by
    // piece as the all-reduce finishes them (the optimizers are elementwise).
    const float lr_factor = LrScheduleFactor(opt_spec, step);
    {
      torch::NoGradGuard no_grad;
      RETURN_IF_ERROR(Annotate(
          reducer.FinishStep([&](int p, int64_t begin, absl::Span<const float> grad) {
            const absl::Time o0 = absl::Now();
            for (int k = 0; k < num_slots; ++k) slot_ptrs[k] = slots[p][k].data() + begin;
            optimizer->Apply(step + 1, lr_factor, grad.data(),
                             params[p].data_ptr<float>() + begin, slot_ptrs.data(),
                             static_cast<int64_t>(grad.size()));
            opt_s += SecondsSince(o0);
          }),
          absl::StrCat("allreduce: step ", step)));
    }
    result.comm_s += SecondsSince(backward_end);
    const std::array<float, BucketReducer::kExtras> extras = reducer.extras();
    const bool stop_all = extras[0] > 0;
    const double mean_loss = extras[1] / n;
    ++step;
    result.samples += batch->size;
    window_loss += mean_loss;
    ++window_steps;

    if (checkpoints && step % spec.checkpoint().every_steps() == 0) {
      std::vector<absl::Span<const float>> arrays;
      for (size_t i = 0; i < params.size(); ++i) {
        arrays.emplace_back(params[i].data_ptr<float>(), numels[i]);
      }
      for (size_t i = 0; i < params.size(); ++i) {
        for (int k = 0; k < num_slots; ++k) arrays.emplace_back(slots[i][k]);
      }
      RETURN_IF_ERROR(WriteCheckpoint(ckpt_path, step, arrays));
      progress.checkpoint_step = step;
      LogInfo(log, "checkpoint", {Kv("job", spec.name()), Kv("rank", rank), Kv("step", step),
                                  Kv("path", ckpt_path)});
    }

    const bool last = step == total || stop_all;
    if ((spec.log_every() > 0 && step % spec.log_every() == 0) || last) {
      const double dt = SecondsSince(window_start);
      const int64_t done = step - first_step;
      result.final_loss = window_loss / window_steps;
      const double comm_busy = reducer.comm_seconds();
      progress.step = step;
      progress.epoch = static_cast<int32_t>(batch->epoch + 1);
      progress.loss = result.final_loss;
      progress.samples_per_s = dt > 0 ? window_steps * spec.batch_size() / dt : 0;
      LogInfo(log, "progress",
              {Kv("job", spec.name()), Kv("rank", rank), Kv("step", step), Kv("total", total),
               Kv("epoch", progress.epoch),
               Kv("loss", absl::StrFormat("%.4f", result.final_loss)),
               Kv("samples_per_s", absl::StrFormat("%.0f", progress.samples_per_s)),
               Kv("data_ms", absl::StrFormat("%.1f", 1e3 * result.data_s / done)),
               Kv("compute_ms", absl::StrFormat("%.1f", 1e3 * result.compute_s / done)),
               Kv("comm_ms", absl::StrFormat("%.1f", 1e3 * result.comm_s / done)),
               Kv("opt_ms", absl::StrFormat("%.1f", 1e3 * opt_s / done)),
               Kv("allreduce_ms", absl::StrFormat("%.1f", 1e3 * (comm_busy - comm_busy_at_window) /
                                                              window_steps)),
               Kv("bytes_per_step", collective->bytes_sent() / done)});
      if (options.on_progress) options.on_progress(progress);
      window_start = absl::Now();
      window_loss = 0;
      window_steps = 0;
      comm_busy_at_window = comm_busy;
    }
    if (stop_all) {
      result.stopped_early = step < total;
      LogInfo(log, "stop_requested", {Kv("job", spec.name()), Kv("rank", rank),
                                      Kv("step", step)});
      break;
    }
  }
  if (window_steps > 0) result.final_loss = window_loss / window_steps;
  result.steps = step - first_step;
  result.wall_s = SecondsSince(start);
  result.samples_per_s = result.wall_s > 0 ? result.samples / result.wall_s : 0;
  result.bytes_pushed = result.raw_bytes_pushed = collective->bytes_sent();
  // In a ring every rank receives as much as it sends.
  result.bytes_pulled = result.raw_bytes_pulled = collective->bytes_sent();

  if (options.evaluate && !result.stopped_early) {
    ASSIGN_OR_RETURN(result.test_accuracy, EvaluateAccuracy(model.get(), data));
    LogInfo(log, "evaluated", {Kv("job", spec.name()), Kv("rank", rank),
                               Kv("accuracy", absl::StrFormat("%.4f", result.test_accuracy)),
                               Kv("test_samples", data.test.size)});
    progress.accuracy = result.test_accuracy;
    if (options.on_progress) options.on_progress(progress);
    if (!spec.output().empty()) {
      RETURN_IF_ERROR(model->Save(spec.output()));
      LogInfo(log, "model_saved", {Kv("job", spec.name()), Kv("path", spec.output())});
    }
  }
  return result;
}

}  // namespace gradmesh
