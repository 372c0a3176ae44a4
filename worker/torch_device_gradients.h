// The LibTorch side of DeviceGradients (worker/core/device_gradients.h): top-k selection,
// error feedback and the fp16/bf16 conversion run where the gradients are (a GPU, or the CPU
// through LibTorch's kernels), and only the selected indices (int32) and the values in their
// wire format are copied to the host, where the payload's index section is written.
//
// Includes LibTorch: only worker/training_loop.cc and the loop's test include it.
//
// Thread safety: not thread-safe (one training thread).
#ifndef GRADMESH_WORKER_TORCH_DEVICE_GRADIENTS_H_
#define GRADMESH_WORKER_TORCH_DEVICE_GRADIENTS_H_

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "worker/core/device_gradients.h"

namespace gradmesh {

class TorchDeviceGradients : public DeviceGradients {
 public:
  // `params` (the model's parameters, contiguous float32, their .grad() contiguous when read)
  // and `names` (for messages) outlive this.
  TorchDeviceGradients(const std::vector<torch::Tensor>* params,
                       const std::vector<std::string>* names)
      : params_(params), names_(names) {}

  absl::Status CheckFinite() override;
  absl::Status Encode(int param, int64_t offset, int64_t numel, const DeviceCodec& codec,
                      const ErrorFeedbackOptions* ef, int64_t slot, std::string* out) override;
  void ResetFeedback() override { state_.clear(); }
  int64_t bytes_to_host() const override { return bytes_to_host_; }

 private:
  struct Feedback {
    torch::Tensor residual;  // float32, numel, on the device.
    torch::Tensor momentum;  // Only with ef->momentum > 0.
  };
  // The gradient slice, or INVALID_ARGUMENT for a bad (param, offset, numel).
  absl::StatusOr<torch::Tensor> Slice(int param, int64_t offset, int64_t numel) const;
  absl::Status EncodeOrThrow(const torch::Tensor& grad, const DeviceCodec& codec,
                             const ErrorFeedbackOptions* ef, int64_t slot, std::string* out);
  // `t` on the host (a synchronous copy), counted.
  torch::Tensor ToHost(const torch::Tensor& t);

  const std::vector<torch::Tensor>* const params_;
  const std::vector<std::string>* const names_;
  std::map<int64_t, Feedback> state_;
  int64_t bytes_to_host_ = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_TORCH_DEVICE_GRADIENTS_H_
