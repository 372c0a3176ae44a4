#include "server/shard.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
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
#include "server/init_job_validation.h"
#include "server/job_state.h"
#include "server/pull_encoder.h"
#include "server/request_ledger.h"
#include "server/shard_durability.h"
#include "server/sync_commits.h"
#include "server/update_log.h"

namespace gradmesh {

// Thread safety: the members are fixed after construction and are each thread-safe (their
// headers give the contracts and lock orders). One job's parts (see shard.h). `state` is built
// first and outlives the others, which refer to it; ledger before durability, which refers to it.
struct Shard::Job {
  Job(MemoryReservation m, std::unique_ptr<JobState> s, const ShardOptions& options,
      MemoryBudget* budget)
      : memory(std::move(m)),
        state(std::move(s)),
        ledger(state->name(), state->num_workers(), options.dedupe_window,
               options.staleness_buckets),
        pulls(state->num_workers(), state->owned_indices(), budget),
        durability(state.get(), &ledger, options.store.get(), options.logger) {
    if (state->layout().commit_steps()) {
      const JobState* st = state.get();
      commits = std::make_unique<SyncCommits>(
          st->name(), st->layout().clip_grad_value(),
          [st](int64_t idx) { return !st->is_buffer(st->partition().chunks()[idx].tensor); });
    }
  }

  // Declared first, so it is released last, after everything it accounts for is freed.
  const MemoryReservation memory;
  const std::unique_ptr<JobState> state;
  RequestLedger ledger;
  PullEncoder pulls;
  ShardDurability durability;
  // commit_steps jobs only (two-phase apply; server/sync_commits.h); null otherwise.
  std::unique_ptr<SyncCommits> commits;
};

namespace {

// Copies InitJob's initial values, which CheckInitialValues accepted (exactly the owned
// chunks, each once, each exactly numel finite float32 values), into the job's chunks.
void LoadInitialValues(const InitJobRequest& request, const JobState& job) {
  for (const ChunkData& c : request.initial()) {
    Chunk& chunk = *job.chunk(job.partition().Find(c.tensor(), c.chunk()));
    absl::MutexLock lock(&chunk.mu);
    chunk.values.resize(chunk.info.numel);
    std::memcpy(chunk.values.data(), c.data().data(), c.data().size());
  }
}

}  // namespace

Shard::Shard(ShardOptions options) : options_(std::move(options)) {}
Shard::~Shard() {
  // No call is in progress any more (a daemon stops its gRPC server first). Complete whatever
  // still waits, then stop the timer (which runs what it still holds, such as a sync step
  // completed by SetSyncGroup), all before the jobs and their policies go.
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& kv : jobs_) jobs.push_back(kv.second);
  }
  for (const auto& job : jobs) {
    job->state->policy().AbortWaits(absl::UnavailableError(
        absl::StrCat("job ", job->state->name(), ": the shard is shutting down; retry")));
  }
  timer_.reset();
}

absl::StatusOr<std::unique_ptr<Shard>> Shard::Create(ShardOptions options) {
  if (options.dedupe_window <= 0) {
    return absl::InvalidArgumentError("ShardOptions.dedupe_window must be > 0");
  }
  if (options.staleness_buckets < 2) {
    return absl::InvalidArgumentError("ShardOptions.staleness_buckets must be >= 2");
  }
  RETURN_IF_ERROR(ValidateShardLimits(options.limits));
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

absl::StatusOr<MemoryReservation> Shard::ReserveBytes(int64_t bytes, const std::string& what) {
  RETURN_IF_ERROR(budget_.Reserve(bytes, what));
  return MemoryReservation(&budget_, bytes);
}

absl::StatusOr<MemoryReservation> Shard::ReserveMemory(const InitJobRequest& layout,
                                                       const Partition& partition, bool restore) {
  const std::string context = absl::StrCat("InitJob: job ", layout.job());
  auto optimizer = options_.optimizers.Create(layout.optimizer());
  if (!optimizer.ok()) return Annotate(optimizer.status(), context);
  const JobMemory need =
      EstimateJobMemory(layout, partition, (*optimizer)->num_slots(), options_.dedupe_window);
  if (restore) {
    budget_.ForceReserve(need.total());
  } else {
    RETURN_IF_ERROR(
        budget_.Reserve(need.total(), context, need.Describe(layout.optimizer().name())));
  }
  return MemoryReservation(&budget_, need.total());
}

absl::StatusOr<std::shared_ptr<Shard::Job>> Shard::BuildJob(const InitJobRequest& layout,
                                                            MemoryReservation memory) {
  ASSIGN_OR_RETURN(std::unique_ptr<JobState> state,
                   JobState::Create(layout, options_.optimizers, options_.consistency,
                                    options_.store != nullptr, options_.logger));
  // Waiting pushes and pulls of every job share the shard's timer and wait limit.
  state->policy().UseTimer(timer_.get());
  state->policy().UseWaitCounter(&waiting_);
  return std::make_shared<Job>(std::move(memory), std::move(state), options_, &budget_);
}

absl::Status Shard::CheckJobCount(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(jobs_.size()) < options_.limits.max_jobs) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat("InitJob: job ", name,
                                                   ": this shard already holds ", jobs_.size(),
                                                   " jobs, the most it allows (--max_jobs)"));
}

