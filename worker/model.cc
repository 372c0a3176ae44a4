#include "worker/model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <sys/stat.h>
#include <torch/script.h>

#include <cmath>
#include <exception>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "worker/model_names.h"

namespace gradmesh {
namespace {

// "float32", "int64", ...: PyTorch's Python names (ElemTypeName), which users know from their
// own code (c10::toString says "Float", "Long"); c10's name for the types gradmesh cannot carry.
std::string DTypeName(torch::ScalarType type) {
  absl::StatusOr<ElemType> t = ToElemType(type, "");
  return t.ok() ? ElemTypeName(*t) : c10::toString(type);
}

// "float32[64, 1, 28, 28]" for messages.
std::string TensorString(const torch::Tensor& t) {
  if (!t.defined()) return "undefined tensor";
  return absl::StrCat(DTypeName(t.scalar_type()), "[", absl::StrJoin(t.sizes(), ", "), "]");
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

// The models built here say what they are in messages ("model mlp", "TorchScript model
// /p/m.pt"); CheckModelFitsData names the model with it.
class NamedModel : public Model {
 public:
  virtual std::string Describe() const = 0;
};

std::string Describe(Model* model) {
  const auto* named = dynamic_cast<const NamedModel*>(model);
  return named != nullptr ? named->Describe() : std::string("model");
}

// Checks the contract of Model::Forward for the built-in MNIST models.
absl::Status CheckMnistInput(const std::string& model, const torch::Tensor& x) {
  if (!x.defined() || x.scalar_type() != torch::kFloat32 || x.dim() != 4 || x.size(1) != 1 ||
      x.size(2) != 28 || x.size(3) != 28) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model ", model, ": input must be float32 [N, 1, 28, 28], got ", TensorString(x)));
  }
  return absl::OkStatus();
}

// Layer `layer` of a built-in model: its weight and bias are parameters 2 * layer and
// 2 * layer + 1 (registration order).
void OpenLayer(const ParameterGate& gate, int layer) {
  if (gate) gate(2 * layer, 2 * layer + 2);
}

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(784, 256))),
        fc2(register_module("fc2", torch::nn::Linear(256, 256))),
        fc3(register_module("fc3", torch::nn::Linear(256, 10))) {}

  // `gate` (may be empty) opens each layer's parameters (weight, bias) before it runs.
  torch::Tensor forward(const torch::Tensor& x, const ParameterGate& gate = {}) {
    OpenLayer(gate, 0);
    torch::Tensor h = torch::relu(fc1(x.flatten(1)));
    OpenLayer(gate, 1);
    h = torch::relu(fc2(h));
    OpenLayer(gate, 2);
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

  torch::Tensor forward(const torch::Tensor& x, const ParameterGate& gate = {}) {
    OpenLayer(gate, 0);
    torch::Tensor h = torch::max_pool2d(torch::relu(conv1(x)), 2);  // [N, 6, 14, 14]
    OpenLayer(gate, 1);
    h = torch::max_pool2d(torch::relu(conv2(h)), 2);  // [N, 16, 5, 5]
    OpenLayer(gate, 2);
    h = torch::relu(fc1(h.flatten(1)));
    OpenLayer(gate, 3);
    h = torch::relu(fc2(h));
    OpenLayer(gate, 4);
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
class BuiltinModel : public NamedModel {
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

  std::string Describe() const override { return absl::StrCat("model ", name_); }

  bool SetParameterGate(ParameterGate gate) override {
    gate_ = std::move(gate);
    return true;
  }

  absl::StatusOr<torch::Tensor> Forward(const torch::Tensor& x) override {
    if (absl::Status s = CheckMnistInput(name_, x); !s.ok()) return s;
    try {
      return module_->forward(x, gate_);
    } catch (const std::exception& e) {
      return FromException(absl::StatusCode::kInvalidArgument,
                           absl::StrCat("model ", name_, ": forward on ", TensorString(x)), e);
    }
  }

  absl::StatusOr<torch::Tensor> ModuleLoss(const torch::Tensor&, const torch::Tensor&) override {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", name_,
                     " has no method loss(x, y) (built-in models have none); use loss: "
                     "cross_entropy"));
  }
  bool HasModuleLoss() override { return false; }

  std::vector<torch::Tensor> Parameters() override { return params_; }
  std::vector<std::string> ParameterNames() override { return names_; }
  std::vector<torch::Tensor> Buffers() override { return {}; }
  std::vector<std::string> BufferNames() override { return {}; }
  void SetTraining(bool training) override { module_->train(training); }
  absl::Status ToDevice(const torch::Device& device) override {
    try {
      module_->to(device);
    } catch (const std::exception& e) {
      return FromException(absl::StatusCode::kInternal,
                           absl::StrCat("model ", name_, ": moving to ", device.str()), e);
    }
    return absl::OkStatus();
  }

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
  ParameterGate gate_;  // Empty: none.
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
};

