#include "server/shard.h"

#include <cstring>
#include <deque>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/numeric.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "google/protobuf/util/message_differencer.h"

namespace gradmesh {

// One stored chunk: values, optimizer slots and version, under its own lock.
struct Chunk {
  explicit Chunk(const ChunkInfo& i) : info(i) {}
  const ChunkInfo info;
  absl::Mutex mu;
  std::vector<float> values ABSL_GUARDED_BY(mu);
  std::vector<float> slots ABSL_GUARDED_BY(mu);  // num_slots * numel, slot-major.
  int64_t version ABSL_GUARDED_BY(mu) = 0;        // Number of updates applied.
};

struct WorkerRecord {
  int64_t last_step = -1;
  bool finished = false;
  int64_t pushes_applied = 0;
  // Request ids of the last dedupe_window applied pushes (true) and of pushes being applied
  // now (false); id_order lists the applied ones, oldest first.
  absl::flat_hash_map<uint64_t, bool> recent_ids;
  std::deque<uint64_t> id_order;
};

struct Shard::Job {
  // Constant after InitJob.
  InitJobRequest layout;  // The InitJob request without initial values.
  std::unique_ptr<Partition> partition;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<ConsistencyPolicy> policy;
  // Owned chunks, keyed by index in partition->chunks().
  absl::flat_hash_map<int64_t, std::unique_ptr<Chunk>> chunks;
  int64_t owned_elements = 0;

  absl::Mutex mu;
  std::vector<WorkerRecord> workers ABSL_GUARDED_BY(mu);
  std::vector<int64_t> staleness ABSL_GUARDED_BY(mu);
  int64_t pushes_applied ABSL_GUARDED_BY(mu) = 0;
  int64_t duplicates ABSL_GUARDED_BY(mu) = 0;
};

namespace {

std::string ChunkName(const std::string& job, const InitJobRequest& layout, int32_t t,
                      int32_t c) {
  const std::string tensor =
      t >= 0 && t < layout.tensors_size() ? layout.tensors(t).name() : absl::StrCat("#", t);
  return absl::StrCat("job ", job, " tensor ", t, " (", tensor, ") chunk ", c);
}

// Checks that `data` holds exactly `numel` finite float32 values.
absl::Status CheckDenseFloats(const ChunkData& c, int64_t numel, const std::string& where) {
  if (c.dtype() != FLOAT32 && c.dtype() != DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": dtype ", DType_Name(c.dtype()), " is not supported; use FLOAT32"));
  }
  if (!c.codec().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": codec \"", c.codec(), "\" is not supported by this shard"));
  }
  const int64_t want = numel * static_cast<int64_t>(sizeof(float));
  if (static_cast<int64_t>(c.data().size()) != want) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected ", numel,
                                                   " float32 values (", want, " bytes), got ",
                                                   c.data().size(), " bytes"));
  }
  std::vector<float> aligned;
  const float* x = reinterpret_cast<const float*>(c.data().data());
  if (reinterpret_cast<uintptr_t>(x) % alignof(float) != 0) {
    aligned.resize(numel);
    std::memcpy(aligned.data(), c.data().data(), want);
    x = aligned.data();
  }
  const int64_t bad = FirstNonFinite(x, numel);
  if (bad >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": element ", bad, " is not finite (",
                                                   x[bad], "); nothing was applied"));
  }
  return absl::OkStatus();
}

// Float view of validated chunk data (copying only if misaligned).
const float* FloatView(const std::string& data, std::vector<float>* scratch) {
  const float* x = reinterpret_cast<const float*>(data.data());
  if (reinterpret_cast<uintptr_t>(x) % alignof(float) == 0) return x;
  scratch->resize(data.size() / sizeof(float));
  std::memcpy(scratch->data(), data.data(), data.size());
  return scratch->data();
}

