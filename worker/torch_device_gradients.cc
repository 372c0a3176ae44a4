#include "worker/torch_device_gradients.h"

#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status.h"
#include "compression/float16.h"

namespace gradmesh {
namespace {

// The values as the wire carries them: float32 as is, fp16/bf16 rounded to nearest even after
// clamping to the format's largest finite value (compression/float16.h).
torch::Tensor WireValues(const torch::Tensor& values, ValueType type) {
  if (type == ValueType::kFloat32) return values.contiguous();
  const bool half = type == ValueType::kFloat16;
  const double max = half ? 65504.0 : static_cast<double>(kBFloat16Max);
  return values.clamp(-max, max).to(half ? torch::kHalf : torch::kBFloat16).contiguous();
}

// Concatenation without a copy for one tensor.
torch::Tensor Flat(absl::Span<const torch::Tensor> parts) {
  return parts.size() == 1 ? parts[0]
                           : torch::cat(std::vector<torch::Tensor>(parts.begin(), parts.end()));
}

torch::Tensor AsBytes(const torch::Tensor& t) { return t.contiguous().view(torch::kByte); }

// Writes one chunk's payload: n elements, k sent (`indices`, ascending, when k < n; none when
// every element is sent), `values` k values of `value_bytes` each.
void WritePayload(const DeviceCodec& codec, uint64_t n, uint64_t k, const uint32_t* indices,
                  const char* values, size_t value_bytes, std::string* out) {
  PayloadHeader header;
  header.codec = codec.codec;
  header.value_type = codec.values;
  header.n = n;
  size_t at = kHeaderBytes;
  if (codec.codec == CodecId::kTopK) {
    size_t index_bytes = 0;
    IndexEncoding encoding = IndexEncoding::kAll;
    const absl::Span<const uint32_t> idx(indices, k < n ? k : 0);
    if (k < n) encoding = ChooseIndexEncoding(n, idx, &index_bytes);
    header.aux = static_cast<uint8_t>(encoding);
    out->resize(kSparseHeaderBytes + index_bytes + k * value_bytes);
    PutU64(k, out->data() + kHeaderBytes);
    PutU64(index_bytes, out->data() + kHeaderBytes + 8);
    if (k < n) WriteIndices(encoding, n, idx, out->data() + kSparseHeaderBytes);
    at = kSparseHeaderBytes + index_bytes;
  } else {
    out->resize(kHeaderBytes + n * value_bytes);
  }
  WritePayloadHeader(header, out->data());
  std::memcpy(out->data() + at, values, k * value_bytes);
}

}  // namespace

torch::Tensor TorchDeviceGradients::ToHost(const torch::Tensor& bytes) {
  bytes_to_host_ += bytes.numel();
  if (bytes.is_cpu()) return bytes.contiguous();
  if (!pinned_.defined() || pinned_.numel() < bytes.numel()) {
    pinned_ = torch::empty(
        {std::max<int64_t>(bytes.numel(), 2 * (pinned_.defined() ? pinned_.numel() : 0))},
        torch::TensorOptions().dtype(torch::kByte).pinned_memory(true));
  }
  torch::Tensor dst = pinned_.narrow(0, 0, bytes.numel());
  dst.copy_(bytes);  // Synchronous.
  return dst;
}

absl::StatusOr<torch::Tensor> TorchDeviceGradients::Slice(const DeviceChunk& c) const {
  if (c.param < 0 || c.param >= static_cast<int>(params_->size())) {
    return absl::InvalidArgumentError(absl::StrCat("device gradients: no parameter ", c.param,
                                                   " (the model has ", params_->size(), ")"));
  }
  const torch::Tensor& g = (*params_)[c.param].grad();
  if (!g.defined() || g.scalar_type() != torch::kFloat || !g.is_contiguous()) {
    return absl::InternalError(absl::StrCat("device gradients: ", (*names_)[c.param],
                                            " has no contiguous float32 gradient"));
  }
  if (c.offset < 0 || c.numel < 0 || c.offset + c.numel > g.numel()) {
    return absl::InvalidArgumentError(absl::StrCat("device gradients: elements [", c.offset, ", ",
                                                   c.offset + c.numel, ") of ", (*names_)[c.param],
                                                   ", which has ", g.numel()));
  }
  return g.reshape({-1}).narrow(0, c.offset, c.numel);
}

absl::Status TorchDeviceGradients::CheckSlots(absl::Span<const DeviceChunk> chunks,
                                              const ErrorFeedbackOptions* ef) {
  std::set<int64_t> seen;
  const bool momentum = ef != nullptr && ef->momentum > 0.0f;
  for (const DeviceChunk& c : chunks) {
    if (!seen.insert(c.slot).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("device gradients: slot ", c.slot, " appears twice in one batch"));
    }
    if (ef == nullptr) continue;
    auto it = state_.find(c.slot);
    if (it == state_.end()) continue;
    if (it->second.residual.numel() != c.numel || it->second.momentum.defined() != momentum) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device gradients: slot ", c.slot, " holds ", it->second.residual.numel(),
          " elements of error feedback", it->second.momentum.defined() ? " with momentum" : "",
          ", not ", c.numel, momentum ? " with momentum" : ""));
    }
  }
  return absl::OkStatus();
}

