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
// Memory: a pass takes about 50 bytes of device memory per element for its temporaries, so
// chunks go in passes of at most kPassElements elements (~800 MiB; one pass for models up to
// 16.7 M parameters); error feedback keeps 4 bytes per parameter (8 with DGC momentum), and
// twice that while a push's new state replaces the old.
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
  static constexpr int64_t kPassElements = int64_t{1} << 24;

  // `params` (the model's parameters, contiguous float32, their .grad() contiguous when read)
  // and `names` (for messages) outlive this. `pass_elements`: the most elements of one pass
  // (a larger chunk gets a pass of its own).
  TorchDeviceGradients(const std::vector<torch::Tensor>* params,
                       const std::vector<std::string>* names, int64_t pass_elements = kPassElements)
      : params_(params), names_(names), pass_elements_(pass_elements) {}

  absl::Status Encode(absl::Span<const DeviceChunk> chunks, const DeviceCodec& codec,
                      const ErrorFeedbackOptions* ef, std::vector<std::string>* out) override;
  void ResetFeedback() override { state_.clear(); }
  int64_t bytes_to_host() const override { return bytes_to_host_; }

 private:
  struct Feedback {
    torch::Tensor residual;  // float32, the chunk's numel, on the device.
    torch::Tensor momentum;  // Only with ef->momentum > 0.
  };
  // Per chunk of a pass (cached by the pass's sizes and ks: a push's passes repeat every
  // step), on the device: elements, elements sent, first flat index, and first flat index
  // minus the first index of its sent elements in the pass's list of them.
  struct Plan {
    torch::Tensor sizes, ks, starts, shifts;
  };
  // A pass's new error-feedback state, committed once every pass has succeeded.
  struct Pending {
    absl::Span<const DeviceChunk> chunks;
    std::vector<int64_t> sizes;
    torch::Tensor residual, momentum;
  };
  // The gradient slice, or INVALID_ARGUMENT for a bad (param, offset, numel).
  absl::StatusOr<torch::Tensor> Slice(const DeviceChunk& chunk) const;
  // INVALID_ARGUMENT unless the slots are distinct and each one's state (if any) fits.
  absl::Status CheckSlots(absl::Span<const DeviceChunk> chunks, const ErrorFeedbackOptions* ef);
  const Plan& PlanFor(const std::vector<int64_t>& sizes, const std::vector<int64_t>& ks,
                      const torch::Device& device);
  // Passes of at most pass_elements_ elements; commits their state if all of them succeed.
  absl::Status EncodeOrThrow(absl::Span<const DeviceChunk> chunks,
                             absl::Span<const torch::Tensor> grads, const DeviceCodec& codec,
                             const ErrorFeedbackOptions* ef, std::string* out);
  // One pass: payloads into out[0, chunks.size()), the new state (with ef) into *pending.
  absl::Status EncodePass(absl::Span<const DeviceChunk> chunks,
                          absl::Span<const torch::Tensor> grads, const DeviceCodec& codec,
                          const ErrorFeedbackOptions* ef, std::string* out, Pending* pending);
  // The indices (ascending, flat in the pass) of each chunk's top-k magnitudes of `acc`.
  torch::Tensor SelectTopK(const torch::Tensor& acc, const Plan& plan, int64_t total_k);
  // The message naming the first element of the batch that is not finite.
  absl::Status NotFinite(absl::Span<const DeviceChunk> chunks,
                         absl::Span<const torch::Tensor> grads);
  // `bytes` (uint8) on the host: a synchronous copy (into a reused pinned buffer from a
  // GPU), counted.
  torch::Tensor ToHost(const torch::Tensor& bytes);

  const std::vector<torch::Tensor>* const params_;
  const std::vector<std::string>* const names_;
  const int64_t pass_elements_;
  std::map<int64_t, Feedback> state_;
  std::map<std::vector<int64_t>, Plan> plans_;  // By sizes, then ks.
  torch::Tensor pinned_;
  int64_t bytes_to_host_ = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_TORCH_DEVICE_GRADIENTS_H_
