// Checkpoint files (see checkpoint.h).
#include "common/checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <system_error>

#include "absl/base/config.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#ifndef ABSL_IS_LITTLE_ENDIAN
#error "common/checkpoint.cc writes the host's bytes as little-endian; port it first"
#endif

namespace gradmesh {
namespace ckpt {
namespace {

constexpr char kMagic[8] = {'G', 'M', 'C', 'K', 'P', 'T', 'F', '\n'};
constexpr size_t kPrefixBytes = 16;          // Magic, version, header length.
constexpr size_t kMinHeaderSection = 4 * 4;  // Kind length, two counts, CRC.
constexpr uint32_t kMaxHeaderSection = 1u << 30;
constexpr size_t kStreamBuffer = 1 << 20;  // Payload verification reads.
constexpr char kFormatName[] = "gmckpt/1";

static_assert(sizeof(z_size_t) >= sizeof(size_t), "crc32_z must take size_t lengths");

enum MetaType : uint8_t { kMetaInt64 = 1, kMetaFloat64 = 2, kMetaString = 3 };

std::string Hex32(uint32_t v) { return absl::StrFormat("0x%08x", v); }

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  if (errno == 0) {  // ReadAll hit the end of a file that shrank while being read.
    return absl::DataLossError(absl::StrCat("checkpoint ", path, ": ", what, ": truncated"));
  }
  return absl::InternalError(
      absl::StrCat("checkpoint ", path, ": ", what, ": ", std::strerror(errno)));
}

// An owned file descriptor.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }
  // Closes now; false (errno set) if close failed.
  bool Close() {
    const int fd = fd_;
    fd_ = -1;
    return close(fd) == 0;
  }

