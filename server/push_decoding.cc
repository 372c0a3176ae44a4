#include "server/push_decoding.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/numeric.h"
#include "common/status.h"

namespace gradmesh {

absl::StatusOr<std::shared_ptr<const Compressor>> CodecCache::Get(const std::string& spec) {
  {
    absl::MutexLock lock(&mu_);
    auto it = codecs_.find(spec);
    if (it != codecs_.end()) return it->second;
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Compressor> codec, registry_->Create(spec));
  std::shared_ptr<const Compressor> shared = std::move(codec);
  absl::MutexLock lock(&mu_);
  // Bounded: a client cannot grow the cache without limit with ever new specs.
  if (codecs_.size() < 64) codecs_.emplace(spec, shared);
  return shared;
}

namespace {

// dtype, codec and length of raw float32 data of `bytes` bytes.
absl::Status CheckDenseLayout(const ChunkData& c, int64_t bytes, int64_t numel,
                              const std::string& where) {
  if (c.dtype() != FLOAT32 && c.dtype() != DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": dtype ", DType_Name(c.dtype()), " is not supported; use FLOAT32"));
  }
  if (!c.codec().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": codec \"", c.codec(), "\" is not supported by this shard"));
  }
  const int64_t want = numel * static_cast<int64_t>(sizeof(float));
  if (bytes != want) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected ", numel, " float32 values (",
                                                   want, " bytes), got ", bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status NonFinite(const std::string& where, int64_t index, float value) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": element ", index, " is not finite (",
                                                 value, "); nothing was applied"));
}

}  // namespace

absl::Status CheckDenseFloats(const ChunkData& c, int64_t numel, const std::string& where,
                              bool allow_infinite) {
  RETURN_IF_ERROR(CheckDenseLayout(c, static_cast<int64_t>(c.data().size()), numel, where));
  std::vector<float> aligned;
  const float* x = reinterpret_cast<const float*>(c.data().data());
  if (reinterpret_cast<uintptr_t>(x) % alignof(float) != 0) {
    aligned.resize(numel);
    std::memcpy(aligned.data(), c.data().data(), c.data().size());
    x = aligned.data();
  }
  if (allow_infinite) {
    for (int64_t i = 0; i < numel; ++i) {
      if (std::isnan(x[i])) return NonFinite(where, i, x[i]);
    }
    return absl::OkStatus();
  }
  const int64_t bad = FirstNonFinite(x, numel);
  if (bad >= 0) return NonFinite(where, bad, x[bad]);
  return absl::OkStatus();
}

const float* FloatView(const std::string& data, std::vector<float>* scratch) {
  const float* x = reinterpret_cast<const float*>(data.data());
  if (reinterpret_cast<uintptr_t>(x) % alignof(float) == 0) return x;
  scratch->resize(data.size() / sizeof(float));
  std::memcpy(scratch->data(), data.data(), data.size());
  return scratch->data();
}

absl::StatusOr<const float*> DecodePushedChunk(CodecCache& codecs, const ChunkData& c,
                                               const DenseData* dense, int64_t numel,
                                               const std::string& where,
                                               std::vector<float>* scratch) {
  if (dense != nullptr && dense->present) {
    // Copied and scanned as it was received (rpc/tensor_wire.h DecodePushRequest).
    RETURN_IF_ERROR(CheckDenseLayout(c, dense->bytes, numel, where));
    if (dense->first_nonfinite >= 0) {
      return NonFinite(where, dense->first_nonfinite, dense->data()[dense->first_nonfinite]);
    }
    return dense->data();
  }
  if (c.codec().empty()) {
    RETURN_IF_ERROR(CheckDenseFloats(c, numel, where));
    return FloatView(c.data(), scratch);
  }
  if (c.dtype() != FLOAT32 && c.dtype() != DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": dtype ", DType_Name(c.dtype()), " with codec \"", c.codec(),
                     "\"; the codec's payload describes its own encoding, dtype must be FLOAT32"));
  }
  auto codec = codecs.Get(c.codec());
  if (!codec.ok()) return Annotate(codec.status(), where);
  scratch->assign(numel, 0.0f);
  RETURN_IF_ERROR(Annotate((*codec)->Decode(c.data(), absl::MakeSpan(*scratch)),
                           absl::StrCat(where, ": malformed \"", c.codec(), "\" payload")));
  const int64_t bad = FirstNonFinite(scratch->data(), numel);
  if (bad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": decoded element ", bad, " is not finite; nothing was applied"));
  }
  return static_cast<const float*>(scratch->data());
}

}  // namespace gradmesh
