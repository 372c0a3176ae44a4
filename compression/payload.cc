#include "compression/payload.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace gradmesh {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "payloads are little-endian and written with memcpy");

std::string CodecIdName(uint8_t codec) {
  switch (static_cast<CodecId>(codec)) {
    case CodecId::kIdentity:
      return "identity";
    case CodecId::kFp16:
      return "fp16";
    case CodecId::kBf16:
      return "bf16";
    case CodecId::kTopK:
      return "topk";
    case CodecId::kTopKApprox:
      return "topk_approx";
    case CodecId::kRandomK:
      return "randomk";
    case CodecId::kQsgd:
      return "qsgd";
  }
  return absl::StrCat("codec ", static_cast<int>(codec));
}

std::string ValueTypeName(uint8_t type) {
  switch (static_cast<ValueType>(type)) {
    case ValueType::kFloat32:
      return "float32";
    case ValueType::kFloat16:
      return "fp16";
    case ValueType::kBFloat16:
      return "bf16";
    case ValueType::kQsgdCodes:
      return "qsgd codes";
  }
  return absl::StrCat("value type ", static_cast<int>(type));
}

size_t ValueBytes(ValueType type) { return type == ValueType::kFloat32 ? 4 : 2; }

void PutU64(uint64_t v, char* dst) { std::memcpy(dst, &v, 8); }
uint64_t GetU64(const char* src) {
  uint64_t v;
  std::memcpy(&v, src, 8);
  return v;
}
void PutU32(uint32_t v, char* dst) { std::memcpy(dst, &v, 4); }
uint32_t GetU32(const char* src) {
  uint32_t v;
  std::memcpy(&v, src, 4);
  return v;
}

void WritePayloadHeader(const PayloadHeader& header, char* dst) {
  dst[0] = static_cast<char>(header.version);
  dst[1] = static_cast<char>(header.codec);
  dst[2] = static_cast<char>(header.value_type);
  dst[3] = static_cast<char>(header.aux);
  PutU32(0, dst + 4);
  PutU64(header.n, dst + 8);
}

absl::StatusOr<PayloadHeader> ReadPayloadHeader(absl::string_view payload) {
  if (payload.size() < kHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("payload of ", payload.size(),
                                                   " bytes is shorter than its ", kHeaderBytes,
                                                   "-byte header"));
  }
  PayloadHeader h;
  h.version = static_cast<uint8_t>(payload[0]);
  if (h.version != kPayloadVersion) {
    return absl::InvalidArgumentError(absl::StrCat("payload format version ",
                                                   static_cast<int>(h.version),
                                                   " (supported: ", kPayloadVersion, ")"));
  }
  h.codec = static_cast<CodecId>(static_cast<uint8_t>(payload[1]));
  h.value_type = static_cast<ValueType>(static_cast<uint8_t>(payload[2]));
  h.aux = static_cast<uint8_t>(payload[3]);
  if (GetU32(payload.data() + 4) != 0) {
    return absl::InvalidArgumentError("payload header: reserved bytes 4-7 are not 0");
  }
  h.n = GetU64(payload.data() + 8);
  return h;
}

namespace {

inline size_t VarintBytes(uint32_t v) {
  return 1 + (v >= (1u << 7)) + (v >= (1u << 14)) + (v >= (1u << 21)) + (v >= (1u << 28));
}

}  // namespace

size_t DeltaVarintBytes(absl::Span<const uint32_t> indices) {
  size_t bytes = 0;
  uint32_t next = 0;  // the smallest index the next one can be
  for (uint32_t i : indices) {
    bytes += VarintBytes(i - next);
    next = i + 1;
  }
  return bytes;
}

IndexEncoding ChooseIndexEncoding(uint64_t n, absl::Span<const uint32_t> indices, size_t* bytes) {
  if (indices.size() == n) {
    *bytes = 0;
    return IndexEncoding::kAll;
  }
  const size_t bitmap = BitmapBytes(n);
  // Every varint takes at least one byte: skip the count when that alone loses.
  if (indices.size() <= bitmap) {
    const size_t varint = DeltaVarintBytes(indices);
    if (varint <= bitmap) {
      *bytes = varint;
      return IndexEncoding::kDeltaVarint;
    }
  }
  *bytes = bitmap;
  return IndexEncoding::kBitmap;
}

void WriteIndices(IndexEncoding encoding, uint64_t n, absl::Span<const uint32_t> indices,
                  char* dst) {
  switch (encoding) {
    case IndexEncoding::kAll:
      return;
    case IndexEncoding::kDeltaVarint: {
      uint8_t* p = reinterpret_cast<uint8_t*>(dst);
      uint32_t next = 0;
      for (uint32_t i : indices) {
        uint32_t v = i - next;
        next = i + 1;
        while (v >= 0x80) {
          *p++ = static_cast<uint8_t>(v | 0x80);
          v >>= 7;
        }
        *p++ = static_cast<uint8_t>(v);
      }
      return;
    }
    case IndexEncoding::kBitmap: {
      uint8_t* p = reinterpret_cast<uint8_t*>(dst);
      std::memset(p, 0, BitmapBytes(n));
      for (uint32_t i : indices) p[i >> 3] |= static_cast<uint8_t>(1u << (i & 7));
      return;
    }
  }
}

