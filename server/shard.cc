#include "server/shard.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "google/protobuf/util/message_differencer.h"
#include "server/job_state.h"
#include "server/pull_encoder.h"
#include "server/request_ledger.h"
#include "server/shard_durability.h"

namespace gradmesh {

// Thread safety: the members are fixed after construction and are each thread-safe (their
// headers give the contracts and lock orders). One job's parts (see shard.h). `state` is built
// first and outlives the others, which refer to it; ledger before durability, which refers to it.
struct Shard::Job {
  Job(std::unique_ptr<JobState> s, const ShardOptions& options)
      : state(std::move(s)),
        ledger(state->name(), state->num_workers(), options.dedupe_window,
               options.staleness_buckets),
        pulls(state->num_workers(), state->owned_indices()),
        durability(state.get(), &ledger, options.store.get(), options.logger) {}

  const std::unique_ptr<JobState> state;
  RequestLedger ledger;
  PullEncoder pulls;
  ShardDurability durability;
};

namespace {

// Copies InitJob's initial values into the job's chunks: exactly the owned chunks, each once,
// each exactly numel finite float32 values.
absl::Status LoadInitialValues(const InitJobRequest& request, const JobState& job) {
  const int32_t me = job.shard_index();
  if (request.initial_size() != static_cast<int>(job.chunks().size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InitJob: job ", request.job(), " shard ", me, " owns ", job.chunks().size(),
        " chunks but the request carries initial values for ", request.initial_size()));
  }
  for (const ChunkData& c : request.initial()) {
    const std::string where = job.ChunkName(c.tensor(), c.chunk());
    const int64_t idx = job.partition().Find(c.tensor(), c.chunk());
    auto it = job.chunks().find(idx);
    if (idx < 0 || it == job.chunks().end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("InitJob: ", where, " is not owned by shard ", me));
    }
    Chunk& chunk = *it->second;
    RETURN_IF_ERROR(CheckDenseFloats(c, chunk.info.numel, absl::StrCat("InitJob: ", where)));
    absl::MutexLock lock(&chunk.mu);
    if (!chunk.values.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("InitJob: ", where, " appears twice"));
    }
    chunk.values.resize(chunk.info.numel);
    std::memcpy(chunk.values.data(), c.data().data(), c.data().size());
  }
  return absl::OkStatus();
}

}  // namespace

Shard::Shard(ShardOptions options) : options_(std::move(options)) {}
Shard::~Shard() = default;

absl::StatusOr<std::unique_ptr<Shard>> Shard::Create(ShardOptions options) {
  if (options.dedupe_window <= 0) {
    return absl::InvalidArgumentError("ShardOptions.dedupe_window must be > 0");
  }
  if (options.staleness_buckets < 2) {
    return absl::InvalidArgumentError("ShardOptions.staleness_buckets must be >= 2");
  }
  std::unique_ptr<Shard> shard(new Shard(std::move(options)));
  RETURN_IF_ERROR(shard->Restore());
  return shard;
}

