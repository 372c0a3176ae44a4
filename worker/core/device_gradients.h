// DeviceGradients: a step's parameter gradients where backward left them (a GPU), encoded
// there, so that only a push codec's payload crosses to the host instead of every float32.
//
// The training loop offers one to the mode after Start (TrainingMode::UseDeviceGradients)
// when the job computes on a GPU (or --device_codec=on, which also takes this path on the
// CPU, through LibTorch's kernels: how tests check it without a GPU) and nothing of the loop
// itself needs the host gradient (no clipping or loss scaling by the loop, no backward
// overlap). A mode that accepts reads every step's parameter gradients through it; the host
// spans Exchange gets for parameters are then not refreshed (buffers' deltas are, as ever).
// The ps modes accept when their push codec is one DeviceCodecOf knows (worker/ps).
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

#include "absl/status/status.h"
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

class DeviceGradients {
 public:
  virtual ~DeviceGradients() = default;

  // OK when every parameter gradient of the step is finite; otherwise InvalidArgument naming
  // the first parameter and element that is not.
  virtual absl::Status CheckFinite() = 0;

  // Encodes elements [offset, offset + numel) of parameter `param`'s gradient with `codec`
  // into *out (replacing it). With `ef` (not null), through the error-feedback state `slot`
  // (a chunk's index; zero the first time a slot is used), exactly as ErrorFeedback::Compress
  // with those options; without, as Compressor::Encode. InvalidArgument (state unchanged)
  // when what would be encoded is not finite; INTERNAL for a failure of the device.
  virtual absl::Status Encode(int param, int64_t offset, int64_t numel, const DeviceCodec& codec,
                              const ErrorFeedbackOptions* ef, int64_t slot, std::string* out) = 0;

  // Zeroes every slot's error-feedback state (e.g. the push codec changed).
  virtual void ResetFeedback() = 0;

  // Bytes copied from the device to the host by Encode and CheckFinite so far.
  virtual int64_t bytes_to_host() const = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_CORE_DEVICE_GRADIENTS_H_
