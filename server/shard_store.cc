#include "server/shard_store.h"

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "server/chunks_file.h"
#include "server/update_log.h"

namespace gradmesh {
namespace {

std::string MetaKey(const std::string& job) { return absl::StrCat("m/", job); }
std::string SnapKey(const std::string& job) { return absl::StrCat("s/", job); }
std::string ChunkPrefix(const std::string& job) { return absl::StrCat("c/", job, "/"); }
std::string ChunkKey(const std::string& job, int64_t idx) {
  return absl::StrFormat("c/%s/%016x", job, idx);
}
std::string LogPrefix(const std::string& job) { return absl::StrCat("l/", job, "/"); }
std::string LogKey(const std::string& job, int64_t seq) {
  return absl::StrFormat("l/%s/%016x", job, seq);
}

// Keys of a job's chunks and log records run from PREFIX up to (not including) the prefix
// with its last byte, '/', replaced by the next one, '0'.
std::string EndOfPrefix(std::string prefix) {
  prefix.back() = '0';
  return prefix;
}

absl::Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("RocksDB ", what, ": ", s.ToString()));
}

}  // namespace

ShardStore::ShardStore(std::string dir, Options options, std::unique_ptr<rocksdb::DB> db)
    : dir_(std::move(dir)), options_(options), db_(std::move(db)) {}

ShardStore::~ShardStore() = default;

absl::StatusOr<std::unique_ptr<ShardStore>> ShardStore::Open(const std::string& dir,
                                                             Options options) {
  rocksdb::Options o;
  o.create_if_missing = true;
  o.compression = rocksdb::kNoCompression;  // Float data barely compresses.
  o.write_buffer_size = 64 << 20;
  // A write-ahead log cut short by a crash (its last record torn) is recovered up to the tear;
  // one damaged elsewhere is an error at open. RocksDB's default recovery stops at the first
  // damage without a word, and the jobs written after it would be forgotten. (A log file
  // removed is not noticed here: Shard::Restore reports the update logs it leaves orphaned.)
  o.wal_recovery_mode = rocksdb::WALRecoveryMode::kTolerateCorruptedTailRecords;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(o, dir, &raw);
  if (!s.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot open shard state in ", dir, ": ", s.ToString()));
  }
  return std::unique_ptr<ShardStore>(
      new ShardStore(dir, options, std::unique_ptr<rocksdb::DB>(raw)));
}

absl::Status ShardStore::AppendUpdate(const std::string& job, const state::UpdateRecord& record) {
  rocksdb::WriteOptions w;
  w.sync = options_.fsync;
  return FromRocks(db_->Put(w, LogKey(job, record.seq()), record.SerializeAsString()),
                   absl::StrCat("log append for job ", job, " in ", dir_));
}

std::string ShardStore::log_root() const { return absl::StrCat(dir_, "/updates"); }

absl::StatusOr<std::unique_ptr<UpdateLog>> ShardStore::OpenLog(const std::string& job,
                                                               int64_t next_seq, bool fresh) {
  auto log = UpdateLog::Open(log_root(), job, next_seq, fresh, options_.fsync);
  if (!log.ok()) {
    return absl::Status(log.status().code(), absl::StrCat("opening the update log of job ", job,
                                                          ": ", log.status().message()));
  }
  return log;
}

absl::Status ShardStore::RemoveLog(const std::string& job) {
  return UpdateLog::Remove(log_root(), job);
}

absl::StatusOr<std::unique_ptr<ChunksFileWriter>> ShardStore::OpenChunksFile(const std::string& job,
                                                                             int slot) {
  return ChunksFileWriter::Open(ChunksFilePath(absl::StrCat(log_root(), "/", job), slot),
                                options_.fsync);
}

absl::Status ShardStore::DeleteJob(const std::string& job) {
  rocksdb::WriteBatch batch;
  batch.Delete(MetaKey(job));
  batch.Delete(SnapKey(job));
  batch.DeleteRange(ChunkPrefix(job), EndOfPrefix(ChunkPrefix(job)));
  batch.DeleteRange(LogPrefix(job), EndOfPrefix(LogPrefix(job)));
  rocksdb::WriteOptions w;
  w.sync = options_.fsync;
  absl::Status st =
      FromRocks(db_->Write(w, &batch), absl::StrCat("deleting job ", job, " in ", dir_));
  if (!st.ok()) return st;
  // After the layout is gone: leftover segments of a job without layout are never read (and
  // a job created under the name again deletes them before its first snapshot).
  return RemoveLog(job);
}

SnapshotWrite::SnapshotWrite(std::string job)
    : job_(std::move(job)), batch_(std::make_unique<rocksdb::WriteBatch>()) {}

SnapshotWrite::~SnapshotWrite() = default;

void SnapshotWrite::AddChunk(int64_t idx, int64_t version, absl::string_view values,
                             absl::string_view slots) {
  state::ChunkState chunk;
  chunk.set_version(version);
  chunk.set_values(values.data(), values.size());
  chunk.set_slots(slots.data(), slots.size());
  const std::string key = ChunkKey(job_, idx);
  const std::string value = chunk.SerializeAsString();
  batch_->Put(key, value);
  bytes_ += static_cast<int64_t>(key.size() + value.size());
}

