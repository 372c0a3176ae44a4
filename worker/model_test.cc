#include "worker/model.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

ModelSpec Spec(const std::string& name, const std::string& path = "") {
  ModelSpec spec;
  spec.set_name(name);
  spec.set_path(path);
  return spec;
}

int64_t NumParameters(Model* model) {
  int64_t n = 0;
  for (const torch::Tensor& p : model->Parameters()) n += p.numel();
  return n;
}

bool FileExists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

std::string MakeTempDir() {
  std::string tmpl = ::testing::TempDir();
  if (tmpl.empty() || tmpl.back() != '/') tmpl += '/';
  tmpl += "model_test_XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  const char* dir = mkdtemp(buf.data());
  EXPECT_NE(dir, nullptr) << tmpl;
  return dir == nullptr ? std::string() : std::string(dir);
}

class ModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::set_num_threads(1);
    dir_ = MakeTempDir();
  }
  std::string dir_;
};

TEST_F(ModelTest, MlpParameters) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec("mlp"), 1));
  EXPECT_EQ(NumParameters(model.get()), 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10);
  EXPECT_EQ(NumParameters(model.get()), 269322);
  EXPECT_EQ(model->ParameterNames(),
            (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                                      "fc3.weight", "fc3.bias"}));
  const std::vector<std::vector<int64_t>> shapes = {{256, 784}, {256},     {256, 256},
                                                    {256},      {10, 256}, {10}};
  const std::vector<torch::Tensor> params = model->Parameters();
  ASSERT_EQ(params.size(), shapes.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].sizes().vec(), shapes[i]) << i;
    EXPECT_TRUE(params[i].requires_grad()) << i;
    EXPECT_TRUE(params[i].is_leaf()) << i;
    EXPECT_EQ(params[i].scalar_type(), torch::kFloat32) << i;
  }
}

TEST_F(ModelTest, LeNetParameters) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec("lenet"), 1));
  const int64_t expected = (6 * 1 * 5 * 5 + 6) + (16 * 6 * 5 * 5 + 16) + (400 * 120 + 120) +
                           (120 * 84 + 84) + (84 * 10 + 10);
  EXPECT_EQ(expected, 61706);
  EXPECT_EQ(NumParameters(model.get()), expected);
  EXPECT_EQ(model->ParameterNames(),
            (std::vector<std::string>{"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                      "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                                      "fc3.weight", "fc3.bias"}));
  EXPECT_EQ(model->Parameters()[0].sizes().vec(), (std::vector<int64_t>{6, 1, 5, 5}));
  EXPECT_EQ(model->Parameters()[2].sizes().vec(), (std::vector<int64_t>{16, 6, 5, 5}));
}

TEST_F(ModelTest, ForwardShapeAndGradients) {
  for (const char* name : {"mlp", "lenet"}) {
    SCOPED_TRACE(name);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec(name), 3));
    const torch::Tensor x = torch::randn({5, 1, 28, 28});
    ASSERT_OK_AND_ASSIGN(torch::Tensor logits, model->Forward(x));
    EXPECT_EQ(logits.sizes().vec(), (std::vector<int64_t>{5, 10}));

    const torch::Tensor y = torch::tensor({0, 1, 2, 3, 9}, torch::kInt64);
    ASSERT_OK_AND_ASSIGN(torch::Tensor loss, CrossEntropyLoss(model.get(), x, y));
    EXPECT_EQ(loss.dim(), 0);
    loss.backward();
    for (const torch::Tensor& p : model->Parameters()) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().sizes(), p.sizes());
    }
    ASSERT_OK_AND_ASSIGN(int64_t correct, CountCorrect(model.get(), x, y));
    EXPECT_EQ(correct, logits.argmax(1).eq(y).sum().item<int64_t>());

    // A label column [N, 1] is the [N] it stands for: the same loss, count and metrics (not
    // a sequence of one token).
    const torch::Tensor column = y.unsqueeze(1);
    ASSERT_OK_AND_ASSIGN(torch::Tensor column_loss, CrossEntropyLoss(model.get(), x, column));
    EXPECT_EQ(column_loss.item<float>(), loss.item<float>());
    ASSERT_OK_AND_ASSIGN(int64_t column_correct, CountCorrect(model.get(), x, column));
    EXPECT_EQ(column_correct, correct);
    torch::NoGradGuard no_grad;
    EvalTotals flat_totals, column_totals;
    ASSERT_OK(EvaluateBatch(model.get(), LossKind::kCrossEntropy, x, y, &flat_totals));
    ASSERT_OK(EvaluateBatch(model.get(), LossKind::kCrossEntropy, x, column, &column_totals));
    const EvalMetrics flat_m = Metrics(flat_totals), column_m = Metrics(column_totals);
    EXPECT_EQ(column_m.accuracy, flat_m.accuracy);
    EXPECT_EQ(column_m.test_loss, flat_m.test_loss);
    EXPECT_EQ(column_m.perplexity, -1);
  }
}

TEST_F(ModelTest, ForwardRejectsBadInput) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec("lenet"), 1));
  EXPECT_STATUS_MSG(model->Forward(torch::randn({5, 784})), absl::StatusCode::kInvalidArgument,
                    "model lenet: input must be float32 [N, 1, 28, 28], got float32[5, 784]");
  EXPECT_STATUS(model->Forward(torch::zeros({2, 1, 28, 28}, torch::kFloat64)),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(model->Forward(torch::Tensor()), absl::StatusCode::kInvalidArgument);

  const torch::Tensor x = torch::randn({2, 1, 28, 28});
  EXPECT_STATUS_MSG(CrossEntropyLoss(model.get(), x, torch::tensor({1, 2, 3}, torch::kInt64)),
                    absl::StatusCode::kInvalidArgument,
                    "loss cross_entropy: model output float32[2, 10] does not fit targets "
                    "int64[3]; expected logits [N, C] with targets [N] (or [N, 1]), or [N, T, "
                    "C] with targets [N, T]");
  // Out-of-range class: caught before LibTorch's bare assertion, naming index and classes.
  EXPECT_STATUS_MSG(CrossEntropyLoss(model.get(), x, torch::tensor({1, 10}, torch::kInt64)),
                    absl::StatusCode::kInvalidArgument,
                    "loss cross_entropy: target class index 10 is out of range for model output "
                    "float32[2, 10] (10 classes: indices 0..9)");
  EXPECT_STATUS(CountCorrect(model.get(), x, torch::tensor({1}, torch::kInt64)),
                absl::StatusCode::kInvalidArgument);
}

TEST_F(ModelTest, SeedDeterminesInitialWeights) {
  for (const char* name : {"mlp", "lenet"}) {
    SCOPED_TRACE(name);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> a, CreateModel(Spec(name), 42));
    torch::randn({100});  // Unrelated RNG use in between must not matter.
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> b, CreateModel(Spec(name), 42));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> c, CreateModel(Spec(name), 43));
    const auto pa = a->Parameters();
    const auto pb = b->Parameters();
    const auto pc = c->Parameters();
    ASSERT_EQ(pa.size(), pb.size());
    ASSERT_EQ(pa.size(), pc.size());
    for (size_t i = 0; i < pa.size(); ++i) {
      EXPECT_TRUE(torch::equal(pa[i], pb[i])) << i;
      EXPECT_FALSE(torch::equal(pa[i], pc[i])) << i;
    }
  }
}

TEST_F(ModelTest, UnknownNameListsKnownModels) {
  EXPECT_STATUS_MSG(CreateModel(Spec("resnet"), 1), absl::StatusCode::kInvalidArgument,
                    "unknown model \"resnet\" (known: lenet, mlp, torchscript)");
  EXPECT_STATUS_MSG(CreateModel(Spec(""), 1), absl::StatusCode::kInvalidArgument, "mlp");
}

