#include "worker/core/tensor_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/status.h"

namespace gradmesh {
namespace {

// data.pkl of a dict of tensors is a few hundred bytes (more with plain values under other
// keys). The bounds keep a hostile pickle from making the machine allocate much: at most
// kMaxPickleBytes marks and stack slots, kMaxValues values (~200 bytes each, strings aside),
// and kMaxTextBytes of strings in all: a few opcodes copy a memoized string into a new value
// (STACK_GLOBAL joins two, a persistent id or tensor rebuild copies its storage key), so a
// 1 MiB pickle could otherwise make ~10^5 copies of a 1 MiB string.
constexpr uint64_t kMaxPickleBytes = uint64_t{1} << 20;
constexpr size_t kMaxValues = size_t{1} << 17;
constexpr uint64_t kMaxTextBytes = 4 * kMaxPickleBytes;
// A dataset file has ~3 + (number of storages) entries; 64 MiB of central directory is far
// more than any real file needs.
constexpr uint64_t kMaxCentralDirBytes = uint64_t{64} << 20;
constexpr size_t kMaxDims = 64;
// Per-sample bytes above this are refused (keeps every size product far from overflow).
constexpr int64_t kMaxSampleBytes = int64_t{1} << 40;

uint64_t Le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// An open file: size at open time and bounded reads that name the file in errors.
class File {
 public:
  File(std::string path, int fd, uint64_t size) : path_(std::move(path)), fd_(fd), size_(size) {}
  ~File() {
    if (fd_ >= 0) close(fd_);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  static absl::StatusOr<std::unique_ptr<File>> Open(const std::string& path) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      return absl::Status(absl::ErrnoToStatusCode(err),
                          absl::StrCat("cannot open ", path, ": ", std::strerror(err)));
    }
    auto file = std::make_unique<File>(path, fd, 0);
    struct stat st;
    if (fstat(fd, &st) != 0) {
      const int err = errno;
      return absl::Status(absl::ErrnoToStatusCode(err),
                          absl::StrCat("cannot stat ", path, ": ", std::strerror(err)));
    }
    if (!S_ISREG(st.st_mode)) {
      return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
    }
    file->size_ = static_cast<uint64_t>(st.st_size);
    return file;
  }

  // Reads exactly n bytes at `offset`; `what` names them for errors. Reading past the size
  // the file had when opened is INVALID_ARGUMENT (a truncated or lying file); a file that
  // shrank since is DATA_LOSS.
  absl::Status ReadAt(uint64_t offset, uint64_t n, void* out, absl::string_view what) const {
    if (offset > size_ || n > size_ - offset) {
      return absl::InvalidArgumentError(
          absl::StrCat(path_, ": truncated or corrupt: ", what, " at byte ", offset, " (", n,
                       " bytes) is past the end of the file (", size_, " bytes)"));
    }
    uint8_t* dst = static_cast<uint8_t*>(out);
    uint64_t done = 0;
    while (done < n) {
      const size_t want = static_cast<size_t>(std::min<uint64_t>(n - done, uint64_t{1} << 30));
      const ssize_t got = pread(fd_, dst + done, want, static_cast<off_t>(offset + done));
      if (got < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        return absl::Status(absl::ErrnoToStatusCode(err),
                            absl::StrCat(path_, ": reading ", what, ": ", std::strerror(err)));
      }
      if (got == 0) {
        return absl::DataLossError(
            absl::StrCat(path_, ": file shrank while open (reading ", what, ")"));
      }
      done += static_cast<uint64_t>(got);
    }
    return absl::OkStatus();
  }

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }

 private:
  std::string path_;
  int fd_;
  uint64_t size_;
};

absl::Status Invalid(const File& f, absl::string_view msg) {
  return absl::InvalidArgumentError(absl::StrCat(f.path(), ": ", msg));
}

// ---------------------------------------------------------------------------------------------
// Zip

struct ZipEntry {
  uint16_t method = 0;
  uint64_t compressed = 0;
  uint64_t size = 0;
  uint64_t local_offset = 0;
};

struct CentralDirectory {
  uint64_t offset = 0;
  uint64_t size = 0;
  uint64_t entries = 0;
};

