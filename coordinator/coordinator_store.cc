// RocksDB tables of the coordinator (see coordinator_store.h).
#include "coordinator/coordinator_store.h"

#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace gradmesh {
namespace {

constexpr char kJobPrefix[] = "j/";
constexpr char kNodePrefix[] = "n/";

template <typename Record>
absl::StatusOr<std::vector<Record>> LoadPrefix(rocksdb::DB* db, const std::string& prefix,
                                               const std::string& dir) {
  std::vector<Record> out;
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    Record record;
    if (!record.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) {
      return absl::DataLossError(
          absl::StrCat("coordinator table in ", dir, ": cannot parse key ", it->key().ToString()));
    }
    out.push_back(std::move(record));
  }
  if (!it->status().ok()) {
    return absl::InternalError(
        absl::StrCat("coordinator table in ", dir, ": ", it->status().ToString()));
  }
  return out;
}

}  // namespace

CoordinatorStore::CoordinatorStore(std::string dir, Options options,
                                   std::unique_ptr<rocksdb::DB> db)
    : dir_(std::move(dir)), options_(options), db_(std::move(db)) {}

CoordinatorStore::~CoordinatorStore() = default;

absl::StatusOr<std::unique_ptr<CoordinatorStore>> CoordinatorStore::Open(const std::string& dir,
                                                                         Options options) {
  rocksdb::Options o;
  o.create_if_missing = true;
  o.write_buffer_size = 4 << 20;  // Small tables.
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(o, dir, &raw);
  if (!s.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot open coordinator tables in ", dir, ": ", s.ToString()));
  }
  return std::unique_ptr<CoordinatorStore>(
      new CoordinatorStore(dir, options, std::unique_ptr<rocksdb::DB>(raw)));
}

absl::Status CoordinatorStore::Write(
    const std::vector<const coordinator_state::JobRecord*>& jobs,
    const std::vector<const coordinator_state::NodeRecord*>& nodes) {
  if (jobs.empty() && nodes.empty()) return absl::OkStatus();
  rocksdb::WriteBatch batch;
  for (const auto* job : jobs) {
    batch.Put(absl::StrCat(kJobPrefix, job->status().job_id()), job->SerializeAsString());
  }
  for (const auto* node : nodes) {
    batch.Put(absl::StrCat(kNodePrefix, node->info().name()), node->SerializeAsString());
  }
  rocksdb::WriteOptions w;
  w.sync = options_.sync;
  rocksdb::Status s = db_->Write(w, &batch);
  if (!s.ok()) {
    return absl::InternalError(
        absl::StrCat("writing coordinator tables in ", dir_, ": ", s.ToString()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<coordinator_state::JobRecord>> CoordinatorStore::LoadJobs() const {
  return LoadPrefix<coordinator_state::JobRecord>(db_.get(), kJobPrefix, dir_);
}

absl::StatusOr<std::vector<coordinator_state::NodeRecord>> CoordinatorStore::LoadNodes() const {
  return LoadPrefix<coordinator_state::NodeRecord>(db_.get(), kNodePrefix, dir_);
}

}  // namespace gradmesh