absl::StatusOr<Shard::Existing> Shard::JobExists(const InitJobRequest& layout) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(layout.job());
  if (it == jobs_.end()) return Existing::kNone;
  const InitJobRequest& held = it->second->state->layout();
  if (!held.incarnation().empty() && !layout.incarnation().empty() &&
      held.incarnation() != layout.incarnation()) {
    return Existing::kStale;
  }
  google::protobuf::util::MessageDifferencer same_layout;
  same_layout.IgnoreField(InitJobRequest::descriptor()->FindFieldByName("incarnation"));
  if (!same_layout.Compare(held, layout)) {
    return absl::FailedPreconditionError(
        absl::StrCat("InitJob: job ", layout.job(),
                     " already exists on this shard with a different layout, optimizer, mode, "
                     "durability or worker count; use another job name"));
  }
  return Existing::kSame;
}

absl::Status Shard::DropStaleJob(const std::string& name, const std::string& incarnation) {
  std::shared_ptr<Job> old;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(name);
    if (it == jobs_.end()) return absl::OkStatus();
    old = it->second;
    jobs_.erase(it);
  }
  // Its workers are gone: the coordinator compacted the job and gave the name to a new one,
  // whose token the old workers do not have. Its memory returns when the last reference goes.
  // A push still in flight must not write the old job's log or a snapshot into the files the
  // new job is about to own.
  old->durability.Close();
  if (options_.store != nullptr) {
    RETURN_IF_ERROR(
        Annotate(options_.store->DeleteJob(name), absl::StrCat("InitJob: replacing job ", name)));
  }
  LogInfo(options_.logger, "job_replaced",
          {Kv("job", name), Kv("old_incarnation", old->state->layout().incarnation().substr(0, 12)),
           Kv("incarnation", incarnation.substr(0, 12))});
  return absl::OkStatus();
}

absl::StatusOr<bool> Shard::AddJob(const std::string& name, std::shared_ptr<Job> job) {
  // Creation is serialised, so the job becomes durable before it becomes visible: no push
  // can be acknowledged for a job whose layout and initial values are not in the store.
  absl::MutexLock init_lock(&init_mu_);
  ASSIGN_OR_RETURN(const Existing found, JobExists(job->state->layout()));
  if (found == Existing::kSame) return false;  // Created meanwhile by another call.
  if (found == Existing::kStale) {
    RETURN_IF_ERROR(DropStaleJob(name, job->state->layout().incarnation()));
  }
  RETURN_IF_ERROR(CheckJobCount(name));  // Creation is serialised: the count holds.
  if (job->state->durability() != Durability::kNone) {
    RETURN_IF_ERROR(
        Annotate(job->durability.MaybeSnapshot(/*force=*/true),
                 absl::StrCat("InitJob: job ", name, " could not be made durable; not created")));
  }
  absl::MutexLock lock(&mu_);
  jobs_.emplace(name, std::move(job));
  return true;
}

