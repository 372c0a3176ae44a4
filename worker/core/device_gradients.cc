#include "worker/core/device_gradients.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace gradmesh {

std::optional<DeviceCodec> DeviceCodecOf(const Compressor& codec) {
  const std::string name = codec.name();
  absl::string_view spec = name;
  DeviceCodec out;
  if (absl::ConsumeSuffix(&spec, "+fp16")) {
    out.values = ValueType::kFloat16;
  } else if (absl::ConsumeSuffix(&spec, "+bf16")) {
    out.values = ValueType::kBFloat16;
  }
  if (absl::StartsWith(spec, "topk:")) {
    out.codec = CodecId::kTopK;
    out.density = codec.density();
    return out;
  }
  if (out.values != ValueType::kFloat32) return std::nullopt;  // Another sparsifier.
  if (spec == "fp16") {
    out.codec = CodecId::kFp16;
    out.values = ValueType::kFloat16;
    return out;
  }
  if (spec == "bf16") {
    out.codec = CodecId::kBf16;
    out.values = ValueType::kBFloat16;
    return out;
  }
  return std::nullopt;
}

}  // namespace gradmesh
