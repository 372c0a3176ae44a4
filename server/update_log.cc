#include "server/update_log.h"

#include <fcntl.h>
#include <limits.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace gradmesh {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "frames are written little-endian");

constexpr uint32_t kMagic = 0x31474d4c;      // "LMG1" on disk.
constexpr size_t kHeadBytes = 32;            // magic, length, seq, payload sum, header sum.
constexpr uint8_t kGradsTag = (2 << 3) | 2;  // UpdateRecord.grads, length-delimited.
constexpr uint8_t kDataTag = (6 << 3) | 2;   // ChunkData.data, length-delimited.
constexpr const char* kSuffix = ".log";
// Deleted segments kept for reuse: writing over a file's cached pages costs about half of
// writing new ones (no page and block allocation, no truncation when deleted).
constexpr int kSpares = 2;

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// Adds 32-byte blocks [p, p + 32 * n) to the four lanes' sums.
inline void Blocks(const char* p, size_t n, uint64_t* a, uint64_t* b) {
  uint64_t a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
  uint64_t b0 = b[0], b1 = b[1], b2 = b[2], b3 = b[3];
  for (size_t i = 0; i < n; ++i, p += 32) {
    uint64_t w[4];
    std::memcpy(w, p, 32);
    a0 += w[0];
    a1 += w[1];
    a2 += w[2];
    a3 += w[3];
    b0 += a0;
    b1 += a1;
    b2 += a2;
    b3 += a3;
  }
  a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3;
  b[0] = b0, b[1] = b1, b[2] = b2, b[3] = b3;
}

uint64_t Checksum(const char* data, size_t size) {
  StreamChecksum c;
  c.Update(data, size);
  return c.Finish();
}

// The first seqs of the segments in `dir`, ascending (none if there is no directory).
absl::StatusOr<std::vector<int64_t>> ListSegments(const std::string& dir) {
  std::vector<int64_t> firsts;
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) return firsts;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    uint64_t first = 0;
    if (name.size() != 16 + std::strlen(kSuffix) || !absl::EndsWith(name, kSuffix) ||
        !absl::SimpleHexAtoi(name.substr(0, 16), &first)) {
      continue;  // Not ours.
    }
    firsts.push_back(static_cast<int64_t>(first));
  }
  if (ec) return absl::InternalError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  std::sort(firsts.begin(), firsts.end());
  return firsts;
}

std::string SegmentName(const std::string& dir, int64_t first) {
  return absl::StrFormat("%s/%016x%s", dir, first, kSuffix);
}

// The seq of a whole, valid frame header at `head` (at least kHeadBytes), or -1.
int64_t ValidHeaderSeq(const char* head) {
  uint32_t magic;
  uint64_t seq, head_sum;
  std::memcpy(&magic, head, 4);
  std::memcpy(&seq, head + 8, 8);
  std::memcpy(&head_sum, head + 24, 8);
  if (magic != kMagic || head_sum != Checksum(head, 24)) return -1;
  return static_cast<int64_t>(seq);
}

// Whether the frame whose header is at byte `at` of `bytes` has its whole payload there,
// matching the header's checksum.
bool PayloadWhole(const std::string& bytes, size_t at) {
  uint32_t size;
  uint64_t payload_sum;
  std::memcpy(&size, bytes.data() + at + 4, 4);
  std::memcpy(&payload_sum, bytes.data() + at + 16, 8);
  return bytes.size() - at - kHeadBytes >= size &&
         payload_sum == Checksum(bytes.data() + at + kHeadBytes, size);
}

// A segment's records end at the first frame that is not whole and valid. A writer killed
// mid-write leaves such a frame last: nothing it wrote after it. A valid frame of a later
// seq beyond it means a frame the writer finished (and acknowledged) was damaged since:
// DataLoss naming the file and offset rather than replaying without it and what follows.
absl::Status CheckTornNotDamaged(const std::string& path, const std::string& bytes, size_t at,
                                 uint64_t next) {
  for (size_t p = at + 1; p + kHeadBytes <= bytes.size(); ++p) {
    if (bytes[p] != static_cast<char>(kMagic & 0xff)) continue;  // Quick reject.
    const int64_t seq = ValidHeaderSeq(bytes.data() + p);
    // Lower seqs past the end are a reused file's older records; a frame that is not whole
    // (a reused file's own torn one) proves nothing.
    if (seq < 0 || static_cast<uint64_t>(seq) < next || !PayloadWhole(bytes, p)) continue;
    return absl::DataLossError(absl::StrCat(
        "update log ", path, ": the record at byte ", at, " (seq ", next,
        ") is damaged, and a whole record follows it (seq ", seq, " at byte ", p,
        "): the log is corrupt, not torn by a crash; updates it acknowledged would be lost (to "
        "accept that loss, truncate the file to ",
        at, " bytes)"));
  }
  return absl::OkStatus();
}