// A Model over a TorchScript module loaded from disk.
class TorchScriptModel : public NamedModel {
 public:
  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& path) {
    // Checked up front because torch::jit::load reports a missing file as a generic
    // c10::Error, indistinguishable from a corrupt one.
    struct stat st;
    if (path.empty() || stat(path.c_str(), &st) != 0) {
      return absl::NotFoundError(
          absl::StrCat("TorchScript model file \"", path, "\" not found (set model.path)"));
    }
    if (!S_ISREG(st.st_mode)) {
      // A directory, or a FIFO or device whose open would block the job's start for good.
      return absl::InvalidArgumentError(
          absl::StrCat("TorchScript model file \"", path, "\" is not a regular file"));
    }
    auto model = std::unique_ptr<TorchScriptModel>(new TorchScriptModel(path));
    try {
      // Onto the CPU whatever device it was saved from (a module saved on a GPU names CUDA
      // storages, which a CPU LibTorch cannot make): the loop moves it to its own device.
      model->module_ = torch::jit::load(path, torch::Device(torch::kCPU));
      model->module_.train(true);
      if (absl::Status s = model->CollectTensors(); !s.ok()) return s;
      model->has_loss_ = model->module_.find_method("loss").has_value();
    } catch (const std::exception& e) {
      return FromException(absl::StatusCode::kInvalidArgument,
                           absl::StrCat("loading TorchScript model ", path), e);
    }
    if (model->params_.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("TorchScript model ", path,
                       " has no parameters to train (a module saved after torch.jit.freeze "
                       "holds its weights as constants: save it before freezing)"));
    }
    return std::unique_ptr<Model>(std::move(model));
  }

  std::string Describe() const override { return absl::StrCat("TorchScript model ", path_); }

  absl::StatusOr<torch::Tensor> Forward(const torch::Tensor& x) override {
    // The module decides which inputs it accepts and what it returns; the losses check the
    // output against the targets.
    if (!x.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(Describe(), ": forward on undefined tensor"));
    }
    try {
      const torch::jit::IValue result = module_.forward({AsTrained(x)});
      std::optional<torch::Tensor> out = OutputTensor(result);
      if (!out.has_value()) {
        return absl::InvalidArgumentError(absl::StrCat(
            Describe(), ": forward on ", TensorString(x), " returned a ", result.tagKind(),
            "; it must return a tensor, a tuple or list whose first element is one, or a dict "
            "with a tensor under \"logits\" or \"out\""));
      }
      return *std::move(out);
    } catch (const std::exception& e) {
      return FromException(absl::StatusCode::kInvalidArgument,
                           absl::StrCat(Describe(), ": forward on ", TensorString(x)), e);
    }
  }

  // The prediction in what forward returned: the tensor itself; the first element of a tuple
  // or list (as models with auxiliary outputs return (logits, aux), or HuggingFace models
  // with return_dict=False); the "logits" or "out" entry of a dict (torchvision's
  // segmentation models: {"out": ..., "aux": ...}). None otherwise.
  static std::optional<torch::Tensor> OutputTensor(const torch::jit::IValue& v) {
    if (v.isTensor()) return v.toTensor();
    if (v.isTuple() && !v.toTupleRef().elements().empty() &&
        v.toTupleRef().elements()[0].isTensor()) {
      return v.toTupleRef().elements()[0].toTensor();
    }
    if (v.isList() && !v.toListRef().empty() && v.toListRef()[0].isTensor()) {
      return v.toListRef()[0].toTensor();
    }
    if (v.isGenericDict() && v.toGenericDict().keyType()->kind() == c10::TypeKind::StringType) {
      const c10::Dict<torch::jit::IValue, torch::jit::IValue> d = v.toGenericDict();
      for (const char* key : {"logits", "out"}) {
        auto it = d.find(torch::jit::IValue(std::string(key)));
        if (it != d.end() && it->value().isTensor()) return it->value().toTensor();
      }
    }
    return std::nullopt;
  }

  absl::StatusOr<torch::Tensor> ModuleLoss(const torch::Tensor& x,
                                           const torch::Tensor& y) override {
    if (!has_loss_) {
      return absl::FailedPreconditionError(
          absl::StrCat(Describe(),
                       " has no method loss(x, y); add @torch.jit.export def loss(self, x, y) "
                       "or use loss: cross_entropy"));
    }
    const std::string call =
        absl::StrCat(Describe(), ": loss(x, y) on x ", TensorString(x), ", y ", TensorString(y));
    if (!x.defined() || !y.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(call, ": undefined tensor"));
    }
    torch::jit::IValue result;
    try {
      result = module_.run_method("loss", AsTrained(x), AsTrained(y));
    } catch (const std::exception& e) {
      return FromException(absl::StatusCode::kInvalidArgument, call, e);
    }
    if (!result.isTensor()) {
      return absl::InvalidArgumentError(absl::StrCat(call, " returned a ", result.tagKind(),
                                                     "; expected a scalar floating tensor"));
    }
    torch::Tensor loss = result.toTensor();
    if (!loss.defined() || loss.dim() != 0 || !loss.is_floating_point()) {
      return absl::InvalidArgumentError(absl::StrCat(call, " returned ", TensorString(loss),
                                                     "; expected a scalar floating tensor"));
    }
    return loss;
  }
  bool HasModuleLoss() override { return has_loss_; }

  std::vector<torch::Tensor> Parameters() override { return params_; }
  std::vector<std::string> ParameterNames() override { return names_; }
  std::vector<torch::Tensor> Buffers() override {
    // The tensors the module holds now, under the names first listed: a forward that assigned
    // a buffer anew (an EMA written as `self.ema = ...`) left the first tensor behind. A buffer
    // since set to None comes back undefined.
    std::vector<torch::Tensor> now(buffer_names_.size());
    size_t next = 0;
    for (const auto& item : module_.named_buffers(/*recurse=*/true)) {
      // Same walk, same order: a listed name is found at or after the last one matched.
      for (size_t i = next; i < buffer_names_.size(); ++i) {
        if (buffer_names_[i] != item.name) continue;
        now[i] = item.value;
        next = i + 1;
        break;
      }
    }
    return now;
  }
  std::vector<std::string> BufferNames() override { return buffer_names_; }
  std::vector<std::string> FrozenParameterNames() override { return frozen_names_; }
  void SetTraining(bool training) override { module_.train(training); }
  absl::Status ToDevice(const torch::Device& device) override {
    try {
      module_.to(device);  // In place (set_data): params_ and Buffers() still alias the module.
    } catch (const std::exception& e) {
      return FromException(absl::StatusCode::kInternal,
                           absl::StrCat(Describe(), ": moving to ", device.str()), e);
    }
    return absl::OkStatus();
  }

  absl::Status Save(const std::string& path) override {
    // Parameters() and Buffers() alias the module's slots, so this writes their current values,
    // in the types the module was saved with: a converted module's tensors go back to them for
    // the write and then to their float32 values (kept, so no rounding is carried on).
    std::vector<std::pair<torch::Tensor, torch::Tensor>> restore;
    try {
      torch::NoGradGuard no_grad;
      std::unordered_set<const c10::TensorImpl*> done;
      auto to_saved = [&](const std::string& name, torch::Tensor t) {
        auto it = saved_types_.find(name);
        if (it == saved_types_.end() || !t.defined() || t.scalar_type() == it->second ||
            !done.insert(t.unsafeGetTensorImpl()).second) {
          return;
        }
        restore.emplace_back(t, t.data());
        // A frozen parameter goes back as it was (never trained: no rounding through float32).
        auto original = frozen_originals_.find(name);
        t.set_data(original != frozen_originals_.end() ? original->second
                                                       : t.data().to(it->second));
      };
      for (const auto& item : module_.named_parameters(/*recurse=*/true)) {
        to_saved(item.name, item.value);
      }
      for (const auto& item : module_.named_buffers(/*recurse=*/true)) {
        to_saved(item.name, item.value);
      }
      module_.save(path);
    } catch (const std::exception& e) {
      RestoreTrainedTypes(restore);
      return FromException(absl::StatusCode::kInternal,
                           absl::StrCat("saving TorchScript model to ", path), e);
    }
    RestoreTrainedTypes(restore);
    return absl::OkStatus();
  }

  std::vector<torch::ScalarType> SavedParameterTypes() override { return saved_param_types_; }
  std::vector<torch::ScalarType> SavedBufferTypes() override { return saved_buffer_types_; }

 private:
  explicit TorchScriptModel(std::string path) : path_(std::move(path)) {}

  // Lists parameters and buffers once, in named_parameters() / named_buffers() order (the
  // tensors are the module's own, so in-place updates reach forward; Buffers() looks the
  // buffers up again). A tensor registered
  // under two names (tied weights) is listed once, under its first name: listing it twice
  // would apply its (already summed) gradient twice.
  //
  // A parameter saved with requires_grad off while others have it on is frozen (a model
  // fine-tuned in part, as `p.requires_grad = False` leaves it in PyTorch): it is not trained
  // or exchanged and keeps the module's value (any dtype). A module with it off on every
  // parameter (exported for inference, or from torch.no_grad code) trains them all.
  absl::Status CollectTensors() {
    std::unordered_set<const c10::TensorImpl*> seen;
    bool any_trainable = false;
    for (const auto& item : module_.named_parameters(/*recurse=*/true)) {
      any_trainable = any_trainable || item.value.requires_grad();
    }
    if (NeedsFloat32(any_trainable)) ConvertToFloat32(any_trainable);
    for (const auto& item : module_.named_parameters(/*recurse=*/true)) {
      if (item.value.is_floating_point()) param_types_.insert(item.value.scalar_type());
    }
    for (const auto& item : module_.named_parameters(/*recurse=*/true)) {
      torch::Tensor p = item.value;
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      if (any_trainable && !p.requires_grad()) {
        frozen_names_.push_back(item.name);
        continue;
      }
      // Gradients travel as contiguous float32 spans over host memory (ModelView); reject
      // anything else here rather than failing later in the middle of training. A strided
      // one (nn.Parameter(w.t())) is made contiguous in place: the module keeps the same
      // parameter with the same values, now in row-major order.
      if (p.scalar_type() == torch::kFloat32 && p.device().is_cpu() && !p.is_contiguous()) {
        torch::NoGradGuard no_grad;
        p.set_data(p.contiguous());
      }
      if (p.scalar_type() != torch::kFloat32 || !p.device().is_cpu() || !p.is_contiguous()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "TorchScript model ", path_, ": parameter ", item.name, " is ", TensorString(p),
            p.is_contiguous() ? "" : " (not contiguous)", " on ", p.device().str(),
            "; only float32 CPU parameters are supported (float64, float16 and "
            "bfloat16 ones are trained as float32)"));
      }
      p.requires_grad_(true);  // Off on every parameter: train them all (above).
      names_.push_back(item.name);
      params_.push_back(p);
      saved_param_types_.push_back(SavedType(item.name, p.scalar_type()));
    }
    for (const auto& item : module_.named_buffers(/*recurse=*/true)) {
      torch::Tensor b = item.value;
      if (!b.defined() || !seen.insert(b.unsafeGetTensorImpl()).second) continue;
      if (!b.device().is_cpu()) {
        return absl::InvalidArgumentError(absl::StrCat("TorchScript model ", path_, ": buffer ",
                                                       item.name, " is on ", b.device().str(),
                                                       "; only CPU buffers are supported"));
      }
      buffer_names_.push_back(item.name);
      saved_buffer_types_.push_back(SavedType(item.name, b.scalar_type()));
    }
    return absl::OkStatus();
  }

  // Floating types a module may be saved in and is trained in as float32.
  static bool IsConvertible(torch::ScalarType t) {
    return t == torch::kFloat64 || t == torch::kFloat16 || t == torch::kBFloat16;
  }

  // True if a parameter to be trained is float64, float16 or bfloat16 (`model.double()`,
  // `model.half()` before saving): the shards' optimizers, the codecs and the collectives
  // work on float32, so such a module is trained as float32 and written back in its types.
  bool NeedsFloat32(bool any_trainable) {
    for (const auto& item : module_.named_parameters(/*recurse=*/true)) {
      const torch::Tensor& p = item.value;
      if ((!any_trainable || p.requires_grad()) && p.device().is_cpu() &&
          IsConvertible(p.scalar_type())) {
        return true;
      }
    }
    return false;
  }

  // Converts every float64/float16/bfloat16 parameter and buffer (frozen ones too: the forward
  // mixes them with the others) to float32 in place, as Module.float() does, remembering each
  // name's type for Save and the exports, and a frozen parameter's values as they were.
  // Integer and bool tensors stay as they are.
  void ConvertToFloat32(bool any_trainable) {
    torch::NoGradGuard no_grad;
    // The converted tensors' impls with their saved types (to find tied aliases).
    std::vector<std::pair<const c10::TensorImpl*, torch::ScalarType>> converted_impls;
    auto convert = [&](const std::string& name, torch::Tensor t, bool frozen) {
      if (!t.defined() || !t.device().is_cpu()) return;
      if (IsConvertible(t.scalar_type())) {
        saved_types_[name] = t.scalar_type();
        if (frozen) frozen_originals_[name] = t.data();
        t.set_data(t.data().to(torch::kFloat32).contiguous());
      } else if (t.scalar_type() == torch::kFloat32) {
        // A tied alias of a tensor converted under its first name.
        for (const auto& [first, type] : converted_impls) {
          if (first == t.unsafeGetTensorImpl()) saved_types_[name] = type;
        }
        return;
      } else {
        return;
      }
      converted_impls.emplace_back(t.unsafeGetTensorImpl(), saved_types_[name]);
    };
    for (const auto& item : module_.named_parameters(/*recurse=*/true)) {
      convert(item.name, item.value, any_trainable && !item.value.requires_grad());
    }
    for (const auto& item : module_.named_buffers(/*recurse=*/true)) {
      convert(item.name, item.value, false);
    }
  }

  // The type the tensor under `name` was saved in (`now` if it was not converted).
  torch::ScalarType SavedType(const std::string& name, torch::ScalarType now) const {
    auto it = saved_types_.find(name);
    return it == saved_types_.end() ? now : it->second;
  }

  // A floating input or target as the trained module takes it: one of a type none of its
  // parameters has (NumPy's float64 data for a float32 module, any input of a converted one)
  // as float32; anything else as it is (a frozen float16 part may take float16 input).
  torch::Tensor AsTrained(const torch::Tensor& x) const {
    return x.defined() && x.is_floating_point() && x.scalar_type() != torch::kFloat32 &&
                   param_types_.count(x.scalar_type()) == 0
               ? x.to(torch::kFloat32)
               : x;
  }

  static void RestoreTrainedTypes(
      const std::vector<std::pair<torch::Tensor, torch::Tensor>>& restore) {
    for (const auto& [tensor, trained] : restore) {
      torch::Tensor t = tensor;
      t.set_data(trained);
    }
  }

  const std::string path_;
  torch::jit::Module module_;
  bool has_loss_ = false;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
  std::vector<std::string> buffer_names_;
  std::vector<std::string> frozen_names_;
  // The types ConvertToFloat32 converted from, by parameter or buffer name (tied aliases
  // too).
  std::map<std::string, torch::ScalarType> saved_types_;
  // Frozen parameters' values as the module had them before that conversion, by name.
  std::map<std::string, torch::Tensor> frozen_originals_;
  // The floating types of the module's parameters (after any conversion).
  std::set<torch::ScalarType> param_types_;
  std::vector<torch::ScalarType> saved_param_types_;   // Parallel to params_.
  std::vector<torch::ScalarType> saved_buffer_types_;  // Parallel to buffer_names_.
};

