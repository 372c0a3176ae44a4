// Checkpoint files shared by every training mode: one self-describing, checksummed format
// and one crash-safe writer with a kept previous copy.
//
// A checkpoint has a kind (free text chosen by the caller: "gossip", "allreduce",
// "ps-export", ...), key/value metadata (int64, double or string values: step, rank,
// num_workers, weight, ...) and named arrays, each with a dtype and an element count.
//
// File layout (format version 1; every integer little-endian, no padding):
//
//   offset  size  field
//   0       8     magic "GMCKPTF\n"
//   8       4     u32 format version (1)
//   12      4     u32 H: bytes of the header section that follows (its CRC included)
//   16      H     header section:
//                   u32 n + n bytes     kind
//                   u32 m               metadata entries, sorted by key, each:
//                     u32 n + n bytes     key
//                     u8 type             1 int64 | 2 float64 | 3 string
//                     value               i64 | f64 (IEEE-754) | u32 n + n bytes
//                   u32 a               arrays, in payload order, each:
//                     u32 n + n bytes     name
//                     u8 dtype            see DType
//                     u64 count           elements
//                   u32 header CRC      CRC-32 of bytes [0, 16 + H - 4)
//   16+H    P     payload: every array's count * DTypeSize(dtype) bytes, in header order
//   16+H+P  4     u32 file CRC: CRC-32 of bytes [0, 16 + H + P), header and payload
//
// Checksum: zlib's CRC-32 (polynomial 0xEDB88320, as in gzip/PNG), computed with crc32_z over
// size_t lengths, so arrays past 4 GiB are summed whole (see Crc32). The header CRC lets
// ReadCheckpointHeader validate metadata without reading the payload; the total size follows
// from the header, so truncation is reported as such before any checksum.
//
// Writing (WriteCheckpointFile): arrays are streamed from the caller's memory (no copy of the
// payload) into a temporary file "<path>.tmp.XXXXXX" in the same directory, which is
// fsynced; the current <path>, if it is a valid checkpoint, is renamed to <path>.prev; the
// temporary file is renamed to <path>; the directory is fsynced. A crash at any point leaves
// <path> or <path>.prev (or both) complete. A crash may leave a "<path>.tmp.*" file behind;
// it is never read.
//
// Reading (ReadCheckpointFile, ReadCheckpointHeader) falls back to <path>.prev when <path> is
// missing, truncated or fails a checksum, and reports that in CheckpointSource. Files of an
// older, mode-specific format are read through LegacyFormat parsers given by the caller, or
// refused with FAILED_PRECONDITION naming the format.
//
// Errors (every message names the file and what is wrong):
//   NOT_FOUND            neither <path> nor <path>.prev exists;
//   DATA_LOSS            truncated, bad magic, bad checksum, malformed header (naming both
//                        files when the fallback is bad too);
//   FAILED_PRECONDITION  a valid checkpoint of another kind, a legacy format the caller does
//                        not read, or a newer format version;
//   INVALID_ARGUMENT     a bad write request (empty or duplicate names, negative counts);
//   INTERNAL             I/O errors (with errno's text).
//
// Thread safety: the free functions are thread-safe for distinct paths; concurrent writers of
// one path are not supported (concurrent readers are; they see the old or the new file).
// Metadata and Checkpoint are plain values (not synchronised).
// The host must be little-endian (checked at compile time).
#ifndef GRADMESH_COMMON_CHECKPOINT_H_
#define GRADMESH_COMMON_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace gradmesh {
namespace ckpt {

inline constexpr uint32_t kFormatVersion = 1;

// Element types of arrays (the value is the byte stored in the file).
enum class DType : uint8_t {
  kFloat32 = 1,
  kFloat64 = 2,
  kInt64 = 3,
  kUint8 = 4,
  kInt32 = 5,
};

// Bytes per element; 0 for a value that is no DType.
size_t DTypeSize(DType dtype);
// "float32", "float64", "int64", "uint8", "int32", or "dtype(<n>)".
std::string DTypeName(DType dtype);

template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> : std::integral_constant<DType, DType::kFloat32> {};
template <>
struct DTypeOf<double> : std::integral_constant<DType, DType::kFloat64> {};
template <>
struct DTypeOf<int64_t> : std::integral_constant<DType, DType::kInt64> {};
template <>
struct DTypeOf<uint8_t> : std::integral_constant<DType, DType::kUint8> {};
template <>
struct DTypeOf<int32_t> : std::integral_constant<DType, DType::kInt32> {};

// Incremental CRC-32 (zlib's). Update takes size_t lengths and hands them to crc32_z whole,
// so any split of the same bytes gives the same value, at any size.
class Crc32 {
 public:
  void Update(const void* data, size_t size);
  uint32_t value() const { return static_cast<uint32_t>(crc_); }