absl::StatusOr<std::shared_ptr<Shard::Job>> Shard::FindJob(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(name);
  if (it == jobs_.end()) {
    if (options_.store != nullptr) {
      return absl::NotFoundError(absl::StrCat(
          "job ", name, " is not known to this shard: its data dir ", options_.store->dir(),
          " holds no state for it (InitJob creates it; was the shard restarted on another "
          "directory?)"));
    }
    return absl::NotFoundError(absl::StrCat("job ", name, " is not known to this shard"));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<Shard::Job>> Shard::BuildJob(const InitJobRequest& layout) const {
  ASSIGN_OR_RETURN(std::unique_ptr<JobState> state,
                   JobState::Create(layout, options_.optimizers, options_.consistency,
                                    options_.store != nullptr));
  return std::make_shared<Job>(std::move(state), options_);
}

absl::StatusOr<bool> Shard::JobExists(const InitJobRequest& layout) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(layout.job());
  if (it == jobs_.end()) return false;
  if (!google::protobuf::util::MessageDifferencer::Equals(it->second->state->layout(), layout)) {
    return absl::FailedPreconditionError(
        absl::StrCat("InitJob: job ", layout.job(),
                     " already exists on this shard with a different layout, optimizer, mode, "
                     "durability or worker count; use another job name"));
  }
  return true;
}

absl::StatusOr<bool> Shard::AddJob(const std::string& name, std::shared_ptr<Job> job) {
  // Creation is serialised, so the job becomes durable before it becomes visible: no push
  // can be acknowledged for a job whose layout and initial values are not in the store.
  absl::MutexLock init_lock(&init_mu_);
  ASSIGN_OR_RETURN(const bool found, JobExists(job->state->layout()));
  if (found) return false;  // Created meanwhile by another call.
  if (job->state->durability() != Durability::kNone) {
    RETURN_IF_ERROR(
        Annotate(job->durability.MaybeSnapshot(/*force=*/true),
                 absl::StrCat("InitJob: job ", name, " could not be made durable; not created")));
  }
  absl::MutexLock lock(&mu_);
  jobs_.emplace(name, std::move(job));
  return true;
}

absl::StatusOr<InitJobResponse> Shard::InitJob(const InitJobRequest& request) {
  RETURN_IF_ERROR(ValidateLayout(request));
  const InitJobRequest layout = NormalizedLayout(request);
  InitJobResponse response;
  // Fast path, before copying the initial values into a new job.
  ASSIGN_OR_RETURN(const bool found, JobExists(layout));
  if (found) {
    response.set_created(false);
    return response;
  }
  // Build the job outside the locks: copying initial values can take a while.
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, BuildJob(layout));
  RETURN_IF_ERROR(LoadInitialValues(request, *job->state));
  ASSIGN_OR_RETURN(const bool created, AddJob(request.job(), job));
  response.set_created(created);
  if (created) {
    LogInfo(
        options_.logger, "job_created",
        {Kv("job", request.job()), Kv("shard", layout.shard_index()),
         Kv("chunks", job->state->chunks().size()), Kv("elements", job->state->owned_elements()),
         Kv("optimizer", layout.optimizer().name()), Kv("mode", layout.consistency()),
         Kv("workers", layout.num_workers()), Kv("durability", layout.durability().mode())});
  }
  return response;
}

absl::Status Shard::ApplyUpdate(Job* job, const ChunkUpdate& u, bool replay) {
  return job->durability.Apply(u, replay, [job, &u] {
    const std::vector<int64_t> staleness = job->state->ApplyToChunks(u);
    job->ledger.RecordUpdate(staleness, u.requests);
  });
}

absl::Status Shard::Restore() {
  if (options_.store == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::vector<ShardStore::StoredJob> stored, options_.store->LoadAll());
  for (const ShardStore::StoredJob& s : stored) RETURN_IF_ERROR(RestoreJob(s));
  return absl::OkStatus();
}

absl::Status Shard::RestoreJob(const ShardStore::StoredJob& s) {
  const std::string& name = s.layout.job();
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, BuildJob(s.layout));
  // Replay goes through the same code that applied the updates.
  RETURN_IF_ERROR(job->durability.Restore(s, [this, &job](const ChunkUpdate& u) {
    return ApplyUpdate(job.get(), u, /*replay=*/true);
  }));
  std::vector<int64_t> pushed;
  std::vector<bool> finished;
  job->ledger.Clocks(&pushed, &finished);
  job->state->policy().Restore(pushed, finished);
  LogInfo(options_.logger, "job_restored",
          {Kv("job", name), Kv("snapshot_update", s.snapshot.seq()),
           Kv("replayed_updates", job->durability.stats().replayed),
           Kv("dir", options_.store->dir()), Kv("durability", s.layout.durability().mode())});
  absl::MutexLock lock(&mu_);
  jobs_.emplace(name, std::move(job));
  return absl::OkStatus();
}

absl::Status Shard::PushUpdate(const Job& job, const PushRequest& request, ChunkUpdate* update,
                               std::vector<Chunk*>* targets,
                               std::vector<std::vector<float>>* scratch) {
  const JobState& state = *job.state;
  absl::flat_hash_set<int64_t> seen;
  scratch->resize(request.chunks_size());
  for (int i = 0; i < request.chunks_size(); ++i) {
    const ChunkData& c = request.chunks(i);
    ASSIGN_OR_RETURN(auto owned, state.OwnedChunk("Push", c.tensor(), c.chunk()));
    const auto [idx, chunk] = owned;
    const std::string where = state.ChunkName(c.tensor(), c.chunk());
    if (c.version() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Push: ", where, ": base version ", c.version(), " is negative"));
    }
    if (!seen.insert(idx).second) {
      return absl::InvalidArgumentError(absl::StrCat("Push: ", where, " appears twice"));
    }
    ASSIGN_OR_RETURN(const float* grad,
                     DecodePushedChunk(codecs_, c, chunk->info.numel, absl::StrCat("Push: ", where),
                                       &(*scratch)[i]));
    targets->push_back(chunk);
    update->chunks.push_back(idx);
    update->numels.push_back(chunk->info.numel);
    update->grads.push_back(grad);
    update->base_versions.push_back(c.version());
  }
  update->requests.push_back({request.worker(), request.step(), request.request_id()});
  return absl::OkStatus();
}

