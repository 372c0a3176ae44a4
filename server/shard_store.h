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
//   s/<job>            state::JobSnapshot
//   c/<job>/<idx:16x>  state::ChunkState of partition chunk idx
//   l/<job>/<seq:16x>  state::UpdateRecord, seq > snapshot seq
//
// Writes go through RocksDB's write-ahead log. With fsync=false (default) a write survives
// the process dying (kill -9) but not the machine; fsync=true survives both and costs an
// fsync per write.
//
// Thread safety: all methods may be called concurrently (RocksDB is thread-safe); callers
// order log appends themselves.
#ifndef GRADMESH_SERVER_SHARD_STORE_H_
#define GRADMESH_SERVER_SHARD_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/gradmesh.pb.h"
#include "server/state.pb.h"

namespace rocksdb {
class DB;
}  // namespace rocksdb

namespace gradmesh {

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

  // Appends an update record to the job's log.
  absl::Status AppendUpdate(const std::string& job, const state::UpdateRecord& record);

  // Atomically writes a snapshot (and the layout, when `layout` is non-null, as InitJob does)
  // and drops log records with seq <= snapshot.seq(). Returns the bytes written.
  absl::StatusOr<int64_t> WriteSnapshot(const std::string& job, const InitJobRequest* layout,
                                        const std::map<int64_t, state::ChunkState>& chunks,
                                        const state::JobSnapshot& snapshot);

  // Deletes everything of `job` (layout, snapshot, chunks, log) in one atomic write.
  absl::Status DeleteJob(const std::string& job);

  struct StoredJob {
    InitJobRequest layout;
    state::JobSnapshot snapshot;
    std::map<int64_t, state::ChunkState> chunks;
    std::vector<state::UpdateRecord> log;  // seq > snapshot.seq, ascending.
  };

  // Every job in the store. DataLoss naming the key if a value cannot be parsed.
  absl::StatusOr<std::vector<StoredJob>> LoadAll();

 private:
  ShardStore(std::string dir, Options options, std::unique_ptr<rocksdb::DB> db);

  const std::string dir_;
  const Options options_;
  const std::unique_ptr<rocksdb::DB> db_;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_SHARD_STORE_H_
