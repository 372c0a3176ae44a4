// CoordinatorStore: the coordinator's job and node tables in RocksDB (--data_dir).
//
// Keys (a prefix, then the job id or node name whole, never split; values are protos):
//   j/<job_id>   coordinator_state::JobRecord
//   n/<name>     coordinator_state::NodeRecord
//   m/<job_id>/<kind>/h          a published model's ModelHeader (proto/coordinator.proto)
//   m/<job_id>/<kind>/d<index>   its payload, in kModelChunkBytes pieces (index: 8 digits)
//
// Every Write is one atomic RocksDB batch written with sync=true (fsync of the WAL), so a
// record the coordinator acted on survives a crash of the machine, not just of the process.
//
// Thread safety: all methods may be called concurrently (RocksDB is thread-safe); the
// coordinator serialises its writes itself.
#ifndef GRADMESH_COORDINATOR_COORDINATOR_STORE_H_
#define GRADMESH_COORDINATOR_COORDINATOR_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
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

  // Writes (replacing) the given records and deletes the jobs with the ids in `delete_jobs`
  // (and their published models), in one atomic batch.
  absl::Status Write(const std::vector<const coordinator_state::JobRecord*>& jobs,
                     const std::vector<const coordinator_state::NodeRecord*>& nodes,
                     const std::vector<std::string>& delete_jobs = {});

  // Number of batches written so far (tests check that reads write nothing).
  int64_t writes() const { return writes_.load(); }

  // Every stored record. DataLoss naming the key if a value cannot be parsed.
  absl::StatusOr<std::vector<coordinator_state::JobRecord>> LoadJobs() const;
  absl::StatusOr<std::vector<coordinator_state::NodeRecord>> LoadNodes() const;

  // Published models (one per job and kind). Pieces of this size: the unit GetModel streams.
  static constexpr size_t kModelChunkBytes = 1 << 20;
  // Replaces the model of (header.job_id, header.kind) by `header` and `payload` in one atomic
  // batch (a reader sees the old model or the new one, never a mix). The caller validated
  // them. Internal naming the directory on a RocksDB error (then nothing changed).
  absl::Status PutModel(const ModelHeader& header, absl::string_view payload)
      ABSL_LOCKS_EXCLUDED(model_mu_);
  // Reads the model of (job_id, kind) from one snapshot: `on_header` with its header, then
  // `on_data` with each stored piece in order (a callback returning false stops the read:
  // Cancelled). NotFound when none is stored; DataLoss naming the key if a header cannot be
  // parsed or the pieces do not add up to header.total_bytes.
  absl::Status ReadModel(const std::string& job_id, ModelKind kind,
                         const std::function<bool(const ModelHeader&)>& on_header,
                         const std::function<bool(absl::string_view)>& on_data) const;
  // Deletes every published model of the job (no-op when none).
  absl::Status DeleteModels(const std::string& job_id);

 private:
  CoordinatorStore(std::string dir, Options options, std::unique_ptr<rocksdb::DB> db);

  const std::string dir_;
  const Options options_;
  const std::unique_ptr<rocksdb::DB> db_;
  std::atomic<int64_t> writes_{0};
  // Serialises PutModel: each lists the pieces it replaces, so two must not interleave.
  absl::Mutex model_mu_;
};

}  // namespace gradmesh

#endif  // GRADMESH_COORDINATOR_COORDINATOR_STORE_H_