absl::Status ReadIndices(uint8_t encoding, uint64_t n, uint64_t k, absl::string_view src,
                         std::vector<uint32_t>* indices) {
  indices->clear();
  if (k > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse payload sends k=", k, " of n=", n, " elements"));
  }
  if (n > 0xffffffffu) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse payload with n=", n, " elements (at most 4294967295 are supported)"));
  }
  switch (static_cast<IndexEncoding>(encoding)) {
    case IndexEncoding::kAll: {
      if (k != n || !src.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("index encoding 'all' needs k == n and no index bytes (k=", k, ", n=", n,
                         ", index bytes=", src.size(), ")"));
      }
      indices->resize(n);
      for (uint64_t i = 0; i < n; ++i) (*indices)[i] = static_cast<uint32_t>(i);
      return absl::OkStatus();
    }
    case IndexEncoding::kDeltaVarint: {
      if (k > src.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "delta-varint indices: ", k, " indices cannot fit in ", src.size(), " bytes"));
      }
      indices->resize(k);
      const uint8_t* p = reinterpret_cast<const uint8_t*>(src.data());
      const uint8_t* end = p + src.size();
      uint64_t next = 0;
      for (uint64_t j = 0; j < k; ++j) {
        const uint8_t* start = p;
        uint64_t v = 0;
        int shift = 0;
        while (true) {
          if (p == end) {
            return absl::InvalidArgumentError(
                absl::StrCat("delta-varint indices: truncated at index ", j, " of ", k));
          }
          const uint8_t byte = *p++;
          v |= static_cast<uint64_t>(byte & 0x7f) << shift;
          if ((byte & 0x80) == 0) {
            if (byte == 0 && p - start > 1) {
              return absl::InvalidArgumentError(
                  absl::StrCat("delta-varint indices: non-canonical varint at index ", j));
            }
            break;
          }
          shift += 7;
          if (shift > 28) {
            return absl::InvalidArgumentError(
                absl::StrCat("delta-varint indices: varint longer than 5 bytes at index ", j));
          }
        }
        const uint64_t index = next + v;
        if (index >= n) {
          return absl::InvalidArgumentError(absl::StrCat(
              "delta-varint indices: index ", index, " (entry ", j, ") out of range [0, ", n, ")"));
        }
        (*indices)[j] = static_cast<uint32_t>(index);
        next = index + 1;
      }
      if (p != end) {
        return absl::InvalidArgumentError(
            absl::StrCat("delta-varint indices: ", end - p, " bytes left after ", k, " indices"));
      }
      return absl::OkStatus();
    }
    case IndexEncoding::kBitmap: {
      if (src.size() != BitmapBytes(n)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "bitmap indices: ", src.size(), " bytes, expected ", BitmapBytes(n), " for n=", n));
      }
      const uint8_t* p = reinterpret_cast<const uint8_t*>(src.data());
      if ((n & 7) != 0 && (p[n >> 3] >> (n & 7)) != 0) {
        return absl::InvalidArgumentError(absl::StrCat("bitmap indices: bits set beyond n=", n));
      }
      const size_t bytes = src.size();
      const size_t words = bytes / 8;
      uint64_t count = 0;
      for (size_t w = 0; w < words; ++w) {
        uint64_t word;
        std::memcpy(&word, p + 8 * w, 8);
        count += static_cast<uint64_t>(__builtin_popcountll(word));
      }
      for (size_t b = 8 * words; b < bytes; ++b) count += __builtin_popcount(p[b]);
      if (count != k) {
        return absl::InvalidArgumentError(
            absl::StrCat("bitmap indices: ", count, " bits set, header says k=", k));
      }
      indices->resize(k);
      uint32_t* out = indices->data();
      size_t c = 0;
      for (size_t w = 0; w < words; ++w) {
        uint64_t word;
        std::memcpy(&word, p + 8 * w, 8);
        while (word != 0) {
          out[c++] = static_cast<uint32_t>(64 * w + __builtin_ctzll(word));
          word &= word - 1;
        }
      }
      for (size_t b = 8 * words; b < bytes; ++b) {
        uint32_t byte = p[b];
        while (byte != 0) {
          out[c++] = static_cast<uint32_t>(8 * b + __builtin_ctz(byte));
          byte &= byte - 1;
        }
      }
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown index encoding ",
                                                 static_cast<int>(encoding),
                                                 " (known: 0 all, 1 delta-varint, ", "2 bitmap)"));
}

}  // namespace gradmesh
