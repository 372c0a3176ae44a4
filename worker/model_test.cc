#include "worker/model.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>
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
  }
}

TEST_F(ModelTest, ForwardRejectsBadInput) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model, CreateModel(Spec("lenet"), 1));
  EXPECT_STATUS_MSG(model->Forward(torch::randn({5, 784})), absl::StatusCode::kInvalidArgument,
                    "model lenet: input must be float32 [N, 1, 28, 28], got Float [5, 784]");
  EXPECT_STATUS(model->Forward(torch::zeros({2, 1, 28, 28}, torch::kFloat64)),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(model->Forward(torch::Tensor()), absl::StatusCode::kInvalidArgument);

  const torch::Tensor x = torch::randn({2, 1, 28, 28});
  EXPECT_STATUS_MSG(CrossEntropyLoss(model.get(), x, torch::tensor({1, 2, 3}, torch::kInt64)),
                    absl::StatusCode::kInvalidArgument, "labels must be int64 [2]");
  // Out-of-range class: LibTorch throws, and the error comes back as a status.
  EXPECT_STATUS_MSG(CrossEntropyLoss(model.get(), x, torch::tensor({1, 10}, torch::kInt64)),
                    absl::StatusCode::kInvalidArgument, "cross-entropy loss");
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

  // A module's outputs must be [N, C]; a rank-2 input reaches the module, which fails on it.
  EXPECT_STATUS_MSG(model->Forward(torch::randn({3, 5})), absl::StatusCode::kInvalidArgument,
                    "TorchScript model " + path + ": forward on Float [3, 5]");
}

}  // namespace
}  // namespace gradmesh
