#include "server/pull_encoder.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "compression/changes.h"

namespace gradmesh {
namespace {

void SetDense(absl::Span<const float> values, std::string* data) {
  data->assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

}  // namespace

PullEncoder::PullEncoder(int32_t num_workers, absl::Span<const int64_t> chunks,
                         MemoryBudget* budget)
    : num_workers_(num_workers), budget_(budget) {
  for (int64_t idx : chunks) sent_.emplace(idx, std::make_unique<Sent>());
}

PullEncoder::~PullEncoder() {
  if (budget_ != nullptr) budget_->Release(reserved_.load());
}

absl::StatusOr<PullFormat> PullEncoder::ParseFormat(const std::string& job,
                                                    const std::string& codec, CodecCache& codecs) {
  PullFormat format;
  format.codec = codec;
  if (codec.empty()) return format;
  if (codec == "changes") {
    format.kind = PullFormat::Kind::kChanges;
    return format;
  }
  // Parameters may be sent narrower or as exact changes, never sparsified or randomised.
  if (codec != "fp16" && codec != "bf16") {
    return absl::InvalidArgumentError(absl::StrCat("Pull: job ", job, " codec \"", codec,
                                                   "\" is not one of \"\", fp16, bf16, changes"));
  }
  format.kind = PullFormat::Kind::kNarrow;
  ASSIGN_OR_RETURN(format.compressor, codecs.Get(codec));
  return format;
}

absl::Status PullEncoder::Encode(const PullFormat& format, int64_t chunk, int32_t worker,
                                 int64_t held_version, absl::Span<const float> values,
                                 int64_t version, ChunkData* out) {
  switch (format.kind) {
    case PullFormat::Kind::kChanges:
      EncodeChanges(sent_.at(chunk).get(), worker, held_version, values, version, out);
      return absl::OkStatus();
    case PullFormat::Kind::kNarrow:
      out->set_codec(format.codec);
      return format.compressor->Encode(values, /*seed=*/0, out->mutable_data());
    case PullFormat::Kind::kDense:
      break;
  }
  SetDense(values, out->mutable_data());
  return absl::OkStatus();
}

void PullEncoder::EncodeChanges(Sent* sent, int32_t worker, int64_t held_version,
                                absl::Span<const float> values, int64_t version, ChunkData* out) {
  absl::MutexLock lock(&sent->mu);
  if (sent->values.empty()) {
    sent->values.resize(num_workers_);
    sent->version.assign(num_workers_, -1);
  }
  // Only what changed since the values this worker holds, if we know what it holds; else (or
  // when that is not smaller) the chunk dense, which it then holds.
  std::vector<float>& held = sent->values[worker];
  const int64_t dense = static_cast<int64_t>(values.size() * sizeof(float));
  const bool known =
      held_version >= 0 && held_version == sent->version[worker] && held.size() == values.size();
  if (known && gradmesh::EncodeChanges(values, absl::MakeSpan(held), dense, out->mutable_data())) {
    out->set_codec("changes");
  } else {
    SetDense(values, out->mutable_data());
    if (held.empty() && budget_ != nullptr) {
      if (!budget_->TryReserve(dense)) {
        sent->version[worker] = -1;  // Not remembered: the next pull is dense again.
        return;
      }
      reserved_ += dense;
    }
    held.assign(values.begin(), values.end());
  }
  sent->version[worker] = version;
}

}  // namespace gradmesh
