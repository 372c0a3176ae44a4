#include "server/chunks_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace gradmesh {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "chunk files are written little-endian");

constexpr uint32_t kMagic = 0x31474d43;  // "CMG1" on disk.
constexpr size_t kFileHead = 8;          // magic, zero.
constexpr size_t kChunkHead = 32;        // index, version, values bytes, slots bytes.

absl::Status Damaged(const std::string& path, const std::string& what) {
  return absl::DataLossError(absl::StrCat("snapshot chunk file ", path, ": ", what,
                                          " (the file was damaged or replaced after the "
                                          "snapshot that names it was written)"));
}

}  // namespace

std::string ChunksFilePath(const std::string& dir, int slot) {
  return absl::StrCat(dir, "/chunks.", slot);
}

ChunksFileWriter::ChunksFileWriter(std::string path, int fd, bool fsync)
    : path_(std::move(path)), fd_(fd), fsync_(fsync) {}

ChunksFileWriter::~ChunksFileWriter() {
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<std::unique_ptr<ChunksFileWriter>> ChunksFileWriter::Open(const std::string& path,
                                                                         bool fsync) {
  const std::string dir = std::filesystem::path(path).parent_path().string();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  // Written over in place (no O_TRUNC): the pages cached from the last time are reused.
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return FileError("cannot open snapshot chunk file", path);
  auto writer = std::unique_ptr<ChunksFileWriter>(new ChunksFileWriter(path, fd, fsync));
  const uint32_t head[2] = {kMagic, 0};
  writer->Write({{const_cast<uint32_t*>(head), kFileHead}});
  return writer;
}

void ChunksFileWriter::Write(std::vector<iovec> iov) {
  if (!status_.ok()) return;
  int64_t bytes = 0;
  for (const iovec& v : iov) {
    // (An empty array's data() may be null, which the checksum's memcpy must not get.)
    if (v.iov_len > 0) checksum_.Update(static_cast<const char*>(v.iov_base), v.iov_len);
    bytes += static_cast<int64_t>(v.iov_len);
  }
  status_ = WriteFully(fd_, &iov, "cannot write snapshot chunk file", path_);
  size_ += bytes;
}

void ChunksFileWriter::Add(int64_t index, int64_t version, absl::string_view values,
                           absl::string_view slots) {
  const uint64_t head[4] = {static_cast<uint64_t>(index), static_cast<uint64_t>(version),
                            values.size(), slots.size()};
  Write({{const_cast<uint64_t*>(head), kChunkHead},
         {const_cast<char*>(values.data()), values.size()},
         {const_cast<char*>(slots.data()), slots.size()}});
  ++chunks_;
}

absl::StatusOr<state::ChunksFileRef> ChunksFileWriter::Finish() {
  if (status_.ok() && ftruncate(fd_, static_cast<off_t>(size_)) != 0) {
    status_ = FileError("cannot cut snapshot chunk file", path_);
  }
  if (status_.ok() && fsync_ && fdatasync(fd_) != 0) {
    status_ = FileError("cannot sync snapshot chunk file", path_);
  }
  if (close(fd_) != 0 && status_.ok()) {
    status_ = FileError("cannot close snapshot chunk file", path_);
  }
  fd_ = -1;
  if (status_.ok() && fsync_) {
    // The file's name, and its directory's in updates/ (either may be new: this job's first
    // snapshot, or an earlier attempt that created the file and failed), must survive a crash
    // before the snapshot naming it is written. Two fsyncs per snapshot.
    const std::filesystem::path dir = std::filesystem::path(path_).parent_path();
    status_ = SyncDirectory(dir.string());
    if (status_.ok()) status_ = SyncDirectory(dir.parent_path().string());
  }
  if (!status_.ok()) return status_;
  state::ChunksFileRef ref;
  ref.set_bytes(size_);
  ref.set_chunks(chunks_);
  ref.set_checksum(checksum_.Finish());
  return ref;
}

absl::StatusOr<std::map<int64_t, state::ChunkState>> ReadChunksFile(
    const std::string& path, const state::ChunksFileRef& ref) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) return Damaged(path, "is missing");
  if (fd < 0) return FileError("cannot open snapshot chunk file", path);
  struct stat st;
  std::string bytes;
  bool read_ok = fstat(fd, &st) == 0;
  if (read_ok && st.st_size != ref.bytes()) {
    // Before anything is allocated: a damaged size (a file grown to a terabyte) is this error,
    // not an allocation of its size.
    close(fd);
    return Damaged(path, absl::StrCat("holds ", st.st_size, " bytes, not ", ref.bytes()));
  }
  if (read_ok) bytes.resize(static_cast<size_t>(st.st_size));
  for (size_t at = 0; read_ok && at < bytes.size();) {
    const ssize_t r = read(fd, bytes.data() + at, bytes.size() - at);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      read_ok = false;
      if (r == 0) errno = EIO;  // Shorter than its size a moment ago.
    }
    at += r > 0 ? static_cast<size_t>(r) : 0;
  }
  const absl::Status read_error =
      read_ok ? absl::OkStatus() : FileError("cannot read snapshot chunk file", path);
  close(fd);
  if (!read_error.ok()) return read_error;
  if (static_cast<int64_t>(bytes.size()) != ref.bytes()) {
    return Damaged(path, absl::StrCat("holds ", bytes.size(), " bytes, not ", ref.bytes()));
  }
  StreamChecksum sum;
  sum.Update(bytes.data(), bytes.size());
  uint32_t magic = 0;
  if (bytes.size() >= 4) std::memcpy(&magic, bytes.data(), 4);
  if (sum.Finish() != ref.checksum() || bytes.size() < kFileHead || magic != kMagic) {
    return Damaged(path, "its checksum does not match");
  }
  std::map<int64_t, state::ChunkState> chunks;
  size_t at = kFileHead;
  while (at < bytes.size()) {
    uint64_t head[4];
    if (bytes.size() - at < kChunkHead) return Damaged(path, "a chunk header is cut short");
    std::memcpy(head, bytes.data() + at, kChunkHead);
    at += kChunkHead;
    if (head[2] > bytes.size() - at || head[3] > bytes.size() - at - head[2]) {
      return Damaged(path, absl::StrCat("chunk ", static_cast<int64_t>(head[0]), " is cut short"));
    }
    state::ChunkState& c = chunks[static_cast<int64_t>(head[0])];
    c.set_version(static_cast<int64_t>(head[1]));
    c.set_values(bytes.data() + at, head[2]);
    c.set_slots(bytes.data() + at + head[2], head[3]);
    at += head[2] + head[3];
  }
  if (static_cast<int64_t>(chunks.size()) != ref.chunks()) {
    return Damaged(path, absl::StrCat("holds ", chunks.size(), " chunks, not ", ref.chunks()));
  }
  return chunks;
}

}  // namespace gradmesh
