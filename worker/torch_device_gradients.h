// The LibTorch side of DeviceGradients (worker/core/device_gradients.h): error feedback, top-k
// selection and the fp16/bf16 conversion run where the gradients are (a GPU, or the CPU through
// LibTorch's kernels), for all of a push's chunks in one pass (a fixed number of kernels
// whatever the number of chunks), and one copy brings the selected indices (int32) and the
// values in their wire format to the host, where each chunk's payload is written.
//
// Top-k of every chunk at once: a stable sort of all magnitudes (descending), then a stable
// sort of the chunk ids in that order, leaves each chunk's elements together, by magnitude,
// equal magnitudes by index (the host's tie rule); each chunk's first k are its top-k.
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

  absl::Status Encode(absl::Span<const DeviceChunk> chunks, const DeviceCodec& codec,
                      const ErrorFeedbackOptions* ef, std::vector<std::string>* out) override;
  void ResetFeedback() override { state_.clear(); }
  int64_t bytes_to_host() const override { return bytes_to_host_; }

 private:
  struct Feedback {
    torch::Tensor residual;  // float32, the chunk's numel, on the device.
    torch::Tensor momentum;  // Only with ef->momentum > 0.
  };
  // What a batch's shape determines (cached: a push's chunks are the same every step).
  struct Plan {
    std::vector<int64_t> sizes, ks;  // Per chunk: elements, elements sent.
    torch::Tensor segment;           // Per element: its chunk.
    torch::Tensor positions;         // Per sent element: its place in the grouped order.
    torch::Tensor starts;            // Per sent element: its chunk's first flat index.
  };
  // The gradient slice, or INVALID_ARGUMENT for a bad (param, offset, numel).
  absl::StatusOr<torch::Tensor> Slice(const DeviceChunk& chunk) const;
  // INVALID_ARGUMENT unless the slots are distinct and each one's state (if any) fits.
  absl::Status CheckSlots(absl::Span<const DeviceChunk> chunks, const ErrorFeedbackOptions* ef);
  const Plan& PlanFor(const std::vector<int64_t>& sizes, const std::vector<int64_t>& ks,
                      const torch::Device& device);
  absl::Status EncodeOrThrow(absl::Span<const DeviceChunk> chunks,
                             const std::vector<torch::Tensor>& grads, const DeviceCodec& codec,
                             const ErrorFeedbackOptions* ef, std::vector<std::string>* out);
  // The message naming the first element of the batch that is not finite.
  absl::Status NotFinite(absl::Span<const DeviceChunk> chunks,
                         const std::vector<torch::Tensor>& grads);
  // `bytes` (uint8) on the host: a synchronous copy (into a reused pinned buffer from a
  // GPU), counted.
  torch::Tensor ToHost(const torch::Tensor& bytes);

  const std::vector<torch::Tensor>* const params_;
  const std::vector<std::string>* const names_;
  std::map<int64_t, Feedback> state_;
  Plan plan_;
  torch::Tensor pinned_;
  int64_t bytes_to_host_ = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_TORCH_DEVICE_GRADIENTS_H_
