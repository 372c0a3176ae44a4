#include "server/shard_durability.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "server/chunks_file.h"
#include "server/push_decoding.h"
#include "server/update_log.h"

namespace gradmesh {

ShardDurability::ShardDurability(const JobState* job, RequestLedger* ledger, ShardStore* store,
                                 const Logger* logger)
    : job_(job), ledger_(ledger), store_(store), logger_(logger) {
  absl::MutexLock lock(&mu_);
  snapshot_time_ = absl::Now();
}

int64_t LogBytesPerSnapshot(int64_t state_bytes) {
  return std::max(kLogBytesPerSnapshot, kLogPerStateBytes * state_bytes);
}

int64_t ShardDurability::StateBytes() const {
  return (job_->owned_elements() + job_->owned_slot_elements()) *
         static_cast<int64_t>(sizeof(float));
}

absl::Status ShardDurability::Apply(const ChunkUpdate& u, bool replay,
                                    absl::FunctionRef<void()> apply) {
  if (job_->durability() == Durability::kEveryUpdate && !replay) {
    // Write-ahead: the update is in the log before anything changes or is acknowledged.
    const std::vector<absl::string_view> data = GradientBytes(u);
    const EncodedRecord record(Record(u), data);  // Outside every lock.
    return Commit(record, apply);
  }
  absl::ReaderMutexLock lock(&apply_mu_);
  apply();
  return absl::OkStatus();
}

std::vector<absl::string_view> ShardDurability::GradientBytes(const ChunkUpdate& u) {
  std::vector<absl::string_view> data;
  for (size_t i = 0; i < u.chunks.size(); ++i) {
    data.emplace_back(reinterpret_cast<const char*>(u.grads[i]),
                      static_cast<size_t>(u.numels[i]) * sizeof(float));
  }
  return data;
}

state::UpdateRecord ShardDurability::Record(const ChunkUpdate& u) const {
  state::UpdateRecord rec;  // Without seq and gradient bytes: EncodedRecord adds them.
  for (size_t i = 0; i < u.chunks.size(); ++i) {
    const ChunkInfo& info = job_->partition().chunks()[u.chunks[i]];
    ChunkData* g = rec.add_grads();
    g->set_tensor(info.tensor);
    g->set_chunk(info.chunk);
    g->set_version(u.base_versions[i]);
  }
  for (const RequestRef& r : u.requests) {
    state::RequestRef* out = rec.add_requests();
    out->set_worker(r.worker);
    out->set_step(r.step);
    out->set_request_id(r.request_id);
  }
  if (u.lr_scale != 1.0f) rec.set_lr_scale(u.lr_scale);
  return rec;
}

absl::Status ShardDurability::Commit(const EncodedRecord& record, absl::FunctionRef<void()> apply) {
  Pending p{&record, &apply};
  log_mu_.Lock();
  queue_.push_back(&p);
  // Either a leader logs and applies our update, or we lead: first in the queue while no one
  // writes.
  auto done_or_lead = [this, &p]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(log_mu_) {
    return p.done || (!writing_ && !queue_.empty() && queue_.front() == &p);
  };
  log_mu_.Await(absl::Condition(&done_or_lead));
  if (!p.done) LeadBatch();
  log_mu_.Unlock();
  return p.status;
}

void ShardDurability::LeadBatch() {
  std::vector<Pending*> batch(queue_.begin(), queue_.end());
  queue_.clear();
  if (log_closed_) {
    for (Pending* p : batch) {
      p->status = absl::AbortedError(absl::StrCat(
          "Push: job ", job_->name(), " not applied: the job was replaced on this shard"));
      p->done = true;
    }
    return;
  }
  writing_ = true;
  const int64_t first = next_seq_;
  const bool fresh = !log_restored_;
  log_mu_.Unlock();
  absl::Status st = WriteBatch(first, batch, fresh);
  log_mu_.Lock();
  writing_ = false;  // The next leader may write the next batch while we apply this one.
  // A failed batch takes no seqs: the next one reuses them, so the log has no holes.
  if (st.ok()) {
    next_seq_ += static_cast<int64_t>(batch.size());
    log_mu_.Unlock();
    ApplyBatch(first, batch);
    log_mu_.Lock();
  }
  for (Pending* p : batch) {
    p->status = st;
    p->done = true;
  }
}

absl::Status ShardDurability::WriteBatch(int64_t first, const std::vector<Pending*>& batch,
                                         bool fresh) {
  std::vector<const EncodedRecord*> records;
  int64_t bytes = 0;
  for (const Pending* p : batch) {
    records.push_back(p->record);
    bytes += p->record->payload_bytes();
  }
  absl::Status st;
  if (log_ == nullptr) {
    auto log = store_->OpenLog(job_->name(), first, fresh);
    if (log.ok()) log_ = *std::move(log);
    st = log.status();
  }
  if (st.ok()) st = log_->Append(first, records);
  RETURN_IF_ERROR(Annotate(st, absl::StrCat("Push: job ", job_->name(), " not applied")));
  absl::MutexLock lock(&mu_);
  logged_bytes_ += bytes;
  log_records_ += static_cast<int64_t>(batch.size());
  ++log_writes_;
  return absl::OkStatus();
}

void ShardDurability::ApplyBatch(int64_t first, const std::vector<Pending*>& batch) {
  {
    // Not under apply_mu_: a snapshot waiting for it exclusively would block the batch
    // before us, which we wait for.
    absl::MutexLock lock(&order_mu_);
    auto our_turn = [this, first]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(order_mu_) {
      return applied_seq_ == first - 1;
    };
    order_mu_.Await(absl::Condition(&our_turn));
  }
  {
    absl::ReaderMutexLock lock(&apply_mu_);
    for (Pending* p : batch) (*p->apply)();  // In seq order.
  }
  absl::MutexLock lock(&order_mu_);
  applied_seq_ = first + static_cast<int64_t>(batch.size()) - 1;
}

absl::Status ShardDurability::RotateLog(int64_t snapshot_seq) {
  log_mu_.Lock();
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(log_mu_) { return !writing_; };
  log_mu_.Await(absl::Condition(&idle));
  writing_ = true;  // Keeps leaders away from log_.
  log_mu_.Unlock();
  absl::Status st = log_ != nullptr ? log_->Rotate(snapshot_seq) : absl::OkStatus();
  log_mu_.Lock();
  writing_ = false;
  log_mu_.Unlock();
  return st;
}

bool ShardDurability::StartSnapshot(bool force) {
  const DurabilitySpec& d = job_->layout().durability();
  absl::MutexLock lock(&mu_);
  if (closed_) return false;
  if (force) {
    // A forced snapshot must capture the state as of now: wait for one in progress.
    mu_.Await(absl::Condition(
        +[](bool* running) { return !*running; }, &snapshot_running_));
    if (closed_) return false;
  } else if (snapshot_running_) {
    return false;
  }
  const int64_t updates = ledger_->updates_applied();
  const bool by_count = updates - snapshot_update_ >= d.snapshot_every_updates();
  // Bounds the log files and replay (see kLogBytesPerSnapshot).
  const bool by_bytes = logged_bytes_ >= LogBytesPerSnapshot(StateBytes());
  // Time-based snapshots would differ between shards of a sync job: count only there.
  const bool by_time = !job_->sync_mode() && d.snapshot_every_seconds() > 0 &&
                       updates > snapshot_update_ &&
                       absl::Now() - snapshot_time_ >= absl::Seconds(d.snapshot_every_seconds());
  if (!force && !by_count && !by_time && !by_bytes) return false;
  if (!force && absl::Now() < snapshot_retry_after_) return false;
  snapshot_running_ = true;
  return true;
}

void ShardDurability::Capture(ChunksFileWriter* file, state::JobSnapshot* snap) {
  // Exclusive: no update is half-applied while the chunks are written.
  absl::WriterMutexLock apply_lock(&apply_mu_);
  for (const auto& [idx, chunk] : job_->chunks()) {
    absl::MutexLock lock(&chunk->mu);
    file->Add(idx, chunk->version,
              absl::string_view(reinterpret_cast<const char*>(chunk->values.data()),
                                chunk->values.size() * sizeof(float)),
              absl::string_view(reinterpret_cast<const char*>(chunk->slots.data()),
                                chunk->slots.size() * sizeof(float)));
  }
  ledger_->SaveTo(snap);
}

absl::StatusOr<int64_t> ShardDurability::WriteSnapshot(bool force, state::JobSnapshot* snap,
                                                       int* slot, bool* store_written) {
  int stored, uncertain;
  {
    absl::MutexLock lock(&mu_);
    stored = stored_slot_;
    uncertain = uncertain_slot_;
  }
  // A chunk file no stored snapshot may name: a crash while it is written leaves the stored
  // snapshot whole.
  *slot = 0;
  while (*slot == stored || *slot == uncertain) ++*slot;
  ASSIGN_OR_RETURN(std::unique_ptr<ChunksFileWriter> file,
                   store_->OpenChunksFile(job_->name(), *slot));
  if (file->ok()) Capture(file.get(), snap);  // Not for nothing under the exclusive lock.
  ASSIGN_OR_RETURN(state::ChunksFileRef ref, file->Finish());  // Synced with fsync.
  ref.set_slot(*slot);
  *snap->mutable_chunks_file() = ref;
  SnapshotWrite keys(job_->name());  // No chunk keys: the file holds them.
  // The first file of a job (of a store from before chunk files: its chunk keys are stale now).
  if (stored < 0) keys.DropChunkKeys();
  *store_written = true;
  // A forced snapshot (job creation, job end) also (re)writes the layout: the first one must.
  return store_->WriteSnapshot(&keys, force ? &job_->layout() : nullptr, *snap);
}

absl::Status ShardDurability::MaybeSnapshot(bool force) {
  if (job_->durability() == Durability::kNone) return absl::OkStatus();
  if (!StartSnapshot(force)) return absl::OkStatus();
  if (absl::Status st = RemoveStaleLog(); !st.ok()) {
    absl::MutexLock lock(&mu_);
    snapshot_running_ = false;
    return st;
  }
  const absl::Time start = absl::Now();
  state::JobSnapshot snap;
  int slot = -1;
  bool store_written = false;
  const absl::StatusOr<int64_t> bytes = WriteSnapshot(force, &snap, &slot, &store_written);
  // Before the next snapshot may start (snapshot_running_), so that no later snapshot's
  // segments are deleted under an earlier one.
  const absl::Status rotated = bytes.ok() && job_->durability() == Durability::kEveryUpdate
                                   ? RotateLog(snap.seq())
                                   : absl::OkStatus();
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  absl::MutexLock lock(&mu_);
  snapshot_running_ = false;
  if (!bytes.ok()) {
    // A store write that failed may still have reached RocksDB's log, and name this file after
    // a restart: the next attempt writes another (three slots).
    if (store_written) uncertain_slot_ = slot;
    // Not on every push: each attempt holds apply_mu_ exclusively.
    snapshot_retry_after_ = absl::Now() + absl::Seconds(5);
    LogError(logger_, "snapshot_failed",
             {Kv("job", job_->name()), Kv("error", bytes.status().ToString())});
    return bytes.status();
  }
  snapshot_update_ = snap.seq();
  stored_slot_ = slot;
  uncertain_slot_ = -1;
  logged_bytes_ = 0;
  snapshot_time_ = absl::Now();
  ++snapshots_;
  last_snapshot_s_ = secs;
  last_snapshot_bytes_ = *bytes;
  LogInfo(logger_, "snapshot",
          {Kv("job", job_->name()), Kv("update", snap.seq()), Kv("bytes", *bytes),
           Kv("ms", absl::StrFormat("%.1f", secs * 1e3))});
  if (!rotated.ok()) {
    // The snapshot stands; the segments it covers are deleted by a later one.
    LogError(logger_, "log_rotation_failed",
             {Kv("job", job_->name()), Kv("error", rotated.ToString())});
  }
  return rotated;
}

absl::Status ShardDurability::RemoveStaleLog() {
  {
    absl::MutexLock lock(&mu_);
    if (restored_ || snapshots_ > 0) return absl::OkStatus();
  }
  // The first snapshot of a new job: log files under its name are a deleted job's (whose
  // deletion did not finish), and must be gone before this job's layout makes them readable.
  return Annotate(store_->RemoveLog(job_->name()),
                  absl::StrCat("job ", job_->name(), ": deleting a previous job's update log"));
}

absl::Status ShardDurability::RestoreChunks(const ShardStore::StoredJob& s) const {
  for (const auto& [idx, chunk] : job_->chunks()) {
    auto it = s.chunks.find(idx);
    absl::MutexLock lock(&chunk->mu);
    const size_t want_values = chunk->info.numel * sizeof(float);
    if (it == s.chunks.end() || it->second.values().size() != want_values ||
        it->second.slots().size() != chunk->slots.size() * sizeof(float)) {
      return absl::DataLossError(absl::StrCat("restoring job ", job_->name(), " from ",
                                              store_->dir(), ": chunk ", idx,
                                              " is missing or has the wrong size"));
    }
    chunk->version = it->second.version();
    chunk->values.resize(chunk->info.numel);
    // (No memcpy for an empty array: its data() may be null, which memcpy must not get.)
    if (want_values > 0) {
      std::memcpy(chunk->values.data(), it->second.values().data(), want_values);
    }
    if (!it->second.slots().empty()) {
      std::memcpy(chunk->slots.data(), it->second.slots().data(), it->second.slots().size());
    }
  }
  return absl::OkStatus();
}

absl::Status ShardDurability::ReplayLog(
    const ShardStore::StoredJob& s,
    const std::function<absl::Status(const ChunkUpdate&)>& replay) const {
  const Partition& p = job_->partition();
  for (const state::UpdateRecord& rec : s.log) {
    ChunkUpdate u;
    std::vector<std::vector<float>> scratch(rec.grads_size());
    for (int i = 0; i < rec.grads_size(); ++i) {
      const ChunkData& g = rec.grads(i);
      const int64_t idx = p.Find(g.tensor(), g.chunk());
      if (idx < 0 || job_->chunks().find(idx) == job_->chunks().end() ||
          g.data().size() != p.chunks()[idx].numel * sizeof(float)) {
        return absl::DataLossError(absl::StrCat("restoring job ", job_->name(), ": log record ",
                                                rec.seq(),
                                                " names a chunk this shard "
                                                "does not own or has the wrong size"));
      }
      u.chunks.push_back(idx);
      u.numels.push_back(p.chunks()[idx].numel);
      u.grads.push_back(FloatView(g.data(), &scratch[i]));
      u.base_versions.push_back(g.version());
    }
    for (const state::RequestRef& r : rec.requests()) {
      u.requests.push_back({r.worker(), r.step(), r.request_id()});
    }
    if (rec.lr_scale() != 0.0f) u.lr_scale = rec.lr_scale();
    RETURN_IF_ERROR(replay(u));
  }
  return absl::OkStatus();
}

absl::Status ShardDurability::Restore(
    const ShardStore::StoredJob& s, const std::function<absl::Status(const ChunkUpdate&)>& replay) {
  RETURN_IF_ERROR(RestoreChunks(s));
  {
    absl::WriterMutexLock apply_lock(&apply_mu_);
    ledger_->RestoreFrom(s.snapshot);
    absl::MutexLock lock(&mu_);
    snapshot_update_ = s.snapshot.seq();
    stored_slot_ = s.snapshot.has_chunks_file() ? s.snapshot.chunks_file().slot() : -1;
    restored_ = true;
  }
  // Replay logged updates in order, through the same code that applied them.
  RETURN_IF_ERROR(ReplayLog(s, replay));
  const int64_t applied = ledger_->updates_applied();
  {
    // New records continue the log; its files hold the replayed ones until a snapshot.
    absl::MutexLock lock(&log_mu_);
    next_seq_ = applied + 1;
    log_restored_ = true;
  }
  {
    absl::MutexLock lock(&order_mu_);
    applied_seq_ = applied;
  }
  absl::MutexLock lock(&mu_);
  replayed_ = static_cast<int64_t>(s.log.size());
  return absl::OkStatus();
}

void ShardDurability::Close() {
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    mu_.Await(absl::Condition(
        +[](bool* running) { return !*running; }, &snapshot_running_));
  }
  absl::MutexLock lock(&log_mu_);
  log_closed_ = true;
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(log_mu_) { return !writing_; };
  log_mu_.Await(absl::Condition(&idle));
  log_.reset();
}

ShardDurability::Stats ShardDurability::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s;
  s.snapshots = snapshots_;
  s.last_snapshot_s = last_snapshot_s_;
  s.last_snapshot_bytes = last_snapshot_bytes_;
  s.snapshot_update = snapshot_update_;
  s.restored = restored_;
  s.replayed = replayed_;
  s.log_records = log_records_;
  s.log_writes = log_writes_;
  s.state_bytes = StateBytes();
  return s;
}

}  // namespace gradmesh
