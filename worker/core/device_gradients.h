// DeviceGradients: a step's parameter gradients where backward left them (a GPU), encoded
// there, so that only a push codec's payload crosses to the host instead of every float32.
//
// The training loop offers one to the mode after Start (TrainingMode::UseDeviceGradients)
// when the job computes on a GPU (or --device_codec=on, which also takes this path on the
// CPU, through LibTorch's kernels: how tests check it without a GPU) and the mode does not
// want the per-gradient hook; the loop then clips, unscales and checks the gradient where it
// is. A mode that accepts reads every step's parameter gradients through it; the host spans
// Exchange gets for parameters are then not refreshed (buffers' deltas are, as ever). The ps
// modes' plain exchange accepts when its push codec is one DeviceCodecOf knows (worker/ps).
//
// What Encode produces is the host codec's payload (compression/payload.h), byte for byte
// what ErrorFeedback::Compress (or Compressor::Encode without error feedback) gives for the
// same gradient, ties at top-k's k-th magnitude included (they go to the lower indices).
//
// Thread safety: used by one thread at a time (the training thread, between backward and
// the next step's forward).
#ifndef GRADMESH_WORKER_CORE_DEVICE_GRADIENTS_H_
#define GRADMESH_WORKER_CORE_DEVICE_GRADIENTS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "compression/compressor.h"
#include "compression/error_feedback.h"
#include "compression/payload.h"

namespace gradmesh {

// A codec a device encodes: topk:<ratio> (values float32, fp16 or bf16), fp16, bf16.
struct DeviceCodec {
  CodecId codec = CodecId::kTopK;  // kTopK, kFp16 or kBf16.
  ValueType values = ValueType::kFloat32;
  double density = 1.0;  // kTopK: the ratio of elements sent.
};

// The device codec of `codec` (by its canonical name and density), or nullopt for codecs
// that stay on the host (identity, topk_approx, randomk, qsgd and their compositions).
std::optional<DeviceCodec> DeviceCodecOf(const Compressor& codec);

// One chunk of a parameter's gradient to encode: elements [offset, offset + numel) of
// parameter `param`, through the error-feedback state `slot` (e.g. the chunk's index).
struct DeviceChunk {
  int param = 0;
  int64_t offset = 0;
  int64_t numel = 0;
  int64_t slot = 0;
};

class DeviceGradients {
 public:
  virtual ~DeviceGradients() = default;

  // Encodes each of `chunks` (distinct slots) with `codec` into (*out)[i] (out is resized to
  // chunks.size()): one pass over all of them on the device and one copy to the host. With
  // `ef` (not null), through each chunk's error-feedback state (zero the first time a slot is
  // used), exactly as ErrorFeedback::Compress with those options; without, as
  // Compressor::Encode. All or nothing: INVALID_ARGUMENT for a bad chunk, a slot used with
  // another size, or a gradient (or error-feedback sum) that is not finite (naming the first
  // parameter and element), and then no state has changed; INTERNAL for a device failure or a
  // parameter without a contiguous float32 gradient.
  virtual absl::Status Encode(absl::Span<const DeviceChunk> chunks, const DeviceCodec& codec,
                              const ErrorFeedbackOptions* ef, std::vector<std::string>* out) = 0;

  // Zeroes every slot's error-feedback state (e.g. the push codec changed).
  virtual void ResetFeedback() = 0;

  // Bytes copied from the device to the host by Encode so far.
  virtual int64_t bytes_to_host() const = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_CORE_DEVICE_GRADIENTS_H_