 private:
  int fd_;
};

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Reads exactly n bytes; false on error or end of file (errno 0 at end of file).
bool ReadAll(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t r = read(fd, p, n);
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (r == 0) {
      errno = 0;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

void PutString(std::string* out, absl::string_view s) {
  Put<uint32_t>(out, static_cast<uint32_t>(s.size()));
  out->append(s.data(), s.size());
}

// A bounds-checked cursor over the header section.
class Cursor {
 public:
  Cursor(const char* p, size_t n) : p_(p), end_(p + n) {}
  template <typename T>
  bool Get(T* v) {
    if (static_cast<size_t>(end_ - p_) < sizeof(T)) return false;
    std::memcpy(v, p_, sizeof(T));
    p_ += sizeof(T);
    return true;
  }
  bool GetString(std::string* s) {
    uint32_t n;
    if (!Get(&n) || static_cast<size_t>(end_ - p_) < n) return false;
    s->assign(p_, n);
    p_ += n;
    return true;
  }
  bool done() const { return p_ == end_; }

 private:
  const char* p_;
  const char* end_;
};

ArrayData MakeArrayData(DType dtype, size_t count) {
  switch (dtype) {
    case DType::kFloat32:
      return std::vector<float>(count);
    case DType::kFloat64:
      return std::vector<double>(count);
    case DType::kInt64:
      return std::vector<int64_t>(count);
    case DType::kUint8:
      return std::vector<uint8_t>(count);
    case DType::kInt32:
      return std::vector<int32_t>(count);
  }
  return std::vector<uint8_t>();
}

char* ArrayBytes(ArrayData* d) {
  return std::visit([](auto& v) { return reinterpret_cast<char*>(v.data()); }, *d);
}

// Reads one file (no fallback). With header_only the arrays are not loaded (data stays
// empty); they are still streamed through the CRC when options.verify_payload.
absl::StatusOr<Checkpoint> ReadOne(const std::string& path, const ReadOptions& options,
                                   bool header_only) {
  auto loss = [&path](const std::string& what) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, ": ", what));
  };
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("checkpoint ", path, " does not exist"));
    }
    return ErrnoError("cannot open", path);
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return ErrnoError("cannot stat", path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);

  // Enough of the start to recognise this format or a legacy one.
  size_t prefix_len = kPrefixBytes;
  for (const LegacyFormat& l : options.legacy) prefix_len = std::max(prefix_len, l.magic.size());
  std::string prefix(static_cast<size_t>(std::min<uint64_t>(size, prefix_len)), '\0');
  if (!ReadAll(fd.get(), prefix.data(), prefix.size())) return ErrnoError("cannot read", path);

  if (prefix.size() < sizeof(kMagic) || std::memcmp(prefix.data(), kMagic, sizeof(kMagic)) != 0) {
    for (const LegacyFormat& l : options.legacy) {
      if (l.magic.empty() || prefix.compare(0, l.magic.size(), l.magic) != 0) continue;
      if (!l.parse) {
        return absl::FailedPreconditionError(
            absl::StrCat("checkpoint ", path, " is a ", l.name, ", ",
                         options.kind.empty() ? "which is not read here"
                                              : "expected kind '" + options.kind + "'"));
      }
      std::string bytes(static_cast<size_t>(size), '\0');
      if (lseek(fd.get(), 0, SEEK_SET) != 0 || !ReadAll(fd.get(), bytes.data(), bytes.size())) {
        return ErrnoError("cannot read", path);
      }
      absl::StatusOr<Checkpoint> c = l.parse(path, bytes);
      if (!c.ok()) return c.status();
      if (!options.kind.empty() && c->header.kind != options.kind) {
        return absl::FailedPreconditionError(absl::StrCat("checkpoint ", path, " is a ", l.name,
                                                          " of kind '", c->header.kind,
                                                          "', expected '", options.kind, "'"));
      }
      c->header.source.path = path;
      c->header.source.format = l.name;
      if (header_only) c->data.clear();
      return c;
    }
    return loss(absl::StrCat("bad magic or too short (", size, " bytes starting \"",
                             absl::CHexEscape(prefix.substr(0, sizeof(kMagic))),
                             "\"): not a gradmesh checkpoint"));
  }
  if (size < kPrefixBytes) return loss(absl::StrCat("truncated (", size, " bytes)"));
  uint32_t version, section;
  std::memcpy(&version, prefix.data() + 8, 4);
  std::memcpy(&section, prefix.data() + 12, 4);
  if (version != kFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint ", path, " has format version ",
                                                      version, "; this build reads version ",
                                                      kFormatVersion));
  }
  if (section < kMinHeaderSection || section > kMaxHeaderSection) {
    return loss(absl::StrCat("malformed header length ", section));
  }
  if (kPrefixBytes + section > size) {
    return loss(absl::StrCat("truncated: the header needs ", kPrefixBytes + section,
                             " bytes, the file has ", size));
  }
  std::string head(kPrefixBytes + section, '\0');
  std::memcpy(head.data(), prefix.data(), kPrefixBytes);
  if (lseek(fd.get(), kPrefixBytes, SEEK_SET) != static_cast<off_t>(kPrefixBytes) ||
      !ReadAll(fd.get(), head.data() + kPrefixBytes, section)) {
    return ErrnoError("cannot read", path);
  }
  uint32_t stored;
  std::memcpy(&stored, head.data() + head.size() - 4, 4);
  Crc32 crc;
  crc.Update(head.data(), head.size() - 4);
  if (crc.value() != stored) {
    return loss(absl::StrCat("header checksum mismatch (CRC mismatch: stored ", Hex32(stored),
                             ", computed ", Hex32(crc.value()), ")"));
  }
  crc.Update(head.data() + head.size() - 4, 4);  // The file CRC covers the header CRC too.

  Checkpoint c;
  CheckpointHeader& h = c.header;
  h.source.path = path;
  h.source.format = kFormatName;
  Cursor cur(head.data() + kPrefixBytes, section - 4);
  uint32_t n;
  if (!cur.GetString(&h.kind) || !cur.Get(&n)) return loss("malformed header (kind)");
  for (uint32_t i = 0; i < n; ++i) {
    std::string key;
    uint8_t type;
    if (!cur.GetString(&key) || !cur.Get(&type)) return loss("malformed header (metadata)");
    bool ok = false;
    if (type == kMetaInt64) {
      int64_t v = 0;
      ok = cur.Get(&v);
      h.metadata.SetInt(key, v);
    } else if (type == kMetaFloat64) {
      double v = 0;
      ok = cur.Get(&v);
      h.metadata.SetDouble(key, v);
    } else if (type == kMetaString) {
      std::string v;
      ok = cur.GetString(&v);
      h.metadata.SetString(key, std::move(v));
    }
    if (!ok) return loss(absl::StrCat("malformed header (metadata '", key, "')"));
  }
  uint64_t payload = 0;
  if (!cur.Get(&n)) return loss("malformed header (array count)");
  for (uint32_t i = 0; i < n; ++i) {
    ArrayInfo a;
    uint8_t dtype;
    uint64_t count;
    if (!cur.GetString(&a.name) || !cur.Get(&dtype) || !cur.Get(&count)) {
      return loss(absl::StrCat("malformed header (array ", i, ")"));
    }
    a.dtype = static_cast<DType>(dtype);
    const size_t es = DTypeSize(a.dtype);
    if (es == 0) {
      return loss(absl::StrCat("array '", a.name, "' has unknown dtype ", int{dtype}));
    }
    if (count > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / es ||
        payload > std::numeric_limits<uint64_t>::max() / 2 - count * es) {
      return loss(absl::StrCat("array '", a.name, "' has an impossible count ", count));
    }
    a.count = static_cast<int64_t>(count);
    payload += count * es;
    h.arrays.push_back(std::move(a));
  }
  if (!cur.done()) return loss("malformed header (trailing bytes)");
  if (!options.kind.empty() && h.kind != options.kind) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint ", path, " is of kind '", h.kind,
                                                      "', expected '", options.kind, "'"));
  }
  const uint64_t expected = head.size() + payload + 4;
  if (size < expected) {
    return loss(absl::StrCat("truncated: ", size, " bytes, the header describes ", expected));
  }
  if (size > expected) {
    return loss(absl::StrCat(size - expected, " trailing bytes after the checksum (", size,
                             " bytes, the header describes ", expected, ")"));
  }
  if (header_only && !options.verify_payload) return c;

  std::string buffer;
  for (const ArrayInfo& a : h.arrays) {
    const size_t bytes = static_cast<size_t>(a.count) * DTypeSize(a.dtype);
    if (header_only) {
      buffer.resize(std::min(bytes, kStreamBuffer));
      for (size_t left = bytes; left > 0;) {
        const size_t piece = std::min(left, buffer.size());
        if (!ReadAll(fd.get(), buffer.data(), piece)) return ErrnoError("cannot read", path);
        crc.Update(buffer.data(), piece);
        left -= piece;
      }
    } else {
      c.data.push_back(MakeArrayData(a.dtype, static_cast<size_t>(a.count)));
      char* p = ArrayBytes(&c.data.back());
      if (!ReadAll(fd.get(), p, bytes)) return ErrnoError("cannot read", path);
      crc.Update(p, bytes);
    }
  }
  if (!ReadAll(fd.get(), reinterpret_cast<char*>(&stored), 4)) {
    return ErrnoError("cannot read", path);
  }
  if (crc.value() != stored) {
    return loss(absl::StrCat("payload checksum mismatch (CRC mismatch: stored ", Hex32(stored),
                             ", computed ", Hex32(crc.value()), ")"));
  }
  return c;
}