absl::Status ValidateLayout(const InitJobRequest& r) {
  if (r.job().empty()) return absl::InvalidArgumentError("InitJob: job name is empty");
  if (r.tensors_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("InitJob: job ", r.job(), " has no tensors"));
  }
  absl::flat_hash_set<std::string> names;
  for (int t = 0; t < r.tensors_size(); ++t) {
    const TensorSpec& ts = r.tensors(t);
    if (ts.name().empty() || !names.insert(ts.name()).second) {
      return absl::InvalidArgumentError(absl::StrCat("InitJob: job ", r.job(), " tensor ", t,
                                                     " has an empty or repeated name \"",
                                                     ts.name(), "\""));
    }
    int64_t numel = 1;
    for (int64_t d : ts.shape()) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrCat("InitJob: job ", r.job(), " tensor ",
                                                       ts.name(), " has a negative dimension"));
      }
      if (d != 0 && numel > (int64_t{1} << 40) / d) {
        return absl::InvalidArgumentError(absl::StrCat(
            "InitJob: job ", r.job(), " tensor ", ts.name(), " has more than 2^40 elements"));
      }
      numel *= d;
    }
  }
  if (r.num_shards() <= 0 || r.shard_index() < 0 || r.shard_index() >= r.num_shards()) {
    return absl::InvalidArgumentError(absl::StrCat("InitJob: job ", r.job(), " shard_index ",
                                                   r.shard_index(), " not in [0, ",
                                                   r.num_shards(), ")"));
  }
  if (r.num_workers() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("InitJob: job ", r.job(), " num_workers must be > 0"));
  }
  return absl::OkStatus();
}

int64_t Numel(const TensorSpec& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  return n;
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
  return std::unique_ptr<Shard>(new Shard(std::move(options)));
}

absl::StatusOr<std::shared_ptr<Shard::Job>> Shard::FindJob(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(name);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job ", name, " is not known to this shard"));
  }
  return it->second;
}

absl::StatusOr<InitJobResponse> Shard::InitJob(const InitJobRequest& request) {
  RETURN_IF_ERROR(ValidateLayout(request));
  InitJobRequest layout = request;
  layout.clear_initial();
  if (layout.consistency().empty()) layout.set_consistency("async");

  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request.job());
    if (it != jobs_.end()) {
      if (!google::protobuf::util::MessageDifferencer::Equals(it->second->layout, layout)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "InitJob: job ", request.job(),
            " already exists on this shard with a different layout, optimizer, mode or worker "
            "count; use another job name"));
      }
      InitJobResponse response;
      response.set_created(false);
      return response;
    }
  }

  // Build the job outside the lock: copying initial values can take a while.
  auto job = std::make_shared<Job>();
  job->layout = layout;
  std::vector<int64_t> numels;
  for (const TensorSpec& t : layout.tensors()) numels.push_back(Numel(t));
  auto partition = Partition::Create(numels, layout.chunk_elems(), layout.num_shards());
  if (!partition.ok()) {
    return Annotate(partition.status(), absl::StrCat("InitJob: job ", request.job()));
  }
  job->partition = std::make_unique<Partition>(std::move(partition).value());
  {
    auto opt = options_.optimizers.Create(layout.optimizer());
    if (!opt.ok()) return Annotate(opt.status(), absl::StrCat("InitJob: job ", request.job()));
    job->optimizer = std::move(opt).value();
    auto policy = options_.consistency.Create({layout.consistency(), layout.num_workers()});
    if (!policy.ok()) {
      return Annotate(policy.status(), absl::StrCat("InitJob: job ", request.job()));
    }
    job->policy = std::move(policy).value();
  }
  const Partition& p = *job->partition;
  const int32_t me = layout.shard_index();
  for (int64_t idx : p.shard_chunks(me)) {
    job->chunks.emplace(idx, std::make_unique<Chunk>(p.chunks()[idx]));
    job->owned_elements += p.chunks()[idx].numel;
  }
  // Initial values: exactly the owned chunks, each once.
  if (request.initial_size() != static_cast<int>(job->chunks.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InitJob: job ", request.job(), " shard ", me, " owns ", job->chunks.size(),
        " chunks but the request carries initial values for ", request.initial_size()));
  }
  const int num_slots = job->optimizer->num_slots();
  for (const ChunkData& c : request.initial()) {
    const std::string where = ChunkName(request.job(), layout, c.tensor(), c.chunk());
    const int64_t idx = p.Find(c.tensor(), c.chunk());
    auto it = job->chunks.find(idx);
    if (idx < 0 || it == job->chunks.end()) {
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
    chunk.slots.assign(static_cast<size_t>(num_slots) * chunk.info.numel, 0.0f);
  }
  {
    absl::MutexLock lock(&job->mu);
    job->workers.resize(layout.num_workers());
    job->staleness.assign(options_.staleness_buckets, 0);
  }
  InitJobResponse response;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = jobs_.emplace(request.job(), job);
    if (!inserted && !google::protobuf::util::MessageDifferencer::Equals(it->second->layout,
                                                                         layout)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "InitJob: job ", request.job(), " was created concurrently with a different layout"));
    }
    response.set_created(inserted);
  }
  if (response.created()) {
    LogInfo(options_.logger, "job_created",
            {Kv("job", request.job()), Kv("shard", me), Kv("chunks", job->chunks.size()),
             Kv("elements", job->owned_elements), Kv("optimizer", layout.optimizer().name()),
             Kv("mode", layout.consistency()), Kv("workers", layout.num_workers())});
  }
  return response;
}