TEST_F(ModelTest, RegistryRegistersCustomFactories) {
  ModelRegistry registry = ModelRegistry::WithBuiltins();
  EXPECT_EQ(registry.Names(), (std::vector<std::string>{"lenet", "mlp", "torchscript"}));
  int calls = 0;
  ASSERT_OK(registry.Register("big_mlp", [&calls](const ModelSpec&) {
    ++calls;
    return CreateModel(Spec("mlp"), 5);
  }));
  EXPECT_STATUS(
      registry.Register("mlp", [](const ModelSpec&) { return CreateModel(Spec("mlp"), 5); }),
      absl::StatusCode::kAlreadyExists);
  EXPECT_STATUS(registry.Register("x", nullptr), absl::StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, registry.Create(Spec("big_mlp"), 1));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(NumParameters(model.get()), 269322);
  EXPECT_EQ(ModelRegistry().Names(), std::vector<std::string>{});
  EXPECT_STATUS_MSG(ModelRegistry().Create(Spec("mlp"), 1), absl::StatusCode::kInvalidArgument,
                    "unknown model \"mlp\"");
}

TEST_F(ModelTest, BuiltinSaveWritesEveryParameter) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec("lenet"), 9));
  const std::string path = dir_ + "/lenet.pt";
  ASSERT_OK(model->Save(path));
  // torch::save writes one nested archive per submodule.
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  const std::vector<std::string> names = model->ParameterNames();
  const std::vector<torch::Tensor> params = model->Parameters();
  for (size_t i = 0; i < names.size(); ++i) {
    const size_t dot = names[i].find('.');
    ASSERT_NE(dot, std::string::npos);
    torch::serialize::InputArchive child;
    ASSERT_TRUE(archive.try_read(names[i].substr(0, dot), child)) << names[i];
    torch::Tensor t;
    ASSERT_TRUE(child.try_read(names[i].substr(dot + 1), t)) << names[i];
    EXPECT_TRUE(torch::equal(t, params[i])) << names[i];
  }
  EXPECT_STATUS_MSG(model->Save(dir_ + "/no/such/dir/x.pt"), absl::StatusCode::kInternal,
                    "model lenet: saving to " + dir_ + "/no/such/dir/x.pt");
}

TEST_F(ModelTest, TorchScriptErrors) {
  const std::string missing = dir_ + "/missing.pt";
  EXPECT_STATUS_MSG(CreateModel(Spec("torchscript", missing), 1), absl::StatusCode::kNotFound,
                    missing);
  EXPECT_STATUS(CreateModel(Spec("torchscript"), 1), absl::StatusCode::kNotFound);
  const std::string garbage = dir_ + "/garbage.pt";
  std::FILE* f = std::fopen(garbage.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("not a zip archive", f);
  std::fclose(f);
  EXPECT_STATUS_MSG(CreateModel(Spec("torchscript", garbage), 1),
                    absl::StatusCode::kInvalidArgument, "loading TorchScript model " + garbage);
  // A directory or a FIFO: refused at once (opening a FIFO would block the job's start).
  EXPECT_STATUS_MSG(CreateModel(Spec("torchscript", dir_), 1), absl::StatusCode::kInvalidArgument,
                    "is not a regular file");
  const std::string fifo = dir_ + "/model.fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_STATUS_MSG(CreateModel(Spec("torchscript", fifo), 1), absl::StatusCode::kInvalidArgument,
                    "TorchScript model file \"" + fifo + "\" is not a regular file");
}

// Where bazel puts the test's data files: the working directory is the runfiles root of
// this workspace, but fall back to TEST_SRCDIR in case a runner changes directory.
std::string DataPath(const std::string& relative) {
  if (FileExists(relative)) return relative;
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr && workspace != nullptr) {
    return absl::StrCat(srcdir, "/", workspace, "/", relative);
  }
  return relative;
}

constexpr char kPython[] = "/usr/bin/python3";

// overlap: 2: a built-in model's forward opens each layer's parameters, first layer first,
// just before it runs. A gate that writes another model's values into each layer as it opens
// (as the previous step's answers arrive) gives that model's output exactly.
TEST_F(ModelTest, BuiltinForwardOpensEachLayerBeforeItRuns) {
  for (const auto& [name, layers] :
       std::vector<std::pair<std::string, int>>{{"mlp", 3}, {"lenet", 5}}) {
    SCOPED_TRACE(name);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec(name), 3));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> fresh, CreateModel(Spec(name), 4));
    const torch::Tensor x = torch::randn({5, 1, 28, 28});
    ASSERT_OK_AND_ASSIGN(torch::Tensor before, model->Forward(x));
    ASSERT_OK_AND_ASSIGN(torch::Tensor expected, fresh->Forward(x));
    std::vector<std::pair<int, int>> opened;
    std::vector<torch::Tensor> params = model->Parameters(), next = fresh->Parameters();
    ASSERT_TRUE(model->SetParameterGate([&](int begin, int end) {
      opened.emplace_back(begin, end);
      torch::NoGradGuard no_grad;
      for (int i = begin; i < end; ++i) params[i].copy_(next[i]);
    }));
    ASSERT_OK_AND_ASSIGN(torch::Tensor gated, model->Forward(x));
    std::vector<std::pair<int, int>> want;
    for (int l = 0; l < layers; ++l) want.emplace_back(2 * l, 2 * l + 2);
    EXPECT_EQ(opened, want);
    EXPECT_TRUE(torch::equal(gated, expected));
    EXPECT_FALSE(torch::equal(before, expected));  // The values did change.
    // Removed: the forward calls nothing.
    ASSERT_TRUE(model->SetParameterGate(nullptr));
    ASSERT_OK(model->Forward(x).status());
    EXPECT_EQ(opened.size(), want.size());
  }
}

TEST_F(ModelTest, TorchScriptTrainSaveReload) {
  if (std::system(absl::StrCat(kPython, " -c 'import torch' >/dev/null 2>&1").c_str()) != 0) {
    GTEST_SKIP() << kPython << " cannot import torch (install python3-torch)";
  }
  const std::string script = DataPath("worker/testdata/export_mlp.py");
  ASSERT_TRUE(FileExists(script)) << script;
  const std::string path = dir_ + "/m.pt";
  ASSERT_EQ(std::system(absl::StrCat(kPython, " ", script, " ", path).c_str()), 0);

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec("torchscript", path), 1));
  EXPECT_EQ(NumParameters(model.get()), 784 * 64 + 64 + 64 * 10 + 10);
  // No forward pre-hook reaches a TorchScript module's layers: the caller waits for all.
  EXPECT_FALSE(model->SetParameterGate([](int, int) {}));
  EXPECT_EQ(model->ParameterNames(),
            (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}));
  for (const torch::Tensor& p : model->Parameters()) {
    EXPECT_TRUE(p.requires_grad());
    EXPECT_TRUE(p.is_leaf());
  }

  torch::manual_seed(123);
  const torch::Tensor x = torch::randn({32, 1, 28, 28});
  const torch::Tensor y = torch::randint(0, 10, {32}, torch::kInt64);
  torch::Tensor initial_out;
  {
    torch::NoGradGuard no_grad;
    ASSERT_OK_AND_ASSIGN(initial_out, model->Forward(x));
  }
  EXPECT_EQ(initial_out.sizes().vec(), (std::vector<int64_t>{32, 10}));

  // Plain SGD through the interface: gradients land in Parameters()[i].grad() and in-place
  // updates of those tensors change the module.
  double first_loss = 0;
  double last_loss = 0;
  for (int step = 0; step < 20; ++step) {
    for (torch::Tensor& p : model->Parameters()) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    ASSERT_OK_AND_ASSIGN(torch::Tensor loss, CrossEntropyLoss(model.get(), x, y));
    loss.backward();
    if (step == 0) first_loss = loss.item<double>();
    last_loss = loss.item<double>();
    torch::NoGradGuard no_grad;
    for (torch::Tensor& p : model->Parameters()) {
      ASSERT_TRUE(p.grad().defined());
      p.sub_(p.grad() * 0.1);
    }
  }
  EXPECT_LT(last_loss, first_loss);

  const std::string saved = dir_ + "/m2.pt";
  ASSERT_OK(model->Save(saved));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> reloaded, CreateModel(Spec("torchscript", saved), 1));
  model->SetTraining(false);
  reloaded->SetTraining(false);
  torch::NoGradGuard no_grad;
  ASSERT_OK_AND_ASSIGN(torch::Tensor out, model->Forward(x));
  ASSERT_OK_AND_ASSIGN(torch::Tensor reloaded_out, reloaded->Forward(x));
  EXPECT_TRUE(torch::equal(out, reloaded_out));
  EXPECT_FALSE(torch::equal(out, initial_out));  // Training changed the saved module.

  // Any input reaches the module; this one fails on a rank-2 input, and says so.
  EXPECT_STATUS_MSG(model->Forward(torch::randn({3, 5})), absl::StatusCode::kInvalidArgument,
                    "TorchScript model " + path + ": forward on float32[3, 5]");
}