template <typename Holder>
absl::StatusOr<std::unique_ptr<Model>> MakeBuiltin(const std::string& name) {
  try {
    return std::unique_ptr<Model>(new BuiltinModel<Holder>(name, Holder()));
  } catch (const std::exception& e) {
    return FromException(absl::StatusCode::kInternal, absl::StrCat("creating model ", name), e);
  }
}

// Class-index targets as the loss takes them: a column of labels [N, 1] beside logits [N, C]
// (a label column, as tabular data often has it) is the [N] it stands for; anything else as it
// is.
torch::Tensor ClassTargets(const torch::Tensor& out, const torch::Tensor& y) {
  if (out.defined() && y.defined() && out.dim() == 2 && y.dim() == 2 && y.size(1) == 1 &&
      y.size(0) == out.size(0)) {
    return y.reshape({-1});
  }
  return y;
}

// Checks that a model output fits cross-entropy targets: logits [N, C] with integer [N] (or
// [N, 1]), or [N, T, C] with integer [N, T], every index in [0, C). y.min()/y.max() keep the range
// check to two reductions; LibTorch's own message for a bad index is a bare assertion.
absl::Status CheckCrossEntropyFits(const torch::Tensor& out, const torch::Tensor& y_in) {
  const torch::Tensor y = ClassTargets(out, y_in);
  auto mismatch = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("loss cross_entropy: model output ",
                                                   TensorString(out), " does not fit targets ",
                                                   TensorString(y_in), "; ", why));
  };
  if (!out.defined() || !y.defined()) return mismatch("undefined tensor");
  if (!out.is_floating_point()) return mismatch("the output must be floating-point logits");
  if (y.is_floating_point() || y.is_complex() || y.scalar_type() == torch::kBool) {
    return mismatch(
        "targets must be integer class indices (any integer dtype; float targets: use loss "
        "mse)");
  }
  const bool flat = out.dim() == 2 && y.dim() == 1 && y.size(0) == out.size(0);
  const bool sequence =
      out.dim() == 3 && y.dim() == 2 && y.size(0) == out.size(0) && y.size(1) == out.size(1);
  if (!flat && !sequence) {
    return mismatch(
        "expected logits [N, C] with targets [N] (or [N, 1]), or [N, T, C] with targets [N, T]");
  }
  if (y.numel() == 0 || out.size(-1) == 0) return mismatch("empty batch or no classes");
  const int64_t classes = out.size(-1);
  const int64_t lowest = y.min().item<int64_t>();
  const int64_t highest = y.max().item<int64_t>();
  if (lowest < 0 || highest >= classes) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss cross_entropy: target class index ", lowest < 0 ? lowest : highest,
                     " is out of range for model output ", TensorString(out), " (", classes,
                     " classes: indices 0..", classes - 1, ")"));
  }
  return absl::OkStatus();
}

