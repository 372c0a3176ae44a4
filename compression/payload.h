// The byte layout of encoded tensors (the payloads of compression/compressor.h), and the
// index encodings of the sparse codecs. Codecs use it; it is public so that tests and tools
// can build and inspect payloads.
//
// All integers are little-endian; values are little-endian IEEE float32 / fp16 / bf16.
//
//   Common header (16 bytes):
//     [0]     u8  format version (kPayloadVersion = 1)
//     [1]     u8  codec (CodecId)
//     [2]     u8  value type (ValueType) of the values section; kQsgdCodes for QSGD
//     [3]     u8  aux: IndexEncoding for sparse codecs, bits for QSGD, 0 otherwise
//     [4, 8)  u32 reserved, 0
//     [8, 16) u64 n, number of elements of the (decoded) tensor
//   Dense (identity, fp16, bf16):
//     [16, ...)   n values
//   Sparse (topk, topk_approx, randomk, each possibly +fp16/+bf16):
//     [16, 24)    u64 k, number of elements sent (k <= n)
//     [24, 32)    u64 index_bytes
//     [32, 32 + index_bytes)  the k indices, strictly ascending, in the IndexEncoding:
//        kAll:         nothing (index_bytes = 0, k = n: every element is sent)
//        kDeltaVarint: k LEB128 varints; the first is the first index, each next one is
//                      the gap to the previous index minus 1 (so duplicates and descending
//                      indices cannot be expressed); canonical (no 0x80 0x00 padding), at most
//                      5 bytes, and every index < n
//        kBitmap:      ceil(n / 8) bytes, bit i (byte i / 8, bit i % 8) set iff i is sent;
//                      bits >= n are 0; exactly k bits set
//     then k values
//   QSGD:
//     [16, 20)    f32 norm (finite, >= 0)
//     [20, 24)    u32 reserved, 0
//     [24, ...)   ceil(n * (bits + 1) / 8) bytes: n codes of (bits + 1) bits, code i at bit
//                 offset i * (bits + 1) of the little-endian bit stream; code = level |
//                 (negative << bits), level in [0, 2^bits - 1]; unused final bits are 0
// A payload is exactly as long as its header says: truncation and trailing bytes are errors.
//
// Thread safety: pure functions.
#ifndef GRADMESH_COMPRESSION_PAYLOAD_H_
#define GRADMESH_COMPRESSION_PAYLOAD_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace gradmesh {

inline constexpr uint8_t kPayloadVersion = 1;
inline constexpr size_t kHeaderBytes = 16;
inline constexpr size_t kSparseHeaderBytes = 32;
inline constexpr size_t kQsgdHeaderBytes = 24;

enum class CodecId : uint8_t {
  kIdentity = 1,
  kFp16 = 2,
  kBf16 = 3,
  kTopK = 4,
  kTopKApprox = 5,
  kRandomK = 6,
  kQsgd = 7,
};

enum class ValueType : uint8_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kQsgdCodes = 3,
};

enum class IndexEncoding : uint8_t {
  kAll = 0,
  kDeltaVarint = 1,
  kBitmap = 2,
};

// "identity", "fp16", ... ("codec 200" for unknown values), for messages.
std::string CodecIdName(uint8_t codec);
std::string ValueTypeName(uint8_t type);

// Bytes per value of a float value type (4 or 2).
size_t ValueBytes(ValueType type);

struct PayloadHeader {
  uint8_t version = kPayloadVersion;
  CodecId codec = CodecId::kIdentity;
  ValueType value_type = ValueType::kFloat32;
  uint8_t aux = 0;
  uint64_t n = 0;
};

// Writes the 16-byte common header at dst.
void WritePayloadHeader(const PayloadHeader& header, char* dst);

// Parses the common header: InvalidArgument when the payload is shorter than 16 bytes, the
// version is not kPayloadVersion or the reserved bytes are not 0.
absl::StatusOr<PayloadHeader> ReadPayloadHeader(absl::string_view payload);

// Little-endian fixed-width helpers (dst/src need 8 or 4 bytes).
void PutU64(uint64_t v, char* dst);
uint64_t GetU64(const char* src);
void PutU32(uint32_t v, char* dst);
uint32_t GetU32(const char* src);

// Exact encoded sizes of the ascending, duplicate-free `indices` of an n-element tensor.
size_t DeltaVarintBytes(absl::Span<const uint32_t> indices);
inline size_t BitmapBytes(uint64_t n) { return static_cast<size_t>((n + 7) / 8); }

// The smallest encoding: kAll when every element is sent (k == n), else whichever of
// kDeltaVarint and kBitmap is smaller (kDeltaVarint on a tie). Sets *bytes to its size.
IndexEncoding ChooseIndexEncoding(uint64_t n, absl::Span<const uint32_t> indices, size_t* bytes);

// Writes `indices` (ascending, < n) in `encoding` at dst, which has exactly the size that
// ChooseIndexEncoding / DeltaVarintBytes / BitmapBytes gave.
void WriteIndices(IndexEncoding encoding, uint64_t n, absl::Span<const uint32_t> indices,
                  char* dst);

// Parses and validates an index section (all of `src`) holding k indices of an n-element
// tensor: InvalidArgument (naming the problem and the position) unless it is exactly as
// described above. Replaces *indices.
absl::Status ReadIndices(uint8_t encoding, uint64_t n, uint64_t k, absl::string_view src,
                         std::vector<uint32_t>* indices);

}  // namespace gradmesh

#endif  // GRADMESH_COMPRESSION_PAYLOAD_H_