// A module saved with requires_grad off on layer 1 (fine-tuning the rest) lists layer 2 alone
// as its parameters and layer 1 as frozen, which backward leaves without gradients and a save
// keeps frozen; with it off on every parameter all are trained.
TEST_F(ModelTest, TorchScriptFrozenParametersAreNotTrained) {
  const std::string part = dir_ + "/frozen_part.pt";
  const std::string all = dir_ + "/frozen_all.pt";
  ASSERT_EQ(std::system(absl::StrCat(kPython, " -c 'import sys, torch\n",
                                     "m = torch.nn.Sequential(torch.nn.Flatten(), ",
                                     "torch.nn.Linear(784, 8), torch.nn.Linear(8, 10))\n",
                                     "m[1].requires_grad_(False)\n",
                                     "torch.jit.script(m).save(sys.argv[1])\n",
                                     "m.requires_grad_(False)\n",
                                     "torch.jit.script(m).save(sys.argv[2])' ", part, " ", all)
                            .c_str()),
            0);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec("torchscript", part), 1));
  EXPECT_EQ(model->ParameterNames(), (std::vector<std::string>{"2.weight", "2.bias"}));
  EXPECT_EQ(model->FrozenParameterNames(), (std::vector<std::string>{"1.weight", "1.bias"}));
  ASSERT_OK_AND_ASSIGN(torch::Tensor out, model->Forward(torch::randn({2, 1, 28, 28})));
  out.sum().backward();
  for (const torch::Tensor& p : model->Parameters()) EXPECT_TRUE(p.grad().defined());
  const std::string saved = dir_ + "/frozen_saved.pt";
  ASSERT_OK(model->Save(saved));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> again, CreateModel(Spec("torchscript", saved), 1));
  EXPECT_EQ(again->FrozenParameterNames(), model->FrozenParameterNames());

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> every, CreateModel(Spec("torchscript", all), 1));
  EXPECT_TRUE(every->FrozenParameterNames().empty());
  EXPECT_EQ(every->ParameterNames(),
            (std::vector<std::string>{"1.weight", "1.bias", "2.weight", "2.bias"}));
}

// A forward returning more than the prediction: the first element of a tuple or list, the
// "logits" or "out" entry of a dict; anything else is refused saying what is accepted.
TEST_F(ModelTest, TorchScriptForwardOutputsWithAuxiliaryParts) {
  const std::string script = dir_ + "/outputs.py";
  std::ofstream(script) << R"PY(import sys, torch
from typing import Dict, List, Tuple
class T(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(784, 10)
    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x.flatten(1))
        return y, y.sum()
class L(T):
    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        y = self.fc(x.flatten(1))
        return [y, -y]
class D(T):
    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        y = self.fc(x.flatten(1))
        return {"aux": -y, "out": y}
class N(T):
    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"aux": self.fc(x.flatten(1))}
for c, f in ((T, "tuple"), (L, "list"), (D, "dict"), (N, "none")):
    torch.manual_seed(0)
    torch.jit.script(c()).save(sys.argv[1] + "/out_" + f + ".pt")
)PY";
  const std::string py = absl::StrCat(kPython, " ", script, " ", dir_);
  ASSERT_EQ(std::system(py.c_str()), 0) << py;
  const torch::Tensor x = torch::randn({3, 1, 28, 28});
  std::optional<torch::Tensor> first;
  for (const char* kind : {"tuple", "list", "dict"}) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model,
                         CreateModel(Spec("torchscript", dir_ + "/out_" + kind + ".pt"), 1));
    ASSERT_OK_AND_ASSIGN(torch::Tensor out, model->Forward(x));
    EXPECT_EQ(out.sizes().vec(), (std::vector<int64_t>{3, 10})) << kind;
    if (!first.has_value()) first = out.detach();
    EXPECT_TRUE(torch::equal(out, *first)) << kind;  // Same weights (seed 0): same logits.
    ASSERT_OK_AND_ASSIGN(torch::Tensor loss, ComputeLoss(model.get(), LossKind::kCrossEntropy, x,
                                                         torch::tensor({1, 2, 3}, torch::kInt64)));
    loss.backward();
    EXPECT_TRUE(model->Parameters()[0].grad().defined()) << kind;
  }
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> none,
                       CreateModel(Spec("torchscript", dir_ + "/out_none.pt"), 1));
  EXPECT_STATUS_MSG(none->Forward(x), absl::StatusCode::kInvalidArgument,
                    "returned a GenericDict; it must return a tensor, a tuple or list whose first "
                    "element is one, or a dict with a tensor under \"logits\" or \"out\"");
}

// A parameter stored strided (nn.Parameter(w.t())) is made contiguous in place: it trains
// as any other, and the forward gives what the module as saved gives.
TEST_F(ModelTest, TorchScriptStridedParameterIsMadeContiguous) {
  const std::string script = dir_ + "/strided.py";
  std::ofstream(script) << R"PY(import sys, torch
class S(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(10, 784).t())
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1).matmul(self.w)
torch.manual_seed(0)
m = S()
assert not m.w.is_contiguous()
torch.jit.script(m).save(sys.argv[1])
)PY";
  const std::string path = dir_ + "/strided.pt";
  ASSERT_EQ(std::system(absl::StrCat(kPython, " ", script, " ", path).c_str()), 0);
  torch::jit::Module as_saved = torch::jit::load(path);
  ASSERT_FALSE((*as_saved.named_parameters().begin()).value.is_contiguous());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec("torchscript", path), 1));
  ASSERT_EQ(model->Parameters().size(), 1u);
  EXPECT_TRUE(model->Parameters()[0].is_contiguous());
  const torch::Tensor x = torch::randn({3, 1, 28, 28});
  ASSERT_OK_AND_ASSIGN(torch::Tensor out, model->Forward(x));
  torch::NoGradGuard no_grad;
  // (The GEMM may round differently over the two layouts.)
  const torch::Tensor want = as_saved.forward({x}).toTensor();
  EXPECT_TRUE(torch::allclose(out, want, 1e-5, 1e-4)) << (out - want).abs().max();
}

// A module saved from a GPU (its storages say "cuda"; made here by renaming the CPU module's
// storage location, as this machine's PyTorch has no CUDA) loads onto the CPU.
TEST_F(ModelTest, TorchScriptSavedOnAGpuLoadsOntoTheCpu) {
  const std::string script = dir_ + "/cuda_saved.py";
  std::ofstream(script) << R"PY(import sys, torch, zipfile
torch.manual_seed(0)
torch.jit.script(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))).save(
    sys.argv[1] + ".cpu")
src = zipfile.ZipFile(sys.argv[1] + ".cpu")
with zipfile.ZipFile(sys.argv[1], "w") as out:
    for i in src.infolist():
        data = src.read(i.filename)
        if i.filename.endswith("data.pkl"):
            assert b"X\x03\x00\x00\x00cpu" in data
            data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x04\x00\x00\x00cuda")
        out.writestr(i, data)
try:
    torch.jit.load(sys.argv[1])
    sys.exit("a CPU torch loaded CUDA storages without map_location")
