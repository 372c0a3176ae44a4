// ChunksFile: the chunk states of one job's snapshot (values, optimizer slots, versions) as a
// file beside its update log, <store dir>/updates/<job>/chunks.<slot> (slot 0 or 1 in turn; 2 once
// a snapshot's RocksDB write failed, which may yet name the file it wrote):
//
//   magic u32 | zero u32, then per chunk:
//   index i64 | version i64 | values bytes u64 | slots bytes u64 | values | slots
//
// (little-endian; values and slots are float32 arrays). The file holds no checksum of its
// own: the snapshot record in RocksDB that names it (state::ChunksFileRef: slot, bytes,
// chunks, checksum) is written after the file is complete (and synced with fsync), so a
// snapshot only ever names a whole file, and a file that does not match its record was
// damaged since: DataLoss.
//
// Why a file and not RocksDB keys: a snapshot rewrites every chunk, and through RocksDB each
// byte was copied into the write, its write-ahead log (with a CRC pass), the memtable, then a
// table file, and by compaction again; here it is one checksum pass and the kernel's copy,
// written over the older of two files, whose cached pages are reused (allocating page-cache
// pages afresh is what costs most on the VMs measured; README "Durability cost").
//
// Thread safety: a ChunksFileWriter is its owner's; ReadChunksFile is a function of the file.
#ifndef GRADMESH_SERVER_CHUNKS_FILE_H_
#define GRADMESH_SERVER_CHUNKS_FILE_H_

#include <sys/uio.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/state.pb.h"
#include "server/update_log.h"

namespace gradmesh {

// <dir>/chunks.<slot>
std::string ChunksFilePath(const std::string& dir, int slot);

class ChunksFileWriter {
 public:
  // Starts writing `path` over whatever it holds (creating it and its directory if needed).
  // `fsync`: Finish syncs the file, its directory and that one's parent. Internal error naming
  // the path.
  static absl::StatusOr<std::unique_ptr<ChunksFileWriter>> Open(const std::string& path,
                                                                bool fsync);
  ~ChunksFileWriter();
  ChunksFileWriter(const ChunksFileWriter&) = delete;
  ChunksFileWriter& operator=(const ChunksFileWriter&) = delete;

  // Whether every write so far succeeded.
  bool ok() const { return status_.ok(); }

  // Writes chunk `index`'s state (`values` and `slots`: float32 arrays' bytes) at the end. A
  // failed write is kept and returned by Finish; later Adds do nothing.
  void Add(int64_t index, int64_t version, absl::string_view values, absl::string_view slots);

  // Cuts the file at what was written, syncs it with fsync, closes it, and returns the
  // reference a snapshot record keeps (slot left 0), or the first error, naming the path.
  absl::StatusOr<state::ChunksFileRef> Finish();

 private:
  ChunksFileWriter(std::string path, int fd, bool fsync);
  // Writes `iov` at the end (the file's offset), adding it to the checksum.
  void Write(std::vector<iovec> iov);

  const std::string path_;
  int fd_;
  const bool fsync_;
  int64_t size_ = 0;
  int64_t chunks_ = 0;
  StreamChecksum checksum_;
  absl::Status status_;
};

// The chunk states of the file at `path` as `ref` describes it. DataLoss naming the path if it
// is missing, or its size, checksum, chunk count or framing does not match; Internal error if
// it cannot be opened or read.
absl::StatusOr<std::map<int64_t, state::ChunkState>> ReadChunksFile(
    const std::string& path, const state::ChunksFileRef& ref);

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_CHUNKS_FILE_H_