absl::StatusOr<InitJobResponse> Shard::InitJob(const InitJobRequest& request,
                                               const std::string& incarnation) {
  // Everything is checked before anything of the job is allocated: the request's fields and
  // limits, then its partition (bounded by them), initial values and memory.
  RETURN_IF_ERROR(
      ValidateInitJob(request, options_.limits, options_.optimizers, options_.consistency));
  InitJobRequest layout = NormalizedLayout(request);
  layout.set_incarnation(incarnation);  // Ours, never the caller's.
  InitJobResponse response;
  // Fast path, before copying the initial values into a new job.
  ASSIGN_OR_RETURN(const Existing found, JobExists(layout));
  if (found == Existing::kSame) {
    response.set_created(false);
    return response;
  }
  ASSIGN_OR_RETURN(const Partition partition, LayoutPartition(layout));
  if (found == Existing::kStale) {
    // A new submission reusing the name of a job this shard still holds: the old one goes
    // first, so its memory and job slot are free for the new one.
    absl::MutexLock init_lock(&init_mu_);
    RETURN_IF_ERROR(DropStaleJob(request.job(), incarnation));
  }
  RETURN_IF_ERROR(CheckJobCount(request.job()));
  // Memory before the initial values: a job that cannot fit is told so whatever it carries.
  ASSIGN_OR_RETURN(MemoryReservation memory, ReserveMemory(layout, partition, /*restore=*/false));
  RETURN_IF_ERROR(CheckInitialValues(request, partition));
  // Build the job outside the locks: copying initial values can take a while.
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, BuildJob(layout, std::move(memory)));
  LoadInitialValues(request, *job->state);
  ASSIGN_OR_RETURN(const bool created, AddJob(request.job(), job));
  response.set_created(created);
  if (created) {
    LogInfo(
        options_.logger, "job_created",
        {Kv("job", request.job()), Kv("shard", layout.shard_index()),
         Kv("chunks", job->state->chunks().size()), Kv("elements", job->state->owned_elements()),
         Kv("optimizer", layout.optimizer().name()), Kv("mode", layout.consistency()),
         Kv("workers", layout.num_workers()), Kv("durability", layout.durability().mode()),
         Kv("memory_bytes", job->memory.bytes()), Kv("memory_reserved", budget_.used())});
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
  WarnOrphanedLogs(stored);
  return absl::OkStatus();
}

void Shard::WarnOrphanedLogs(const std::vector<ShardStore::StoredJob>& stored) const {
  // A job's update log without the job in the store: the store lost what named it (its files
  // damaged or removed by hand). Nothing can replay it; say so rather than start as if the
  // job never was. (A directory with only chunk files is a job whose creation did not finish:
  // its first snapshot wrote the file, and the store never named it.)
  std::error_code ec;
  const std::string root = options_.store->log_root();
  for (std::filesystem::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string job = it->path().filename().string();
    std::error_code dir_ec;
    if (!it->is_directory(dir_ec) ||
        std::any_of(stored.begin(), stored.end(),
                    [&](const ShardStore::StoredJob& s) { return s.layout.job() == job; })) {
      continue;
    }
    if (!UpdateLog::HasSegments(root, job)) continue;
    LogWarning(options_.logger, "orphaned_update_log",
               {Kv("job", job), Kv("path", it->path().string()),
                Kv("why", "the store has no job of this name: its state cannot be restored")});
  }
}

absl::Status Shard::RestoreJob(const ShardStore::StoredJob& s) {
  const std::string& name = s.layout.job();
  ASSIGN_OR_RETURN(const Partition partition, LayoutPartition(s.layout));
  // A job the shard already held is restored even beyond the budget (logged below).
  ASSIGN_OR_RETURN(MemoryReservation memory, ReserveMemory(s.layout, partition, /*restore=*/true));
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, BuildJob(s.layout, std::move(memory)));
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
           Kv("dir", options_.store->dir()), Kv("durability", s.layout.durability().mode()),
           Kv("memory_reserved", budget_.used()), Kv("memory_limit", budget_.limit())});
  absl::MutexLock lock(&mu_);
  jobs_.emplace(name, std::move(job));
  return absl::OkStatus();
}

absl::Status Shard::PushUpdate(const Job& job, const PushRequest& request, const DenseChunks* dense,
                               ChunkUpdate* update, std::vector<Chunk*>* targets,
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
    ASSIGN_OR_RETURN(
        const float* grad,
        DecodePushedChunk(
            codecs_, c,
            dense != nullptr && static_cast<size_t>(i) < dense->size() ? &(*dense)[i] : nullptr,
            chunk->info.numel, absl::StrCat("Push: ", where), &(*scratch)[i]));
    targets->push_back(chunk);
    update->chunks.push_back(idx);
    update->numels.push_back(chunk->info.numel);
    update->grads.push_back(grad);
    update->base_versions.push_back(c.version());
  }
  update->requests.push_back({request.worker(), request.step(), request.request_id()});
  return absl::OkStatus();
}