except RuntimeError:
    pass
)PY";
  const std::string path = dir_ + "/cuda_saved.pt";
  ASSERT_EQ(std::system(absl::StrCat(kPython, " ", script, " ", path).c_str()), 0);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec("torchscript", path), 1));
  ASSERT_EQ(model->Parameters().size(), 2u);
  for (const torch::Tensor& p : model->Parameters()) EXPECT_TRUE(p.device().is_cpu());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> cpu,
                       CreateModel(Spec("torchscript", path + ".cpu"), 1));
  EXPECT_TRUE(torch::equal(model->Parameters()[0], cpu->Parameters()[0]));
}

// A module saved in float64, float16 or bfloat16 (`model.double()` before saving) is trained as
// float32: its parameters and floating buffers are float32 and say the type they were saved in,
// integer buffers stay as they are, floating inputs of any type are given to it as float32, and
// Save writes the saved types back while the module keeps its float32 values.
TEST_F(ModelTest, TorchScriptModuleSavedInAnotherFloatTypeTrainsAsFloat32) {
  const std::string script = dir_ + "/typed.py";
  std::ofstream(script) << R"PY(import sys, torch
for name, dtype in (("f64", torch.float64), ("f16", torch.float16), ("bf16", torch.bfloat16)):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                            torch.nn.Linear(8, 3)).to(dtype)
    torch.jit.script(m).save(sys.argv[1] + "/" + name + ".pt")
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()
with torch.no_grad():
    m[0].weight.copy_(torch.randn(8, 6, dtype=torch.float64))  # Beyond float32's precision.
m[0].requires_grad_(False)
torch.jit.script(m).save(sys.argv[1] + "/f64_frozen.pt")
)PY";
  ASSERT_EQ(std::system(absl::StrCat(kPython, " ", script, " ", dir_).c_str()), 0);
  const std::vector<std::string> names = {"0.weight", "0.bias", "3.weight", "3.bias"};
  const std::vector<std::string> buffers = {"1.running_mean", "1.running_var",
                                            "1.num_batches_tracked"};
  for (const auto& [file, saved] : std::vector<std::pair<std::string, torch::ScalarType>>{
           {"f64", torch::kFloat64}, {"f16", torch::kFloat16}, {"bf16", torch::kBFloat16}}) {
    SCOPED_TRACE(file);
    const std::string path = dir_ + "/" + file + ".pt";
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec("torchscript", path), 1));
    // BatchNorm's weight and bias are parameters too.
    EXPECT_EQ(model->ParameterNames(), (std::vector<std::string>{"0.weight", "0.bias", "1.weight",
                                                                 "1.bias", "3.weight", "3.bias"}));
    for (const torch::Tensor& p : model->Parameters()) {
      EXPECT_EQ(p.scalar_type(), torch::kFloat32);
      EXPECT_TRUE(p.requires_grad());
    }
    EXPECT_EQ(model->SavedParameterTypes(), std::vector<torch::ScalarType>(6, saved));
    EXPECT_EQ(model->BufferNames(), buffers);
    EXPECT_EQ(model->SavedBufferTypes(),
              (std::vector<torch::ScalarType>{saved, saved, torch::kInt64}));
    const std::vector<torch::Tensor> now = model->Buffers();
    EXPECT_EQ(now[0].scalar_type(), torch::kFloat32);
    EXPECT_EQ(now[2].scalar_type(), torch::kInt64);

    // The values are the saved ones (exact: every saved type widens to float32 exactly), and a
    // forward on float64 input gives what the same input in float32 gives.
    torch::jit::Module as_saved = torch::jit::load(path);
    for (const auto& item : as_saved.named_parameters()) {
      if (item.name == "0.weight") {
        EXPECT_TRUE(torch::equal(model->Parameters()[0], item.value.to(torch::kFloat32)));
      }
    }
    torch::manual_seed(1);
    const torch::Tensor x = torch::randn({16, 6}, torch::kFloat64);
    ASSERT_OK_AND_ASSIGN(torch::Tensor out, model->Forward(x));
    EXPECT_EQ(out.scalar_type(), torch::kFloat32);
    ASSERT_OK_AND_ASSIGN(torch::Tensor loss,
                         ComputeLoss(model.get(), LossKind::kCrossEntropy, x,
                                     torch::randint(0, 3, {16}, torch::kInt64)));
    loss.backward();
    const float* data = model->Parameters()[0].data_ptr<float>();
    {
      torch::NoGradGuard no_grad;
      for (torch::Tensor& p : model->Parameters()) p.sub_(p.grad() * 0.1);
      ASSERT_OK_AND_ASSIGN(torch::Tensor again, model->Forward(x.to(torch::kFloat32)));
      ASSERT_OK_AND_ASSIGN(torch::Tensor wide, model->Forward(x));
      EXPECT_TRUE(torch::equal(again, wide));
    }

    // Save writes the saved types with the trained values rounded to them; the model keeps
    // training on its float32 values, in the same storage (the loop's views point there).
    const torch::Tensor trained = model->Parameters()[0].detach().clone();
    const std::string out_path = dir_ + "/" + file + "_saved.pt";
    ASSERT_OK(model->Save(out_path));
    EXPECT_EQ(model->Parameters()[0].scalar_type(), torch::kFloat32);
    EXPECT_EQ(model->Parameters()[0].data_ptr<float>(), data);
    EXPECT_TRUE(torch::equal(model->Parameters()[0], trained));
    EXPECT_EQ(model->Buffers()[0].scalar_type(), torch::kFloat32);
    torch::jit::Module written = torch::jit::load(out_path);
    std::map<std::string, torch::Tensor> got;
    for (const auto& item : written.named_parameters()) got[item.name] = item.value;
    for (const auto& item : written.named_buffers()) got[item.name] = item.value;
    for (const std::string& n : names) EXPECT_EQ(got[n].scalar_type(), saved) << n;
    EXPECT_EQ(got["1.running_mean"].scalar_type(), saved);
    EXPECT_EQ(got["1.num_batches_tracked"].scalar_type(), torch::kInt64);
    EXPECT_TRUE(torch::equal(got["0.weight"], trained.to(saved)));
  }

  // A frozen float64 layer is written back bit for bit (never trained: no trip through
  // float32), the trained one in float64.
  {
    const std::string path = dir_ + "/f64_frozen.pt";
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec("torchscript", path), 1));
    EXPECT_EQ(model->FrozenParameterNames(), (std::vector<std::string>{"0.weight", "0.bias"}));
    ASSERT_OK(model->Save(dir_ + "/f64_frozen_saved.pt"));
    torch::jit::Module before = torch::jit::load(path);
    torch::jit::Module after = torch::jit::load(dir_ + "/f64_frozen_saved.pt");
    std::map<std::string, torch::Tensor> was, now;
    for (const auto& item : before.named_parameters()) was[item.name] = item.value;
    for (const auto& item : after.named_parameters()) now[item.name] = item.value;
    ASSERT_EQ(now["0.weight"].scalar_type(), torch::kFloat64);
    EXPECT_TRUE(torch::equal(now["0.weight"], was["0.weight"]));
    EXPECT_FALSE(torch::equal(
        was["0.weight"],
        was["0.weight"].to(torch::kFloat32).to(torch::kFloat64)));  // Not float32 values.
    EXPECT_EQ(now["2.weight"].scalar_type(), torch::kFloat64);
  }

  // A float32 module keeps its types, and takes float64 input as float32.
  const std::string f32 = dir_ + "/f32.pt";
  ASSERT_EQ(
      std::system(absl::StrCat(kPython, " -c 'import sys, torch\n",
                               "torch.jit.script(torch.nn.Linear(6, 3)).save(sys.argv[1])' ", f32)
                      .c_str()),
      0);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> plain, CreateModel(Spec("torchscript", f32), 1));
  EXPECT_EQ(plain->SavedParameterTypes(),
            (std::vector<torch::ScalarType>{torch::kFloat32, torch::kFloat32}));
  const torch::Tensor x64 = torch::randn({4, 6}, torch::kFloat64);
  ASSERT_OK_AND_ASSIGN(torch::Tensor a, plain->Forward(x64));
  ASSERT_OK_AND_ASSIGN(torch::Tensor b, plain->Forward(x64.to(torch::kFloat32)));
  EXPECT_TRUE(torch::equal(a, b));
}

