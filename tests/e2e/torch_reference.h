// Independent single-process LibTorch references for the e2e numerical checks (#14): the
// built-in MLP trained with torch::optim on MNIST batches of the whole global batch, with and
// without torch::nn::utils::clip_grad_norm_, and the comparisons the tests make against them.
// Only the e2e tests that check numbers include this (it pulls in torch).
#ifndef GRADMESH_TESTS_E2E_TORCH_REFERENCE_H_
#define GRADMESH_TESTS_E2E_TORCH_REFERENCE_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace gradmesh {
namespace e2e {

struct ClippedReferenceOptions {
  std::string mnist_dir;  // <data_dir>/mnist
  uint64_t seed = 7;      // model initialisation and loader order
  int64_t batch_size = 64;
  int64_t steps = 50;
  double lr = 0.05;
  double momentum = 0.9;
  double clip_grad_norm = 0.5;
  std::vector<int64_t> skip_steps;  // steps whose batch is drawn and not trained on
};

struct ClippedReference {
  std::vector<std::string> names;        // the MLP's parameter names, in order
  std::vector<torch::Tensor> clipped;    // parameters after the clipped run
  std::vector<torch::Tensor> unclipped;  // the same run without clipping
};

// Trains two MLPs from the same seed on the same batches with SGD(lr, momentum): one clipped
// to the global norm `clip_grad_norm` before every step, one not. One intra-op thread.
absl::StatusOr<ClippedReference> TrainClippedMlpReference(const ClippedReferenceOptions& options);

// Max over tensors of ||a - b|| / ||b|| (in double).
double MaxRelError(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b);

// Reads the tensors a built-in model saved with torch::save (one archive per submodule, names
// "submodule.tensor"); empty (with a gtest failure) if one is missing.
std::vector<torch::Tensor> LoadSaved(const std::string& path,
                                     const std::vector<std::string>& names);

}  // namespace e2e
}  // namespace gradmesh

#endif  // GRADMESH_TESTS_E2E_TORCH_REFERENCE_H_