absl::StatusOr<PushResponse> Shard::Push(const PushRequest& request) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job()));
  const Partition& p = *job->partition;
  if (request.worker() < 0 || request.worker() >= job->layout.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat("Push: job ", request.job(), " worker ",
                                                   request.worker(), " not in [0, ",
                                                   job->layout.num_workers(), ")"));
  }
  // Validate everything before changing anything.
  std::vector<Chunk*> targets;
  targets.reserve(request.chunks_size());
  absl::flat_hash_set<int64_t> seen;
  for (const ChunkData& c : request.chunks()) {
    const std::string where = ChunkName(request.job(), job->layout, c.tensor(), c.chunk());
    const int64_t idx = p.Find(c.tensor(), c.chunk());
    if (idx < 0) return absl::NotFoundError(absl::StrCat("Push: ", where, " does not exist"));
    auto it = job->chunks.find(idx);
    if (it == job->chunks.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Push: ", where, " belongs to shard ", p.chunks()[idx].shard, ", not shard ",
          job->layout.shard_index()));
    }
    if (!seen.insert(idx).second) {
      return absl::InvalidArgumentError(absl::StrCat("Push: ", where, " appears twice"));
    }
    RETURN_IF_ERROR(CheckDenseFloats(c, it->second->info.numel, absl::StrCat("Push: ", where)));
    targets.push_back(it->second.get());
  }

  PushResponse response;
  {
    absl::MutexLock lock(&job->mu);
    WorkerRecord& w = job->workers[request.worker()];
    auto it = w.recent_ids.find(request.request_id());
    if (it != w.recent_ids.end()) {
      if (!it->second) {
        // The original is still being applied (e.g. waiting at a barrier): the client retries
        // ABORTED with backoff and will then be told it is a duplicate, or may apply it if
        // the original failed.
        return absl::AbortedError(absl::StrCat("Push: job ", request.job(), " worker ",
                                               request.worker(), " request ",
                                               request.request_id(), " is still in progress"));
      }
      ++job->duplicates;
      response.set_duplicate(true);
      return response;
    }
    w.recent_ids.emplace(request.request_id(), false);
  }

  std::vector<int64_t> staleness(targets.size(), 0);
  response.mutable_new_versions()->Resize(static_cast<int>(targets.size()), 0);
  const Optimizer& opt = *job->optimizer;
  auto apply = [&](float lr_scale) {
    std::vector<float> scratch;
    std::vector<float*> slot_ptrs(opt.num_slots());
    for (size_t i = 0; i < targets.size(); ++i) {
      Chunk& chunk = *targets[i];
      const ChunkData& c = request.chunks(static_cast<int>(i));
      const float* grad = FloatView(c.data(), &scratch);
      absl::MutexLock lock(&chunk.mu);
      const int64_t n = chunk.info.numel;
      for (int s = 0; s < opt.num_slots(); ++s) slot_ptrs[s] = chunk.slots.data() + s * n;
      staleness[i] = c.version() < chunk.version ? chunk.version - c.version() : 0;
      const float scale = lr_scale * LrScheduleFactor(job->layout.optimizer(), chunk.version);
      ++chunk.version;
      opt.Apply(chunk.version, scale, grad, chunk.values.data(), slot_ptrs.data(), n);
      response.set_new_versions(static_cast<int>(i), chunk.version);
    }
  };
  absl::Status st = job->policy->OnPush(request.worker(), request.step(), apply);
  if (!st.ok()) {
    // Not applied: forget the id so that a retry can succeed.
    absl::MutexLock lock(&job->mu);
    job->workers[request.worker()].recent_ids.erase(request.request_id());
    return st;
  }
  {
    absl::MutexLock lock(&job->mu);
    WorkerRecord& w = job->workers[request.worker()];
    w.recent_ids[request.request_id()] = true;
    w.id_order.push_back(request.request_id());
    if (static_cast<int64_t>(w.id_order.size()) > options_.dedupe_window) {
      w.recent_ids.erase(w.id_order.front());
      w.id_order.pop_front();
    }
    w.last_step = std::max(w.last_step, request.step());
    ++w.pushes_applied;
    ++job->pushes_applied;
    const int64_t last = static_cast<int64_t>(job->staleness.size()) - 1;
    for (int64_t s : staleness) ++job->staleness[std::min(s, last)];
  }
  return response;
}