// ---- Any model, any data: the TorchScript modules of testdata/models (made by gen.py). ----

std::string ModelPath(const std::string& name) {
  return DataPath("worker/testdata/models/" + name + ".pt");
}

// expected.txt: "key value..." lines that gen.py computed with PyTorch.
std::map<std::string, std::vector<double>> ReadExpected() {
  std::map<std::string, std::vector<double>> values;
  std::ifstream in(DataPath("worker/testdata/models/expected.txt"));
  EXPECT_TRUE(in.good()) << "worker/testdata/models/expected.txt";
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string key;
    fields >> key;
    double v;
    while (fields >> v) values[key].push_back(v);
  }
  return values;
}

// The batches of gen.py, rebuilt from the same integer formulas.
torch::Tensor CnnX() {
  return ((torch::arange(4 * 36).reshape({4, 1, 6, 6}) % 11) - 5).to(torch::kFloat32) * 0.3;
}
torch::Tensor CnnY() { return torch::tensor({0, 1, 2, 3}, torch::kInt64); }
torch::Tensor SeqX() { return (torch::arange(15).reshape({3, 5}) * 3) % 7; }
torch::Tensor SeqY() { return (SeqX() + 1) % 7; }
torch::Tensor RegressX() {
  return ((torch::arange(12).reshape({4, 3}) % 5) - 2).to(torch::kFloat32) * 0.5;
}
torch::Tensor RegressY() { return (torch::arange(4).to(torch::kFloat32) * 0.25).reshape({4, 1}); }
torch::Tensor OwnLossX() {
  return ((torch::arange(12).reshape({3, 4}) % 7) - 3).to(torch::kFloat32) * 0.5;
}
torch::Tensor OwnLossY() { return torch::tensor({0, 2, 1}, torch::kInt64); }

std::vector<double> Values(const torch::Tensor& t) {
  torch::Tensor flat = t.detach().to(torch::kFloat64).contiguous().flatten();
  return std::vector<double>(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel());
}

void ExpectNear(const std::vector<double>& actual, const std::vector<double>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) EXPECT_NEAR(actual[i], expected[i], 1e-5) << i;
}

// A model whose forward returns a fixed tensor: for output shapes no module here produces.
class FixedOutputModel : public Model {
 public:
  explicit FixedOutputModel(torch::Tensor out) : out_(std::move(out)) {}
  absl::StatusOr<torch::Tensor> Forward(const torch::Tensor&) override { return out_; }
  absl::StatusOr<torch::Tensor> ModuleLoss(const torch::Tensor&, const torch::Tensor&) override {
    return absl::FailedPreconditionError("none");
  }
  bool HasModuleLoss() override { return false; }
  std::vector<torch::Tensor> Parameters() override { return {}; }
  std::vector<std::string> ParameterNames() override { return {}; }
  std::vector<torch::Tensor> Buffers() override { return {}; }
  std::vector<std::string> BufferNames() override { return {}; }
  void SetTraining(bool) override {}
  absl::Status Save(const std::string&) override { return absl::OkStatus(); }

 private:
  torch::Tensor out_;
};

class AnyModelTest : public ModelTest {
 protected:
  void SetUp() override {
    ModelTest::SetUp();
    expected_ = ReadExpected();
  }
  double Expected(const std::string& key) {
    EXPECT_EQ(expected_[key].size(), 1u) << key;
    return expected_[key].empty() ? -1 : expected_[key][0];
  }
  absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& name) {
    return CreateModel(Spec("torchscript", ModelPath(name)), 1);
  }
  std::map<std::string, std::vector<double>> expected_;
};

TEST(LossTest, ParseAndName) {
  ASSERT_OK_AND_ASSIGN(LossKind kind, ParseLoss(""));
  EXPECT_EQ(kind, LossKind::kCrossEntropy);
  for (LossKind k : {LossKind::kCrossEntropy, LossKind::kMse, LossKind::kModule}) {
    ASSERT_OK_AND_ASSIGN(LossKind parsed, ParseLoss(LossName(k)));
    EXPECT_EQ(parsed, k) << LossName(k);
  }
  EXPECT_STREQ(LossName(LossKind::kMse), "mse");
  EXPECT_STATUS_MSG(ParseLoss("hinge"), absl::StatusCode::kInvalidArgument,
                    "unknown loss \"hinge\" (known: cross_entropy, mse, module)");
  EXPECT_STATUS(ParseLoss("MSE"), absl::StatusCode::kInvalidArgument);
}

TEST_F(ModelTest, BuiltinHasNoBuffersOrModuleLoss) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec("mlp"), 1));
  EXPECT_TRUE(model->Buffers().empty());
  EXPECT_TRUE(model->BufferNames().empty());
  EXPECT_FALSE(model->HasModuleLoss());
  const torch::Tensor x = torch::randn({2, 1, 28, 28});
  const torch::Tensor y = torch::tensor({1, 2}, torch::kInt64);
  EXPECT_STATUS_MSG(model->ModuleLoss(x, y), absl::StatusCode::kFailedPrecondition,
                    "model mlp has no method loss(x, y)");
  EXPECT_STATUS_MSG(ComputeLoss(model.get(), LossKind::kModule, x, y),
                    absl::StatusCode::kFailedPrecondition, "model mlp has no method loss(x, y)");
  // The MNIST input check stays.
  EXPECT_STATUS_MSG(model->Forward(torch::zeros({2, 1, 28, 28}, torch::kInt64)),
                    absl::StatusCode::kInvalidArgument, "got int64[2, 1, 28, 28]");
}

TEST_F(AnyModelTest, BatchNormBuffersAliasTheModule) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, Load("bn_cnn"));
  EXPECT_EQ(model->ParameterNames(),
            (std::vector<std::string>{"conv1.weight", "conv1.bias", "bn1.weight", "bn1.bias",
                                      "fc.weight", "fc.bias"}));
  EXPECT_EQ(model->BufferNames(), (std::vector<std::string>{"bn1.running_mean", "bn1.running_var",
                                                            "bn1.num_batches_tracked"}));
  const std::vector<torch::Tensor> buffers = model->Buffers();
  ASSERT_EQ(buffers.size(), 3u);
  EXPECT_EQ(buffers[0].scalar_type(), torch::kFloat32);
  EXPECT_EQ(buffers[0].sizes().vec(), std::vector<int64_t>{3});
  EXPECT_EQ(buffers[1].scalar_type(), torch::kFloat32);
  EXPECT_EQ(buffers[2].scalar_type(), torch::kInt64);
  EXPECT_EQ(buffers[2].dim(), 0);
  EXPECT_TRUE(torch::equal(buffers[0], torch::zeros({3})));
  EXPECT_TRUE(torch::equal(buffers[1], torch::ones({3})));
  EXPECT_EQ(buffers[2].item<int64_t>(), 0);
  for (const torch::Tensor& b : buffers) EXPECT_FALSE(b.requires_grad());

  // A training-mode forward updates the running statistics in the very tensors returned.
  ASSERT_OK_AND_ASSIGN(torch::Tensor loss,
                       ComputeLoss(model.get(), LossKind::kCrossEntropy, CnnX(), CnnY()));
  EXPECT_NEAR(loss.item<double>(), Expected("bn_cnn.ce_train"), 1e-5);
  ExpectNear(Values(buffers[0]), expected_["bn_cnn.running_mean_after"]);
  ExpectNear(Values(buffers[1]), expected_["bn_cnn.running_var_after"]);
  EXPECT_EQ(buffers[2].item<int64_t>(), 1);
  loss.backward();
  for (const torch::Tensor& p : model->Parameters()) EXPECT_TRUE(p.grad().defined());

  // Save writes the current buffers.
  const std::string saved = dir_ + "/bn.pt";
  ASSERT_OK(model->Save(saved));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> reloaded, CreateModel(Spec("torchscript", saved), 1));
  const std::vector<torch::Tensor> reloaded_buffers = reloaded->Buffers();
  ASSERT_EQ(reloaded_buffers.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(reloaded_buffers[i], buffers[i])) << i;

  // Writes into them reach forward: back to the initial statistics, the evaluation-mode loss
  // is the one gen.py computed with the initial module.
  {
    torch::NoGradGuard no_grad;
    buffers[0].zero_();
    buffers[1].fill_(1);
  }
  model->SetTraining(false);
  torch::NoGradGuard no_grad;
  ASSERT_OK_AND_ASSIGN(torch::Tensor eval_loss, CrossEntropyLoss(model.get(), CnnX(), CnnY()));
  EXPECT_NEAR(eval_loss.item<double>(), Expected("bn_cnn.ce_eval"), 1e-5);
  EXPECT_EQ(buffers[2].item<int64_t>(), 1);  // Evaluation mode leaves them alone.
  ASSERT_OK_AND_ASSIGN(int64_t correct, CountCorrect(model.get(), CnnX(), CnnY()));
  EXPECT_EQ(correct, static_cast<int64_t>(Expected("bn_cnn.correct_eval")));

  EvalTotals totals;
  ASSERT_OK(EvaluateBatch(model.get(), LossKind::kCrossEntropy, CnnX(), CnnY(), &totals));
  EXPECT_EQ(totals.samples, 4);
  EXPECT_EQ(totals.predictions, 4);
  EXPECT_TRUE(totals.classification);
  EXPECT_FALSE(totals.sequence);
  const EvalMetrics m = Metrics(totals);
  EXPECT_NEAR(m.test_loss, Expected("bn_cnn.ce_eval"), 1e-5);
  EXPECT_DOUBLE_EQ(m.accuracy, Expected("bn_cnn.correct_eval") / 4);
  EXPECT_EQ(m.perplexity, -1);
}