// The mse target for `out`: y converted to the output's dtype, of the output's shape. y may
// also be [N] for an output [N, 1] (a single regression value per sample); nothing else is
// broadcast, since a silently broadcast mse is a classic wrong-shape bug.
absl::StatusOr<torch::Tensor> MseTarget(const torch::Tensor& out, const torch::Tensor& y) {
  auto mismatch = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("loss mse: model output ", TensorString(out),
                                                   " does not fit targets ", TensorString(y), "; ",
                                                   why));
  };
  if (!out.defined() || !y.defined()) return mismatch("undefined tensor");
  if (!out.is_floating_point()) return mismatch("the output must be floating-point");
  if (!y.is_floating_point()) {
    return mismatch("targets must be floating-point (class indices: use loss cross_entropy)");
  }
  if (out.dim() == 0 || out.numel() == 0) return mismatch("expected a non-empty batch [N, ...]");
  if (y.sizes() == out.sizes()) return y.to(out.scalar_type());
  if (out.dim() == 2 && out.size(1) == 1 && y.dim() == 1 && y.size(0) == out.size(0)) {
    return y.unsqueeze(1).to(out.scalar_type());
  }
  return mismatch("targets must have the output's shape (or [N] for an output [N, 1])");
}

// The mean loss of `kind` (cross-entropy or mse) of a model output against y.
absl::StatusOr<torch::Tensor> LossOfOutput(LossKind kind, const torch::Tensor& out,
                                           const torch::Tensor& y) {
  try {
    if (kind == LossKind::kCrossEntropy) {
      RETURN_IF_ERROR(CheckCrossEntropyFits(out, y));
      // [N, T, C] flattens to N*T predictions: the mean is over every token. Integer targets
      // of any width are class indices (uint8 labels, as IDX files hold them, convert exactly).
      return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}),
                                                  y.reshape({-1}).to(torch::kInt64));
    }
    if (kind == LossKind::kMse) {
      ASSIGN_OR_RETURN(torch::Tensor target, MseTarget(out, y));
      return torch::mse_loss(out, target);
    }
  } catch (const std::exception& e) {
    return FromException(absl::StatusCode::kInvalidArgument,
                         absl::StrCat("loss ", LossName(kind), " of model output ",
                                      TensorString(out), " and targets ", TensorString(y)),
                         e);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("loss ", LossName(kind), " is not computed from the model's output"));
}

