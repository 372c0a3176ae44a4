// CoordinatorStore: the coordinator's job and node tables in RocksDB (--data_dir).
//
// Keys (a prefix, then the job id or node name whole; values are protos):
// after the prefix and never split):
//   j/<job_id>   coordinator_state::JobRecord
//   n/<name>     coordinator_state::NodeRecord
//
// Every Write is one atomic RocksDB batch written with sync=true (fsync of the WAL), so a
// record the coordinator acted on survives a crash of the machine, not just of the process.
//
// Thread safety: all methods may be called concurrently (RocksDB is thread-safe); the
// coordinator serialises its writes itself.
#ifndef GRADMESH_COORDINATOR_COORDINATOR_STORE_H_
#define GRADMESH_COORDINATOR_COORDINATOR_STORE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/state.pb.h"

namespace rocksdb {
class DB;
}  // namespace rocksdb

namespace gradmesh {

class CoordinatorStore {
 public:
  struct Options {
    // fsync the WAL on every write. Default true: submits, cancels and placement changes are
    // rare and must not be lost.
    bool sync = true;
  };

  // Opens (creating if needed) the database in `dir`. Internal naming the directory if RocksDB
  // cannot open it (e.g. another coordinator holds its lock).
  static absl::StatusOr<std::unique_ptr<CoordinatorStore>> Open(const std::string& dir,
                                                                Options options);
  ~CoordinatorStore();

  const std::string& dir() const { return dir_; }

  // Writes (replacing) the given records in one atomic batch.
  absl::Status Write(const std::vector<const coordinator_state::JobRecord*>& jobs,
                     const std::vector<const coordinator_state::NodeRecord*>& nodes);

  // Every stored record. DataLoss naming the key if a value cannot be parsed.
  absl::StatusOr<std::vector<coordinator_state::JobRecord>> LoadJobs() const;
  absl::StatusOr<std::vector<coordinator_state::NodeRecord>> LoadNodes() const;

 private:
  CoordinatorStore(std::string dir, Options options, std::unique_ptr<rocksdb::DB> db);

  const std::string dir_;
  const Options options_;
  const std::unique_ptr<rocksdb::DB> db_;
};

}  // namespace gradmesh

#endif  // GRADMESH_COORDINATOR_COORDINATOR_STORE_H_