TEST_F(AnyModelTest, IntBufferOnly) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, Load("int_buffer"));
  EXPECT_EQ(model->BufferNames(), std::vector<std::string>{"calls"});
  const std::vector<torch::Tensor> buffers = model->Buffers();
  ASSERT_EQ(buffers.size(), 1u);
  EXPECT_EQ(buffers[0].scalar_type(), torch::kInt64);
  EXPECT_EQ(buffers[0].item<int64_t>(), 0);
  const torch::Tensor x = torch::ones({2, 2});
  ASSERT_OK(model->Forward(x).status());
  EXPECT_EQ(buffers[0].item<int64_t>(), 1);
  {
    torch::NoGradGuard no_grad;
    buffers[0].fill_(41);
  }
  ASSERT_OK(model->Forward(x).status());
  EXPECT_EQ(buffers[0].item<int64_t>(), 42);  // The module counted on from the written value.
  model->SetTraining(false);
  ASSERT_OK(model->Forward(x).status());
  EXPECT_EQ(buffers[0].item<int64_t>(), 42);
  EXPECT_EQ(model->Buffers()[0].item<int64_t>(), 42);
}

TEST_F(AnyModelTest, SequenceModelTokenLossAccuracyPerplexity) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, Load("tiny_seq"));
  EXPECT_TRUE(model->Buffers().empty());
  ASSERT_OK_AND_ASSIGN(torch::Tensor out, model->Forward(SeqX()));  // int64 input.
  EXPECT_EQ(out.sizes().vec(), (std::vector<int64_t>{3, 5, 7}));
  ASSERT_OK_AND_ASSIGN(torch::Tensor loss,
                       ComputeLoss(model.get(), LossKind::kCrossEntropy, SeqX(), SeqY()));
  EXPECT_NEAR(loss.item<double>(), Expected("tiny_seq.ce"), 1e-5);
  loss.backward();
  for (const torch::Tensor& p : model->Parameters()) EXPECT_TRUE(p.grad().defined());
  ASSERT_OK_AND_ASSIGN(int64_t correct, CountCorrect(model.get(), SeqX(), SeqY()));
  EXPECT_EQ(correct, static_cast<int64_t>(Expected("tiny_seq.correct")));

  // Two batches of different sizes: the totals weight by tokens, so the mean over the test
  // set equals the mean over the whole batch.
  model->SetTraining(false);
  EvalTotals totals;
  using torch::indexing::Slice;
  ASSERT_OK(EvaluateBatch(model.get(), LossKind::kCrossEntropy, SeqX().index({Slice(0, 2)}),
                          SeqY().index({Slice(0, 2)}), &totals));
  ASSERT_OK(EvaluateBatch(model.get(), LossKind::kCrossEntropy, SeqX().index({Slice(2, 3)}),
                          SeqY().index({Slice(2, 3)}), &totals));
  EXPECT_EQ(totals.samples, 3);
  EXPECT_EQ(totals.predictions, 15);
  EXPECT_EQ(totals.correct, static_cast<int64_t>(Expected("tiny_seq.correct")));
  EXPECT_TRUE(totals.classification);
  EXPECT_TRUE(totals.sequence);
  const EvalMetrics m = Metrics(totals);
  EXPECT_NEAR(m.test_loss, Expected("tiny_seq.ce"), 1e-5);
  EXPECT_DOUBLE_EQ(m.accuracy, Expected("tiny_seq.correct") / 15);
  EXPECT_NEAR(m.perplexity, Expected("tiny_seq.perplexity"), 1e-4);
  EXPECT_NEAR(m.perplexity, std::exp(m.test_loss), 1e-12);

  // Targets of the wrong length and out-of-vocabulary tokens.
  EXPECT_STATUS_MSG(ComputeLoss(model.get(), LossKind::kCrossEntropy, SeqX(),
                                torch::zeros({3, 6}, torch::kInt64)),
                    absl::StatusCode::kInvalidArgument,
                    "loss cross_entropy: model output float32[3, 5, 7] does not fit targets "
                    "int64[3, 6]");
  EXPECT_STATUS_MSG(ComputeLoss(model.get(), LossKind::kCrossEntropy, SeqX(), SeqY() + 1),
                    absl::StatusCode::kInvalidArgument,
                    "target class index 7 is out of range for model output float32[3, 5, 7] "
                    "(7 classes: indices 0..6)");
  // The module rejects token ids beyond its embedding; the message is the module's.
  EXPECT_STATUS_MSG(model->Forward(SeqX() + 7), absl::StatusCode::kInvalidArgument,
                    "TorchScript model " + ModelPath("tiny_seq") + ": forward on int64[3, 5]: ");
  EXPECT_STATUS_MSG(model->Forward(torch::Tensor()), absl::StatusCode::kInvalidArgument,
                    "forward on undefined tensor");
}

TEST_F(AnyModelTest, ForwardErrorsCarryTheModulesMessageWithoutBacktrace) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, Load("bn_cnn"));
  absl::StatusOr<torch::Tensor> out = model->Forward(CnnX().to(torch::kInt64));
  EXPECT_STATUS_MSG(
      out, absl::StatusCode::kInvalidArgument,
      "TorchScript model " + ModelPath("bn_cnn") + ": forward on int64[4, 1, 6, 6]: ");
  EXPECT_EQ(std::string(out.status().message()).find("Exception raised from"), std::string::npos)
      << out.status();
}