// Samples in a batch: the targets' first dimension (the input's if the targets are scalars).
int64_t BatchSamples(const torch::Tensor& x, const torch::Tensor& y) {
  if (y.defined() && y.dim() > 0) return y.size(0);
  if (x.defined() && x.dim() > 0) return x.size(0);
  return 1;
}

// CheckModelFitsData without the buffer and RNG bookkeeping or the `where` prefix.
absl::Status CheckFits(Model* model, LossKind kind, const torch::Tensor& x,
                       const torch::Tensor& y) {
  if (kind == LossKind::kModule) return model->ModuleLoss(x, y).status();
  ASSIGN_OR_RETURN(torch::Tensor out, model->Forward(x));
  absl::Status s = LossOfOutput(kind, out, y).status();
  return s.ok() ? s : Annotate(s, Describe(model));
}

}  // namespace

torch::ScalarType ToScalarType(ElemType type) {
  switch (type) {
    case ElemType::kFloat32:
      return torch::kFloat32;
    case ElemType::kFloat64:
      return torch::kFloat64;
    case ElemType::kFloat16:
      return torch::kFloat16;
    case ElemType::kBFloat16:
      return torch::kBFloat16;
    case ElemType::kInt64:
      return torch::kInt64;
    case ElemType::kInt32:
      return torch::kInt32;
    case ElemType::kInt16:
      return torch::kInt16;
    case ElemType::kInt8:
      return torch::kInt8;
    case ElemType::kUInt8:
      return torch::kUInt8;
    case ElemType::kBool:
      return torch::kBool;
  }
  return torch::kFloat32;
}