void SnapshotWrite::DropChunkKeys() {
  batch_->DeleteRange(ChunkPrefix(job_), EndOfPrefix(ChunkPrefix(job_)));
}

absl::StatusOr<int64_t> ShardStore::WriteSnapshot(SnapshotWrite* write,
                                                  const InitJobRequest* layout,
                                                  const state::JobSnapshot& snapshot) {
  const std::string& job = write->job_;
  rocksdb::WriteBatch& batch = *write->batch_;
  int64_t bytes = write->bytes_;
  if (snapshot.has_chunks_file()) bytes += snapshot.chunks_file().bytes();
  auto put = [&](const std::string& key, const std::string& value) {
    bytes += static_cast<int64_t>(key.size() + value.size());
    batch.Put(key, value);
  };
  if (layout != nullptr) put(MetaKey(job), layout->SerializeAsString());
  put(SnapKey(job), snapshot.SerializeAsString());
  batch.DeleteRange(LogKey(job, 0), LogKey(job, snapshot.seq() + 1));
  rocksdb::WriteOptions w;
  w.sync = options_.fsync;
  absl::Status st =
      FromRocks(db_->Write(w, &batch), absl::StrCat("snapshot of job ", job, " in ", dir_));
  batch.Clear();
  if (!st.ok()) return st;
  return bytes;
}

absl::StatusOr<std::vector<ShardStore::StoredJob>> ShardStore::LoadAll() {
  std::vector<StoredJob> jobs;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek("m/"); it->Valid() && it->key().starts_with("m/"); it->Next()) {
    StoredJob job;
    if (!job.layout.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) {
      return absl::DataLossError(
          absl::StrCat("corrupt job layout at key ", it->key().ToString(), " in ", dir_));
    }
    jobs.push_back(std::move(job));
  }
  if (!it->status().ok()) return FromRocks(it->status(), "scan");
  for (StoredJob& job : jobs) {
    const std::string& name = job.layout.job();
    std::string value;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), SnapKey(name), &value);
    if (!s.ok() || !job.snapshot.ParseFromString(value)) {
      return absl::DataLossError(
          absl::StrCat("job ", name, " has no readable snapshot in ", dir_, ": ", s.ToString()));
    }
    if (job.snapshot.has_chunks_file()) {
      const state::ChunksFileRef& ref = job.snapshot.chunks_file();
      ASSIGN_OR_RETURN(
          job.chunks,
          ReadChunksFile(ChunksFilePath(absl::StrCat(log_root(), "/", name), ref.slot()), ref));
    }
    const std::string cp = ChunkPrefix(name);
    for (it->Seek(cp); !job.snapshot.has_chunks_file() && it->Valid() && it->key().starts_with(cp);
         it->Next()) {
      const std::string hex = it->key().ToString().substr(cp.size());
      const int64_t idx = static_cast<int64_t>(std::stoull(hex, nullptr, 16));
      state::ChunkState chunk;
      if (!chunk.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) {
        return absl::DataLossError(
            absl::StrCat("corrupt chunk state at key ", it->key().ToString(), " in ", dir_));
      }
      job.chunks.emplace(idx, std::move(chunk));
    }
    const std::string lp = LogPrefix(name);
    for (it->Seek(lp); it->Valid() && it->key().starts_with(lp); it->Next()) {
      state::UpdateRecord rec;
      if (!rec.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) {
        return absl::DataLossError(
            absl::StrCat("corrupt update record at key ", it->key().ToString(), " in ", dir_));
      }
      if (rec.seq() > job.snapshot.seq()) job.log.push_back(std::move(rec));
    }
    if (!it->status().ok()) return FromRocks(it->status(), "scan");
    RETURN_IF_ERROR(LoadLogFiles(&job));
  }
  return jobs;
}

absl::Status ShardStore::LoadLogFiles(StoredJob* job) const {
  const std::string& name = job->layout.job();
  std::vector<state::UpdateRecord> records;
  RETURN_IF_ERROR(UpdateLog::ReadSegments(log_root(), name, &records));
  for (state::UpdateRecord& rec : records) {
    if (rec.seq() > job->snapshot.seq()) job->log.push_back(std::move(rec));
  }
  // Records in RocksDB (written before the log files) come first; replay needs every seq
  // after the snapshot's, once each, in order.
  int64_t want = job->snapshot.seq() + 1;
  for (const state::UpdateRecord& rec : job->log) {
    if (rec.seq() != want) {
      return absl::DataLossError(
          absl::StrCat("the update log of job ", name, " in ", dir_, " has record ", rec.seq(),
                       " where ", want, " should be (after snapshot ", job->snapshot.seq(), ")"));
    }
    ++want;
  }
  return absl::OkStatus();
}

}  // namespace gradmesh