 private:
  unsigned long crc_ = 0;  // zlib's uLong; crc32(0, NULL, 0) == 0.
};

using MetaValue = std::variant<int64_t, double, std::string>;

// Key/value metadata. Keys are unique, non-empty; a Set replaces an earlier value.
class Metadata {
 public:
  void SetInt(const std::string& key, int64_t value) { entries_[key] = value; }
  void SetDouble(const std::string& key, double value) { entries_[key] = value; }
  void SetString(const std::string& key, std::string value) { entries_[key] = std::move(value); }

  bool Has(absl::string_view key) const { return entries_.find(key) != entries_.end(); }
  // INVALID_ARGUMENT naming the key when it is missing or holds another type.
  absl::StatusOr<int64_t> GetInt(absl::string_view key) const;
  absl::StatusOr<double> GetDouble(absl::string_view key) const;
  absl::StatusOr<std::string> GetString(absl::string_view key) const;

  const std::map<std::string, MetaValue, std::less<>>& entries() const { return entries_; }
  bool operator==(const Metadata& o) const { return entries_ == o.entries_; }

 private:
  std::map<std::string, MetaValue, std::less<>> entries_;
};

// One array to write: a view of the caller's memory (not owned; must outlive the write).
struct ArrayRef {
  std::string name;
  DType dtype = DType::kFloat32;
  const void* data = nullptr;
  int64_t count = 0;  // Elements.

  template <typename T>
  static ArrayRef Of(std::string name, absl::Span<const T> values) {
    return ArrayRef{std::move(name), DTypeOf<T>::value, values.data(),
                    static_cast<int64_t>(values.size())};
  }
};

// An array's description in the header.
struct ArrayInfo {
  std::string name;
  DType dtype = DType::kFloat32;
  int64_t count = 0;
};

// An array's values, as a vector of its dtype's C++ type.
using ArrayData = std::variant<std::vector<float>, std::vector<double>, std::vector<int64_t>,
                               std::vector<uint8_t>, std::vector<int32_t>>;

// Where a read came from.
struct CheckpointSource {
  std::string path;        // The file actually read: <path> or <path>.prev.
  bool from_prev = false;  // True when <path> was unusable and <path>.prev was read.
  std::string main_error;  // Why <path> was not used (empty when it was).
  std::string format;      // "gmckpt/1", or the LegacyFormat's name.
};

// Everything but the array values.
struct CheckpointHeader {
  std::string kind;
  Metadata metadata;
  std::vector<ArrayInfo> arrays;
  CheckpointSource source;  // Set by the read functions.

  // Index of the array named `name`, or -1.
  int Find(absl::string_view name) const;
};

struct Checkpoint {
  CheckpointHeader header;
  std::vector<ArrayData> data;  // Parallel to header.arrays.

  // Moves the array named `name` out (leaving it empty). INVALID_ARGUMENT naming the array
  // and the source file when it is missing or of another dtype.
  template <typename T>
  absl::StatusOr<std::vector<T>> Take(absl::string_view name);