absl::Status Shard::StartPush(const PushRequest& request, const DenseChunks* dense, PushDone* done,
                              WaitCancel* cancel) {
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
  RETURN_IF_ERROR(PushUpdate(*job, request, dense, &update, &targets, &scratch));

  const int32_t worker = request.worker();
  const int64_t step = request.step();
  const uint64_t id = request.request_id();
  SyncCommits* commits = job->commits.get();
  if (commits == nullptr && request.nonfinite()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Push: job ", request.job(), " worker ", worker, " step ", step,
        " is flagged nonfinite, but the job does not commit its steps (commit_steps)"));
  }
  update.nonfinite = request.nonfinite();
  // commit_steps: a push of a step held here that this worker contributed to (a retry, or a
  // restarted worker) is a duplicate, answered with the step's figures.
  if (commits != nullptr) {
    if (std::optional<PreparedStep> held = commits->Find(step, worker); held.has_value()) {
      PushResponse response;
      response.set_duplicate(true);
      *response.mutable_prepared() = *held;
      (*done)(std::move(response));
      return absl::OkStatus();
    }
  }
  ASSIGN_OR_RETURN(const RequestLedger::Admission admission,
                   job->ledger.BeginPush(worker, step, id));
  if (admission == RequestLedger::Admission::kDuplicate) {
    PushResponse response;
    response.set_duplicate(true);
    (*done)(std::move(response));
    return absl::OkStatus();
  }
  // The policy copies what it keeps of `update` (whose buffers die with this call).
  // commit_steps: the completed step is held for its commit instead of applied.
  ApplyFn apply = [this, job](const ChunkUpdate& u) {
    if (job->commits != nullptr) return job->commits->Prepare(u);
    return ApplyUpdate(job.get(), u, /*replay=*/false);
  };
  WaitDone finish = [job, worker, step, id, targets = std::move(targets),
                     done = std::move(*done)](absl::Status st) {
    // A prepared push is not applied yet: its id is not remembered (retries are answered from
    // the held step), and its commit records it.
    job->ledger.EndPush(worker, step, id, st.ok() && job->commits == nullptr);
    if (!st.ok()) {
      done(std::move(st));
      return;
    }
    PushResponse response;
    if (job->commits != nullptr) {
      std::optional<PreparedStep> held = job->commits->Find(step, worker);
      if (!held.has_value()) {
        // Committed and forgotten before this answer went out (kRemembered steps later).
        done(absl::AbortedError(absl::StrCat("Push: job ", job->state->name(), " step ", step,
                                             " was committed before its answer was sent")));
        return;
      }
      *response.mutable_prepared() = *held;
    }
    for (Chunk* chunk : targets) {
      absl::MutexLock lock(&chunk->mu);
      response.add_new_versions(chunk->version);
    }
    // A failed periodic snapshot is logged; the push itself was applied (and, for
    // every_update, logged), so it still succeeds.
    (void)job->durability.MaybeSnapshot(/*force=*/false);
    done(std::move(response));
  };
  job->state->policy().StartPush(update, std::move(apply), std::move(finish), cancel);
  return absl::OkStatus();
}

// What a pull reads, checked: its job (held, so its chunks stay valid), the chunks with the
// version the worker holds of each (-1: unknown), and the format.
struct Shard::PullPlan {
  std::shared_ptr<Job> job;
  int32_t worker = 0;
  std::vector<std::pair<int64_t, Chunk*>> targets;
  std::vector<int64_t> held;
  PullFormat format;
};

void Shard::PushAsync(const PushRequest& request, PushDone done, WaitCancel* cancel,
                      const DenseChunks* dense) {
  if (request.has_pull()) {
    // The pull is checked whole before the push can change anything.
    absl::StatusOr<PullPlan> plan = PlanFusedPull(request);
    if (!plan.ok()) {
      done(plan.status());
      return;
    }
    done = [this, plan = std::move(plan).value(), done = std::move(done),
            cancel](absl::StatusOr<PushResponse> pushed) mutable {
      if (!pushed.ok()) {
        done(std::move(pushed));
        return;
      }
      auto response = std::make_shared<PushResponse>(std::move(pushed).value());
      ReadPull(
          std::move(plan), response->mutable_pulled(),
          [response, done = std::move(done)](absl::Status st) {
            if (!st.ok()) {
              done(Annotate(st, "the push was applied, its pull failed"));
              return;
            }
            done(std::move(*response));
          },
          cancel);
    };
  }
  if (absl::Status st = StartPush(request, dense, &done, cancel); !st.ok()) done(std::move(st));
}