absl::StatusOr<PushResponse> Shard::Push(const PushRequest& request) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job()));
  RETURN_IF_ERROR(job->state->CheckWorker("Push", request.worker()));
  if (request.step() < 0 || request.step() >= (int64_t{1} << 62)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Push: job ", request.job(), " step ", request.step(), " out of range"));
  }
  // Validate everything before changing anything.
  ChunkUpdate update;
  std::vector<Chunk*> targets;
  std::vector<std::vector<float>> scratch;
  RETURN_IF_ERROR(PushUpdate(*job, request, &update, &targets, &scratch));

  PushResponse response;
  ASSIGN_OR_RETURN(const RequestLedger::Admission admission,
                   job->ledger.BeginPush(request.worker(), request.step(), request.request_id()));
  if (admission == RequestLedger::Admission::kDuplicate) {
    response.set_duplicate(true);
    return response;
  }
  const absl::Status st = job->state->policy().OnPush(update, [this, &job](const ChunkUpdate& u) {
    return ApplyUpdate(job.get(), u, /*replay=*/false);
  });
  job->ledger.EndPush(request.worker(), request.step(), request.request_id(), st.ok());
  RETURN_IF_ERROR(st);
  for (Chunk* chunk : targets) {
    absl::MutexLock lock(&chunk->mu);
    response.add_new_versions(chunk->version);
  }
  // A failed periodic snapshot is logged; the push itself was applied (and, for
  // every_update, logged), so it still succeeds.
  (void)job->durability.MaybeSnapshot(/*force=*/false);
  return response;
}

absl::Status Shard::Pull(const PullRequest& request, PullResponse* response) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job()));
  const JobState& state = *job->state;
  RETURN_IF_ERROR(state.CheckWorker("Pull", request.worker()));
  std::vector<std::pair<int64_t, Chunk*>> targets;
  std::vector<int64_t> held;  // Version the worker holds of each target (-1: unknown).
  if (request.chunks_size() == 0) {
    for (int64_t idx : state.owned_indices()) {
      targets.emplace_back(idx, state.chunk(idx));
      held.push_back(-1);
    }
  } else {
    for (const ChunkData& c : request.chunks()) {
      ASSIGN_OR_RETURN(auto owned, state.OwnedChunk("Pull", c.tensor(), c.chunk()));
      targets.push_back(owned);
      held.push_back(c.version());
    }
  }
  ASSIGN_OR_RETURN(const PullFormat format,
                   PullEncoder::ParseFormat(request.job(), request.codec(), codecs_));
  RETURN_IF_ERROR(state.policy().BeforePull(request.worker()));
  response->mutable_chunks()->Reserve(static_cast<int>(targets.size()));
  for (size_t t = 0; t < targets.size(); ++t) {
    const auto [idx, chunk] = targets[t];
    ChunkData* out = response->add_chunks();
    out->set_tensor(chunk->info.tensor);
    out->set_chunk(chunk->info.chunk);
    out->set_dtype(FLOAT32);
    absl::MutexLock lock(&chunk->mu);
    out->set_version(chunk->version);
    RETURN_IF_ERROR(Annotate(job->pulls.Encode(format, idx, request.worker(), held[t],
                                               chunk->values, chunk->version, out),
                             absl::StrCat("Pull: job ", request.job(), " chunk (",
                                          chunk->info.tensor, ",", chunk->info.chunk, ")")));
  }
  return absl::OkStatus();
}