absl::Status TorchDeviceGradients::Encode(absl::Span<const DeviceChunk> chunks,
                                          const DeviceCodec& codec, const ErrorFeedbackOptions* ef,
                                          std::vector<std::string>* out) {
  out->resize(chunks.size());
  if (chunks.empty()) return absl::OkStatus();
  std::vector<torch::Tensor> grads;
  for (const DeviceChunk& c : chunks) {
    ASSIGN_OR_RETURN(torch::Tensor g, Slice(c));
    grads.push_back(std::move(g));
  }
  RETURN_IF_ERROR(CheckSlots(chunks, ef));
  try {
    torch::NoGradGuard no_grad;
    return EncodeOrThrow(chunks, grads, codec, ef, out->data());
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("device gradients: encoding ", chunks.size(),
                                            " chunks: ", e.what_without_backtrace()));
  }
}

absl::Status TorchDeviceGradients::EncodeOrThrow(absl::Span<const DeviceChunk> chunks,
                                                 absl::Span<const torch::Tensor> grads,
                                                 const DeviceCodec& codec,
                                                 const ErrorFeedbackOptions* ef, std::string* out) {
  std::vector<Pending> pending;
  for (size_t begin = 0; begin < chunks.size();) {
    size_t end = begin + 1;
    int64_t n = chunks[begin].numel;
    while (end < chunks.size() && n + chunks[end].numel <= pass_elements_) n += chunks[end++].numel;
    pending.emplace_back();
    RETURN_IF_ERROR(EncodePass(chunks.subspan(begin, end - begin),
                               grads.subspan(begin, end - begin), codec, ef, out + begin,
                               &pending.back()));
    begin = end;
  }
  if (ef == nullptr) return absl::OkStatus();
  // Every pass succeeded: the new state replaces the old (views of each pass's tensors).
  for (const Pending& p : pending) {
    const std::vector<torch::Tensor> residuals = p.residual.split_with_sizes(p.sizes);
    std::vector<torch::Tensor> momenta;
    if (p.momentum.defined()) momenta = p.momentum.split_with_sizes(p.sizes);
    for (size_t s = 0; s < p.chunks.size(); ++s) {
      Feedback& f = state_[p.chunks[s].slot];
      f.residual = residuals[s];
      if (p.momentum.defined()) f.momentum = momenta[s];
    }
  }
  return absl::OkStatus();
}

const TorchDeviceGradients::Plan& TorchDeviceGradients::PlanFor(const std::vector<int64_t>& sizes,
                                                                const std::vector<int64_t>& ks,
                                                                const torch::Device& device) {
  std::vector<int64_t> key = sizes;
  key.insert(key.end(), ks.begin(), ks.end());
  auto [it, fresh] = plans_.try_emplace(std::move(key));
  Plan& plan = it->second;
  if (!fresh && plan.sizes.device() == device) return plan;
  std::vector<int64_t> starts, shifts;
  int64_t start = 0, sent = 0;
  for (size_t s = 0; s < sizes.size(); ++s) {
    starts.push_back(start);
    shifts.push_back(start - sent);
    start += sizes[s];
    sent += ks[s];
  }
  const auto on = torch::TensorOptions().dtype(torch::kLong);
  plan.sizes = torch::tensor(sizes, on).to(device);
  plan.ks = torch::tensor(ks, on).to(device);
  plan.starts = torch::tensor(starts, on).to(device);
  plan.shifts = torch::tensor(shifts, on).to(device);
  return plan;
}

torch::Tensor TorchDeviceGradients::SelectTopK(const torch::Tensor& acc, const Plan& plan,
                                               int64_t total_k) {
  const int64_t chunks = plan.sizes.numel();
  // Every output size is known here, so nothing waits for the device.
  const torch::Tensor segment = torch::repeat_interleave(
      torch::arange(chunks, acc.options().dtype(torch::kInt)), plan.sizes, 0, acc.numel());
  const torch::Tensor by_magnitude =
      std::get<1>(acc.abs().sort(/*stable=*/true, /*dim=*/0, /*descending=*/true));
  const torch::Tensor grouped = by_magnitude.index_select(
      0, std::get<1>(segment.index_select(0, by_magnitude).sort(true, 0, false)));
  // Chunk s's first ks[s] elements in the grouped order are its top-k.
  const torch::Tensor positions = torch::repeat_interleave(plan.shifts, plan.ks, 0, total_k) +
                                  torch::arange(total_k, acc.options().dtype(torch::kLong));
  return std::get<0>(grouped.index_select(0, positions).sort());
}

