// ValueCodec: how a gossip message carries a flat parameter vector.
//
//   ""      float32 little-endian, numel * 4 bytes (exact)
//   "fp16"  compression/ fp16 payload (round to nearest even; ~3 significant digits)
//   "bf16"  compression/ bf16 payload (~2 significant digits, float32's range)
//
// Decode validates everything (codec, size, every value finite) and never writes outside
// `out`. Senders of a lossy codec compensate for its rounding themselves (see replica.h), so
// mixing conserves mass whatever the codec.
//
// Thread safety: a ValueCodec is immutable after Create(); its methods are const and may run
// concurrently.
#ifndef GRADMESH_WORKER_GOSSIP_VALUE_CODEC_H_
#define GRADMESH_WORKER_GOSSIP_VALUE_CODEC_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "compression/compressor.h"

namespace gradmesh {

class ValueCodec {
 public:
  // InvalidArgument for anything but "", "fp16", "bf16".
  static absl::StatusOr<ValueCodec> Create(const std::string& name);

  const std::string& name() const { return name_; }
  bool lossless() const { return compressor_ == nullptr; }

  // Replaces *out with the encoding of `in`. InvalidArgument naming the first non-finite
  // element.
  absl::Status Encode(absl::Span<const float> in, std::string* out) const;

  // Bytes Encode writes for `numel` values (at most that for a compressor's format).
  size_t EncodedSize(size_t numel) const {
    return compressor_ != nullptr ? compressor_->MaxEncodedSize(numel) : numel * sizeof(float);
  }

  // Decodes `in` into `out` (whose size is the expected element count). InvalidArgument with a
  // message naming the problem (size, malformed payload, non-finite value).
  absl::Status Decode(absl::string_view in, absl::Span<float> out) const;

 private:
  ValueCodec(std::string name, std::shared_ptr<const Compressor> compressor)
      : name_(std::move(name)), compressor_(std::move(compressor)) {}

  std::string name_;
  std::shared_ptr<const Compressor> compressor_;  // Null for float32.
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_VALUE_CODEC_H_
