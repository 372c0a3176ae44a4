// UpdateLog: one job's write-ahead log of updates (durability every_update), as append-only
// segment files beside the shard's RocksDB (server/shard_store.h):
//
//   <store dir>/updates/<job>/<first seq:016x>.log
//
// A segment is a sequence of frames, each one UpdateRecord:
//
//   magic u32 | payload bytes u32 | seq u64 | payload checksum u64 | header checksum u64
//   payload: the UpdateRecord's protobuf wire bytes without its seq (which the frame holds)
//
// (little-endian). The payload is written from pieces: the record's small fields, encoded
// here, and each gradient's bytes referenced where they already are (a push's decoded
// request), so a record costs one copy, the kernel's, and no RocksDB write-ahead log, CRC or
// memtable. A reader stops a segment at the first frame that is short or whose checksums do
// not match: the tail a writer killed mid-write leaves, which was never acknowledged.
//
// Segments rotate after each snapshot; a segment is deleted once a snapshot covers all its
// records, or kept as a spare file (<dir>/spare.<i>, up to two) that a later segment is
// written over from its start: rewriting cached pages costs about half of allocating new
// ones. A reader also stops a segment at the first frame whose seq does not follow (the
// older records beyond a reused file's new end). Durability is as RocksDB's was: each write reaches
// the kernel before Append returns (survives kill -9); with fsync, also the disk (fdatasync; a new
// segment's directory is synced too).
//
// Thread safety: EncodedRecord is immutable once built. An UpdateLog is NOT thread-safe: its
// owner serialises every call (ShardDurability's group-commit leader); ReadSegments is a
// static function of the files alone.
#ifndef GRADMESH_SERVER_UPDATE_LOG_H_
#define GRADMESH_SERVER_UPDATE_LOG_H_

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/state.pb.h"

namespace gradmesh {

// One update record ready to be written: its protobuf wire bytes as pieces, the gradients'
// bytes referenced (not copied), and the payload's checksum. Built by the pushing thread,
// outside every lock.
class EncodedRecord {
 public:
  // `meta` is the record without its seq and without grads(i).data(), which is `data[i]`
  // (same count as meta.grads()); the bytes `data` refers to must outlive every write of it.
  EncodedRecord(const state::UpdateRecord& meta, const std::vector<absl::string_view>& data);

  int64_t payload_bytes() const { return payload_bytes_; }

 private:
  friend class UpdateLog;
  struct Piece {
    const char* raw;  // Referenced bytes, or null: bytes_ from `offset`.
    size_t offset;
    size_t size;
  };
  void Add(const char* raw, size_t size);

  std::string bytes_;  // The small fields' wire bytes (tags, lengths, ids, versions).
  std::vector<Piece> pieces_;
  int64_t payload_bytes_ = 0;
  uint64_t checksum_ = 0;
};

// 64-bit checksum of a byte stream fed in pieces (four interleaved Fletcher sums over 64-bit
// words; fast, for detecting torn or garbled writes, not tampering).
class StreamChecksum {
 public:
  void Update(const char* data, size_t size);
  uint64_t Finish() const;

 private:
  void Block(const char* p);

  uint64_t a_[4] = {1, 2, 3, 4};
  uint64_t b_[4] = {0, 0, 0, 0};
  char pending_[32];
  size_t pending_size_ = 0;
  uint64_t total_ = 0;
};

// Internal error "<what> <path>: <strerror(errno)>".
absl::Status FileError(const std::string& what, const std::string& path);
// Writes all of `iov` at `fd`'s offset with writev (IOV_MAX entries at a time, a short write
// continued where it stopped; `iov` is used up). Internal error "<what> <path>: ..." if a write
// fails or writes nothing.
absl::Status WriteFully(int fd, std::vector<iovec>* iov, const std::string& what,
                        const std::string& path);
// fsync of directory `dir` (after a file in it was created, renamed or deleted).
absl::Status SyncDirectory(const std::string& dir);

class UpdateLog {
 public:
  // The log of `job` under `root` (<store dir>/updates), whose next record will be `next_seq`.
  // Segments already there hold only records < next_seq (replayed into the state) and are kept
  // until a snapshot covers them, or are all deleted (spares too) if `fresh` (a new job: they
  // belong to a deleted job of the same name). Segments starting at or after next_seq hold no
  // applied record (only a torn tail) and are deleted. Internal error naming the path on failure.
  static absl::StatusOr<std::unique_ptr<UpdateLog>> Open(const std::string& root,
                                                         const std::string& job, int64_t next_seq,
                                                         bool fresh, bool fsync);
  ~UpdateLog();

  UpdateLog(const UpdateLog&) = delete;
  UpdateLog& operator=(const UpdateLog&) = delete;

  // Appends `records` as seq first_seq, first_seq + 1, ... (first_seq continues the log) with
  // one writev (per 1024 pieces), then fdatasync with fsync. On failure nothing of the batch
  // stays in the log (the segment is truncated back) and the error names the file; if even
  // that fails, every later Append fails too.
  absl::Status Append(int64_t first_seq, absl::Span<const EncodedRecord* const> records);

  // Starts a new segment at the next Append and deletes every segment whose records all have
  // seq <= `snapshot_seq` (the snapshot covers them).
  absl::Status Rotate(int64_t snapshot_seq);

  // Records of the segments of `job` under `root`, in order (each segment up to its first
  // torn or garbled frame). No directory: none. Internal error naming the file if one cannot
  // be read, DataLoss if a whole frame's payload is not an UpdateRecord.
  static absl::Status ReadSegments(const std::string& root, const std::string& job,
                                   std::vector<state::UpdateRecord>* out);

  // Whether the log of `job` under `root` has segment files (false if they cannot be listed).
  static bool HasSegments(const std::string& root, const std::string& job);

  // Deletes the log of `job` under `root` (all its segments and the directory).
  static absl::Status Remove(const std::string& root, const std::string& job);

 private:
  struct Segment {
    int64_t first;
    int64_t last;  // Highest seq it may hold.
  };
  UpdateLog(std::string dir, bool fsync, std::vector<Segment> segments);
  std::string SegmentPath(int64_t first) const;
  std::string SparePath(int i) const;
  absl::Status StartSegment(int64_t first);

  const std::string dir_;
  const bool fsync_;
  std::vector<Segment> segments_;  // Ascending; the last is open when fd_ >= 0.
  std::vector<int> spares_;        // Deleted segments kept for reuse, as spare.<i>.
  int fd_ = -1;
  int64_t size_ = 0;     // Bytes of the open segment.
  absl::Status broken_;  // Set when a failed append could not be undone.
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_UPDATE_LOG_H_
