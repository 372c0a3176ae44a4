#include "compression/changes.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace gradmesh {
namespace {

constexpr int kMaxVarintBytes = 10;

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Reads a varint at *pos as protobuf's CodedInputStream::ReadVarint64 does: at most 10
// bytes, bits beyond 64 dropped. False if truncated or longer than 10 bytes.
bool ReadVarint(absl::string_view in, size_t* pos, uint64_t* value) {
  uint64_t result = 0;
  for (int count = 0; count < kMaxVarintBytes; ++count) {
    if (*pos >= in.size()) return false;
    const uint8_t b = static_cast<uint8_t>(in[(*pos)++]);
    result |= static_cast<uint64_t>(b & 0x7F) << (7 * count);
    if ((b & 0x80) == 0) {
      *value = result;
      return true;
    }
  }
  return false;
}

}  // namespace

bool EncodeChanges(absl::Span<const float> now, absl::Span<float> held, int64_t max_bytes,
                   std::string* out) {
  const int64_t n = static_cast<int64_t>(now.size());
  if (held.size() != now.size()) return false;
  std::vector<int64_t> changed;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t a, b;
    std::memcpy(&a, now.data() + i, sizeof(a));
    std::memcpy(&b, held.data() + i, sizeof(b));
    if (a != b) {
      // Receivers refuse non-finite changes: let such a chunk go dense.
      if (!std::isfinite(now[i])) return false;
      changed.push_back(i);
    }
  }
  std::string payload;
  PutVarint(changed.size(), &payload);
  int64_t prev = -1;
  for (int64_t i : changed) {
    PutVarint(static_cast<uint64_t>(i - prev - 1), &payload);
    prev = i;
    if (static_cast<int64_t>(payload.size() + 4 * changed.size()) >= max_bytes) return false;
  }
  const size_t values_at = payload.size();
  payload.resize(values_at + 4 * changed.size());
  for (size_t k = 0; k < changed.size(); ++k) {
    std::memcpy(&payload[values_at + 4 * k], now.data() + changed[k], sizeof(float));
  }
  if (static_cast<int64_t>(payload.size()) >= max_bytes) return false;
  for (int64_t i : changed) held[i] = now[i];
  *out = std::move(payload);
  return true;
}

absl::Status DecodeChanges(absl::string_view payload, absl::Span<float> values) {
  size_t pos = 0;
  uint64_t count;
  if (!ReadVarint(payload, &pos, &count) || count > values.size()) {
    return absl::DataLossError("changes payload: bad entry count");
  }
  std::vector<uint64_t> indices(count);
  int64_t prev = -1;
  for (uint64_t k = 0; k < count; ++k) {
    uint64_t gap;
    if (!ReadVarint(payload, &pos, &gap) || gap >= values.size()) {
      return absl::DataLossError("changes payload: truncated or bad index");
    }
    const uint64_t idx = static_cast<uint64_t>(prev + 1) + gap;
    if (idx >= values.size()) {
      return absl::DataLossError(
          absl::StrCat("changes payload: index ", idx, " out of range [0, ", values.size(), ")"));
    }
    indices[k] = idx;
    prev = static_cast<int64_t>(idx);
  }
  const int rest = static_cast<int>(payload.size()) - static_cast<int>(pos);
  if (static_cast<uint64_t>(rest) != 4 * count) {
    return absl::DataLossError(
        absl::StrCat("changes payload: ", rest, " value bytes for ", count, " entries"));
  }
  const char* v = payload.data() + pos;
  for (uint64_t k = 0; k < count; ++k) {
    float f;
    std::memcpy(&f, v + 4 * k, sizeof(f));
    if (!std::isfinite(f)) return absl::DataLossError("changes payload: non-finite value");
  }
  for (uint64_t k = 0; k < count; ++k) std::memcpy(&values[indices[k]], v + 4 * k, sizeof(float));
  return absl::OkStatus();
}

}  // namespace gradmesh