// Finds the central directory from the end-of-central-directory record (and the zip64 one
// when its locator is present: archives over 4 GiB or with many entries).
absl::StatusOr<CentralDirectory> FindCentralDirectory(const File& f) {
  constexpr uint64_t kEocd = 22;
  if (f.size() < kEocd) return Invalid(f, "not a zip archive (too short); not a torch.save file");
  const uint64_t tail_len = std::min<uint64_t>(f.size(), kEocd + 0xFFFF);
  std::vector<uint8_t> tail(tail_len);
  RETURN_IF_ERROR(f.ReadAt(f.size() - tail_len, tail_len, tail.data(), "zip trailer"));
  int64_t at = -1;
  for (int64_t p = static_cast<int64_t>(tail_len - kEocd); p >= 0; --p) {
    const uint8_t* r = tail.data() + p;
    if (Le(r, 4) == 0x06054b50 && p + kEocd + Le(r + 20, 2) <= tail_len) {
      at = p;
      break;
    }
  }
  if (at < 0) {
    return Invalid(f,
                   "not a zip archive (no end of central directory); torch.save files are zip "
                   "archives since torch 1.6 (re-save without _use_new_zipfile_serialization="
                   "False)");
  }
  const uint8_t* r = tail.data() + at;
  CentralDirectory cd{Le(r + 16, 4), Le(r + 12, 4), Le(r + 10, 2)};
  const uint64_t eocd_pos = f.size() - tail_len + static_cast<uint64_t>(at);
  if (eocd_pos >= 20) {
    uint8_t loc[20];
    RETURN_IF_ERROR(f.ReadAt(eocd_pos - 20, 20, loc, "zip64 locator"));
    if (Le(loc, 4) == 0x07064b50) {
      const uint64_t z64 = Le(loc + 8, 8);
      uint8_t rec[56];
      RETURN_IF_ERROR(f.ReadAt(z64, 56, rec, "zip64 end of central directory"));
      if (Le(rec, 4) != 0x06064b50) {
        return Invalid(f, "corrupt zip64 end of central directory record");
      }
      cd = CentralDirectory{Le(rec + 48, 8), Le(rec + 40, 8), Le(rec + 32, 8)};
    }
  }
  if (cd.offset > f.size() || cd.size > f.size() - cd.offset) {
    return Invalid(f, absl::StrCat("central directory (", cd.size, " bytes at ", cd.offset,
                                   ") is past the end of the file"));
  }
  if (cd.size > kMaxCentralDirBytes) {
    return Invalid(f, absl::StrCat("central directory of ", cd.size, " bytes is too large"));
  }
  return cd;
}

