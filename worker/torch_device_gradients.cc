#include "worker/torch_device_gradients.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status.h"
#include "compression/float16.h"

namespace gradmesh {
namespace {

// The values as the wire carries them: float32 as is, fp16/bf16 rounded to nearest even after
// clamping to the format's largest finite value (compression/float16.h).
torch::Tensor WireValues(const torch::Tensor& values, ValueType type) {
  if (type == ValueType::kFloat32) return values;
  const bool half = type == ValueType::kFloat16;
  const double max = half ? 65504.0 : static_cast<double>(kBFloat16Max);
  return values.clamp(-max, max).to(half ? torch::kHalf : torch::kBFloat16);
}

// The indices (ascending, int64) of the k largest magnitudes of `acc`, 0 < k < n, ties at the
// k-th magnitude going to the lower indices, as the host's top-k (compression/select.h) breaks
// them: torch::topk alone breaks them in no fixed order, and gradients do tie (an MLP's first
// layer has equal gradients wherever two pixels are equal over the whole batch).
torch::Tensor TopKIndices(const torch::Tensor& acc, int64_t k) {
  const torch::Tensor magnitude = acc.abs();
  const torch::Tensor kth = std::get<0>(magnitude.topk(k, 0, true, false)).min();
  const torch::Tensor above = magnitude > kth;
  const torch::Tensor tied = magnitude == kth;
  // The first (k - |above|) of the tied elements, by index.
  const torch::Tensor room = k - above.sum();
  const torch::Tensor chosen = above.logical_or(tied.logical_and(tied.cumsum(0) <= room));
  return chosen.nonzero().reshape({-1});
}

}  // namespace

torch::Tensor TorchDeviceGradients::ToHost(const torch::Tensor& t) {
  torch::Tensor h = t.to(torch::kCPU).contiguous();
  bytes_to_host_ += h.numel() * static_cast<int64_t>(h.element_size());
  return h;
}

absl::StatusOr<torch::Tensor> TorchDeviceGradients::Slice(int param, int64_t offset,
                                                          int64_t numel) const {
  if (param < 0 || param >= static_cast<int>(params_->size())) {
    return absl::InvalidArgumentError(absl::StrCat("device gradients: no parameter ", param,
                                                   " (the model has ", params_->size(), ")"));
  }
  const torch::Tensor& g = (*params_)[param].grad();
  if (!g.defined() || g.scalar_type() != torch::kFloat || !g.is_contiguous()) {
    return absl::InternalError(absl::StrCat("device gradients: ", (*names_)[param],
                                            " has no contiguous float32 gradient"));
  }
  if (offset < 0 || numel < 0 || offset + numel > g.numel()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device gradients: elements [", offset, ", ", offset + numel, ") of ",
                     (*names_)[param], ", which has ", g.numel()));
  }
  return g.reshape({-1}).narrow(0, offset, numel);
}

absl::Status TorchDeviceGradients::CheckFinite() {
  try {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> flags;
    for (const torch::Tensor& p : *params_) {
      if (p.grad().defined()) flags.push_back(torch::isfinite(p.grad()).all());
    }
    if (flags.empty() || ToHost(torch::stack(flags).all()).item<bool>()) return absl::OkStatus();
    for (size_t i = 0; i < params_->size(); ++i) {
      const torch::Tensor& g = (*params_)[i].grad();
      if (!g.defined()) continue;
      const torch::Tensor bad = torch::logical_not(torch::isfinite(g.reshape({-1}))).nonzero();
      if (bad.numel() == 0) continue;
      return absl::InvalidArgumentError(absl::StrCat("gradient of ", (*names_)[i], " element ",
                                                     ToHost(bad[0][0]).item<int64_t>(),
                                                     " is not finite"));
    }
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("device gradients: finiteness check failed: ", e.what_without_backtrace()));
  }
}

absl::Status TorchDeviceGradients::Encode(int param, int64_t offset, int64_t numel,
                                          const DeviceCodec& codec, const ErrorFeedbackOptions* ef,
                                          int64_t slot, std::string* out) {
  ASSIGN_OR_RETURN(const torch::Tensor grad, Slice(param, offset, numel));
  try {
    torch::NoGradGuard no_grad;
    return EncodeOrThrow(grad, codec, ef, slot, out);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("device gradients: encoding ", (*names_)[param],
                                            " elements [", offset, ", ", offset + numel,
                                            "): ", e.what_without_backtrace()));
  }
}