TEST_F(AnyModelTest, MseLoss) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, Load("regress"));
  const double expected = Expected("regress.mse");
  ASSERT_OK_AND_ASSIGN(torch::Tensor loss,
                       ComputeLoss(model.get(), LossKind::kMse, RegressX(), RegressY()));
  EXPECT_NEAR(loss.item<double>(), expected, 1e-5);
  EXPECT_EQ(loss.dim(), 0);
  loss.backward();
  for (const torch::Tensor& p : model->Parameters()) EXPECT_TRUE(p.grad().defined());
  // y [N] for an output [N, 1], and float64 targets (converted to the output's dtype).
  ASSERT_OK_AND_ASSIGN(torch::Tensor flat,
                       ComputeLoss(model.get(), LossKind::kMse, RegressX(), RegressY().flatten()));
  EXPECT_NEAR(flat.item<double>(), expected, 1e-5);
  ASSERT_OK_AND_ASSIGN(torch::Tensor f64, ComputeLoss(model.get(), LossKind::kMse, RegressX(),
                                                      RegressY().to(torch::kFloat64)));
  EXPECT_EQ(f64.scalar_type(), torch::kFloat32);
  EXPECT_NEAR(f64.item<double>(), expected, 1e-5);

  EXPECT_STATUS_MSG(
      ComputeLoss(model.get(), LossKind::kMse, RegressX(), torch::zeros({4, 1}, torch::kInt64)),
      absl::StatusCode::kInvalidArgument,
      "loss mse: model output float32[4, 1] does not fit targets int64[4, 1]; "
      "targets must be floating-point");
  EXPECT_STATUS_MSG(ComputeLoss(model.get(), LossKind::kMse, RegressX(), torch::zeros({4, 2})),
                    absl::StatusCode::kInvalidArgument,
                    "loss mse: model output float32[4, 1] does not fit targets float32[4, 2]; "
                    "targets must have the output's shape (or [N] for an output [N, 1])");
  EXPECT_STATUS_MSG(ComputeLoss(model.get(), LossKind::kMse, RegressX(), torch::zeros({3})),
                    absl::StatusCode::kInvalidArgument, "does not fit targets float32[3]");
  // No broadcasting: [1, 1] would silently broadcast in PyTorch.
  EXPECT_STATUS(ComputeLoss(model.get(), LossKind::kMse, RegressX(), torch::zeros({1, 1})),
                absl::StatusCode::kInvalidArgument);

  model->SetTraining(false);
  EvalTotals totals;
  ASSERT_OK(EvaluateBatch(model.get(), LossKind::kMse, RegressX(), RegressY(), &totals));
  ASSERT_OK(EvaluateBatch(model.get(), LossKind::kMse, RegressX(), RegressY(), &totals));
  EXPECT_EQ(totals.samples, 8);
  EXPECT_EQ(totals.predictions, 8);
  EXPECT_FALSE(totals.classification);
  const EvalMetrics m = Metrics(totals);
  EXPECT_NEAR(m.test_loss, expected, 1e-5);
  EXPECT_EQ(m.accuracy, -1);
  EXPECT_EQ(m.perplexity, -1);
}

TEST_F(AnyModelTest, ModuleLoss) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, Load("own_loss"));
  EXPECT_TRUE(model->HasModuleLoss());
  ASSERT_OK_AND_ASSIGN(torch::Tensor loss,
                       ComputeLoss(model.get(), LossKind::kModule, OwnLossX(), OwnLossY()));
  EXPECT_NEAR(loss.item<double>(), Expected("own_loss.loss"), 1e-5);
  loss.backward();
  for (const torch::Tensor& p : model->Parameters()) EXPECT_TRUE(p.grad().defined());
  // The same module trained with the built-in loss.
  ASSERT_OK_AND_ASSIGN(torch::Tensor ce, CrossEntropyLoss(model.get(), OwnLossX(), OwnLossY()));
  EXPECT_NEAR(ce.item<double>(), Expected("own_loss.ce"), 1e-5);

  EvalTotals totals;
  ASSERT_OK(EvaluateBatch(model.get(), LossKind::kModule, OwnLossX(), OwnLossY(), &totals));
  EXPECT_EQ(totals.samples, 3);
  const EvalMetrics m = Metrics(totals);
  EXPECT_NEAR(m.test_loss, Expected("own_loss.loss"), 1e-5);
  EXPECT_EQ(m.accuracy, -1);
  EXPECT_EQ(m.perplexity, -1);

  // The module's loss fails on float targets: its message comes back.
  EXPECT_STATUS_MSG(model->ModuleLoss(OwnLossX(), torch::zeros({3})),
                    absl::StatusCode::kInvalidArgument,
                    "TorchScript model " + ModelPath("own_loss") +
                        ": loss(x, y) on x float32[3, 4], y float32[3]: ");

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> bad, Load("bad_loss"));
  EXPECT_TRUE(bad->HasModuleLoss());
  EXPECT_STATUS_MSG(ComputeLoss(bad.get(), LossKind::kModule, OwnLossX(), OwnLossY()),
                    absl::StatusCode::kInvalidArgument,
                    "loss(x, y) on x float32[3, 4], y int64[3] returned float32[3]; expected a "
                    "scalar floating tensor");

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> none, Load("regress"));
  EXPECT_FALSE(none->HasModuleLoss());
  EXPECT_STATUS_MSG(ComputeLoss(none.get(), LossKind::kModule, RegressX(), RegressY()),
                    absl::StatusCode::kFailedPrecondition,
                    "TorchScript model " + ModelPath("regress") +
                        " has no method loss(x, y); add @torch.jit.export def loss(self, x, y) "
                        "or use loss: cross_entropy");
}

TEST(LossShapeTest, CrossEntropyRejectsWhatDoesNotFit) {
  auto ce = [](torch::Tensor out, torch::Tensor y) {
    FixedOutputModel model(std::move(out));
    return ComputeLoss(&model, LossKind::kCrossEntropy, torch::zeros({1}), y).status();
  };
  const torch::Tensor logits = torch::zeros({64, 10});
  EXPECT_OK(ce(logits, torch::zeros({64}, torch::kInt64)));
  EXPECT_STATUS_MSG(ce(logits, torch::zeros({64, 5}, torch::kInt64)),
                    absl::StatusCode::kInvalidArgument,
                    "loss cross_entropy: model output float32[64, 10] does not fit targets "
                    "int64[64, 5]");
  EXPECT_STATUS_MSG(ce(logits, torch::zeros({64})), absl::StatusCode::kInvalidArgument,
                    "does not fit targets float32[64]; targets must be integer class indices");
  EXPECT_STATUS_MSG(ce(logits, torch::zeros({64}, torch::kBool)),
                    absl::StatusCode::kInvalidArgument, "targets must be integer class indices");
  // Any integer dtype is class indices, with the same loss as int64 (uint8: IDX labels).
  const torch::Tensor wide = torch::tensor({3, 0, 9, 7}, torch::kInt64);
  const torch::Tensor scores = torch::randn({4, 10});
  auto ce_loss = [&](const torch::Tensor& y) {
    FixedOutputModel model(scores);
    return ComputeLoss(&model, LossKind::kCrossEntropy, torch::zeros({1}), y);
  };
  ASSERT_OK_AND_ASSIGN(const torch::Tensor want, ce_loss(wide));
  for (torch::ScalarType t : {torch::kUInt8, torch::kInt8, torch::kInt16, torch::kInt32}) {
    ASSERT_OK_AND_ASSIGN(const torch::Tensor got, ce_loss(wide.to(t)));
    EXPECT_EQ(got.item<float>(), want.item<float>()) << t;
  }
  EXPECT_STATUS_MSG(ce_loss(torch::tensor({3, 0, 10, 7}, torch::kUInt8)),
                    absl::StatusCode::kInvalidArgument, "target class index 10 is out of range");
  EXPECT_STATUS_MSG(ce(logits, torch::zeros({63}, torch::kInt64)),
                    absl::StatusCode::kInvalidArgument,
                    "model output float32[64, 10] does not fit targets int64[63]");
  EXPECT_STATUS_MSG(ce(torch::zeros({64}), torch::zeros({64}, torch::kInt64)),
                    absl::StatusCode::kInvalidArgument,
                    "model output float32[64] does not fit targets int64[64]; expected logits "
                    "[N, C] with targets [N] (or [N, 1]), or [N, T, C] with targets [N, T]");
  EXPECT_STATUS_MSG(ce(torch::zeros({2, 3, 4, 5}), torch::zeros({2, 3}, torch::kInt64)),
                    absl::StatusCode::kInvalidArgument, "float32[2, 3, 4, 5]");
  EXPECT_STATUS_MSG(ce(torch::zeros({4, 10}, torch::kInt64), torch::zeros({4}, torch::kInt64)),
                    absl::StatusCode::kInvalidArgument, "the output must be floating-point logits");
  EXPECT_STATUS_MSG(ce(torch::zeros({0, 10}), torch::zeros({0}, torch::kInt64)),
                    absl::StatusCode::kInvalidArgument, "empty batch");
  EXPECT_STATUS_MSG(ce(logits, torch::full({64}, -1, torch::kInt64)),
                    absl::StatusCode::kInvalidArgument,
                    "target class index -1 is out of range for model output float32[64, 10] (10 "
                    "classes: indices 0..9)");
  torch::Tensor y = torch::zeros({64}, torch::kInt64);
  y[7] = 12;
  EXPECT_STATUS_MSG(ce(logits, y), absl::StatusCode::kInvalidArgument, "target class index 12");
  // float64 logits work (the loss is then float64).
  EXPECT_OK(ce(torch::zeros({2, 3}, torch::kFloat64), torch::zeros({2}, torch::kInt64)));

  // Exact values: uniform logits give log(C) per prediction, tokens included.
  FixedOutputModel uniform(torch::zeros({2, 3, 4}));
  ASSERT_OK_AND_ASSIGN(torch::Tensor loss,
                       ComputeLoss(&uniform, LossKind::kCrossEntropy, torch::zeros({2}),
                                   torch::zeros({2, 3}, torch::kInt64)));
  EXPECT_NEAR(loss.item<double>(), std::log(4.0), 1e-6);
}