bool Retriable(const absl::Status& s) {
  return s.code() == absl::StatusCode::kNotFound || s.code() == absl::StatusCode::kDataLoss;
}

// ReadOne(path), else ReadOne(path.prev) as the options say.
absl::StatusOr<Checkpoint> ReadWithFallback(const std::string& path, const ReadOptions& options,
                                            bool header_only) {
  absl::StatusOr<Checkpoint> main = ReadOne(path, options, header_only);
  if (main.ok() || !options.fallback_to_prev || !Retriable(main.status())) return main;
  const std::string prev_path = PrevPath(path);
  absl::StatusOr<Checkpoint> prev = ReadOne(prev_path, options, header_only);
  if (prev.ok()) {
    prev->header.source.from_prev = true;
    prev->header.source.main_error = std::string(main.status().message());
    return prev;
  }
  const bool main_missing = main.status().code() == absl::StatusCode::kNotFound;
  const bool prev_missing = prev.status().code() == absl::StatusCode::kNotFound;
  if (main_missing && prev_missing) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint ", path, " does not exist, nor does ", prev_path));
  }
  if (prev_missing) {
    return absl::Status(main.status().code(),
                        absl::StrCat(main.status().message(), "; no previous copy ", prev_path));
  }
  if (main_missing) {
    return absl::Status(prev.status().code(),
                        absl::StrCat(main.status().message(), "; ", prev.status().message()));
  }
  return absl::DataLossError(
      absl::StrCat(main.status().message(), "; and the previous copy: ", prev.status().message()));
}

