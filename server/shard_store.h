// ShardStore: a shard's durable state in RocksDB.
//
// Per job it keeps the layout (InitJob request), the latest snapshot (every owned chunk's
// values, optimizer slots and version; per-worker progress and recent request ids) and an
// ordered log of updates applied since that snapshot. A shard restarted on the same directory
// loads the snapshot and replays the log (server/shard.cc), so it resumes exactly where the
// last logged update left it.
//
// Keys (job names are [A-Za-z0-9_.-]+, so '/' separates safely):
//   m/<job>            InitJobRequest without initial values
//   s/<job>            state::JobSnapshot, naming the chunk file that holds its chunk states
//   c/<job>/<idx:16x>  state::ChunkState of partition chunk idx: the chunk states as stores
//                      written before the chunk files kept them (still read, and dropped by
//                      snapshots)
//   l/<job>/<seq:16x>  state::UpdateRecord, seq > snapshot seq: the log as stores written
//                      before the log files kept it (still read, and dropped by snapshots)
// and beside them, as files, the every_update log (server/update_log.h) and the snapshots'
// chunk states (server/chunks_file.h):
//   <dir>/updates/<job>/<first seq:16x>.log
//   <dir>/updates/<job>/chunks.<0|1|2>
// RocksDB's write-ahead log, CRC and memtable cost several copies of every gradient and
// serialised the pushes; an append-only file written with one writev per group of
// concurrent records references the gradients' bytes where they are (see README.md,
// "Durability cost").
//
// Writes go through RocksDB's write-ahead log, or the files' writes. With fsync=false
// (default) a write survives the process dying (kill -9) but not the machine; fsync=true
// survives both and costs an fsync per write (per group of records for the log files).
//
// Thread safety: all methods may be called concurrently (RocksDB is thread-safe); each
// UpdateLog is its caller's to serialise (ShardDurability orders log appends).
#ifndef GRADMESH_SERVER_SHARD_STORE_H_
#define GRADMESH_SERVER_SHARD_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/gradmesh.pb.h"
#include "server/state.pb.h"

namespace rocksdb {
class DB;
class WriteBatch;
}  // namespace rocksdb

namespace gradmesh {

class ChunksFileWriter;
class UpdateLog;

// What a snapshot writes to RocksDB beside its record. A snapshot writes its chunks to a file
// (OpenChunksFile) and passes a SnapshotWrite without chunks; AddChunk writes chunk states as
// RocksDB keys c/<job>/<idx>, the format of snapshots before chunk files, which stores
// written before hold (and tests write). Not thread-safe.
class SnapshotWrite {
 public:
  explicit SnapshotWrite(std::string job);
  ~SnapshotWrite();
  SnapshotWrite(const SnapshotWrite&) = delete;
  SnapshotWrite& operator=(const SnapshotWrite&) = delete;

  // Chunk `idx`'s state: `values` and `slots` are float32 arrays' bytes, copied here.
  void AddChunk(int64_t idx, int64_t version, absl::string_view values, absl::string_view slots);
  // Deletes the job's chunk keys (those added after this call stay): once, when a snapshot
  // first names a chunk file.
  void DropChunkKeys();

 private:
  friend class ShardStore;
  const std::string job_;
  std::unique_ptr<rocksdb::WriteBatch> batch_;
  int64_t bytes_ = 0;  // Keys and values added.
};

class ShardStore {
 public:
  struct Options {
    bool fsync = false;  // Sync the WAL on every write. Default false (see above).
  };

  // Opens (creating if needed) the database in `dir`. Internal error naming the directory if
  // RocksDB cannot open it (e.g. another process holds its lock).
  static absl::StatusOr<std::unique_ptr<ShardStore>> Open(const std::string& dir, Options options);
  ~ShardStore();

  const std::string& dir() const { return dir_; }

  // Appends an update record to the job's log in RocksDB (key l/<job>/<seq>): the format
  // before UpdateLog, still read by LoadAll; ShardDurability writes through OpenLog instead.
  absl::Status AppendUpdate(const std::string& job, const state::UpdateRecord& record);

  // The job's update log files (server/update_log.h) under <dir>/updates, whose next record
  // is `next_seq` (`fresh`: a new job, delete whatever segments are there). Syncs as
  // Options.fsync says.
  absl::StatusOr<std::unique_ptr<UpdateLog>> OpenLog(const std::string& job, int64_t next_seq,
                                                     bool fresh);
  // Deletes the job's update log files.
  absl::Status RemoveLog(const std::string& job);

  // Starts writing chunk file `slot` (0, 1 or 2) of `job` (server/chunks_file.h) over what it
  // held; its Finish syncs as Options.fsync says. Internal error naming the path.
  absl::StatusOr<std::unique_ptr<ChunksFileWriter>> OpenChunksFile(const std::string& job,
                                                                   int slot);

  // Atomically writes a snapshot of `write`'s job (and the layout, when `layout` is non-null,
  // as InitJob does) and drops log records with seq <= snapshot.seq(). Its chunks are those of
  // the file snapshot.chunks_file() names (written and finished before), or without one, those
  // added to `write`. Returns the bytes written (the chunk file's included). `write` is used up.
  absl::StatusOr<int64_t> WriteSnapshot(SnapshotWrite* write, const InitJobRequest* layout,
                                        const state::JobSnapshot& snapshot);

  // Deletes everything of `job` (layout, snapshot, chunks, log) in one atomic write.
  absl::Status DeleteJob(const std::string& job);

  struct StoredJob {
    InitJobRequest layout;
    state::JobSnapshot snapshot;
    std::map<int64_t, state::ChunkState> chunks;
    std::vector<state::UpdateRecord> log;  // seq > snapshot.seq, ascending.
  };

  // Every job in the store: its chunks from the snapshot's chunk file (or keys); its log is the
  // RocksDB records, then the log files' (each segment
  // up to a torn tail). DataLoss naming the key or file if a value cannot be parsed, or if the
  // log does not hold every seq after the snapshot's exactly once, in order.
  absl::StatusOr<std::vector<StoredJob>> LoadAll();

  // Where the jobs' update log files are: <dir>/updates/<job>/ (server/update_log.h).
  std::string log_root() const;

 private:
  ShardStore(std::string dir, Options options, std::unique_ptr<rocksdb::DB> db);
  absl::Status LoadLogFiles(StoredJob* job) const;

  const std::string dir_;
  const Options options_;
  const std::unique_ptr<rocksdb::DB> db_;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_SHARD_STORE_H_
