// ValueCodec (see value_codec.h).
#include "worker/gossip/value_codec.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/numeric.h"

namespace gradmesh {

absl::StatusOr<ValueCodec> ValueCodec::Create(const std::string& name) {
  if (name.empty()) return ValueCodec("", nullptr);
  if (name != "fp16" && name != "bf16") {
    return absl::InvalidArgumentError(
        absl::StrCat("gossip codec \"", name, "\" is not one of \"\" (float32), fp16, bf16"));
  }
  auto c = CompressorRegistry::WithBuiltins().Create(name);
  if (!c.ok()) return c.status();
  return ValueCodec(name, std::shared_ptr<const Compressor>(std::move(*c)));
}

absl::Status ValueCodec::Encode(absl::Span<const float> in, std::string* out) const {
  if (compressor_ != nullptr) return compressor_->Encode(in, /*seed=*/0, out);
  const int64_t bad = FirstNonFinite(in.data(), static_cast<int64_t>(in.size()));
  if (bad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gossip values: element ", bad, " is not finite (", in[bad], ")"));
  }
  out->assign(reinterpret_cast<const char*>(in.data()), in.size() * sizeof(float));
  return absl::OkStatus();
}

absl::Status ValueCodec::Decode(absl::string_view in, absl::Span<float> out) const {
  if (compressor_ != nullptr) return compressor_->Decode(in, out);
  if (in.size() != out.size() * sizeof(float)) {
    return absl::InvalidArgumentError(
        absl::StrCat("gossip values: ", in.size(), " bytes of float32 data for ", out.size(),
                     " elements (expected ", out.size() * sizeof(float), ")"));
  }
  std::memcpy(out.data(), in.data(), in.size());
  const int64_t bad = FirstNonFinite(out.data(), static_cast<int64_t>(out.size()));
  if (bad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gossip values: element ", bad, " is not finite (", out[bad], ")"));
  }
  return absl::OkStatus();
}

}  // namespace gradmesh