absl::StatusOr<Shard::PullPlan> Shard::PlanFusedPull(const PushRequest& request) {
  const PullRequest& pull = request.pull();
  if (pull.job() != request.job() || pull.worker() != request.worker()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Push: job ", request.job(), " worker ", request.worker(), " step ",
                     request.step(), ": its pull names job ", pull.job(), " worker ", pull.worker(),
                     "; a push's pull must name the push's own"));
  }
  if (pull.has_commit()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Push: job ", request.job(), " worker ", request.worker(), " step ",
                     request.step(), ": its pull commits a step; commit with a Pull of its own"));
  }
  // The worker is the push's: a bad one is reported as the push's.
  ASSIGN_OR_RETURN(PullPlan plan, PlanPull(pull, "Push"));
  if (plan.job->commits != nullptr) {
    // Its push only prepares the step: the values after it come with the commit.
    return absl::FailedPreconditionError(
        absl::StrCat("Push: job ", request.job(), " commits its steps (commit_steps); its pushes ",
                     "cannot carry a pull: commit with a Pull of its own"));
  }
  return plan;
}

namespace {

// The outcome of a call made blocking, shared with its completion (which may still be
// running after Set when the caller returns). A mutex and condition variable rather than a
// Notification, so that ThreadSanitizer runs see the hand-off.
template <typename T>
struct Outcome {
  void Set(T r) {
    absl::MutexLock lock(&mu);
    result = std::move(r);
    done = true;
    cv.Signal();
  }
  T Wait() {
    absl::MutexLock lock(&mu);
    while (!done) cv.Wait(&mu);
    return std::move(result);
  }
  absl::Mutex mu;
  absl::CondVar cv;
  bool done ABSL_GUARDED_BY(mu) = false;
  T result ABSL_GUARDED_BY(mu);
};

}  // namespace

absl::StatusOr<PushResponse> Shard::Push(const PushRequest& request) {
  auto outcome = std::make_shared<Outcome<absl::StatusOr<PushResponse>>>();
  PushAsync(request, [outcome](absl::StatusOr<PushResponse> r) { outcome->Set(std::move(r)); });
  return outcome->Wait();
}

absl::StatusOr<Shard::PullPlan> Shard::PlanPull(const PullRequest& request,
                                                const char* worker_rpc) {
  PullPlan plan;
  ASSIGN_OR_RETURN(plan.job, FindJob(request.job()));
  const JobState& state = *plan.job->state;
  RETURN_IF_ERROR(state.CheckWorker(worker_rpc, request.worker()));
  plan.worker = request.worker();
  if (request.chunks_size() == 0) {
    for (int64_t idx : state.owned_indices()) {
      plan.targets.emplace_back(idx, state.chunk(idx));
      plan.held.push_back(-1);
    }
  } else {
    for (const ChunkData& c : request.chunks()) {
      ASSIGN_OR_RETURN(auto owned, state.OwnedChunk("Pull", c.tensor(), c.chunk()));
      plan.targets.push_back(owned);
      plan.held.push_back(c.version());
    }
  }
  ASSIGN_OR_RETURN(plan.format, PullEncoder::ParseFormat(request.job(), request.codec(), codecs_));
  return plan;
}

absl::Status Shard::StartPull(const PullRequest& request, PullResponse* response, PullDone* done,
                              WaitCancel* cancel) {
  ASSIGN_OR_RETURN(PullPlan plan, PlanPull(request, "Pull"));
  if (request.has_commit()) {
    ASSIGN_OR_RETURN(const bool committed, CommitStep(plan.job, request));
    if (!committed) {
      response->set_commit_missing(true);
      (*done)(absl::OkStatus());
      return absl::OkStatus();
    }
  }
  ReadPull(std::move(plan), response, std::move(*done), cancel);
  return absl::OkStatus();
}