absl::Status Shard::Finish(const FinishRequest& request) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job()));
  RETURN_IF_ERROR(job->state->CheckWorker("Finish", request.worker()));
  job->state->policy().OnFinish(request.worker());
  const std::optional<int64_t> pushes_applied = job->ledger.MarkFinished(request.worker());
  if (!pushes_applied.has_value()) return absl::OkStatus();  // Not its first Finish.
  LogInfo(options_.logger, "worker_finished",
          {Kv("job", request.job()), Kv("worker", request.worker()), Kv("step", request.step()),
           Kv("pushes_applied", *pushes_applied)});
  // A durable job records each worker's Finish (a restarted shard must not wait for a worker
  // that is gone), and its final state when the last worker finishes.
  if (job->state->durability() != Durability::kNone) {
    (void)job->durability.MaybeSnapshot(/*force=*/true);  // Logged on failure.
  }
  MaybeLogJobStats(*job);
  return absl::OkStatus();
}

void Shard::MaybeLogJobStats(const Job& job) {
  // sync: workers removed from the barrier group push no more, so they do not count.
  if (!job.ledger.AllFinished(job.state->CountedWorkers())) return;
  // The job's metrics, in one line.
  const ConsistencyStats ps = job.state->policy().stats();
  const RequestLedger::Stats ls = job.ledger.stats();
  const ShardDurability::Stats ds = job.durability.stats();
  LogInfo(
      options_.logger, "job_stats",
      {Kv("job", job.state->name()), Kv("mode", job.state->layout().consistency()),
       Kv("pushes_applied", ls.pushes_applied), Kv("updates_applied", ls.updates_applied),
       Kv("duplicates", ls.duplicates), Kv("staleness_histogram", absl::StrJoin(ls.staleness, ",")),
       Kv("max_clock_lead", ps.max_clock_lead),
       Kv("barrier_wait_s", absl::StrFormat("%.3f", ps.barrier_wait_s)),
       Kv("snapshots", ds.snapshots),
       Kv("last_snapshot_ms", absl::StrFormat("%.1f", ds.last_snapshot_s * 1e3)),
       Kv("last_snapshot_bytes", ds.last_snapshot_bytes)});
}

std::vector<std::string> Shard::JobNames() const {
  std::vector<std::string> names;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& kv : jobs_) names.push_back(kv.first);
  }
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<JobInfoResponse> Shard::GetJobInfo(const JobInfoRequest& request) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job()));
  const InitJobRequest& layout = job->state->layout();
  JobInfoResponse r;
  r.set_job(request.job());
  *r.mutable_tensors() = layout.tensors();
  r.set_chunk_elems(layout.chunk_elems());
  r.set_num_shards(layout.num_shards());
  r.set_shard_index(layout.shard_index());
  r.set_num_workers(layout.num_workers());
  r.set_consistency(layout.consistency());
  *r.mutable_optimizer() = layout.optimizer();
  r.set_owned_elements(job->state->owned_elements());
  const ConsistencyStats ps = job->state->policy().stats();
  r.set_max_clock_lead(ps.max_clock_lead);
  r.set_barrier_wait_s(ps.barrier_wait_s);
  const auto [active, lr_scale] = job->state->SyncGroup();
  for (int32_t w : active) r.add_active_workers(w);
  r.set_lr_scale(lr_scale);
  const RequestLedger::Stats ls = job->ledger.stats();
  for (size_t i = 0; i < ls.workers.size(); ++i) {
    WorkerState* w = r.add_workers();
    w->set_worker(static_cast<int32_t>(i));
    w->set_last_step(ls.workers[i].last_step);
    w->set_finished(ls.workers[i].finished);
    w->set_pushes_applied(ls.workers[i].pushes_applied);
  }
  r.set_pushes_applied(ls.pushes_applied);
  r.set_duplicates_dropped(ls.duplicates);
  for (int64_t s : ls.staleness) r.add_staleness_histogram(s);
  r.set_updates_applied(ls.updates_applied);
  const ShardDurability::Stats ds = job->durability.stats();
  r.set_snapshots(ds.snapshots);
  r.set_last_snapshot_s(ds.last_snapshot_s);
  r.set_last_snapshot_bytes(ds.last_snapshot_bytes);
  r.set_snapshot_update(ds.snapshot_update);
  r.set_restored(ds.restored);
  r.set_replayed_updates(ds.replayed);
  return r;
}

absl::Status Shard::SetSyncGroup(const std::string& job_name, const std::vector<int32_t>& active,
                                 double lr_scale) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_name));
  return job->state->SetSyncGroup(active, lr_scale, options_.logger);
}

}  // namespace gradmesh
