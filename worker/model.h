// Models trained by workers: a small interface over LibTorch modules, the built-in MNIST
// architectures, TorchScript modules from disk, and a registry that builds them by name.
//
// Built-in models ("mlp", "lenet") take inputs [N, 1, 28, 28] float32 and return logits
// [N, 10]. Their initial weights depend only on the seed given to CreateModel, so every
// worker of a job constructs identical parameters. A "torchscript" model is whatever module
// the user saved with torch.jit.save (scripted or traced): inputs of any shape and dtype,
// outputs of any shape; its parameters and buffers are trained in place.
//
// Losses (JobSpec.loss, see LossKind) and evaluation metrics live here too, so the training
// loop never looks inside a model's output.
//
// Errors never escape as exceptions: LibTorch's c10::Error and std::exception are caught at
// this boundary and returned as absl::Status with a message saying what failed.
//
// Thread safety: a Model is not thread-safe; use each from one thread at a time. Distinct
// Model objects may be used concurrently. CreateModel / ModelRegistry::Create seed LibTorch's
// process-global RNG (torch::manual_seed), so they must not run concurrently with each other
// or with any other use of that RNG (random tensor creation, dropout, ...) in the process.
#ifndef GRADMESH_WORKER_MODEL_H_
#define GRADMESH_WORKER_MODEL_H_

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/registry.h"
#include "proto/gradmesh.pb.h"
#include "worker/core/examples.h"

namespace gradmesh {

// LibTorch's scalar type of an element type, and back (INVALID_ARGUMENT naming `what` for a
// scalar type gradmesh cannot carry, e.g. complex).
torch::ScalarType ToScalarType(ElemType type);
absl::StatusOr<ElemType> ToElemType(torch::ScalarType type, const std::string& what);

// How a job's loss is computed (JobSpec.loss).
enum class LossKind {
  kCrossEntropy,  // "cross_entropy": logits [N, C] + int64 [N], or [N, T, C] + int64 [N, T].
  kMse,           // "mse": float targets of the output's shape.
  kModule,        // "module": the module's own method loss(x, y) -> scalar Tensor.
};

// "" and "cross_entropy", "mse", "module"; INVALID_ARGUMENT listing them otherwise.
absl::StatusOr<LossKind> ParseLoss(const std::string& name);
const char* LossName(LossKind kind);

// Called by a model's forward before it reads parameters [begin, end) (Parameters() order);
// returns once they hold the values to use (JobSpec overlap: 2, where the previous step's
// pulled values arrive while the next forward runs).
using ParameterGate = std::function<void(int begin, int end)>;

// A trainable model.
class Model {
 public:
  virtual ~Model() = default;

  // Runs the model's forward on a batch x ([N, ...]): built-ins take float32 [N, 1, 28, 28]
  // and return logits [N, 10]; TorchScript modules take what they take. Records the autograd
  // graph unless the caller holds a torch::NoGradGuard. INVALID_ARGUMENT if x has the wrong
  // shape or type or the module fails on it.
  virtual absl::StatusOr<torch::Tensor> Forward(const torch::Tensor& x) = 0;

  // The module's own loss, loss(x, y) -> scalar (JobSpec.loss "module"), with the autograd
  // graph. FAILED_PRECONDITION if the module has no such method (built-ins never do);
  // INVALID_ARGUMENT if it fails or does not return a scalar floating tensor.
  virtual absl::StatusOr<torch::Tensor> ModuleLoss(const torch::Tensor& x,
                                                   const torch::Tensor& y) = 0;
  // True if ModuleLoss can work (the module has a `loss` method).
  virtual bool HasModuleLoss() = 0;

  // The trainable leaf tensors, in a fixed order that is the same for every instance of the
  // same architecture; backward() fills their .grad(). They alias the model's storage, so
  // updating them in place (under torch::NoGradGuard) updates the model.
  virtual std::vector<torch::Tensor> Parameters() = 0;

  // Dotted names ("fc1.weight", ...) of Parameters(), in the same order.
  virtual std::vector<std::string> ParameterNames() = 0;