// Appends the records of one segment's bytes to `out`, up to the first torn frame.
absl::Status ParseSegment(const std::string& path, int64_t first, const std::string& bytes,
                          std::vector<state::UpdateRecord>* out) {
  size_t at = 0;
  uint64_t next = static_cast<uint64_t>(first);
  while (bytes.size() - at >= kHeadBytes) {
    const char* head = bytes.data() + at;
    const int64_t seq = ValidHeaderSeq(head);
    // A reused segment holds older records past its end: their seqs are lower.
    if (seq >= 0 && static_cast<uint64_t>(seq) < next) break;
    if (seq >= 0 && static_cast<uint64_t>(seq) > next) {
      return absl::DataLossError(absl::StrCat("update log ", path, ": the record at byte ", at,
                                              " has seq ", seq, " where seq ", next,
                                              " belongs: records are missing"));
    }
    if (seq < 0 || !PayloadWhole(bytes, at)) return CheckTornNotDamaged(path, bytes, at, next);
    uint32_t size;
    std::memcpy(&size, head + 4, 4);
    const char* payload = head + kHeadBytes;
    state::UpdateRecord rec;
    if (!rec.ParseFromArray(payload, static_cast<int>(size))) {
      return absl::DataLossError(absl::StrCat("update log ", path, ": the record at byte ", at,
                                              " (seq ", seq, ") is not an UpdateRecord"));
    }
    rec.set_seq(static_cast<int64_t>(seq));
    out->push_back(std::move(rec));
    at += kHeadBytes + size;
    ++next;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FileError(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

absl::Status WriteFully(int fd, std::vector<iovec>* iov, const std::string& what,
                        const std::string& path) {
  size_t at = 0;
  while (at < iov->size()) {
    if ((*iov)[at].iov_len == 0) {  // Nothing to write there (an empty array's data() may be
      ++at;                         // null).
      continue;
    }
    const int count = static_cast<int>(std::min<size_t>(iov->size() - at, IOV_MAX));
    ssize_t n = writev(fd, iov->data() + at, count);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;  // Nothing written, and no error said why.
      return FileError(what, path);
    }
    // Skip what was written (a short write continues where it stopped).
    while (at < iov->size() && static_cast<size_t>(n) >= (*iov)[at].iov_len) {
      n -= static_cast<ssize_t>((*iov)[at].iov_len);
      ++at;
    }
    if (n > 0) {
      (*iov)[at].iov_base = static_cast<char*>((*iov)[at].iov_base) + n;
      (*iov)[at].iov_len -= static_cast<size_t>(n);
    }
  }
  return absl::OkStatus();
}

absl::Status SyncDirectory(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return FileError("cannot open directory", dir);
  const int rc = fsync(fd);
  close(fd);
  if (rc != 0) return FileError("cannot sync directory", dir);
  return absl::OkStatus();
}

void StreamChecksum::Update(const char* data, size_t size) {
  total_ += size;
  if (pending_size_ > 0) {
    const size_t take = std::min(sizeof(pending_) - pending_size_, size);
    std::memcpy(pending_ + pending_size_, data, take);
    pending_size_ += take;
    data += take;
    size -= take;
    if (pending_size_ < sizeof(pending_)) return;
    Blocks(pending_, 1, a_, b_);
    pending_size_ = 0;
  }
  Blocks(data, size / 32, a_, b_);
  pending_size_ = size % 32;
  std::memcpy(pending_, data + size - pending_size_, pending_size_);
}

uint64_t StreamChecksum::Finish() const {
  uint64_t a[4], b[4];
  std::copy(std::begin(a_), std::end(a_), a);
  std::copy(std::begin(b_), std::end(b_), b);
  if (pending_size_ > 0) {
    char last[32] = {};
    std::memcpy(last, pending_, pending_size_);
    Blocks(last, 1, a, b);
  }
  constexpr uint64_t kMul = 0x9e3779b97f4a7c15ull;
  uint64_t h = total_ * kMul;
  for (int i = 0; i < 4; ++i) {
    h = (h ^ a[i]) * kMul;
    h = (h ^ b[i]) * kMul;
    h ^= h >> 29;
  }
  return h;
}

EncodedRecord::EncodedRecord(const state::UpdateRecord& meta,
                             const std::vector<absl::string_view>& data) {
  ABSL_RAW_CHECK(static_cast<int>(data.size()) == meta.grads_size(), "one data per gradient");
  size_t from = 0;
  for (int i = 0; i < meta.grads_size(); ++i) {
    // grads(i) as a length-delimited ChunkData: its small fields, then `data` as field 6,
    // whose bytes follow as their own piece.
    const std::string fields = meta.grads(i).SerializeAsString();
    const size_t n = data[i].size();
    bytes_.push_back(static_cast<char>(kGradsTag));
    PutVarint(fields.size() + 1 + VarintSize(n) + n, &bytes_);
    bytes_ += fields;
    bytes_.push_back(static_cast<char>(kDataTag));
    PutVarint(n, &bytes_);
    pieces_.push_back({nullptr, from, bytes_.size() - from});
    pieces_.push_back({data[i].data(), 0, n});
    from = bytes_.size();
  }
  state::UpdateRecord rest = meta;
  rest.clear_grads();
  rest.clear_seq();  // The frame holds it.
  rest.AppendToString(&bytes_);
  pieces_.push_back({nullptr, from, bytes_.size() - from});
  StreamChecksum sum;
  for (const Piece& p : pieces_) {
    sum.Update(p.raw != nullptr ? p.raw : bytes_.data() + p.offset, p.size);
    payload_bytes_ += static_cast<int64_t>(p.size);
  }
  checksum_ = sum.Finish();
}

UpdateLog::UpdateLog(std::string dir, bool fsync, std::vector<Segment> segments)
    : dir_(std::move(dir)), fsync_(fsync), segments_(std::move(segments)) {
  for (int i = 0; i < kSpares; ++i) {
    if (access(SparePath(i).c_str(), F_OK) == 0) spares_.push_back(i);
  }
}

std::string UpdateLog::SparePath(int i) const { return absl::StrCat(dir_, "/spare.", i); }

UpdateLog::~UpdateLog() {
  if (fd_ >= 0) close(fd_);
}

std::string UpdateLog::SegmentPath(int64_t first) const { return SegmentName(dir_, first); }

absl::StatusOr<std::unique_ptr<UpdateLog>> UpdateLog::Open(const std::string& root,
                                                           const std::string& job, int64_t next_seq,
                                                           bool fresh, bool fsync) {
  const std::string dir = absl::StrCat(root, "/", job);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  if (fsync) {
    // The directories' names must survive a crash like the files in them (a store from before
    // chunk files creates its log directory here). On every open, not only when created: an
    // open whose sync failed is retried by the next push, which finds them made.
    RETURN_IF_ERROR(SyncDirectory(root));
    RETURN_IF_ERROR(SyncDirectory(std::filesystem::path(root).parent_path().string()));
  }
  auto firsts = ListSegments(dir);
  if (!firsts.ok()) return firsts.status();
  std::vector<Segment> kept;
  for (int64_t first : *firsts) {
    if (!fresh && first < next_seq) {
      kept.push_back({first, next_seq - 1});
      continue;
    }
    if (unlink(SegmentName(dir, first).c_str()) != 0) {
      return FileError("cannot delete stale log segment", SegmentName(dir, first));
    }
  }
  for (int i = 0; fresh && i < kSpares; ++i) {
    // Their records could have the seqs of the new job's first ones.
    const std::string spare = absl::StrCat(dir, "/spare.", i);
    if (unlink(spare.c_str()) != 0 && errno != ENOENT) {
      return FileError("cannot delete stale log file", spare);
    }
  }
  return std::unique_ptr<UpdateLog>(new UpdateLog(dir, fsync, std::move(kept)));
}

absl::Status UpdateLog::StartSegment(int64_t first) {
  const std::string path = SegmentPath(first);
  if (!spares_.empty()) {
    // Written from its start; a reader stops at the older records past the new ones.
    const std::string spare = SparePath(spares_.back());
    if (rename(spare.c_str(), path.c_str()) != 0) return FileError("cannot reuse log file", spare);
    spares_.pop_back();
    fd_ = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  } else {
    fd_ = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  }
  if (fd_ < 0) return FileError("cannot create log segment", path);
  // The new file's name must survive a crash too. Listed only once that holds: a failed sync
  // leaves the segment to the retry, which starts it again (listed twice, a later Rotate
  // would move the live file away with the stale entry).
  if (fsync_) RETURN_IF_ERROR(SyncDirectory(dir_));
  segments_.push_back({first, first - 1});
  size_ = 0;
  return absl::OkStatus();
}

absl::Status UpdateLog::Append(int64_t first_seq, absl::Span<const EncodedRecord* const> records) {
  if (!broken_.ok()) return broken_;
  if (fd_ < 0) {
    if (absl::Status st = StartSegment(first_seq); !st.ok()) {
      if (fd_ >= 0) close(fd_);
      fd_ = -1;
      return st;
    }
  }
  std::vector<std::array<char, kHeadBytes>> heads(records.size());
  std::vector<iovec> iov;
  int64_t bytes = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    const EncodedRecord& r = *records[i];
    if (r.payload_bytes() > UINT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("update record of ", r.payload_bytes(), " bytes is too large for the log"));
    }
    const uint32_t magic = kMagic, size = static_cast<uint32_t>(r.payload_bytes());
    const uint64_t seq = static_cast<uint64_t>(first_seq) + i;
    char* h = heads[i].data();
    std::memcpy(h, &magic, 4);
    std::memcpy(h + 4, &size, 4);
    std::memcpy(h + 8, &seq, 8);
    std::memcpy(h + 16, &r.checksum_, 8);
    const uint64_t head_sum = Checksum(h, 24);
    std::memcpy(h + 24, &head_sum, 8);
    iov.push_back({h, kHeadBytes});
    for (const EncodedRecord::Piece& p : r.pieces_) {
      if (p.size == 0) continue;
      const char* at = p.raw != nullptr ? p.raw : r.bytes_.data() + p.offset;
      iov.push_back({const_cast<char*>(at), p.size});
    }
    bytes += static_cast<int64_t>(kHeadBytes) + r.payload_bytes();
  }
  absl::Status st =
      WriteFully(fd_, &iov, "cannot write log segment", SegmentPath(segments_.back().first));
  if (st.ok() && fsync_ && fdatasync(fd_) != 0) {
    st = FileError("cannot sync log segment", SegmentPath(segments_.back().first));
  }
  if (!st.ok()) {
    // Nothing of a failed batch may be replayed: cut the segment back to where it was.
    if (ftruncate(fd_, size_) != 0 || lseek(fd_, size_, SEEK_SET) != size_ ||
        (fsync_ && fdatasync(fd_) != 0)) {
      broken_ = absl::InternalError(absl::StrCat("update log ", SegmentPath(segments_.back().first),
                                                 " could not be cut back after a failed write (",
                                                 st.message(), "): ", std::strerror(errno)));
    }
    return st;
  }
  size_ += bytes;
  segments_.back().last = first_seq + static_cast<int64_t>(records.size()) - 1;
  return absl::OkStatus();
}