absl::Status ValidateWrite(const std::string& path, absl::string_view kind,
                           const Metadata& metadata, absl::Span<const ArrayRef> arrays) {
  auto bad = [&path](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, ": ", what));
  };
  if (path.empty()) return absl::InvalidArgumentError("checkpoint: empty path");
  if (kind.empty()) return bad("empty kind");
  for (const auto& [key, value] : metadata.entries()) {
    if (key.empty()) return bad("empty metadata key");
  }
  std::set<absl::string_view> names;
  for (const ArrayRef& a : arrays) {
    if (a.name.empty()) return bad("an array has an empty name");
    if (!names.insert(a.name).second) return bad(absl::StrCat("two arrays named '", a.name, "'"));
    if (DTypeSize(a.dtype) == 0) {
      return bad(
          absl::StrCat("array '", a.name, "' has unknown dtype ", static_cast<int>(a.dtype)));
    }
    if (a.count < 0 || (a.count > 0 && a.data == nullptr)) {
      return bad(absl::StrCat("array '", a.name, "' has count ", a.count,
                              a.data == nullptr ? " and no data" : ""));
    }
  }
  return absl::OkStatus();
}

std::string EncodeHeader(absl::string_view kind, const Metadata& metadata,
                         absl::Span<const ArrayRef> arrays) {
  std::string h(kMagic, sizeof(kMagic));
  Put<uint32_t>(&h, kFormatVersion);
  Put<uint32_t>(&h, 0);  // Section length, set below.
  PutString(&h, kind);
  Put<uint32_t>(&h, static_cast<uint32_t>(metadata.entries().size()));
  for (const auto& [key, value] : metadata.entries()) {
    PutString(&h, key);
    if (const int64_t* i = std::get_if<int64_t>(&value)) {
      Put<uint8_t>(&h, kMetaInt64);
      Put<int64_t>(&h, *i);
    } else if (const double* d = std::get_if<double>(&value)) {
      Put<uint8_t>(&h, kMetaFloat64);
      Put<double>(&h, *d);
    } else {
      Put<uint8_t>(&h, kMetaString);
      PutString(&h, std::get<std::string>(value));
    }
  }
  Put<uint32_t>(&h, static_cast<uint32_t>(arrays.size()));
  for (const ArrayRef& a : arrays) {
    PutString(&h, a.name);
    Put<uint8_t>(&h, static_cast<uint8_t>(a.dtype));
    Put<uint64_t>(&h, static_cast<uint64_t>(a.count));
  }
  const uint32_t section = static_cast<uint32_t>(h.size() + 4 - kPrefixBytes);
  std::memcpy(h.data() + 12, &section, 4);
  Crc32 crc;
  crc.Update(h.data(), h.size());
  Put<uint32_t>(&h, crc.value());
  return h;
}

absl::Status SyncDirectory(const std::string& dir) {
  Fd fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0 || fsync(fd.get()) != 0) return ErrnoError("cannot fsync directory", dir);
  return absl::OkStatus();
}

}  // namespace

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat64:
      return 8;
    case DType::kInt64:
      return 8;
    case DType::kUint8:
      return 1;
    case DType::kInt32:
      return 4;
  }
  return 0;
}

std::string DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kInt64:
      return "int64";
    case DType::kUint8:
      return "uint8";
    case DType::kInt32:
      return "int32";
  }
  return absl::StrCat("dtype(", static_cast<int>(dtype), ")");
}

void Crc32::Update(const void* data, size_t size) {
  if (size == 0) return;  // crc32_z with a null buffer would restart the sum.
  crc_ = crc32_z(crc_, static_cast<const Bytef*>(data), static_cast<z_size_t>(size));
}