  // Appends an array (for LegacyFormat parsers and tests).
  template <typename T>
  void Add(std::string name, std::vector<T> values) {
    header.arrays.push_back(
        ArrayInfo{std::move(name), DTypeOf<T>::value, static_cast<int64_t>(values.size())});
    data.emplace_back(std::move(values));
  }
};

// A file format that predates this one. `magic` is the file's first bytes. `parse` turns the
// whole file's bytes into a Checkpoint (the reader fills in header.source); it returns
// DATA_LOSS naming `path` for a corrupt file (which makes the reader try <path>.prev). A
// LegacyFormat without `parse` is refused with FAILED_PRECONDITION naming `name`.
struct LegacyFormat {
  std::string magic;
  std::string name;  // E.g. "legacy gossip checkpoint (GMGOSCK1)".
  std::function<absl::StatusOr<Checkpoint>(const std::string& path, const std::string& bytes)>
      parse;
};

struct ReadOptions {
  // Required kind; empty accepts any. Another kind is FAILED_PRECONDITION.
  std::string kind;
  // Try <path>.prev when <path> is missing or corrupt (NOT_FOUND, DATA_LOSS).
  bool fallback_to_prev = true;
  // ReadCheckpointHeader only: also stream the payload through the file CRC (constant memory),
  // so a header read succeeds only for a file a full read would accept.
  bool verify_payload = true;
  std::vector<LegacyFormat> legacy;
};

struct WriteOptions {
  // Keep the current <path> as <path>.prev (only when it is a valid checkpoint, verified by
  // streaming it through its checksums; a corrupt one is dropped and the older .prev kept).
  bool keep_prev = true;
  // Formats that count as valid for keep_prev besides this one (parsed whole to verify).
  std::vector<LegacyFormat> legacy;
};

// Writes a checkpoint as described at the top of this file, creating the parent directory.
// INVALID_ARGUMENT for an empty kind or array name, duplicate names, an empty metadata key,
// a negative count or a null pointer with a positive count; INTERNAL (naming the file and
// errno's text) on I/O errors, leaving <path> and <path>.prev as they were.
absl::Status WriteCheckpointFile(const std::string& path, absl::string_view kind,
                                 const Metadata& metadata, absl::Span<const ArrayRef> arrays,
                                 const WriteOptions& options = {});

// Reads and verifies a whole checkpoint (one copy in memory), falling back to <path>.prev.
absl::StatusOr<Checkpoint> ReadCheckpointFile(const std::string& path,
                                              const ReadOptions& options = {});

// Reads only kind, metadata and array descriptions, verified by the header CRC and the file
// size (and the payload CRC when options.verify_payload), falling back like
// ReadCheckpointFile. For a legacy file the whole file is parsed.
absl::StatusOr<CheckpointHeader> ReadCheckpointHeader(const std::string& path,
                                                      const ReadOptions& options = {});

// "<path>.prev"
std::string PrevPath(const std::string& path);

// ---- implementation of templates ----

template <typename T>
absl::StatusOr<std::vector<T>> Checkpoint::Take(absl::string_view name) {
  const int i = header.Find(name);
  if (i < 0 || header.arrays[i].dtype != DTypeOf<T>::value ||
      static_cast<size_t>(i) >= data.size()) {
    return absl::InvalidArgumentError(
        std::string("checkpoint ") + header.source.path + ": no " + DTypeName(DTypeOf<T>::value) +
        " array '" + std::string(name) + "'" +
        (i < 0 ? "" : " (it is " + DTypeName(header.arrays[i].dtype) + ")"));
  }
  std::vector<T> out = std::move(std::get<std::vector<T>>(data[i]));
  std::get<std::vector<T>>(data[i]).clear();
  return out;
}

}  // namespace ckpt
}  // namespace gradmesh

#endif  // GRADMESH_COMMON_CHECKPOINT_H_