absl::Status TorchDeviceGradients::EncodeOrThrow(const torch::Tensor& grad,
                                                 const DeviceCodec& codec,
                                                 const ErrorFeedbackOptions* ef, int64_t slot,
                                                 std::string* out) {
  const int64_t n = grad.numel();
  // acc = grad + residual, or with momentum correction residual + (m * u + grad)
  // (compression/error_feedback.h, in the same float32 operations).
  torch::Tensor acc = grad, next_momentum;
  Feedback* state = nullptr;
  const bool momentum = ef != nullptr && ef->momentum > 0.0f;
  if (ef != nullptr) {
    auto [it, fresh] = state_.try_emplace(slot);
    state = &it->second;
    if (fresh) {
      state->residual = torch::zeros({n}, grad.options());
      if (momentum) state->momentum = torch::zeros({n}, grad.options());
    } else if (state->residual.numel() != n || momentum != state->momentum.defined()) {
      return absl::InvalidArgumentError(absl::StrCat("device gradients: slot ", slot, " holds ",
                                                     state->residual.numel(),
                                                     " elements of error feedback, not ", n));
    }
    if (momentum) {
      next_momentum = state->momentum * ef->momentum;
      next_momentum.add_(grad);
      acc = state->residual + next_momentum;
    } else {
      acc = grad + state->residual;
    }
  }
  const bool sparse = codec.codec == CodecId::kTopK;
  const int64_t k = sparse ? SparseCount(n, codec.density) : n;
  const bool all = k == n;  // Every element is sent, in order: no index section.
  torch::Tensor indices;    // int64, ascending (sparse only).
  torch::Tensor sent = acc;
  if (!all) {
    indices = TopKIndices(acc, k);
    sent = acc.index_select(0, indices);
  }
  const torch::Tensor wire = WireValues(sent, codec.values);
  // Nothing is committed before the payload exists: a non-finite acc changes no state.
  if (!ToHost(torch::isfinite(acc).all()).item<bool>()) {
    const int64_t j =
        ToHost(torch::logical_not(torch::isfinite(acc)).nonzero()[0][0]).item<int64_t>();
    return absl::InvalidArgumentError(
        absl::StrCat("element ", j, " of the ", ef != nullptr ? "accumulated " : "",
                     "gradient is not finite"));
  }
  const size_t value_bytes = ValueBytes(codec.values);
  const torch::Tensor host_values = ToHost(wire);
  PayloadHeader header;
  header.codec = codec.codec;
  header.value_type = codec.values;
  header.n = static_cast<uint64_t>(n);
  size_t at = kHeaderBytes;
  if (sparse) {
    torch::Tensor host_indices;
    absl::Span<const uint32_t> idx;
    size_t index_bytes = 0;
    IndexEncoding encoding = IndexEncoding::kAll;
    if (!all) {
      host_indices = ToHost(indices.to(torch::kInt));
      idx = absl::MakeConstSpan(reinterpret_cast<const uint32_t*>(host_indices.data_ptr<int32_t>()),
                                static_cast<size_t>(k));
      encoding = ChooseIndexEncoding(header.n, idx, &index_bytes);
    }
    header.aux = static_cast<uint8_t>(encoding);
    out->resize(kSparseHeaderBytes + index_bytes + static_cast<size_t>(k) * value_bytes);
    PutU64(static_cast<uint64_t>(k), out->data() + kHeaderBytes);
    PutU64(index_bytes, out->data() + kHeaderBytes + 8);
    if (!all) WriteIndices(encoding, header.n, idx, out->data() + kSparseHeaderBytes);
    at = kSparseHeaderBytes + index_bytes;
  } else {
    out->resize(kHeaderBytes + static_cast<size_t>(n) * value_bytes);
  }
  WritePayloadHeader(header, out->data());
  std::memcpy(out->data() + at, host_values.data_ptr(), static_cast<size_t>(k) * value_bytes);

  if (state == nullptr) return absl::OkStatus();
  // residual = acc - decoded: only the sent elements change (the others keep acc).
  const torch::Tensor decoded = codec.values == ValueType::kFloat32 ? sent : wire.to(torch::kFloat);
  if (all) {
    state->residual = acc - decoded;
  } else {
    state->residual = acc;
    state->residual.index_copy_(0, indices, sent - decoded);
  }
  if (momentum) {
    // Momentum factor masking: u = 0 where a non-zero value was sent.
    if (ef->momentum_masking) {
      const torch::Tensor kept = all ? next_momentum : next_momentum.index_select(0, indices);
      const torch::Tensor masked = torch::where(decoded != 0, torch::zeros_like(kept), kept);
      if (all) {
        next_momentum = masked;
      } else {
        next_momentum.index_copy_(0, indices, masked);
      }
    }
    state->momentum = next_momentum;
  }
  return absl::OkStatus();
}

}  // namespace gradmesh