  // The module's buffers (BatchNorm running_mean / running_var / num_batches_tracked, any
  // registered buffer; float or integer), in Module::named_buffers() order, the same for
  // every instance of the same architecture. They alias the model's storage: forward in
  // training mode updates them in place, and copying into them (under NoGradGuard) changes
  // the model. Built-in models have none. A forward may also replace a buffer with a new
  // tensor (`self.ema = 0.9 * self.ema + ...` in TorchScript): each call returns the tensors
  // the module holds now, so callers fetch them again after a forward rather than keep them.
  virtual std::vector<torch::Tensor> Buffers() = 0;
  // Dotted names ("bn1.running_mean", ...) of Buffers(), in the same order.
  virtual std::vector<std::string> BufferNames() = 0;

  // The element type each of Parameters() has in the model as the user saved it: float32, or
  // the float64 / float16 / bfloat16 of a TorchScript module that loading converted to float32
  // (the shards' optimizers, the codecs and the collectives work on float32); Save and the
  // exports write that type back. Empty: all float32.
  virtual std::vector<torch::ScalarType> SavedParameterTypes() { return {}; }
  // The same for Buffers(), in their order. Empty: the type each buffer has now.
  virtual std::vector<torch::ScalarType> SavedBufferTypes() { return {}; }

  // Parameters the model keeps as they are (not in Parameters(): not trained, not exchanged),
  // in named_parameters() order: a TorchScript module's parameters saved with requires_grad
  // off while others have it on. Built-in models have none.
  virtual std::vector<std::string> FrozenParameterNames() { return {}; }

  // Installs `gate` (empty: none) for every later Forward. A model that calls it before each
  // layer, first layer first, with that layer's parameters (the built-in models) returns
  // true; one that cannot (a TorchScript module: no forward pre-hook reaches its layers)
  // returns false and ignores it, and the caller waits for every parameter before Forward.
  virtual bool SetParameterGate(ParameterGate gate) { return false; }

  // Switches between training and evaluation behaviour (matters for modules with dropout or
  // batch norm).
  virtual void SetTraining(bool training) = 0;

  // Moves the parameters and buffers to `device` in place: the tensors Parameters() and
  // Buffers() returned keep aliasing the model (their data moves). INTERNAL if LibTorch
  // fails (no such device). Models that cannot move answer UNIMPLEMENTED for a non-CPU device.
  virtual absl::Status ToDevice(const torch::Device& device) {
    if (device.is_cpu()) return absl::OkStatus();
    return absl::UnimplementedError("this model cannot move to " + device.str());
  }

  // Writes the model to `path`. Built-in models use torch::save of the module (load it back
  // with torch::load into a module of the same architecture); TorchScript models use
  // Module::save, so CreateModel({name: "torchscript", path}) reads the file back.
  virtual absl::Status Save(const std::string& path) = 0;
};

// Builds a model from its spec. Called after the registry has seeded LibTorch's RNG.
using ModelFactory = std::function<absl::StatusOr<std::unique_ptr<Model>>(const ModelSpec& spec)>;

// Maps model names to factories. A plain value: build one with WithBuiltins() (or empty and
// Register() your own) and pass it where needed; there is no process-wide registry.
//
// Thread safety: const methods may be called concurrently with each other (but see the note
// on the RNG above); Register() must not race with anything.
class ModelRegistry {
 public:
  ModelRegistry() = default;

  // A registry holding "lenet", "mlp" and "torchscript".
  static ModelRegistry WithBuiltins();

  // Adds `factory` under `name`. INVALID_ARGUMENT if name is empty or factory is null,
  // ALREADY_EXISTS if name is taken.
  absl::Status Register(const std::string& name, ModelFactory factory);

  // Seeds LibTorch's global RNG with `seed`, then runs the factory for spec.name().
  // INVALID_ARGUMENT listing the known names if there is none.
  absl::StatusOr<std::unique_ptr<Model>> Create(const ModelSpec& spec, uint64_t seed) const;

  // Registered names, sorted.
  std::vector<std::string> Names() const;

  // OK if `name` is registered, else the same InvalidArgument as Create.
  absl::Status Check(const std::string& name) const { return factories_.Find(name).status(); }