absl::Status Shard::Pull(const PullRequest& request, PullResponse* response) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job()));
  const Partition& p = *job->partition;
  if (request.worker() < 0 || request.worker() >= job->layout.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat("Pull: job ", request.job(), " worker ",
                                                   request.worker(), " not in [0, ",
                                                   job->layout.num_workers(), ")"));
  }
  std::vector<Chunk*> targets;
  if (request.chunks_size() == 0) {
    for (int64_t idx : p.shard_chunks(job->layout.shard_index())) {
      targets.push_back(job->chunks.at(idx).get());
    }
  } else {
    for (const ChunkData& c : request.chunks()) {
      const std::string where = ChunkName(request.job(), job->layout, c.tensor(), c.chunk());
      const int64_t idx = p.Find(c.tensor(), c.chunk());
      if (idx < 0) return absl::NotFoundError(absl::StrCat("Pull: ", where, " does not exist"));
      auto it = job->chunks.find(idx);
      if (it == job->chunks.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "Pull: ", where, " belongs to shard ", p.chunks()[idx].shard, ", not shard ",
            job->layout.shard_index()));
      }
      targets.push_back(it->second.get());
    }
  }
  int64_t step;
  {
    absl::MutexLock lock(&job->mu);
    step = job->workers[request.worker()].last_step;
  }
  RETURN_IF_ERROR(job->policy->BeforePull(request.worker(), step));
  response->mutable_chunks()->Reserve(static_cast<int>(targets.size()));
  for (Chunk* chunk : targets) {
    ChunkData* out = response->add_chunks();
    out->set_tensor(chunk->info.tensor);
    out->set_chunk(chunk->info.chunk);
    out->set_dtype(FLOAT32);
    absl::MutexLock lock(&chunk->mu);
    out->set_version(chunk->version);
    out->mutable_data()->assign(reinterpret_cast<const char*>(chunk->values.data()),
                                chunk->values.size() * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status Shard::Finish(const FinishRequest& request) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job()));
  if (request.worker() < 0 || request.worker() >= job->layout.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat("Finish: job ", request.job(), " worker ",
                                                   request.worker(), " not in [0, ",
                                                   job->layout.num_workers(), ")"));
  }
  absl::MutexLock lock(&job->mu);
  WorkerRecord& w = job->workers[request.worker()];
  if (!w.finished) {
    w.finished = true;
    LogInfo(options_.logger, "worker_finished",
            {Kv("job", request.job()), Kv("worker", request.worker()),
             Kv("step", request.step()), Kv("pushes_applied", w.pushes_applied)});
  }
  return absl::OkStatus();
}

absl::StatusOr<JobInfoResponse> Shard::GetJobInfo(const JobInfoRequest& request) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job()));
  JobInfoResponse r;
  r.set_job(request.job());
  *r.mutable_tensors() = job->layout.tensors();
  r.set_chunk_elems(job->layout.chunk_elems());
  r.set_num_shards(job->layout.num_shards());
  r.set_shard_index(job->layout.shard_index());
  r.set_num_workers(job->layout.num_workers());
  r.set_consistency(job->layout.consistency());
  *r.mutable_optimizer() = job->layout.optimizer();
  r.set_owned_elements(job->owned_elements);
  absl::MutexLock lock(&job->mu);
  for (size_t i = 0; i < job->workers.size(); ++i) {
    WorkerState* w = r.add_workers();
    w->set_worker(static_cast<int32_t>(i));
    w->set_last_step(job->workers[i].last_step);
    w->set_finished(job->workers[i].finished);
    w->set_pushes_applied(job->workers[i].pushes_applied);
  }
  r.set_pushes_applied(job->pushes_applied);
  r.set_duplicates_dropped(job->duplicates);
  for (int64_t s : job->staleness) r.add_staleness_histogram(s);
  return r;
}

}  // namespace gradmesh