absl::StatusOr<ElemType> ToElemType(torch::ScalarType type, const std::string& what) {
  switch (type) {
    case torch::kFloat32:
      return ElemType::kFloat32;
    case torch::kFloat64:
      return ElemType::kFloat64;
    case torch::kFloat16:
      return ElemType::kFloat16;
    case torch::kBFloat16:
      return ElemType::kBFloat16;
    case torch::kInt64:
      return ElemType::kInt64;
    case torch::kInt32:
      return ElemType::kInt32;
    case torch::kInt16:
      return ElemType::kInt16;
    case torch::kInt8:
      return ElemType::kInt8;
    case torch::kUInt8:
      return ElemType::kUInt8;
    case torch::kBool:
      return ElemType::kBool;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, " has dtype ", c10::toString(type), ", which gradmesh cannot carry"));
  }
}

absl::StatusOr<LossKind> ParseLoss(const std::string& name) {
  if (name.empty() || name == "cross_entropy") return LossKind::kCrossEntropy;
  if (name == "mse") return LossKind::kMse;
  if (name == "module") return LossKind::kModule;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown loss \"", name, "\" (known: cross_entropy, mse, module)"));
}

const char* LossName(LossKind kind) {
  switch (kind) {
    case LossKind::kCrossEntropy:
      return "cross_entropy";
    case LossKind::kMse:
      return "mse";
    case LossKind::kModule:
      return "module";
  }
  return "unknown";
}

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

