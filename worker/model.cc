#include "worker/model.h"

#include <sys/stat.h>
#include <torch/script.h>

#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "worker/model_names.h"

namespace gradmesh {
namespace {

// "[64, 1, 28, 28]" for messages.
std::string ShapeString(const torch::Tensor& t) {
  if (!t.defined()) return "undefined";
  return absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]");
}

std::string TypeString(const torch::Tensor& t) {
  return t.defined() ? std::string(c10::toString(t.scalar_type())) : "undefined";
}

// LibTorch reports errors by throwing; everything below converts them at the boundary. The
// backtrace in c10::Error::what() is noise in a status message, so it is left out.
absl::Status FromException(absl::StatusCode code, const std::string& context,
                           const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string what =
      c10_error != nullptr ? c10_error->what_without_backtrace() : std::string(e.what());
  return absl::Status(code, absl::StrCat(context, ": ", what));
}

// Checks the contract of Model::Forward for the built-in MNIST models.
absl::Status CheckMnistInput(const std::string& model, const torch::Tensor& x) {
  if (!x.defined() || x.scalar_type() != torch::kFloat32 || x.dim() != 4 || x.size(1) != 1 ||
      x.size(2) != 28 || x.size(3) != 28) {
    return absl::InvalidArgumentError(absl::StrCat("model ", model,
                                                   ": input must be float32 [N, 1, 28, 28], got ",
                                                   TypeString(x), " ", ShapeString(x)));
  }
  return absl::OkStatus();
}

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(784, 256))),
        fc2(register_module("fc2", torch::nn::Linear(256, 256))),
        fc3(register_module("fc3", torch::nn::Linear(256, 10))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = torch::relu(fc1(x.flatten(1)));
    h = torch::relu(fc2(h));
    return fc3(h);
  }

  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
  torch::nn::Linear fc3;
};
TORCH_MODULE(Mlp);

struct LeNetImpl : torch::nn::Module {
  LeNetImpl()
      : conv1(register_module("conv1",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 6, 5).padding(2)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(6, 16, 5)))),
        fc1(register_module("fc1", torch::nn::Linear(400, 120))),
        fc2(register_module("fc2", torch::nn::Linear(120, 84))),
        fc3(register_module("fc3", torch::nn::Linear(84, 10))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = torch::max_pool2d(torch::relu(conv1(x)), 2);  // [N, 6, 14, 14]
    h = torch::max_pool2d(torch::relu(conv2(h)), 2);                // [N, 16, 5, 5]
    h = torch::relu(fc1(h.flatten(1)));
    h = torch::relu(fc2(h));
    return fc3(h);
  }

  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
  torch::nn::Linear fc3;
};
TORCH_MODULE(LeNet);

// A Model over a torch::nn module holder (Mlp, LeNet) built in C++.
template <typename Holder>
class BuiltinModel : public Model {
 public:
  BuiltinModel(std::string name, Holder module) : name_(std::move(name)), module_(module) {
    // Cached once: named_parameters() walks the module tree and builds an OrderedDict on
    // every call, and the set of parameters never changes.
    for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
      names_.push_back(item.key());
      params_.push_back(item.value());
    }
    module_->train(true);
  }

  absl::StatusOr<torch::Tensor> Forward(const torch::Tensor& x) override {
    if (absl::Status s = CheckMnistInput(name_, x); !s.ok()) return s;
    try {
      return module_->forward(x);
    } catch (const std::exception& e) {
      return FromException(absl::StatusCode::kInvalidArgument,
                           absl::StrCat("model ", name_, ": forward on ", ShapeString(x)), e);
    }
  }

  std::vector<torch::Tensor> Parameters() override { return params_; }
  std::vector<std::string> ParameterNames() override { return names_; }
  void SetTraining(bool training) override { module_->train(training); }

  absl::Status Save(const std::string& path) override {
    try {
      torch::save(module_, path);
    } catch (const std::exception& e) {
      return FromException(absl::StatusCode::kInternal,
                           absl::StrCat("model ", name_, ": saving to ", path), e);
    }
    return absl::OkStatus();
  }

 private:
  const std::string name_;
  Holder module_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
};