TEST(LossShapeTest, MetricsOfNothing) {
  const EvalMetrics m = Metrics(EvalTotals());
  EXPECT_EQ(m.test_loss, 0);
  EXPECT_EQ(m.accuracy, -1);
  EXPECT_EQ(m.perplexity, -1);
  EvalTotals totals;
  totals.loss_sum = 6;
  totals.samples = 2;
  totals.predictions = 4;
  totals.correct = 3;
  totals.classification = true;
  totals.sequence = true;
  const EvalMetrics s = Metrics(totals);
  EXPECT_DOUBLE_EQ(s.test_loss, 1.5);
  EXPECT_DOUBLE_EQ(s.accuracy, 0.75);
  EXPECT_DOUBLE_EQ(s.perplexity, std::exp(1.5));
}

TEST_F(AnyModelTest, CheckModelFitsDataLeavesTheModelAlone) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, Load("bn_cnn"));
  const std::vector<torch::Tensor> buffers = model->Buffers();
  ASSERT_EQ(buffers.size(), 3u);
  {
    torch::NoGradGuard no_grad;
    buffers[0].fill_(0.5);
  }
  std::vector<torch::Tensor> before;
  for (const torch::Tensor& b : buffers) before.push_back(b.clone());
  auto unchanged = [&] {
    for (size_t i = 0; i < buffers.size(); ++i) {
      EXPECT_TRUE(torch::equal(buffers[i], before[i])) << model->BufferNames()[i];
    }
    for (const torch::Tensor& p : model->Parameters()) EXPECT_FALSE(p.grad().defined());
  };
  const std::string where = "data /d/train.pt";
  const std::string name = "TorchScript model " + ModelPath("bn_cnn");

  // In training mode, where the forward would move the running statistics.
  ASSERT_OK(CheckModelFitsData(model.get(), LossKind::kCrossEntropy, CnnX(), CnnY(), where));
  unchanged();
  EXPECT_STATUS_MSG(CheckModelFitsData(model.get(), LossKind::kCrossEntropy, CnnX(),
                                       torch::zeros({4, 5}, torch::kInt64), where),
                    absl::StatusCode::kInvalidArgument,
                    where + ": " + name +
                        ": loss cross_entropy: model output float32[4, 4] does not fit targets "
                        "int64[4, 5]");
  unchanged();
  EXPECT_STATUS_MSG(CheckModelFitsData(model.get(), LossKind::kCrossEntropy, CnnX(),
                                       torch::tensor({0, 1, 2, 4}, torch::kInt64), where),
                    absl::StatusCode::kInvalidArgument,
                    where + ": " + name +
                        ": loss cross_entropy: target class index 4 is out of "
                        "range for model output float32[4, 4] (4 classes");
  EXPECT_STATUS_MSG(CheckModelFitsData(model.get(), LossKind::kMse, CnnX(), CnnY(), where),
                    absl::StatusCode::kInvalidArgument,
                    where + ": " + name +
                        ": loss mse: model output float32[4, 4] does not fit "
                        "targets int64[4]");
  EXPECT_STATUS_MSG(CheckModelFitsData(model.get(), LossKind::kCrossEntropy,
                                       CnnX().to(torch::kInt64), CnnY(), where),
                    absl::StatusCode::kInvalidArgument,
                    where + ": " + name + ": forward on int64[4, 1, 6, 6]: ");
  EXPECT_STATUS_MSG(CheckModelFitsData(model.get(), LossKind::kModule, CnnX(), CnnY(), where),
                    absl::StatusCode::kFailedPrecondition,
                    where + ": " + name +
                        " has no method loss(x, y); add @torch.jit.export def loss(self, x, y) "
                        "or use loss: cross_entropy");
  unchanged();
  model->SetTraining(false);
  ASSERT_OK(CheckModelFitsData(model.get(), LossKind::kCrossEntropy, CnnX(), CnnY(), where));
  unchanged();

  // Built-in models and module losses.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> mlp, CreateModel(Spec("mlp"), 1));
  const torch::Tensor images = torch::zeros({2, 1, 28, 28});
  EXPECT_OK(CheckModelFitsData(mlp.get(), LossKind::kCrossEntropy, images,
                               torch::tensor({3, 9}, torch::kInt64), where));
  EXPECT_STATUS_MSG(CheckModelFitsData(mlp.get(), LossKind::kCrossEntropy, images,
                                       torch::tensor({3, 10}, torch::kInt64), where),
                    absl::StatusCode::kInvalidArgument,
                    where + ": model mlp: loss cross_entropy: target class index 10");
  EXPECT_STATUS_MSG(CheckModelFitsData(mlp.get(), LossKind::kCrossEntropy, torch::zeros({2, 3}),
                                       torch::tensor({3, 9}, torch::kInt64), where),
                    absl::StatusCode::kInvalidArgument,
                    where + ": model mlp: input must be float32 [N, 1, 28, 28], got float32[2, 3]");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> own, Load("own_loss"));
  EXPECT_OK(CheckModelFitsData(own.get(), LossKind::kModule, OwnLossX(), OwnLossY(), where));
  for (const torch::Tensor& p : own->Parameters()) EXPECT_FALSE(p.grad().defined());

  // Dropout in training mode draws from LibTorch's global RNG; the check puts it back.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> dropout, Load("dropout"));
  torch::manual_seed(7);
  const torch::Tensor expected_draw = torch::rand({8});
  torch::manual_seed(7);
  EXPECT_OK(CheckModelFitsData(dropout.get(), LossKind::kCrossEntropy, torch::ones({3, 4}),
                               OwnLossY(), where));
  EXPECT_TRUE(torch::equal(torch::rand({8}), expected_draw));
  torch::manual_seed(7);
  ASSERT_OK(dropout->Forward(torch::ones({3, 4})).status());  // A training forward does draw.
  EXPECT_FALSE(torch::equal(torch::rand({8}), expected_draw));

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> bad, Load("bad_loss"));
  EXPECT_STATUS_MSG(CheckModelFitsData(bad.get(), LossKind::kModule, OwnLossX(), OwnLossY(), where),
                    absl::StatusCode::kInvalidArgument, where + ": TorchScript model ");
}

TEST_F(AnyModelTest, TestModulesStaySmall) {
  for (const char* name :
       {"bn_cnn", "tiny_seq", "regress", "own_loss", "bad_loss", "int_buffer", "dropout"}) {
    struct stat st;
    ASSERT_EQ(stat(ModelPath(name).c_str(), &st), 0) << name;
    EXPECT_LT(st.st_size, 200 * 1024) << name;
  }
}

}  // namespace
}  // namespace gradmesh