absl::StatusOr<torch::Tensor> ComputeLoss(Model* model, LossKind kind, const torch::Tensor& x,
                                          const torch::Tensor& y) {
  if (kind == LossKind::kModule) return model->ModuleLoss(x, y);
  ASSIGN_OR_RETURN(torch::Tensor out, model->Forward(x));
  return LossOfOutput(kind, out, y);
}

absl::StatusOr<torch::Tensor> CrossEntropyLoss(Model* model, const torch::Tensor& x,
                                               const torch::Tensor& y) {
  return ComputeLoss(model, LossKind::kCrossEntropy, x, y);
}

absl::StatusOr<int64_t> CountCorrect(Model* model, const torch::Tensor& x, const torch::Tensor& y) {
  torch::NoGradGuard no_grad;
  ASSIGN_OR_RETURN(torch::Tensor logits, model->Forward(x));
  try {
    RETURN_IF_ERROR(CheckCrossEntropyFits(logits, y));
    return logits.argmax(-1).eq(ClassTargets(logits, y)).sum().item<int64_t>();
  } catch (const std::exception& e) {
    return FromException(absl::StatusCode::kInvalidArgument, "counting correct predictions", e);
  }
}

absl::Status EvaluateBatch(Model* model, LossKind kind, const torch::Tensor& x,
                           const torch::Tensor& y_in, EvalTotals* totals, int64_t valid) {
  torch::NoGradGuard no_grad;
  const int64_t batch = BatchSamples(x, y_in);
  const bool padded = valid >= 0 && valid < batch;
  if (padded && (kind == LossKind::kModule || y_in.dim() == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "evaluating ", Describe(model), ": a padded batch needs per-sample outputs and targets"));
  }
  const int64_t samples = padded ? valid : batch;
  torch::Tensor y = padded ? y_in.narrow(0, 0, samples) : y_in;
  try {
    if (kind == LossKind::kModule) {
      ASSIGN_OR_RETURN(torch::Tensor loss, model->ModuleLoss(x, y));
      totals->loss_sum += loss.item<double>() * static_cast<double>(samples);
      totals->samples += samples;
      totals->predictions += samples;
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(torch::Tensor out, model->Forward(x));
    if (padded) {
      if (out.dim() == 0 || out.size(0) != batch) {
        return absl::InvalidArgumentError(
            absl::StrCat("evaluating ", Describe(model), ": output ", TensorString(out), " for ",
                         batch, " samples has no batch dimension to leave the padding out of"));
      }
      out = out.narrow(0, 0, samples);
    }
    if (kind == LossKind::kCrossEntropy) y = ClassTargets(out, y);
    ASSIGN_OR_RETURN(torch::Tensor loss, LossOfOutput(kind, out, y));
    // Weighted by predictions so that Metrics() gives the mean over the whole test set
    // whatever the batch sizes.
    const int64_t predictions = kind == LossKind::kCrossEntropy ? y.numel() : samples;
    totals->loss_sum += loss.item<double>() * static_cast<double>(predictions);
    totals->samples += samples;
    totals->predictions += predictions;
    if (kind == LossKind::kCrossEntropy) {
      totals->correct += out.argmax(-1).eq(y).sum().item<int64_t>();
      totals->classification = true;
      if (y.dim() == 2) totals->sequence = true;
    }
  } catch (const std::exception& e) {
    return FromException(absl::StatusCode::kInvalidArgument,
                         absl::StrCat("evaluating ", Describe(model), " on x ", TensorString(x),
                                      ", y ", TensorString(y)),
                         e);
  }
  return absl::OkStatus();
}