// Replaces the 0xFFFFFFFF fields of an entry by their zip64 extra-field values.
absl::Status ApplyZip64(const File& f, const uint8_t* extra, uint64_t len, bool need_size,
                        bool need_compressed, bool need_offset, ZipEntry* e) {
  for (uint64_t p = 0; p + 4 <= len;) {
    const uint64_t id = Le(extra + p, 2), n = Le(extra + p + 2, 2);
    if (p + 4 + n > len) break;
    if (id == 0x0001) {
      const uint8_t* v = extra + p + 4;
      uint64_t used = 0;
      for (auto [need, field] :
           {std::pair{need_size, &e->size}, std::pair{need_compressed, &e->compressed},
            std::pair{need_offset, &e->local_offset}}) {
        if (!need) continue;
        if (used + 8 > n) return Invalid(f, "truncated zip64 extra field");
        *field = Le(v + used, 8);
        used += 8;
      }
      return absl::OkStatus();
    }
    p += 4 + n;
  }
  if (need_size || need_compressed || need_offset) {
    return Invalid(f, "zip entry needs a zip64 extra field but has none");
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::flat_hash_map<std::string, ZipEntry>> ReadZipEntries(const File& f) {
  ASSIGN_OR_RETURN(const CentralDirectory cd, FindCentralDirectory(f));
  std::vector<uint8_t> buf(cd.size);
  RETURN_IF_ERROR(f.ReadAt(cd.offset, cd.size, buf.data(), "central directory"));
  absl::flat_hash_map<std::string, ZipEntry> entries;
  uint64_t p = 0;
  for (uint64_t i = 0; i < cd.entries; ++i) {
    if (p + 46 > buf.size() || Le(&buf[p], 4) != 0x02014b50) {
      return Invalid(
          f, absl::StrCat("corrupt zip central directory (entry ", i, " of ", cd.entries, ")"));
    }
    const uint8_t* r = &buf[p];
    ZipEntry e;
    e.method = static_cast<uint16_t>(Le(r + 10, 2));
    e.compressed = Le(r + 20, 4);
    e.size = Le(r + 24, 4);
    const uint64_t name_len = Le(r + 28, 2), extra_len = Le(r + 30, 2), comment = Le(r + 32, 2);
    e.local_offset = Le(r + 42, 4);
    if (p + 46 + name_len + extra_len + comment > buf.size()) {
      return Invalid(f, "corrupt zip central directory (entry past its end)");
    }
    std::string name(reinterpret_cast<const char*>(r + 46), name_len);
    RETURN_IF_ERROR(ApplyZip64(f, r + 46 + name_len, extra_len, e.size == 0xFFFFFFFF,
                               e.compressed == 0xFFFFFFFF, e.local_offset == 0xFFFFFFFF, &e));
    entries.emplace(std::move(name), e);  // A duplicate name keeps the first entry.
    p += 46 + name_len + extra_len + comment;
  }
  return entries;
}

// Offset of an entry's data, after checking it is stored and lies within the file.
absl::StatusOr<uint64_t> EntryData(const File& f, const std::string& name, const ZipEntry& e) {
  if (e.method != 0) {
    return Invalid(f, absl::StrCat("zip entry ", name, " is compressed (method ", e.method,
                                   "); only stored entries can be read in place (write the "
                                   "file with torch.save, which does not compress)"));
  }
  if (e.compressed != e.size) {
    return Invalid(f, absl::StrCat("zip entry ", name, " is stored but its sizes differ (",
                                   e.compressed, " vs ", e.size, ")"));
  }
  uint8_t h[30];
  RETURN_IF_ERROR(f.ReadAt(e.local_offset, 30, h, absl::StrCat("local header of ", name)));
  if (Le(h, 4) != 0x04034b50) {
    return Invalid(f, absl::StrCat("bad local header signature for zip entry ", name));
  }
  const uint64_t data = e.local_offset + 30 + Le(h + 26, 2) + Le(h + 28, 2);
  if (data > f.size() || e.size > f.size() - data) {
    return Invalid(
        f, absl::StrCat("truncated or corrupt: zip entry ", name, " (", e.size, " bytes at ", data,
                        ") is past the end of the file (", f.size(), " bytes)"));
  }
  return data;
}

// ---------------------------------------------------------------------------------------------
// Pickle

struct TensorInfo {
  ElemType type = ElemType::kFloat32;
  std::string key;             // Storage key: the zip entry <archive>/data/<key>.
  int64_t storage_numel = 0;   // Elements of the storage.
  int64_t storage_offset = 0;  // In elements.
  std::vector<int64_t> size;
  std::vector<int64_t> stride;
};

// Every value lives in the machine's arena and refers to others by pointer: no ownership
// cycles and no recursive destruction, whatever the pickle builds.
struct Value {
  enum Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kTuple,
    kList,
    kDict,
    kGlobal,
    kStorage,
    kTensor,
    kObject
  };
  Kind kind = kNone;
  int64_t i = 0;
  std::string s;              // kString; kGlobal: "module name".
  std::vector<Value*> items;  // kTuple, kList; kDict: key, value, key, value...
  TensorInfo tensor;          // kStorage (type, key, storage_numel), kTensor.
};

bool StorageType(absl::string_view name, ElemType* type) {
  static constexpr std::pair<const char*, ElemType> kTypes[] = {
      {"torch FloatStorage", ElemType::kFloat32}, {"torch DoubleStorage", ElemType::kFloat64},
      {"torch HalfStorage", ElemType::kFloat16},  {"torch BFloat16Storage", ElemType::kBFloat16},
      {"torch LongStorage", ElemType::kInt64},    {"torch IntStorage", ElemType::kInt32},
      {"torch ShortStorage", ElemType::kInt16},   {"torch CharStorage", ElemType::kInt8},
      {"torch ByteStorage", ElemType::kUInt8},    {"torch BoolStorage", ElemType::kBool},
  };
  for (const auto& [n, t] : kTypes) {
    if (name == n) {
      *type = t;
      return true;
    }
  }
  return false;
}

// Runs the subset of the pickle protocol that torch.save emits for a dict of tensors (plus
// plain values under other keys). Builds values only: GLOBAL names are recorded, never
// imported, and REDUCE of anything but the tensor rebuild and OrderedDict makes an opaque
// object.
class PickleMachine {
 public:
  PickleMachine(const File& file, const std::vector<uint8_t>& data) : f_(file), d_(data) {}

  absl::StatusOr<Value*> Run();

 private:
  absl::Status Error(absl::string_view msg) const {
    return Invalid(f_, absl::StrCat("data.pkl: ", msg, " (at byte ", op_at_, ")"));
  }
  absl::StatusOr<const uint8_t*> Take(uint64_t n) {
    if (n > d_.size() - pos_) return Error("truncated pickle");
    const uint8_t* p = d_.data() + pos_;
    pos_ += n;
    return p;
  }
  absl::StatusOr<uint64_t> TakeLe(int n) {
    ASSIGN_OR_RETURN(const uint8_t* p, Take(n));
    return Le(p, n);
  }
  absl::StatusOr<std::string> TakeLine() {
    const uint8_t* begin = d_.data() + pos_;
    const uint8_t* end = d_.data() + d_.size();
    const uint8_t* nl = std::find(begin, end, uint8_t{'\n'});
    if (nl == end) return Error("truncated GLOBAL");
    pos_ += static_cast<uint64_t>(nl - begin) + 1;
    return std::string(reinterpret_cast<const char*>(begin), nl - begin);
  }
  Value* New(Value::Kind kind) {
    arena_.emplace_back();
    arena_.back().kind = kind;
    return &arena_.back();
  }
  absl::StatusOr<Value*> Pop() {
    if (stack_.size() <= Floor()) return Error("pickle stack underflow");
    Value* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  size_t Floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // The values since the last MARK, which is removed.
  absl::StatusOr<std::vector<Value*>> PopMark() {
    if (marks_.empty()) return Error("pickle MARK missing");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Value*> items(stack_.begin() + m, stack_.end());
    stack_.resize(m);
    return items;
  }
  absl::Status PushString(uint64_t len) {
    ASSIGN_OR_RETURN(const uint8_t* p, Take(len));
    Value* v = New(Value::kString);
    v->s.assign(reinterpret_cast<const char*>(p), len);
    stack_.push_back(v);
    return absl::OkStatus();
  }
  void PushInt(int64_t i) {
    Value* v = New(Value::kInt);
    v->i = i;
    stack_.push_back(v);
  }
  absl::Status PushTuple(size_t n);
  absl::Status Step(uint8_t op);
  absl::Status StepValues(uint8_t op);
  absl::Status StepContainers(uint8_t op);
  absl::StatusOr<Value*> PersistentLoad(Value* pid);
  absl::StatusOr<Value*> Reduce(Value* callable, Value* args);
  absl::StatusOr<Value*> RebuildTensor(const Value& args);

  const File& f_;
  const std::vector<uint8_t>& d_;
  uint64_t pos_ = 0;
  uint64_t op_at_ = 0;
  bool stopped_ = false;
  std::deque<Value> arena_;
  uint64_t text_bytes_ = 0;  // Of the strings and keys of arena_'s values.
  std::vector<Value*> stack_;
  std::vector<size_t> marks_;
  absl::flat_hash_map<uint64_t, Value*> memo_;
};

absl::StatusOr<Value*> PickleMachine::Run() {
  while (!stopped_) {
    op_at_ = pos_;
    const size_t values = arena_.size();
    ASSIGN_OR_RETURN(const uint8_t* op, Take(1));
    RETURN_IF_ERROR(Step(*op));
    // A step makes at most one value.
    if (arena_.size() > kMaxValues) {
      return Error(absl::StrCat("more than ", kMaxValues, " values; not a dict of tensors"));
    }
    if (arena_.size() > values) {
      text_bytes_ += arena_.back().s.size() + arena_.back().tensor.key.size();
      if (text_bytes_ > kMaxTextBytes) {
        return Error(
            absl::StrCat("more than ", kMaxTextBytes, " bytes of strings; not a dict of tensors"));
      }
    }
  }
  if (stack_.size() != 1 || !marks_.empty()) return Error("pickle ends with a malformed stack");
  return stack_.back();
}

absl::Status PickleMachine::PushTuple(size_t n) {
  if (stack_.size() < Floor() + n) return Error("pickle stack underflow");
  Value* t = New(Value::kTuple);
  t->items.assign(stack_.end() - n, stack_.end());
  stack_.resize(stack_.size() - n);
  stack_.push_back(t);
  return absl::OkStatus();
}

absl::Status PickleMachine::Step(uint8_t op) {
  switch (op) {
    case 0x80: {  // PROTO
      ASSIGN_OR_RETURN(const uint64_t proto, TakeLe(1));
      if (proto > 5) return Error(absl::StrCat("unsupported pickle protocol ", proto));
      return absl::OkStatus();
    }
    case 0x95:  // FRAME: a length hint only.
      return TakeLe(8).status();
    case '.':  // STOP
      stopped_ = true;
      return absl::OkStatus();
    case '(':  // MARK
      marks_.push_back(stack_.size());
      return absl::OkStatus();
    case 'q':     // BINPUT
    case 'r':     // LONG_BINPUT
    case 0x94: {  // MEMOIZE
      uint64_t index = memo_.size();
      if (op != 0x94) {
        ASSIGN_OR_RETURN(index, TakeLe(op == 'q' ? 1 : 4));
      }
      if (stack_.size() <= Floor()) return Error("memo store from an empty stack");
      memo_[index] = stack_.back();
      return absl::OkStatus();
    }
    case 'h':    // BINGET
    case 'j': {  // LONG_BINGET
      ASSIGN_OR_RETURN(const uint64_t index, TakeLe(op == 'h' ? 1 : 4));
      auto it = memo_.find(index);
      if (it == memo_.end()) return Error(absl::StrCat("memo ", index, " is not set"));
      stack_.push_back(it->second);
      return absl::OkStatus();
    }
    default:
      return StepValues(op);
  }
}

absl::Status PickleMachine::StepValues(uint8_t op) {
  switch (op) {
    case 'N':
      stack_.push_back(New(Value::kNone));
      return absl::OkStatus();
    case 0x88:    // NEWTRUE
    case 0x89: {  // NEWFALSE
      Value* v = New(Value::kBool);
      v->i = op == 0x88;
      stack_.push_back(v);
      return absl::OkStatus();
    }
    case 'K':    // BININT1
    case 'M': {  // BININT2
      ASSIGN_OR_RETURN(const uint64_t v, TakeLe(op == 'K' ? 1 : 2));
      PushInt(static_cast<int64_t>(v));
      return absl::OkStatus();
    }
    case 'J': {  // BININT: signed 32-bit.
      ASSIGN_OR_RETURN(const uint64_t v, TakeLe(4));
      PushInt(static_cast<int32_t>(static_cast<uint32_t>(v)));
      return absl::OkStatus();
    }
    case 0x8a: {  // LONG1: little-endian two's complement of n bytes.
      ASSIGN_OR_RETURN(const uint64_t n, TakeLe(1));
      if (n > 8) return Error(absl::StrCat("integer of ", n, " bytes is too large"));
      ASSIGN_OR_RETURN(const uint8_t* p, Take(n));
      uint64_t v = n == 0 ? 0 : Le(p, static_cast<int>(n));
      if (n > 0 && n < 8 && (p[n - 1] & 0x80)) v |= ~uint64_t{0} << (8 * n);  // Sign-extend.
      PushInt(static_cast<int64_t>(v));
      return absl::OkStatus();
    }
    case 'G': {  // BINFLOAT: the value is never needed.
      RETURN_IF_ERROR(Take(8).status());
      stack_.push_back(New(Value::kFloat));
      return absl::OkStatus();
    }
    case 'X':    // BINUNICODE
    case 'B':    // BINBYTES
    case 'T': {  // BINSTRING
      ASSIGN_OR_RETURN(const uint64_t n, TakeLe(4));
      return PushString(n);
    }
    case 0x8c:   // SHORT_BINUNICODE
    case 'C':    // SHORT_BINBYTES
    case 'U': {  // SHORT_BINSTRING
      ASSIGN_OR_RETURN(const uint64_t n, TakeLe(1));
      return PushString(n);
    }
    case 0x8d:    // BINUNICODE8
    case 0x8e: {  // BINBYTES8
      ASSIGN_OR_RETURN(const uint64_t n, TakeLe(8));
      return PushString(n);
    }
    case 'c': {  // GLOBAL "module\nname\n"
      ASSIGN_OR_RETURN(std::string module, TakeLine());
      ASSIGN_OR_RETURN(std::string name, TakeLine());
      Value* v = New(Value::kGlobal);
      v->s = absl::StrCat(module, " ", name);
      stack_.push_back(v);
      return absl::OkStatus();
    }
    case 0x93: {  // STACK_GLOBAL
      ASSIGN_OR_RETURN(Value * name, Pop());
      ASSIGN_OR_RETURN(Value * module, Pop());
      if (name->kind != Value::kString || module->kind != Value::kString) {
        return Error("STACK_GLOBAL needs two strings");
      }
      Value* v = New(Value::kGlobal);
      v->s = absl::StrCat(module->s, " ", name->s);
      stack_.push_back(v);
      return absl::OkStatus();
    }
    case 'Q': {  // BINPERSID
      ASSIGN_OR_RETURN(Value * pid, Pop());
      ASSIGN_OR_RETURN(Value * storage, PersistentLoad(pid));
      stack_.push_back(storage);
      return absl::OkStatus();
    }
    case 'R': {  // REDUCE
      ASSIGN_OR_RETURN(Value * args, Pop());
      ASSIGN_OR_RETURN(Value * callable, Pop());
      ASSIGN_OR_RETURN(Value * v, Reduce(callable, args));
      stack_.push_back(v);
      return absl::OkStatus();
    }
    case 0x81: {  // NEWOBJ: cls.__new__(cls, *args), opaque.
      RETURN_IF_ERROR(Pop().status());
      RETURN_IF_ERROR(Pop().status());
      stack_.push_back(New(Value::kObject));
      return absl::OkStatus();
    }
    case 'b':  // BUILD: sets an object's state, which nothing here looks at.
    case '0':  // POP
      return Pop().status();
    default:
      return StepContainers(op);
  }
}

absl::Status PickleMachine::StepContainers(uint8_t op) {
  switch (op) {
    case '}':  // EMPTY_DICT
      stack_.push_back(New(Value::kDict));
      return absl::OkStatus();
    case ']':  // EMPTY_LIST
      stack_.push_back(New(Value::kList));
      return absl::OkStatus();
    case ')':  // EMPTY_TUPLE
      return PushTuple(0);
    case 0x85:  // TUPLE1
    case 0x86:  // TUPLE2
    case 0x87:  // TUPLE3
      return PushTuple(op - 0x84);
    case 't': {  // TUPLE
      ASSIGN_OR_RETURN(std::vector<Value*> items, PopMark());
      Value* t = New(Value::kTuple);
      t->items = std::move(items);
      stack_.push_back(t);
      return absl::OkStatus();
    }
    case 's':    // SETITEM
    case 'u':    // SETITEMS
    case 'a':    // APPEND
    case 'e': {  // APPENDS
      std::vector<Value*> items;
      if (op == 's' || op == 'a') {
        const size_t n = op == 's' ? 2 : 1;
        if (stack_.size() < Floor() + n) return Error("pickle stack underflow");
        items.assign(stack_.end() - n, stack_.end());
        stack_.resize(stack_.size() - n);
      } else {
        ASSIGN_OR_RETURN(items, PopMark());
      }
      if (stack_.size() <= Floor()) return Error("pickle stack underflow");
      Value* target = stack_.back();
      const bool dict = op == 's' || op == 'u';
      if (target->kind != (dict ? Value::kDict : Value::kList)) {
        return Error(dict ? "SETITEM(S) on a value that is not a dict"
                          : "APPEND(S) on a value that is not a list");
      }
      if (dict && items.size() % 2 != 0) return Error("SETITEMS with an odd number of values");
      target->items.insert(target->items.end(), items.begin(), items.end());
      return absl::OkStatus();
    }
    default:
      return Error(absl::StrFormat(
          "unsupported pickle opcode 0x%02x (not a file written by torch.save of a dict of "
          "tensors)",
          op));
  }
}

// ('storage', torch.XxxStorage, key, location, numel) as written by torch.save.
absl::StatusOr<Value*> PickleMachine::PersistentLoad(Value* pid) {
  const std::vector<Value*>& t = pid->items;
  if (pid->kind != Value::kTuple || t.size() != 5 || t[0]->kind != Value::kString ||
      t[0]->s != "storage" || t[1]->kind != Value::kGlobal || t[2]->kind != Value::kString ||
      t[4]->kind != Value::kInt) {
    return Error("persistent id is not a ('storage', type, key, location, numel) tuple");
  }
  Value* v = New(Value::kStorage);
  if (!StorageType(t[1]->s, &v->tensor.type)) {
    return Error(absl::StrCat("unsupported storage type ", t[1]->s));
  }
  if (t[4]->i < 0) return Error(absl::StrCat("negative storage size ", t[4]->i));
  v->tensor.key = t[2]->s;
  v->tensor.storage_numel = t[4]->i;
  return v;
}

absl::StatusOr<Value*> PickleMachine::Reduce(Value* callable, Value* args) {
  if (callable->kind != Value::kGlobal || args->kind != Value::kTuple) {
    return Error("REDUCE needs a global and an argument tuple");
  }
  if (callable->s == "torch._utils _rebuild_tensor_v2") return RebuildTensor(*args);
  if (callable->s == "collections OrderedDict" && args->items.empty()) {
    return New(Value::kDict);
  }
  // nn.Parameter: (tensor, requires_grad, hooks); the data is the tensor's.
  if (callable->s == "torch._utils _rebuild_parameter" && !args->items.empty() &&
      args->items[0]->kind == Value::kTensor) {
    return args->items[0];
  }
  return New(Value::kObject);
}

// _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks
// [, metadata]).
absl::StatusOr<Value*> PickleMachine::RebuildTensor(const Value& args) {
  const std::vector<Value*>& a = args.items;
  if (a.size() < 4 || a[0]->kind != Value::kStorage || a[1]->kind != Value::kInt ||
      a[2]->kind != Value::kTuple || a[3]->kind != Value::kTuple) {
    return Error("_rebuild_tensor_v2 without (storage, offset, size, stride) arguments");
  }
  Value* v = New(Value::kTensor);
  v->tensor = a[0]->tensor;
  v->tensor.storage_offset = a[1]->i;
  if (a[2]->items.size() > kMaxDims || a[2]->items.size() != a[3]->items.size()) {
    return Error(absl::StrCat("tensor with ", a[2]->items.size(), " sizes and ", a[3]->items.size(),
                              " strides"));
  }
  for (size_t k = 0; k < a[2]->items.size(); ++k) {
    if (a[2]->items[k]->kind != Value::kInt || a[3]->items[k]->kind != Value::kInt) {
      return Error("tensor size or stride is not an integer");
    }
    v->tensor.size.push_back(a[2]->items[k]->i);
    v->tensor.stride.push_back(a[3]->items[k]->i);
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// One file

struct FieldLocation {
  FieldMeta meta;
  uint64_t offset = 0;  // Of sample 0's bytes in the file.
};

struct OpenedFile {
  std::unique_ptr<File> file;
  int64_t n = 0;
  FieldLocation x, y;
};

std::string Join(const std::vector<int64_t>& v) {
  return absl::StrCat("[", absl::StrJoin(v, ","), "]");
}

// Checks tensor `key` of `f` against its storage entry and returns where its samples are.
absl::StatusOr<FieldLocation> Locate(const File& f, const std::string& archive,
                                     const absl::flat_hash_map<std::string, ZipEntry>& entries,
                                     const std::string& key, const TensorInfo& t) {
  const std::string what =
      absl::StrCat(key, " (size ", Join(t.size), ", stride ", Join(t.stride), ")");
  if (t.size.empty()) {
    return Invalid(f, absl::StrCat(key,
                                   " is a 0-dim tensor; it needs a leading sample "
                                   "dimension"));
  }
  FieldLocation loc;
  loc.meta.type = t.type;
  const int64_t elem = ElemSize(t.type);
  int64_t sample_numel = 1;
  for (size_t k = 0; k < t.size.size(); ++k) {
    if (t.size[k] < 0) return Invalid(f, absl::StrCat(what, ": negative size"));
    if (k == 0) continue;
    loc.meta.dims.push_back(t.size[k]);
    if (t.size[k] != 0 && sample_numel > kMaxSampleBytes / elem / t.size[k]) {
      return Invalid(f, absl::StrCat(what, ": samples larger than ", kMaxSampleBytes, " bytes"));
    }
    sample_numel *= t.size[k];
  }
  // Empty samples would let a tiny file claim any number of them.
  if (sample_numel == 0) {
    return Invalid(f, absl::StrCat(what, ": samples have no elements"));
  }
  // Row-major contiguous, ignoring the strides of dimensions of size 1 (as torch does) and
  // every stride of an empty tensor.
  const bool empty = t.size[0] == 0;
  int64_t expected = 1;
  for (size_t k = t.size.size(); k-- > 0;) {
    if (!empty && t.size[k] != 1 && t.stride[k] != expected) {
      return Invalid(f,
                     absl::StrCat(what, " is not contiguous; save ", key, ".contiguous() instead"));
    }
    if (k > 0) expected *= t.size[k];
  }
  const std::string entry_name = absl::StrCat(archive, "/data/", t.key);
  auto it = entries.find(entry_name);
  if (it == entries.end()) {
    return Invalid(f, absl::StrCat(what, ": storage entry ", entry_name, " is missing"));
  }
  ASSIGN_OR_RETURN(const uint64_t data, EntryData(f, entry_name, it->second));
  // The samples must lie within the storage entry: checked by division, so that no product
  // of claimed sizes can overflow.
  const uint64_t entry_elems = it->second.size / static_cast<uint64_t>(elem);
  const uint64_t storage_elems =
      std::min<uint64_t>(entry_elems, static_cast<uint64_t>(t.storage_numel));
  const uint64_t offset = static_cast<uint64_t>(std::max<int64_t>(t.storage_offset, 0));
  if (t.storage_offset < 0 || offset > storage_elems ||
      static_cast<uint64_t>(t.size[0]) > (storage_elems - offset) / sample_numel) {
    return Invalid(
        f, absl::StrCat(what, " at storage offset ", t.storage_offset,
                        " does not fit its storage of ", t.storage_numel, " elements (entry ",
                        entry_name, ": ", it->second.size, " bytes)"));
  }
  loc.offset = data + offset * static_cast<uint64_t>(elem);
  return loc;
}

absl::StatusOr<const TensorInfo*> FindTensor(const File& f, const Value& dict,
                                             const std::string& key) {
  for (size_t k = 0; k + 1 < dict.items.size(); k += 2) {
    if (dict.items[k]->kind != Value::kString || dict.items[k]->s != key) continue;
    const Value* v = dict.items[k + 1];
    if (v->kind != Value::kTensor) {
      return Invalid(f, absl::StrCat(key,
                                     " is not a tensor; save {\"x\": X, \"y\": Y} with "
                                     "X and Y tensors"));
    }
    return &v->tensor;
  }
  return Invalid(f, absl::StrCat("no key \"", key, "\"; save {\"x\": X, \"y\": Y}"));
}

absl::StatusOr<OpenedFile> OpenOne(const std::string& path) {
  OpenedFile out;
  ASSIGN_OR_RETURN(out.file, File::Open(path));
  const File& f = *out.file;
  ASSIGN_OR_RETURN(const auto entries, ReadZipEntries(f));
  // The archive's top directory is named after the file it was first saved as.
  std::string archive;
  for (const auto& [name, e] : entries) {
    const size_t slash = name.find('/');
    if (slash != std::string::npos && name.compare(slash, std::string::npos, "/data.pkl") == 0) {
      if (!archive.empty()) return Invalid(f, "more than one data.pkl in the archive");
      archive = name.substr(0, slash);
    }
  }
  if (archive.empty()) {
    return Invalid(f, "no <archive>/data.pkl entry: not a file written by torch.save");
  }
  const std::string pkl_name = archive + "/data.pkl";
  const ZipEntry& pkl = entries.at(pkl_name);
  ASSIGN_OR_RETURN(const uint64_t pkl_data, EntryData(f, pkl_name, pkl));
  if (pkl.size > kMaxPickleBytes) {
    return Invalid(f, absl::StrCat(pkl_name, " is ", pkl.size, " bytes; more than ",
                                   kMaxPickleBytes, " is not a dict of tensors"));
  }
  // torch >= 2.1 records the byte order; the storages' bytes are used as they are, which is
  // right only for little-endian data on this (little-endian) machine.
  if (auto it = entries.find(archive + "/byteorder"); it != entries.end()) {
    ASSIGN_OR_RETURN(const uint64_t at, EntryData(f, it->first, it->second));
    char order[16] = {};
    const uint64_t n = std::min<uint64_t>(it->second.size, sizeof(order));
    RETURN_IF_ERROR(f.ReadAt(at, n, order, it->first));
    if (absl::string_view(order, n) != "little") {
      return Invalid(
          f, absl::StrCat("byte order \"", absl::string_view(order, n), "\" is not little-endian"));
    }
  }
  std::vector<uint8_t> pickle(pkl.size);
  RETURN_IF_ERROR(f.ReadAt(pkl_data, pkl.size, pickle.data(), pkl_name));
  PickleMachine machine(f, pickle);
  ASSIGN_OR_RETURN(const Value* top, machine.Run());
  if (top->kind != Value::kDict) {
    return Invalid(f, "data.pkl does not hold a dict; save {\"x\": X, \"y\": Y}");
  }
  ASSIGN_OR_RETURN(const TensorInfo* x, FindTensor(f, *top, "x"));
  ASSIGN_OR_RETURN(const TensorInfo* y, FindTensor(f, *top, "y"));
  ASSIGN_OR_RETURN(out.x, Locate(f, archive, entries, "x", *x));
  ASSIGN_OR_RETURN(out.y, Locate(f, archive, entries, "y", *y));
  if (x->size[0] != y->size[0]) {
    return Invalid(f, absl::StrCat("x has ", x->size[0], " samples but y has ", y->size[0]));
  }
  out.n = x->size[0];
  return out;
}

// ---------------------------------------------------------------------------------------------
// The source

class TensorFileSource : public ExampleSource {
 public:
  TensorFileSource(std::string pattern, std::vector<OpenedFile> files)
      : pattern_(std::move(pattern)), files_(std::move(files)) {
    x_ = files_[0].x.meta;
    y_ = files_[0].y.meta;
    for (const OpenedFile& f : files_) {
      starts_.push_back(size_);
      size_ += f.n;
    }
  }

  int64_t size() const override { return size_; }
  const FieldMeta& x() const override { return x_; }
  const FieldMeta& y() const override { return y_; }

  absl::Status Read(int64_t i, uint8_t* x_out, uint8_t* y_out) const override {
    if (i < 0 || i >= size_) {
      return absl::OutOfRangeError(
          absl::StrCat(Describe(), ": sample ", i, " out of range [0, ", size_, ")"));
    }
    const size_t k = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), i) -
                                         starts_.begin() - 1);
    const OpenedFile& f = files_[k];
    const uint64_t local = static_cast<uint64_t>(i - starts_[k]);
    const uint64_t xb = static_cast<uint64_t>(x_.sample_bytes());
    const uint64_t yb = static_cast<uint64_t>(y_.sample_bytes());
    RETURN_IF_ERROR(
        f.file->ReadAt(f.x.offset + local * xb, xb, x_out, absl::StrCat("x of sample ", local)));
    return f.file->ReadAt(f.y.offset + local * yb, yb, y_out, absl::StrCat("y of sample ", local));
  }

  std::string Describe() const override {
    return absl::StrCat("tensors ", pattern_, " (", files_.size(), " files, ", size_, " samples)");
  }

 private:
  const std::string pattern_;
  const std::vector<OpenedFile> files_;
  std::vector<int64_t> starts_;  // Index of each file's first sample.
  int64_t size_ = 0;
  FieldMeta x_, y_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ExampleSource>> OpenTensorFiles(const std::string& dir,
                                                               const std::string& prefix) {
  const std::string base = dir.empty() || dir.back() == '/' ? dir : dir + "/";
  const std::string pattern = absl::StrCat(base, prefix, "*.pt");
  DIR* d = opendir(dir.empty() ? "." : dir.c_str());
  if (d == nullptr) {
    const int err = errno;
    const absl::StatusCode code = err == ENOENT || err == ENOTDIR ? absl::StatusCode::kNotFound
                                                                  : absl::ErrnoToStatusCode(err);
    return absl::Status(code, absl::StrCat("no files ", pattern, ": cannot read directory ", dir,
                                           ": ", std::strerror(err)));
  }
  std::vector<std::string> names;
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() < prefix.size() + 3 || !absl::StartsWith(name, prefix) ||
        !absl::EndsWith(name, ".pt")) {
      continue;
    }
    struct stat st;
    if (stat((base + name).c_str(), &st) == 0 && S_ISREG(st.st_mode)) names.push_back(name);
  }
  closedir(d);
  if (names.empty()) return absl::NotFoundError(absl::StrCat("no files match ", pattern));
  std::sort(names.begin(), names.end());

  std::vector<OpenedFile> files;
  for (const std::string& name : names) {
    ASSIGN_OR_RETURN(OpenedFile f, OpenOne(base + name));
    if (!files.empty()) {
      const OpenedFile& first = files[0];
      for (auto [field, a, b] :
           {std::tuple{"x", &first.x.meta, &f.x.meta}, std::tuple{"y", &first.y.meta, &f.y.meta}}) {
        if (*a != *b) {
          return absl::InvalidArgumentError(absl::StrCat(
              field, " of ", f.file->path(), " is ", b->Describe(), " per sample but ", field,
              " of ", first.file->path(), " is ", a->Describe(), "; every file of ", pattern,
              " must have the same dtypes and per-sample shapes"));
        }
      }
    }
    files.push_back(std::move(f));
  }
  return std::make_unique<TensorFileSource>(pattern, std::move(files));
}

}  // namespace gradmesh