absl::Status TorchDeviceGradients::NotFinite(absl::Span<const DeviceChunk> chunks,
                                             absl::Span<const torch::Tensor> grads) {
  for (size_t s = 0; s < chunks.size(); ++s) {
    const torch::Tensor bad = torch::logical_not(torch::isfinite(grads[s])).nonzero();
    if (bad.numel() == 0) continue;
    return absl::InvalidArgumentError(
        absl::StrCat("gradient of ", (*names_)[chunks[s].param], " element ",
                     chunks[s].offset + bad[0][0].item<int64_t>(), " is not finite"));
  }
  return absl::InvalidArgumentError(
      "the error-feedback sum of a finite gradient and its residual is not finite");
}

absl::Status TorchDeviceGradients::EncodePass(absl::Span<const DeviceChunk> chunks,
                                              absl::Span<const torch::Tensor> grads,
                                              const DeviceCodec& codec,
                                              const ErrorFeedbackOptions* ef, std::string* out,
                                              Pending* pending) {
  const torch::Tensor grad = Flat(grads);
  // acc = grad + residual, or with momentum correction residual + (m * u + grad)
  // (compression/error_feedback.h, in the same float32 operations).
  torch::Tensor acc = grad, next_momentum;
  const bool momentum = ef != nullptr && ef->momentum > 0.0f;
  if (ef != nullptr) {
    std::vector<torch::Tensor> residuals, momenta;
    for (const DeviceChunk& c : chunks) {
      auto it = state_.find(c.slot);
      const bool fresh = it == state_.end();
      residuals.push_back(fresh ? torch::zeros({c.numel}, grad.options()) : it->second.residual);
      if (momentum) {
        momenta.push_back(fresh ? torch::zeros({c.numel}, grad.options()) : it->second.momentum);
      }
    }
    if (momentum) {
      next_momentum = Flat(momenta) * ef->momentum;
      next_momentum.add_(grad);
      acc = Flat(residuals) + next_momentum;
    } else {
      acc = grad + Flat(residuals);
    }
  }
  std::vector<int64_t> sizes, ks;
  int64_t total_k = 0;
  bool sparse = false;  // Some chunk sends fewer than all of its elements.
  for (const DeviceChunk& c : chunks) {
    sizes.push_back(c.numel);
    ks.push_back(codec.codec == CodecId::kTopK ? SparseCount(c.numel, codec.density) : c.numel);
    total_k += ks.back();
    sparse = sparse || ks.back() < c.numel;
  }
  torch::Tensor selected, local;  // Sent flat indices (ascending), and within their chunk.
  torch::Tensor sent = acc;
  if (sparse) {
    const Plan& plan = PlanFor(sizes, ks, acc.device());
    selected = SelectTopK(acc, plan, total_k);
    local = (selected - torch::repeat_interleave(plan.starts, plan.ks, 0, total_k)).to(torch::kInt);
    sent = acc.index_select(0, selected);
  }
  const torch::Tensor wire = WireValues(sent, codec.values);
  // One copy to the host: whether acc is finite (int32), the indices (int32), the values.
  std::vector<torch::Tensor> parts = {
      AsBytes(torch::isfinite(acc).all().to(torch::kInt).reshape({1}))};
  if (sparse) parts.push_back(AsBytes(local));
  parts.push_back(AsBytes(wire));
  const torch::Tensor host = ToHost(torch::cat(parts));
  const char* bytes = reinterpret_cast<const char*>(host.data_ptr<uint8_t>());
  int32_t finite = 0;
  std::memcpy(&finite, bytes, sizeof(finite));
  // Nothing is committed before every payload exists: a non-finite acc changes no state.
  if (finite == 0) return NotFinite(chunks, grads);
  const uint32_t* indices = reinterpret_cast<const uint32_t*>(bytes + sizeof(int32_t));
  const char* values = bytes + sizeof(int32_t) + (sparse ? total_k * sizeof(uint32_t) : 0);
  const size_t value_bytes = ValueBytes(codec.values);
  for (size_t s = 0; s < chunks.size(); ++s) {
    WritePayload(codec, static_cast<uint64_t>(sizes[s]), static_cast<uint64_t>(ks[s]), indices,
                 values, value_bytes, &out[s]);
    if (sparse) indices += ks[s];
    values += ks[s] * value_bytes;
  }
  if (ef == nullptr) return absl::OkStatus();

  // residual = acc - decoded (only the sent elements change); momentum masked where a
  // non-zero value was sent.
  const torch::Tensor decoded = codec.values == ValueType::kFloat32 ? sent : wire.to(torch::kFloat);
  torch::Tensor residual;
  if (sparse) {
    residual = acc;  // A fresh tensor (the sum above).
    residual.index_copy_(0, selected, sent - decoded);
  } else {
    residual = acc - decoded;
  }
  if (momentum && ef->momentum_masking) {
    if (sparse) {
      const torch::Tensor kept = next_momentum.index_select(0, selected);
      next_momentum.index_copy_(0, selected,
                                torch::where(decoded != 0, torch::zeros_like(kept), kept));
    } else {
      next_momentum = torch::where(decoded != 0, torch::zeros_like(next_momentum), next_momentum);
    }
  }
  pending->chunks = chunks;
  pending->sizes = std::move(sizes);
  pending->residual = residual;
  if (momentum) pending->momentum = next_momentum;
  return absl::OkStatus();
}

}  // namespace gradmesh