// A Model over a TorchScript module loaded from disk.
class TorchScriptModel : public Model {
 public:
  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& path) {
    // Checked up front because torch::jit::load reports a missing file as a generic
    // c10::Error, indistinguishable from a corrupt one.
    struct stat st;
    if (path.empty() || stat(path.c_str(), &st) != 0) {
      return absl::NotFoundError(
          absl::StrCat("TorchScript model file \"", path, "\" not found (set model.path)"));
    }
    auto model = std::unique_ptr<TorchScriptModel>(new TorchScriptModel(path));
    try {
      model->module_ = torch::jit::load(path);
      model->module_.train(true);
      for (const auto& item : model->module_.named_parameters(/*recurse=*/true)) {
        torch::Tensor p = item.value;
        // Gradients travel as float32 and live on the host; reject anything else here
        // rather than failing later in the middle of training.
        if (p.scalar_type() != torch::kFloat32 || !p.device().is_cpu()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "TorchScript model ", path, ": parameter ", item.name, " is ", TypeString(p), " on ",
              p.device().str(), "; only float32 CPU parameters are supported"));
        }
        // Modules saved after freezing or from torch.no_grad code may have it off, and
        // then backward would not fill .grad().
        p.requires_grad_(true);
        model->names_.push_back(item.name);
        model->params_.push_back(p);
      }
    } catch (const std::exception& e) {
      return FromException(absl::StatusCode::kInvalidArgument,
                           absl::StrCat("loading TorchScript model ", path), e);
    }
    if (model->params_.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("TorchScript model ", path, " has no parameters to train"));
    }
    return std::unique_ptr<Model>(std::move(model));
  }

  absl::StatusOr<torch::Tensor> Forward(const torch::Tensor& x) override {
    // The module decides which inputs it accepts; only the output contract is checked.
    torch::Tensor out;
    try {
      torch::jit::IValue result = module_.forward({x});
      if (!result.isTensor()) {
        return absl::InvalidArgumentError(absl::StrCat("TorchScript model ", path_, " returned a ",
                                                       result.tagKind(), ", not a tensor"));
      }
      out = result.toTensor();
    } catch (const std::exception& e) {
      return FromException(absl::StatusCode::kInvalidArgument,
                           absl::StrCat("TorchScript model ", path_, ": forward on ", TypeString(x),
                                        " ", ShapeString(x)),
                           e);
    }
    // Checked without calling size() on tensors that may lack dimension 0 (it throws).
    if (!out.defined() || out.dim() != 2 || !x.defined() || x.dim() == 0 ||
        out.size(0) != x.size(0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("TorchScript model ", path_, " returned ", ShapeString(out), " for input ",
                       ShapeString(x), "; expected [N, num_classes]"));
    }
    return out;
  }

  std::vector<torch::Tensor> Parameters() override { return params_; }
  std::vector<std::string> ParameterNames() override { return names_; }
  void SetTraining(bool training) override { module_.train(training); }

  absl::Status Save(const std::string& path) override {
    try {
      module_.save(path);
    } catch (const std::exception& e) {
      return FromException(absl::StatusCode::kInternal,
                           absl::StrCat("saving TorchScript model to ", path), e);
    }
    return absl::OkStatus();
  }

 private:
  explicit TorchScriptModel(std::string path) : path_(std::move(path)) {}

  const std::string path_;
  torch::jit::Module module_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
};

template <typename Holder>
absl::StatusOr<std::unique_ptr<Model>> MakeBuiltin(const std::string& name) {
  try {
    return std::unique_ptr<Model>(new BuiltinModel<Holder>(name, Holder()));
  } catch (const std::exception& e) {
    return FromException(absl::StatusCode::kInternal, absl::StrCat("creating model ", name), e);
  }
}

}  // namespace

ModelRegistry ModelRegistry::WithBuiltins() {
  ModelRegistry registry;
  // Registration of fixed, distinct names cannot fail.
  registry.factories_.Set("mlp", [](const ModelSpec&) { return MakeBuiltin<Mlp>("mlp"); });
  registry.factories_.Set("lenet", [](const ModelSpec&) { return MakeBuiltin<LeNet>("lenet"); });
  registry.factories_.Set(
      "torchscript", [](const ModelSpec& spec) { return TorchScriptModel::Load(spec.path()); });
  return registry;
}

absl::Status ModelRegistry::Register(const std::string& name, ModelFactory factory) {
  return factories_.Add(name, std::move(factory));
}

absl::StatusOr<std::unique_ptr<Model>> ModelRegistry::Create(const ModelSpec& spec,
                                                             uint64_t seed) const {
  auto factory = factories_.Find(spec.name());
  if (!factory.ok()) return factory.status();
  try {
    // Initial weights must be identical on every worker: they all seed the same way before
    // constructing the same modules.
    torch::manual_seed(seed);
    return (**factory)(spec);
  } catch (const std::exception& e) {
    return FromException(absl::StatusCode::kInternal, absl::StrCat("creating model ", spec.name()),
                         e);
  }
}

std::vector<std::string> ModelRegistry::Names() const { return factories_.Names(); }

absl::StatusOr<std::unique_ptr<Model>> CreateModel(const ModelSpec& spec, uint64_t seed) {
  return ModelRegistry::WithBuiltins().Create(spec, seed);
}

absl::StatusOr<torch::Tensor> CrossEntropyLoss(Model* model, const torch::Tensor& x,
                                               const torch::Tensor& y) {
  absl::StatusOr<torch::Tensor> logits = model->Forward(x);
  if (!logits.ok()) return logits.status();
  if (!y.defined() || y.scalar_type() != torch::kInt64 || y.dim() != 1 ||
      y.size(0) != logits->size(0)) {
    return absl::InvalidArgumentError(absl::StrCat("labels must be int64 [", logits->size(0),
                                                   "], got ", TypeString(y), " ", ShapeString(y)));
  }
  try {
    return torch::nn::functional::cross_entropy(*logits, y);
  } catch (const std::exception& e) {
    // E.g. a label outside [0, num_classes).
    return FromException(absl::StatusCode::kInvalidArgument, "cross-entropy loss", e);
  }
}

absl::StatusOr<int64_t> CountCorrect(Model* model, const torch::Tensor& x, const torch::Tensor& y) {
  torch::NoGradGuard no_grad;
  absl::StatusOr<torch::Tensor> logits = model->Forward(x);
  if (!logits.ok()) return logits.status();
  if (!y.defined() || y.dim() != 1 || y.size(0) != logits->size(0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("labels must be [", logits->size(0), "], got ", ShapeString(y)));
  }
  try {
    return logits->argmax(1).eq(y).sum().item<int64_t>();
  } catch (const std::exception& e) {
    return FromException(absl::StatusCode::kInvalidArgument, "counting correct predictions", e);
  }
}

absl::Status CheckModelName(const std::string& name) {
  return ModelRegistry::WithBuiltins().Check(name);
}

}  // namespace gradmesh
