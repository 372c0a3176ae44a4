#include "tests/e2e/torch_reference.h"

#include <algorithm>
#include <memory>
#include <optional>

#include "common/status.h"
#include "gtest/gtest.h"
#include "proto/gradmesh.pb.h"
#include "worker/core/dataset.h"
#include "worker/model.h"

namespace gradmesh {
namespace e2e {

absl::StatusOr<ClippedReference> TrainClippedMlpReference(const ClippedReferenceOptions& o) {
  torch::set_num_threads(1);
  ModelSpec spec;
  spec.set_name("mlp");
  ASSIGN_OR_RETURN(std::unique_ptr<Model> ref, CreateModel(spec, o.seed));
  ASSIGN_OR_RETURN(std::unique_ptr<Model> free, CreateModel(spec, o.seed));
  ASSIGN_OR_RETURN(JobData data, LoadDataset("mnist", o.mnist_dir));
  BatchLoader::Options lo;
  lo.batch_size = o.batch_size;
  lo.max_steps = o.steps;
  lo.seed = o.seed;
  ASSIGN_OR_RETURN(std::unique_ptr<BatchLoader> loader, BatchLoader::Create(data.train.get(), lo));
  const auto sgd_options = torch::optim::SGDOptions(o.lr).momentum(o.momentum);
  torch::optim::SGD sgd(ref->Parameters(), sgd_options);
  torch::optim::SGD sgd_free(free->Parameters(), sgd_options);
  for (int64_t t = 0; t < o.steps; ++t) {
    std::optional<Batch> batch = loader->Next();
    if (!batch.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat("reference: MNIST ran out at step ", t));
    }
    if (std::find(o.skip_steps.begin(), o.skip_steps.end(), t) != o.skip_steps.end()) continue;
    const torch::Tensor x =
        torch::from_blob(batch->x.data(), {batch->size, 1, 28, 28}, torch::kFloat);
    const torch::Tensor y = torch::from_blob(batch->y.data(), {batch->size}, torch::kLong);
    sgd.zero_grad();
    ASSIGN_OR_RETURN(torch::Tensor loss, CrossEntropyLoss(ref.get(), x, y));
    loss.backward();
    torch::nn::utils::clip_grad_norm_(ref->Parameters(), o.clip_grad_norm);
    sgd.step();
    sgd_free.zero_grad();
    ASSIGN_OR_RETURN(torch::Tensor loss_free, CrossEntropyLoss(free.get(), x, y));
    loss_free.backward();
    sgd_free.step();
  }
  ClippedReference out;
  out.names = ref->ParameterNames();
  for (const torch::Tensor& p : ref->Parameters()) out.clipped.push_back(p.detach());
  for (const torch::Tensor& p : free->Parameters()) out.unclipped.push_back(p.detach());
  return out;
}

double MaxRelError(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const torch::Tensor x = a[i].to(torch::kDouble), y = b[i].to(torch::kDouble);
    worst = std::max(worst, (x - y).norm().item<double>() / y.norm().item<double>());
  }
  return worst;
}

std::vector<torch::Tensor> LoadSaved(const std::string& path,
                                     const std::vector<std::string>& names) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  std::vector<torch::Tensor> out;
  for (const std::string& name : names) {
    const size_t dot = name.find('.');
    torch::serialize::InputArchive child;
    torch::Tensor t;
    if (!archive.try_read(name.substr(0, dot), child) || !child.try_read(name.substr(dot + 1), t)) {
      ADD_FAILURE() << "no " << name << " in " << path;
      return {};
    }
    out.push_back(t);
  }
  return out;
}

}  // namespace e2e
}  // namespace gradmesh