 private:
  NamedRegistry<ModelFactory> factories_{"model"};
};

// ModelRegistry::WithBuiltins().Create(spec, seed):
// * "mlp": 784-256-256-10 perceptron with ReLU; the input is flattened.
//   Parameters fc1.weight, fc1.bias, fc2.weight, fc2.bias, fc3.weight, fc3.bias.
// * "lenet": LeNet-5 style CNN: conv 1->6 5x5 (padding 2), ReLU, max-pool 2; conv 6->16 5x5,
//   ReLU, max-pool 2; fc 400->120, ReLU; fc 120->84, ReLU; fc 84->10. Parameters
//   conv1.{weight,bias}, conv2.{weight,bias}, fc1..fc3.{weight,bias}.
// * "torchscript": torch::jit::load(spec.path()) (NOT_FOUND if the file does not exist,
//   INVALID_ARGUMENT if it cannot be loaded or has no parameters), put in training mode.
//   Parameters in Module::named_parameters() order, less frozen ones (requires_grad off
//   while others have it on: FrozenParameterNames()); with it off on all, all are trained.
//   The seed does not affect it.
// Not thread-safe: see the note on the RNG above.
absl::StatusOr<std::unique_ptr<Model>> CreateModel(const ModelSpec& spec, uint64_t seed);

// The mean loss of `kind` for batch (x, y), with the autograd graph attached (call
// .backward() on it): cross-entropy of model->Forward(x) ([N, C] logits against int64 [N],
// or [N, T, C] against [N, T], averaged over every token), mse of Forward(x) against y (same
// shape, float), or model->ModuleLoss(x, y). INVALID_ARGUMENT naming the shapes and dtypes
// when the output does not fit the loss.
absl::StatusOr<torch::Tensor> ComputeLoss(Model* model, LossKind kind, const torch::Tensor& x,
                                          const torch::Tensor& y);

// Mean cross-entropy of model->Forward(x) against class indices y ([N], int64), as
// ComputeLoss(model, kCrossEntropy, x, y).
absl::StatusOr<torch::Tensor> CrossEntropyLoss(Model* model, const torch::Tensor& x,
                                               const torch::Tensor& y);

// Number of samples in x whose arg-max logit equals y. Runs without autograd.
absl::StatusOr<int64_t> CountCorrect(Model* model, const torch::Tensor& x, const torch::Tensor& y);

// Sums over a test set, batch by batch (EvaluateBatch), turned into metrics by Metrics().
struct EvalTotals {
  double loss_sum = 0;          // Sum over batches of (mean batch loss * predictions).
  int64_t samples = 0;          // Samples seen.
  int64_t predictions = 0;      // Classification: samples, or tokens for [N, T] targets.
  int64_t correct = 0;          // Predictions whose arg-max equals the target.
  bool classification = false;  // Cross-entropy: accuracy is meaningful.
  bool sequence = false;        // Cross-entropy over [N, T] targets: perplexity reported.
};

// Adds batch (x, y) to *totals: forward without autograd (the caller sets evaluation mode),
// the loss of `kind` and, for cross-entropy, the correct predictions. With `valid` >= 0 only
// the first `valid` samples count (the rest pad the batch to a size the model needs): their
// outputs and targets alone go into the loss. kModule computes its loss over the whole
// batch, so it takes no padding (`valid` must be -1 or the batch size).
absl::Status EvaluateBatch(Model* model, LossKind kind, const torch::Tensor& x,
                           const torch::Tensor& y, EvalTotals* totals, int64_t valid = -1);

struct EvalMetrics {
  double test_loss = 0;    // Mean loss per prediction (per sample for mse and module).
  double accuracy = -1;    // Classification (token accuracy for sequences); -1 otherwise.
  double perplexity = -1;  // exp(test_loss) for sequence models; -1 otherwise.
};
EvalMetrics Metrics(const EvalTotals& totals);

// What a model did to its buffer `name` that the exchange cannot follow, given the tensor it
// holds now and the element count it had: "set buffer NAME to None" or "resized buffer NAME
// from A to B elements"; "" when it kept the buffer's size.
std::string BufferChange(const std::string& name, const torch::Tensor& now, int64_t elements);

// Checks at job start, on one real batch, that the model takes x and that its output fits
// the loss (shapes, dtypes, class indices within the number of classes, a `loss` method for
// kModule), without changing the model (no autograd, buffers restored). INVALID_ARGUMENT
// (FAILED_PRECONDITION for a missing `loss` method) whose message names `where` (the data
// files), the model, the shapes and dtypes.
absl::Status CheckModelFitsData(Model* model, LossKind kind, const torch::Tensor& x,
                                const torch::Tensor& y, const std::string& where);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_MODEL_H_