namespace {
template <typename T>
absl::StatusOr<T> GetMeta(const std::map<std::string, MetaValue, std::less<>>& entries,
                          absl::string_view key, const char* type) {
  auto it = entries.find(key);
  if (it == entries.end()) {
    return absl::InvalidArgumentError(absl::StrCat("metadata '", key, "' is missing"));
  }
  if (const T* v = std::get_if<T>(&it->second)) return *v;
  return absl::InvalidArgumentError(absl::StrCat("metadata '", key, "' is not ", type));
}
}  // namespace

absl::StatusOr<int64_t> Metadata::GetInt(absl::string_view key) const {
  return GetMeta<int64_t>(entries_, key, "an int64");
}
absl::StatusOr<double> Metadata::GetDouble(absl::string_view key) const {
  return GetMeta<double>(entries_, key, "a double");
}
absl::StatusOr<std::string> Metadata::GetString(absl::string_view key) const {
  return GetMeta<std::string>(entries_, key, "a string");
}

int CheckpointHeader::Find(absl::string_view name) const {
  for (size_t i = 0; i < arrays.size(); ++i) {
    if (arrays[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

std::string PrevPath(const std::string& path) { return path + ".prev"; }

absl::Status WriteCheckpointFile(const std::string& path, absl::string_view kind,
                                 const Metadata& metadata, absl::Span<const ArrayRef> arrays,
                                 const WriteOptions& options) {
  if (absl::Status st = ValidateWrite(path, kind, metadata, arrays); !st.ok()) return st;
  const std::string head = EncodeHeader(kind, metadata, arrays);

  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (parent.empty()) parent = ".";
  std::error_code ec;
  std::filesystem::create_directories(parent, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("checkpoint ", path, ": cannot create its directory: ", ec.message()));
  }
  std::string tmp = path + ".tmp.XXXXXX";
  Fd fd(mkstemp(tmp.data()));
  if (fd.get() < 0) return ErrnoError("cannot create a temporary file", tmp);
  auto fail = [&tmp](const std::string& what) {
    absl::Status st = ErrnoError(what, tmp);
    unlink(tmp.c_str());
    return st;
  };
  if (fchmod(fd.get(), 0644) != 0) return fail("cannot chmod");

  Crc32 crc;
  crc.Update(head.data(), head.size());
  if (!WriteAll(fd.get(), head.data(), head.size())) return fail("cannot write");
  for (const ArrayRef& a : arrays) {
    const size_t bytes = static_cast<size_t>(a.count) * DTypeSize(a.dtype);
    if (bytes == 0) continue;
    crc.Update(a.data, bytes);
    if (!WriteAll(fd.get(), static_cast<const char*>(a.data), bytes)) {
      return fail("cannot write");
    }
  }
  const uint32_t sum = crc.value();
  if (!WriteAll(fd.get(), reinterpret_cast<const char*>(&sum), 4)) return fail("cannot write");
  if (fsync(fd.get()) != 0) return fail("cannot fsync");
  if (!fd.Close()) return fail("cannot close");

  if (options.keep_prev) {
    ReadOptions verify;
    verify.fallback_to_prev = false;
    verify.verify_payload = true;
    verify.legacy = options.legacy;
    const absl::StatusOr<Checkpoint> current = ReadOne(path, verify, /*header_only=*/true);
    if (current.ok() && rename(path.c_str(), PrevPath(path).c_str()) != 0) {
      return fail(absl::StrCat("cannot rename ", path, " to ", PrevPath(path)));
    }
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return fail(absl::StrCat("cannot rename it to ", path));
  }
  return SyncDirectory(parent.string());
}

absl::StatusOr<Checkpoint> ReadCheckpointFile(const std::string& path, const ReadOptions& options) {
  return ReadWithFallback(path, options, /*header_only=*/false);
}

absl::StatusOr<CheckpointHeader> ReadCheckpointHeader(const std::string& path,
                                                      const ReadOptions& options) {
  absl::StatusOr<Checkpoint> c = ReadWithFallback(path, options, /*header_only=*/true);
  if (!c.ok()) return c.status();
  return std::move(c->header);
}

}  // namespace ckpt
}  // namespace gradmesh
