#include "worker/train_util.h"

#include <torch/torch.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "worker/model.h"

namespace gradmesh {

absl::StatusOr<DatasetFiles> LoadJobData(const JobSpec& spec, const std::string& data_dir) {
  const std::string path = spec.dataset().path().empty()
                               ? absl::StrCat(data_dir, "/", spec.dataset().name())
                               : spec.dataset().path();
  return LoadDataset(spec.dataset().name(), path);
}

BatchLoader::Options LoaderOptions(const JobSpec& spec, int32_t rank) {
  BatchLoader::Options lo;
  lo.rank = rank;
  lo.world_size = spec.num_workers();
  lo.batch_size = spec.batch_size();
  lo.epochs = spec.epochs();
  lo.max_steps = spec.steps();
  lo.seed = spec.seed();
  return lo;
}

OptimizerSpec WithDecayUpdates(const OptimizerSpec& spec, int64_t updates) {
  OptimizerSpec out = spec;
  if (!out.lr_schedule().empty() && out.lr_schedule() != "constant" && out.decay_updates() == 0) {
    out.set_decay_updates(std::max<int64_t>(updates, 1));
  }
  return out;
}

absl::StatusOr<double> EvaluateAccuracy(Model* model, const DatasetFiles& data) {
  model->SetTraining(false);
  int64_t correct = 0;
  std::vector<Batch> eval = MakeEvalBatches(data.test, data.mean, data.stddev, 1000);
  for (Batch& b : eval) {
    torch::Tensor x =
        torch::from_blob(b.x.data(), {b.size, 1, data.test.rows, data.test.cols}, torch::kFloat);
    torch::Tensor y = torch::from_blob(b.y.data(), {b.size}, torch::kLong);
    ASSIGN_OR_RETURN(int64_t c, CountCorrect(model, x, y));
    correct += c;
  }
  if (data.test.size == 0) return absl::FailedPreconditionError("evaluate: empty test set");
  return static_cast<double>(correct) / data.test.size;
}

double SecondsSince(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

std::optional<Batch> NextBatch(BatchLoader* loader, absl::Duration step_delay, double* data_s) {
  if (step_delay > absl::ZeroDuration()) absl::SleepFor(step_delay);
  const absl::Time start = absl::Now();
  std::optional<Batch> batch = loader->Next();
  if (batch.has_value()) *data_s += SecondsSince(start);
  return batch;
}

}  // namespace gradmesh
