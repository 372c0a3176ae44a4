// RocksDB tables of the coordinator (see coordinator_store.h).
#include "coordinator/coordinator_store.h"

#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace gradmesh {
namespace {

constexpr char kJobPrefix[] = "j/";
constexpr char kNodePrefix[] = "n/";
constexpr char kModelPrefix[] = "m/";

// m/<job>/ : every model of the job. '/' + 1 == '0' ends the range (job ids hold no '/').
std::string JobModelsBegin(const std::string& job_id) {
  return absl::StrCat(kModelPrefix, job_id, "/");
}
std::string JobModelsEnd(const std::string& job_id) {
  return absl::StrCat(kModelPrefix, job_id, "0");
}
std::string ModelPrefix(const std::string& job_id, ModelKind kind) {
  return absl::StrCat(kModelPrefix, job_id, "/", static_cast<int>(kind), "/");
}
std::string ModelPieceKey(const std::string& prefix, size_t index) {
  return absl::StrCat(prefix, absl::StrFormat("d%08d", index));
}

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

absl::Status CoordinatorStore::Write(const std::vector<const coordinator_state::JobRecord*>& jobs,
                                     const std::vector<const coordinator_state::NodeRecord*>& nodes,
                                     const std::vector<std::string>& delete_jobs) {
  if (jobs.empty() && nodes.empty() && delete_jobs.empty()) return absl::OkStatus();
  rocksdb::WriteBatch batch;
  for (const std::string& id : delete_jobs) {
    batch.Delete(absl::StrCat(kJobPrefix, id));
    batch.DeleteRange(JobModelsBegin(id), JobModelsEnd(id));
  }
  for (const auto* job : jobs) {
    batch.Put(absl::StrCat(kJobPrefix, job->status().job_id()), job->SerializeAsString());
  }
  for (const auto* node : nodes) {
    batch.Put(absl::StrCat(kNodePrefix, node->info().name()), node->SerializeAsString());
  }
  rocksdb::WriteOptions w;
  w.sync = options_.sync;
  rocksdb::Status s = db_->Write(w, &batch);
  writes_.fetch_add(1);
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

absl::Status CoordinatorStore::PutModel(const ModelHeader& header, absl::string_view payload) {
  const std::string prefix = ModelPrefix(header.job_id(), header.kind());
  absl::MutexLock lock(&model_mu_);
  rocksdb::WriteBatch batch;
  // The previous model's keys go first; the new ones (same names where they overlap) are
  // written after them in the same batch, so the later Put wins.
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
      batch.Delete(it->key());
    }
    if (!it->status().ok()) {
      return absl::InternalError(
          absl::StrCat("reading the model table in ", dir_, ": ", it->status().ToString()));
    }
  }
  batch.Put(prefix + "h", header.SerializeAsString());
  for (size_t i = 0, off = 0; off < payload.size(); ++i, off += kModelChunkBytes) {
    const absl::string_view piece = payload.substr(off, kModelChunkBytes);
    batch.Put(ModelPieceKey(prefix, i), rocksdb::Slice(piece.data(), piece.size()));
  }
  rocksdb::WriteOptions w;
  w.sync = options_.sync;
  rocksdb::Status s = db_->Write(w, &batch);
  writes_.fetch_add(1);
  if (!s.ok()) {
    return absl::InternalError(absl::StrCat("writing the model of job ", header.job_id(), " in ",
                                            dir_, ": ", s.ToString()));
  }
  return absl::OkStatus();
}

absl::Status CoordinatorStore::ReadModel(
    const std::string& job_id, ModelKind kind,
    const std::function<bool(const ModelHeader&)>& on_header,
    const std::function<bool(absl::string_view)>& on_data) const {
  const std::string prefix = ModelPrefix(job_id, kind);
  rocksdb::ReadOptions r;
  const rocksdb::Snapshot* snapshot = db_->GetSnapshot();
  r.snapshot = snapshot;
  struct Release {
    rocksdb::DB* db;
    const rocksdb::Snapshot* s;
    ~Release() { db->ReleaseSnapshot(s); }
  } release{db_.get(), snapshot};
  std::string value;
  rocksdb::Status s = db_->Get(r, prefix + "h", &value);
  if (s.IsNotFound()) {
    return absl::NotFoundError(
        absl::StrCat("no model of kind ", ModelKind_Name(kind), " stored for job ", job_id));
  }
  if (!s.ok()) {
    return absl::InternalError(absl::StrCat("reading ", prefix, "h in ", dir_, ": ", s.ToString()));
  }
  ModelHeader header;
  if (!header.ParseFromString(value)) {
    return absl::DataLossError(
        absl::StrCat("model table in ", dir_, ": cannot parse key ", prefix, "h"));
  }
  if (!on_header(header)) return absl::CancelledError("model read stopped by the reader");
  int64_t read = 0;
  size_t index = 0;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(r));
  const std::string pieces = prefix + "d";
  for (it->Seek(pieces); it->Valid() && it->key().starts_with(pieces); it->Next(), ++index) {
    if (it->key().ToString() != ModelPieceKey(prefix, index)) {
      return absl::DataLossError(absl::StrCat("model table in ", dir_, ": unexpected key ",
                                              it->key().ToString(), " (piece ", index, ")"));
    }
    read += static_cast<int64_t>(it->value().size());
    if (!on_data(absl::string_view(it->value().data(), it->value().size()))) {
      return absl::CancelledError("model read stopped by the reader");
    }
  }
  if (!it->status().ok()) {
    return absl::InternalError(
        absl::StrCat("reading ", prefix, " in ", dir_, ": ", it->status().ToString()));
  }
  if (read != header.total_bytes()) {
    return absl::DataLossError(absl::StrCat("model table in ", dir_, ": ", prefix, " holds ", read,
                                            " payload bytes, its header says ",
                                            header.total_bytes()));
  }
  return absl::OkStatus();
}

absl::Status CoordinatorStore::DeleteModels(const std::string& job_id) {
  absl::MutexLock lock(&model_mu_);
  rocksdb::WriteBatch batch;
  batch.DeleteRange(JobModelsBegin(job_id), JobModelsEnd(job_id));
  rocksdb::WriteOptions w;
  w.sync = options_.sync;
  rocksdb::Status s = db_->Write(w, &batch);
  writes_.fetch_add(1);
  if (!s.ok()) {
    return absl::InternalError(
        absl::StrCat("deleting the models of job ", job_id, " in ", dir_, ": ", s.ToString()));
  }
  return absl::OkStatus();
}

}  // namespace gradmesh