void Shard::ReadPull(PullPlan plan, PullResponse* response, PullDone done, WaitCancel* cancel) {
  ConsistencyPolicy& policy = plan.job->state->policy();
  const int32_t worker = plan.worker;
  // Runs when the policy lets the pull proceed (at once unless an ssp bound holds it).
  WaitDone encode = [plan = std::move(plan), dense = PullFormat(), response,
                     done = std::move(done)](absl::Status st) {
    if (!st.ok()) {
      done(std::move(st));
      return;
    }
    Job& job = *plan.job;
    response->mutable_chunks()->Reserve(static_cast<int>(plan.targets.size()));
    for (size_t t = 0; t < plan.targets.size() && st.ok(); ++t) {
      const auto [idx, chunk] = plan.targets[t];
      ChunkData* out = response->add_chunks();
      out->set_tensor(chunk->info.tensor);
      out->set_chunk(chunk->info.chunk);
      out->set_dtype(FLOAT32);
      absl::MutexLock lock(&chunk->mu);
      out->set_version(chunk->version);
      // Buffers are never narrowed: fp16/bf16 would round counts such as num_batches_tracked
      // (bf16 is exact only up to 256); "changes" is lossless and stays.
      const PullFormat& f =
          plan.format.kind == PullFormat::Kind::kNarrow && job.state->is_buffer(chunk->info.tensor)
              ? dense
              : plan.format;
      st = Annotate(
          job.pulls.Encode(f, idx, plan.worker, plan.held[t], chunk->values, chunk->version, out),
          absl::StrCat("Pull: job ", job.state->name(), " chunk (", chunk->info.tensor, ",",
                       chunk->info.chunk, ")"));
    }
    done(std::move(st));
  };
  policy.StartPull(worker, std::move(encode), cancel);
}

absl::StatusOr<bool> Shard::CommitStep(const std::shared_ptr<Job>& job,
                                       const PullRequest& request) {
  if (job->commits == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Pull: job ", request.job(), " worker ", request.worker(), " commits sync step ",
        request.commit().step(), ", but the job does not commit its steps (commit_steps)"));
  }
  const int32_t worker = request.worker();
  ASSIGN_OR_RETURN(
      const SyncCommits::Outcome outcome,
      job->commits->Commit(
          request.commit(), worker,
          [this, &job](const ChunkUpdate& u) { return ApplyUpdate(job.get(), u, false); },
          // After a restart the shard may have applied (replayed) the step with no figures
          // left: the worker's own progress says so.
          [&job, worker](int64_t step) { return job->ledger.last_step(worker) >= step; }));
  if (outcome == SyncCommits::Outcome::kApplied) {
    // As after an applied push: a failed periodic snapshot is logged, the step stands.
    (void)job->durability.MaybeSnapshot(/*force=*/false);
  } else if (outcome == SyncCommits::Outcome::kAppliedOtherwise) {
    LogWarning(options_.logger, "commit_differs",
               {Kv("job", request.job()), Kv("worker", worker), Kv("step", request.commit().step()),
                Kv("skip", request.commit().skip()), Kv("clip_coef", request.commit().clip_coef()),
                Kv("note",
                   "the step was committed otherwise before (figures seen after a "
                   "restart); it stands as applied")});
  }
  return outcome != SyncCommits::Outcome::kMissing;
}

void Shard::PullAsync(const PullRequest& request, PullResponse* response, PullDone done,
                      WaitCancel* cancel) {
  if (absl::Status st = StartPull(request, response, &done, cancel); !st.ok()) {
    done(std::move(st));
  }
}

absl::Status Shard::Pull(const PullRequest& request, PullResponse* response) {
  auto outcome = std::make_shared<Outcome<absl::Status>>();
  PullAsync(request, response, [outcome](absl::Status st) { outcome->Set(std::move(st)); });
  return outcome->Wait();
}

absl::Status Shard::Finish(const FinishRequest& request) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job()));
  RETURN_IF_ERROR(job->state->CheckWorker("Finish", request.worker()));
  job->state->policy().OnFinish(request.worker());
  const std::optional<int64_t> pushes_applied = job->ledger.MarkFinished(request.worker());
  if (pushes_applied.has_value()) {
    LogInfo(options_.logger, "worker_finished",
            {Kv("job", request.job()), Kv("worker", request.worker()), Kv("step", request.step()),
             Kv("pushes_applied", *pushes_applied)});
  }
  // A durable job records each worker's Finish (a restarted shard must not wait for a worker
  // that is gone), and its final state when the last worker finishes: a Finish is acknowledged
  // only once a snapshot taken after it succeeded, also when it is a repeat (a retry whose
  // first attempt is still snapshotting, or failed to).
  bool recorded_now = false;
  if (job->state->durability() != Durability::kNone &&
      !job->ledger.FinishRecorded(request.worker())) {
    RETURN_IF_ERROR(job->durability.MaybeSnapshot(/*force=*/true));
    job->ledger.MarkFinishRecorded(request.worker());
    recorded_now = true;
  }
  // Once per worker: its first Finish, or the retry that recorded it.
  if (pushes_applied.has_value() || recorded_now) MaybeLogJobStats(*job);
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
  r.set_placement(layout.placement());
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
  if (job->commits != nullptr) {
    r.set_steps_committed(job->commits->committed());
    r.set_steps_skipped(job->commits->skipped());
  }
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