EvalMetrics Metrics(const EvalTotals& totals) {
  EvalMetrics m;
  if (totals.predictions <= 0) return m;
  m.test_loss = totals.loss_sum / static_cast<double>(totals.predictions);
  if (totals.classification) {
    m.accuracy = static_cast<double>(totals.correct) / static_cast<double>(totals.predictions);
  }
  if (totals.sequence) m.perplexity = std::exp(m.test_loss);
  return m;
}

std::string BufferChange(const std::string& name, const torch::Tensor& now, int64_t elements) {
  if (!now.defined()) return absl::StrCat("set buffer ", name, " to None");
  if (now.numel() == elements) return "";
  return absl::StrCat("resized buffer ", name, " from ", elements, " to ", now.numel(),
                      " elements");
}

absl::Status CheckModelFitsData(Model* model, LossKind kind, const torch::Tensor& x,
                                const torch::Tensor& y, const std::string& where) {
  torch::NoGradGuard no_grad;
  absl::Status status;
  try {
    // A forward in training mode moves BatchNorm statistics and draws dropout masks; the
    // check must leave both as they were so that it does not perturb the run.
    std::vector<torch::Tensor> buffers = model->Buffers();
    std::vector<torch::Tensor> saved;
    saved.reserve(buffers.size());
    for (const torch::Tensor& b : buffers) saved.push_back(b.clone());
    at::Generator rng = at::detail::getDefaultCPUGenerator();
    torch::Tensor rng_state;
    {
      std::lock_guard<std::mutex> lock(rng.mutex());
      rng_state = rng.get_state();
    }
    status = CheckFits(model, kind, x, y);
    // Fetched again: the forward may have assigned a buffer anew (an EMA) instead of updating
    // it in place; the model must hold the saved values either way.
    buffers = model->Buffers();
    const std::vector<std::string> names = model->BufferNames();
    for (size_t i = 0; i < buffers.size() && i < saved.size(); ++i) {
      if (const std::string change = BufferChange(names[i], buffers[i], saved[i].numel());
          !change.empty()) {
        return Annotate(
            absl::FailedPreconditionError(absl::StrCat(Describe(model), ": forward ", change,
                                                       "; buffers must keep their shapes")),
            where);
      }
      buffers[i].copy_(saved[i]);
    }
    std::lock_guard<std::mutex> lock(rng.mutex());
    rng.set_state(rng_state);
  } catch (const std::exception& e) {
    status = FromException(absl::StatusCode::kInternal, Describe(model), e);
  }
  return status.ok() ? status : Annotate(status, where);
}

absl::Status CheckModelName(const std::string& name) {
  return ModelRegistry::WithBuiltins().Check(name);
}

}  // namespace gradmesh