absl::Status UpdateLog::Rotate(int64_t snapshot_seq) {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  std::vector<Segment> kept;
  for (const Segment& s : segments_) {
    const std::string path = SegmentPath(s.first);
    if (s.last > snapshot_seq) {
      kept.push_back(s);
    } else if (static_cast<int>(spares_.size()) < kSpares) {
      int slot = 0;  // A spare name not in use.
      while (std::find(spares_.begin(), spares_.end(), slot) != spares_.end()) ++slot;
      if (rename(path.c_str(), SparePath(slot).c_str()) != 0) {
        return FileError("cannot set aside log segment", path);
      }
      spares_.push_back(slot);
    } else if (unlink(path.c_str()) != 0 && errno != ENOENT) {
      return FileError("cannot delete log segment", path);
    }
  }
  segments_ = std::move(kept);
  return absl::OkStatus();
}

absl::Status UpdateLog::ReadSegments(const std::string& root, const std::string& job,
                                     std::vector<state::UpdateRecord>* out) {
  const std::string dir = absl::StrCat(root, "/", job);
  auto firsts = ListSegments(dir);
  if (!firsts.ok()) return firsts.status();
  for (int64_t first : *firsts) {
    const std::string path = SegmentName(dir, first);
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (!in.is_open()) return FileError("cannot open log segment", path);
    std::string bytes(static_cast<size_t>(in.tellg()), '\0');
    in.seekg(0);
    if (!in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()))) {
      return FileError("cannot read log segment", path);
    }
    if (absl::Status st = ParseSegment(path, first, bytes, out); !st.ok()) return st;
  }
  return absl::OkStatus();
}

bool UpdateLog::HasSegments(const std::string& root, const std::string& job) {
  const absl::StatusOr<std::vector<int64_t>> firsts = ListSegments(absl::StrCat(root, "/", job));
  return firsts.ok() && !firsts->empty();
}

absl::Status UpdateLog::Remove(const std::string& root, const std::string& job) {
  const std::string dir = absl::StrCat(root, "/", job);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot delete ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace gradmesh
