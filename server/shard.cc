#include "server/shard.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_name.h"
#include "common/numeric.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "common/tensor_wire.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "server/state.pb.h"
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
  // "changes" pulls: per worker, the values last sent and their version (-1: none). Not
  // persisted: after a restart every worker gets the chunk dense once.
  std::vector<std::vector<float>> sent ABSL_GUARDED_BY(mu);
  std::vector<int64_t> sent_version ABSL_GUARDED_BY(mu);
};

struct WorkerRecord {
  int64_t last_step = -1;
  bool finished = false;
  int64_t pushes_applied = 0;
  // Request ids of the last dedupe_window applied pushes (true) and of pushes being applied
  // now (false); id_order lists the applied ones, oldest first.
  absl::flat_hash_map<uint64_t, bool> recent_ids;
  std::deque<uint64_t> id_order;
  // Steps whose push is being applied now (normally at most one).
  absl::flat_hash_set<int64_t> steps_in_progress;
};

enum class Durability { kNone, kPeriodic, kEveryUpdate };

// every_update: snapshot once this much has been logged (well below RocksDB's 64 MiB
// memtable), so that log records are deleted before they are flushed to disk.
constexpr int64_t kLogBytesPerSnapshot = 32ll << 20;

struct Shard::Job {
  // Constant after InitJob.
  InitJobRequest layout;  // The InitJob request without initial values.
  std::unique_ptr<Partition> partition;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<ConsistencyPolicy> policy;
  // Owned chunks, keyed by index in partition->chunks().
  absl::flat_hash_map<int64_t, std::unique_ptr<Chunk>> chunks;
  int64_t owned_elements = 0;
  Durability durability = Durability::kNone;
  bool sync_mode = false;

  // sync: a copy of the policy's barrier group, for GetJobInfo. group_mu also serialises
  // SetSyncGroup calls, so the copy and the policy agree (taken before the policy's lock).
  absl::Mutex group_mu;
  std::vector<int32_t> active_workers ABSL_GUARDED_BY(group_mu);  // Ascending; sync only.
  float lr_scale ABSL_GUARDED_BY(group_mu) = 1.0f;

  // Updates hold this shared (exclusive when logging, so log order is apply order);
  // snapshots hold it exclusive to see a consistent state.
  absl::Mutex apply_mu;
  // Updates applied; the number of the last logged one. Written under `mu` by a holder of
  // apply_mu, so holding either lock exclusively gives a stable value.
  int64_t seq = 0;

  absl::Mutex mu;
  std::vector<WorkerRecord> workers ABSL_GUARDED_BY(mu);
  std::vector<int64_t> staleness ABSL_GUARDED_BY(mu);
  int64_t pushes_applied ABSL_GUARDED_BY(mu) = 0;
  int64_t duplicates ABSL_GUARDED_BY(mu) = 0;
  int64_t updates_applied ABSL_GUARDED_BY(mu) = 0;
  // Snapshot bookkeeping.
  bool snapshot_running ABSL_GUARDED_BY(mu) = false;
  int64_t snapshot_update ABSL_GUARDED_BY(mu) = 0;
  int64_t logged_bytes ABSL_GUARDED_BY(mu) = 0;  // Log bytes since the last snapshot.
  absl::Time snapshot_retry_after ABSL_GUARDED_BY(mu);  // Back-off after a failed snapshot.
  absl::Time snapshot_time ABSL_GUARDED_BY(mu);
  int64_t snapshots ABSL_GUARDED_BY(mu) = 0;
  double last_snapshot_s ABSL_GUARDED_BY(mu) = 0;
  int64_t last_snapshot_bytes ABSL_GUARDED_BY(mu) = 0;
  bool restored ABSL_GUARDED_BY(mu) = false;
  int64_t replayed ABSL_GUARDED_BY(mu) = 0;
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

absl::StatusOr<Durability> ParseDurability(const DurabilitySpec& d) {
  if (d.mode().empty() || d.mode() == "none") return Durability::kNone;
  if (d.mode() == "periodic") return Durability::kPeriodic;
  if (d.mode() == "every_update") return Durability::kEveryUpdate;
  return absl::InvalidArgumentError(absl::StrCat("unknown durability mode \"", d.mode(),
                                                 "\" (known: every_update, none, periodic)"));
}

absl::Status ValidateLayout(const InitJobRequest& r) {
  if (r.job().empty()) return absl::InvalidArgumentError("InitJob: job name is empty");
  if (!IsValidJobName(r.job())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InitJob: job name \"", r.job(), "\" may only use letters, digits, '_', '.', '-'"));
  }
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
  if (r.barrier_timeout_s() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("InitJob: job ", r.job(), " barrier_timeout_s must be >= 0"));
  }
  const DurabilitySpec& d = r.durability();
  if (d.snapshot_every_updates() < 0 || d.snapshot_every_seconds() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InitJob: job ", r.job(), " snapshot intervals must be >= 0"));
  }
  return ParseDurability(d).status();
}

int64_t Numel(const TensorSpec& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  return n;
}

using ChunkMap = absl::flat_hash_map<int64_t, std::unique_ptr<Chunk>>;

absl::Status CheckWorker(const char* rpc, const InitJobRequest& layout, int32_t worker) {
  if (worker >= 0 && worker < layout.num_workers()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(rpc, ": job ", layout.job(), " worker ", worker,
                                                 " not in [0, ", layout.num_workers(), ")"));
}

// The chunk (tensor, chunk) of a request: NOT_FOUND if it does not exist, FAILED_PRECONDITION
// if another shard owns it. Returns its partition index and the stored chunk.
absl::StatusOr<std::pair<int64_t, Chunk*>> OwnedChunk(const char* rpc,
                                                      const InitJobRequest& layout,
                                                      const Partition& p, const ChunkMap& chunks,
                                                      int32_t tensor, int32_t chunk) {
  const int64_t idx = p.Find(tensor, chunk);
  if (idx < 0) {
    return absl::NotFoundError(
        absl::StrCat(rpc, ": ", ChunkName(layout.job(), layout, tensor, chunk), " does not exist"));
  }
  auto it = chunks.find(idx);
  if (it == chunks.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        rpc, ": ", ChunkName(layout.job(), layout, tensor, chunk), " belongs to shard ",
        p.chunks()[idx].shard, ", not shard ", layout.shard_index()));
  }
  return std::make_pair(idx, it->second.get());
}

// Fills defaults the shard relies on, so equal requests compare equal.
InitJobRequest NormalizedLayout(const InitJobRequest& request) {
  InitJobRequest layout = request;
  layout.clear_initial();
  if (layout.consistency().empty()) layout.set_consistency("async");
  if (layout.barrier_timeout_s() == 0) layout.set_barrier_timeout_s(120);
  DurabilitySpec* d = layout.mutable_durability();
  if (d->mode().empty()) d->set_mode("none");
  if (d->snapshot_every_updates() == 0) d->set_snapshot_every_updates(1000);
  return layout;
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
  auto job = std::make_shared<Job>();
  job->layout = layout;
  std::vector<int64_t> numels;
  for (const TensorSpec& t : layout.tensors()) numels.push_back(Numel(t));
  auto partition = Partition::Create(numels, layout.chunk_elems(), layout.num_shards());
  if (!partition.ok()) {
    return Annotate(partition.status(), absl::StrCat("InitJob: job ", layout.job()));
  }
  job->partition = std::make_unique<Partition>(std::move(partition).value());
  auto opt = options_.optimizers.Create(layout.optimizer());
  if (!opt.ok()) return Annotate(opt.status(), absl::StrCat("InitJob: job ", layout.job()));
  job->optimizer = std::move(opt).value();
  ConsistencyConfig config;
  config.job = layout.job();
  config.mode = layout.consistency();
  config.num_workers = layout.num_workers();
  config.barrier_timeout = absl::Seconds(layout.barrier_timeout_s());
  auto policy = options_.consistency.Create(config);
  if (!policy.ok()) return Annotate(policy.status(), absl::StrCat("InitJob: job ", layout.job()));
  job->policy = std::move(policy).value();
  job->sync_mode = job->policy->mode() == "sync";
  if (job->sync_mode) {
    absl::MutexLock lock(&job->group_mu);
    for (int32_t w = 0; w < layout.num_workers(); ++w) job->active_workers.push_back(w);
  }
  if (layout.staleness_damping() && job->policy->mode() != "async") {
    return absl::InvalidArgumentError(absl::StrCat(
        "InitJob: job ", layout.job(), " asks for staleness_damping, which applies to async "
        "mode only (mode is ", job->policy->mode(), ")"));
  }
  ASSIGN_OR_RETURN(job->durability, ParseDurability(layout.durability()));
  if (job->durability != Durability::kNone && options_.store == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "InitJob: job ", layout.job(), " asks for durability ", layout.durability().mode(),
        " but this shard has no data directory (start it with --data_dir)"));
  }
  const Partition& p = *job->partition;
  const int num_slots = job->optimizer->num_slots();
  for (int64_t idx : p.shard_chunks(layout.shard_index())) {
    auto chunk = std::make_unique<Chunk>(p.chunks()[idx]);
    {
      absl::MutexLock lock(&chunk->mu);
      chunk->slots.assign(static_cast<size_t>(num_slots) * chunk->info.numel, 0.0f);
    }
    job->chunks.emplace(idx, std::move(chunk));
    job->owned_elements += p.chunks()[idx].numel;
  }
  absl::MutexLock lock(&job->mu);
  job->workers.resize(layout.num_workers());
  job->staleness.assign(options_.staleness_buckets, 0);
  job->snapshot_time = absl::Now();
  return job;
}

absl::StatusOr<InitJobResponse> Shard::InitJob(const InitJobRequest& request) {
  RETURN_IF_ERROR(ValidateLayout(request));
  const InitJobRequest layout = NormalizedLayout(request);
  // True if the job exists with this layout; FAILED_PRECONDITION if with another.
  auto exists = [this, &layout]() -> absl::StatusOr<bool> {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(layout.job());
    if (it == jobs_.end()) return false;
    if (!google::protobuf::util::MessageDifferencer::Equals(it->second->layout, layout)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "InitJob: job ", layout.job(),
          " already exists on this shard with a different layout, optimizer, mode, "
          "durability or worker count; use another job name"));
    }
    return true;
  };
  InitJobResponse response;
  {
    // Fast path, before copying the initial values into a new job.
    ASSIGN_OR_RETURN(const bool found, exists());
    if (found) {
      response.set_created(false);
      return response;
    }
  }

  // Build the job outside the lock: copying initial values can take a while.
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, BuildJob(layout));
  const Partition& p = *job->partition;
  const int32_t me = layout.shard_index();
  // Initial values: exactly the owned chunks, each once.
  if (request.initial_size() != static_cast<int>(job->chunks.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InitJob: job ", request.job(), " shard ", me, " owns ", job->chunks.size(),
        " chunks but the request carries initial values for ", request.initial_size()));
  }
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
  }
  {
    // Creation is serialised, so the job becomes durable before it becomes visible: no push
    // can be acknowledged for a job whose layout and initial values are not in the store.
    absl::MutexLock init_lock(&init_mu_);
    ASSIGN_OR_RETURN(const bool found, exists());  // Created meanwhile by another call?
    if (found) {
      response.set_created(false);
      return response;
    }
    if (job->durability != Durability::kNone) {
      RETURN_IF_ERROR(Annotate(MaybeSnapshot(job.get(), /*force=*/true),
                               absl::StrCat("InitJob: job ", request.job(),
                                            " could not be made durable; not created")));
    }
    absl::MutexLock lock(&mu_);
    jobs_.emplace(request.job(), job);
    response.set_created(true);
  }
  {
    LogInfo(options_.logger, "job_created",
            {Kv("job", request.job()), Kv("shard", me), Kv("chunks", job->chunks.size()),
             Kv("elements", job->owned_elements), Kv("optimizer", layout.optimizer().name()),
             Kv("mode", layout.consistency()), Kv("workers", layout.num_workers()),
             Kv("durability", layout.durability().mode())});
  }
  return response;
}

absl::StatusOr<std::shared_ptr<const Compressor>> Shard::Codec(const std::string& spec) {
  {
    absl::MutexLock lock(&codecs_mu_);
    auto it = codecs_.find(spec);
    if (it != codecs_.end()) return it->second;
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Compressor> codec, options_.compressors.Create(spec));
  std::shared_ptr<const Compressor> shared = std::move(codec);
  absl::MutexLock lock(&codecs_mu_);
  // Bounded: a client cannot grow the cache without limit with ever new specs.
  if (codecs_.size() < 64) codecs_.emplace(spec, shared);
  return shared;
}

absl::StatusOr<const float*> Shard::ChunkValues(const ChunkData& c, int64_t numel,
                                                const std::string& where,
                                                std::vector<float>* scratch) {
  if (c.codec().empty()) {
    RETURN_IF_ERROR(CheckDenseFloats(c, numel, where));
    return FloatView(c.data(), scratch);
  }
  if (c.dtype() != FLOAT32 && c.dtype() != DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": dtype ", DType_Name(c.dtype()), " with codec \"", c.codec(),
        "\"; the codec's payload describes its own encoding, dtype must be FLOAT32"));
  }
  auto codec = Codec(c.codec());
  if (!codec.ok()) return Annotate(codec.status(), where);
  scratch->assign(numel, 0.0f);
  RETURN_IF_ERROR(Annotate((*codec)->Decode(c.data(), absl::MakeSpan(*scratch)),
                           absl::StrCat(where, ": malformed \"", c.codec(), "\" payload")));
  const int64_t bad = FirstNonFinite(scratch->data(), numel);
  if (bad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": decoded element ", bad, " is not finite; nothing was applied"));
  }
  return static_cast<const float*>(scratch->data());
}

absl::Status Shard::ApplyUpdate(Job* job, const ChunkUpdate& u, bool replay) {
  const bool log = job->durability == Durability::kEveryUpdate && !replay;
  if (log) {
    job->apply_mu.Lock();
  } else {
    job->apply_mu.ReaderLock();
  }
  // Apply under the job's apply lock; released on every path below.
  struct Unlock {
    absl::Mutex* mu;
    bool exclusive;
    ~Unlock() {
      if (exclusive) {
        mu->Unlock();
      } else {
        mu->ReaderUnlock();
      }
    }
  } unlock{&job->apply_mu, log};

  if (log) {
    // Write-ahead: the update is in the log before anything changes or is acknowledged.
    state::UpdateRecord rec;
    rec.set_seq(job->seq + 1);
    for (size_t i = 0; i < u.chunks.size(); ++i) {
      const ChunkInfo& info = job->partition->chunks()[u.chunks[i]];
      ChunkData* g = rec.add_grads();
      g->set_tensor(info.tensor);
      g->set_chunk(info.chunk);
      g->set_version(u.base_versions[i]);
      g->set_data(reinterpret_cast<const char*>(u.grads[i]),
                  static_cast<size_t>(u.numels[i]) * sizeof(float));
    }
    for (const RequestRef& r : u.requests) {
      state::RequestRef* out = rec.add_requests();
      out->set_worker(r.worker);
      out->set_step(r.step);
      out->set_request_id(r.request_id);
    }
    if (u.lr_scale != 1.0f) rec.set_lr_scale(u.lr_scale);
    RETURN_IF_ERROR(Annotate(options_.store->AppendUpdate(job->layout.job(), rec),
                             absl::StrCat("Push: job ", job->layout.job(), " not applied")));
    absl::MutexLock lock(&job->mu);
    job->logged_bytes += static_cast<int64_t>(rec.ByteSizeLong());
  }
  const Optimizer& opt = *job->optimizer;
  const OptimizerSpec& spec = job->layout.optimizer();
  const bool damping = job->layout.staleness_damping();
  std::vector<float*> slot_ptrs(opt.num_slots());
  std::vector<int64_t> staleness(u.chunks.size(), 0);
  for (size_t i = 0; i < u.chunks.size(); ++i) {
    Chunk& chunk = *job->chunks.at(u.chunks[i]);
    absl::MutexLock lock(&chunk.mu);
    const int64_t n = chunk.info.numel;
    for (int s = 0; s < opt.num_slots(); ++s) slot_ptrs[s] = chunk.slots.data() + s * n;
    staleness[i] = u.base_versions[i] < chunk.version ? chunk.version - u.base_versions[i] : 0;
    float scale = LrScheduleFactor(spec, chunk.version);
    if (damping) scale /= static_cast<float>(1 + staleness[i]);
    scale *= u.lr_scale;
    ++chunk.version;
    opt.Apply(chunk.version, scale, u.grads[i], chunk.values.data(), slot_ptrs.data(), n);
  }

  absl::MutexLock lock(&job->mu);
  ++job->seq;
  ++job->updates_applied;
  const int64_t last = static_cast<int64_t>(job->staleness.size()) - 1;
  for (int64_t st : staleness) ++job->staleness[std::min(st, last)];
  for (const RequestRef& r : u.requests) {
    WorkerRecord& w = job->workers[r.worker];
    w.last_step = std::max(w.last_step, r.step);
    ++w.pushes_applied;
    ++job->pushes_applied;
    w.recent_ids[r.request_id] = true;
    w.id_order.push_back(r.request_id);
    if (static_cast<int64_t>(w.id_order.size()) > options_.dedupe_window) {
      w.recent_ids.erase(w.id_order.front());
      w.id_order.pop_front();
    }
  }
  return absl::OkStatus();
}

absl::Status Shard::MaybeSnapshot(Job* job, bool force) {
  if (job->durability == Durability::kNone) return absl::OkStatus();
  const DurabilitySpec& d = job->layout.durability();
  {
    absl::MutexLock lock(&job->mu);
    if (force) {
      // A forced snapshot must capture the state as of now: wait for one in progress.
      job->mu.Await(absl::Condition(
          +[](bool* running) { return !*running; }, &job->snapshot_running));
    } else if (job->snapshot_running) {
      return absl::OkStatus();
    }
    const bool by_count =
        job->updates_applied - job->snapshot_update >= d.snapshot_every_updates();
    // Log records deleted before RocksDB flushes its memtable never reach an SST file.
    const bool by_bytes = job->logged_bytes >= kLogBytesPerSnapshot;
    // Time-based snapshots would differ between shards of a sync job: count only there.
    const bool by_time = !job->sync_mode && d.snapshot_every_seconds() > 0 &&
                         job->updates_applied > job->snapshot_update &&
                         absl::Now() - job->snapshot_time >=
                             absl::Seconds(d.snapshot_every_seconds());
    if (!force && !by_count && !by_time && !by_bytes) return absl::OkStatus();
    if (!force && absl::Now() < job->snapshot_retry_after) return absl::OkStatus();
    job->snapshot_running = true;
  }
  const absl::Time start = absl::Now();
  std::map<int64_t, state::ChunkState> chunks;
  state::JobSnapshot snap;
  {
    // Exclusive: no update is half-applied while we copy.
    absl::WriterMutexLock apply_lock(&job->apply_mu);
    for (const auto& [idx, chunk] : job->chunks) {
      absl::MutexLock lock(&chunk->mu);
      state::ChunkState& cs = chunks[idx];
      cs.set_version(chunk->version);
      cs.set_values(reinterpret_cast<const char*>(chunk->values.data()),
                    chunk->values.size() * sizeof(float));
      cs.set_slots(reinterpret_cast<const char*>(chunk->slots.data()),
                   chunk->slots.size() * sizeof(float));
    }
    absl::MutexLock lock(&job->mu);
    snap.set_seq(job->seq);
    for (const WorkerRecord& w : job->workers) {
      state::WorkerSnapshot* ws = snap.add_workers();
      ws->set_last_step(w.last_step);
      ws->set_finished(w.finished);
      ws->set_pushes_applied(w.pushes_applied);
      for (uint64_t id : w.id_order) ws->add_recent_ids(id);
    }
    snap.set_pushes_applied(job->pushes_applied);
    snap.set_duplicates(job->duplicates);
    for (int64_t s : job->staleness) snap.add_staleness(s);
  }
  // A forced snapshot (job creation, job end) also (re)writes the layout: the first one must.
  auto bytes = options_.store->WriteSnapshot(job->layout.job(), force ? &job->layout : nullptr,
                                             chunks, snap);
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  absl::MutexLock lock(&job->mu);
  job->snapshot_running = false;
  if (!bytes.ok()) {
    // Not on every push: each attempt holds apply_mu exclusively.
    job->snapshot_retry_after = absl::Now() + absl::Seconds(5);
    LogError(options_.logger, "snapshot_failed",
             {Kv("job", job->layout.job()), Kv("error", bytes.status().ToString())});
    return bytes.status();
  }
  job->snapshot_update = snap.seq();
  job->logged_bytes = 0;
  job->snapshot_time = absl::Now();
  ++job->snapshots;
  job->last_snapshot_s = secs;
  job->last_snapshot_bytes = *bytes;
  LogInfo(options_.logger, "snapshot",
          {Kv("job", job->layout.job()), Kv("update", snap.seq()), Kv("bytes", *bytes),
           Kv("ms", absl::StrFormat("%.1f", secs * 1e3))});
  return absl::OkStatus();
}

absl::Status Shard::Restore() {
  if (options_.store == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::vector<ShardStore::StoredJob> stored, options_.store->LoadAll());
  for (ShardStore::StoredJob& s : stored) {
    const std::string& name = s.layout.job();
    ASSIGN_OR_RETURN(std::shared_ptr<Job> job, BuildJob(s.layout));
    for (auto& [idx, chunk] : job->chunks) {
      auto it = s.chunks.find(idx);
      absl::MutexLock lock(&chunk->mu);
      const size_t want_values = chunk->info.numel * sizeof(float);
      if (it == s.chunks.end() || it->second.values().size() != want_values ||
          it->second.slots().size() != chunk->slots.size() * sizeof(float)) {
        return absl::DataLossError(absl::StrCat("restoring job ", name, " from ",
                                                options_.store->dir(), ": chunk ", idx,
                                                " is missing or has the wrong size"));
      }
      chunk->version = it->second.version();
      chunk->values.resize(chunk->info.numel);
      std::memcpy(chunk->values.data(), it->second.values().data(), want_values);
      std::memcpy(chunk->slots.data(), it->second.slots().data(), it->second.slots().size());
    }
    {
      absl::WriterMutexLock apply_lock(&job->apply_mu);
      absl::MutexLock lock(&job->mu);
      job->seq = s.snapshot.seq();
      for (int w = 0; w < s.snapshot.workers_size() && w < static_cast<int>(job->workers.size());
           ++w) {
        const state::WorkerSnapshot& ws = s.snapshot.workers(w);
        WorkerRecord& r = job->workers[w];
        r.last_step = ws.last_step();
        r.finished = ws.finished();
        r.pushes_applied = ws.pushes_applied();
        for (uint64_t id : ws.recent_ids()) {
          r.recent_ids[id] = true;
          r.id_order.push_back(id);
        }
      }
      job->pushes_applied = s.snapshot.pushes_applied();
      job->duplicates = s.snapshot.duplicates();
      for (int i = 0; i < s.snapshot.staleness_size() &&
                      i < static_cast<int>(job->staleness.size());
           ++i) {
        job->staleness[i] = s.snapshot.staleness(i);
      }
      job->updates_applied = s.snapshot.seq();
      job->snapshot_update = s.snapshot.seq();
      job->restored = true;
    }
    // Replay logged updates in order, through the same code that applied them.
    for (const state::UpdateRecord& rec : s.log) {
      ChunkUpdate u;
      std::vector<std::vector<float>> scratch(rec.grads_size());
      for (int i = 0; i < rec.grads_size(); ++i) {
        const ChunkData& g = rec.grads(i);
        const int64_t idx = job->partition->Find(g.tensor(), g.chunk());
        if (idx < 0 || job->chunks.find(idx) == job->chunks.end() ||
            g.data().size() != job->partition->chunks()[idx].numel * sizeof(float)) {
          return absl::DataLossError(absl::StrCat("restoring job ", name, ": log record ",
                                                  rec.seq(), " names a chunk this shard "
                                                  "does not own or has the wrong size"));
        }
        u.chunks.push_back(idx);
        u.numels.push_back(job->partition->chunks()[idx].numel);
        u.grads.push_back(FloatView(g.data(), &scratch[i]));
        u.base_versions.push_back(g.version());
      }
      for (const state::RequestRef& r : rec.requests()) {
        u.requests.push_back({r.worker(), r.step(), r.request_id()});
      }
      if (rec.lr_scale() != 0.0f) u.lr_scale = rec.lr_scale();
      RETURN_IF_ERROR(ApplyUpdate(job.get(), u, /*replay=*/true));
    }
    std::vector<int64_t> pushed;
    std::vector<bool> finished;
    int64_t replayed;
    {
      absl::MutexLock lock(&job->mu);
      for (const WorkerRecord& w : job->workers) {
        pushed.push_back(w.last_step + 1);
        finished.push_back(w.finished);
      }
      job->replayed = static_cast<int64_t>(s.log.size());
      replayed = job->replayed;
    }
    job->policy->Restore(pushed, finished);
    LogInfo(options_.logger, "job_restored",
            {Kv("job", name), Kv("snapshot_update", s.snapshot.seq()),
             Kv("replayed_updates", replayed), Kv("dir", options_.store->dir()),
             Kv("durability", s.layout.durability().mode())});
    absl::MutexLock lock(&mu_);
    jobs_.emplace(name, std::move(job));
  }
  return absl::OkStatus();
}

absl::StatusOr<PushResponse> Shard::Push(const PushRequest& request) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job()));
  RETURN_IF_ERROR(CheckWorker("Push", job->layout, request.worker()));
  if (request.step() < 0 || request.step() >= (int64_t{1} << 62)) {
    return absl::InvalidArgumentError(absl::StrCat("Push: job ", request.job(), " step ",
                                                   request.step(), " out of range"));
  }
  // Validate everything before changing anything.
  ChunkUpdate update;
  std::vector<Chunk*> targets;
  absl::flat_hash_set<int64_t> seen;
  std::vector<std::vector<float>> scratch(request.chunks_size());
  for (int i = 0; i < request.chunks_size(); ++i) {
    const ChunkData& c = request.chunks(i);
    ASSIGN_OR_RETURN(auto owned, OwnedChunk("Push", job->layout, *job->partition, job->chunks,
                                            c.tensor(), c.chunk()));
    const auto [idx, chunk] = owned;
    const std::string where = ChunkName(request.job(), job->layout, c.tensor(), c.chunk());
    if (c.version() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Push: ", where, ": base version ", c.version(), " is negative"));
    }
    if (!seen.insert(idx).second) {
      return absl::InvalidArgumentError(absl::StrCat("Push: ", where, " appears twice"));
    }
    ASSIGN_OR_RETURN(const float* grad, ChunkValues(c, chunk->info.numel,
                                                    absl::StrCat("Push: ", where), &scratch[i]));
    targets.push_back(chunk);
    update.chunks.push_back(idx);
    update.numels.push_back(chunk->info.numel);
    update.grads.push_back(grad);
    update.base_versions.push_back(c.version());
  }
  update.requests.push_back({request.worker(), request.step(), request.request_id()});

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
    if (request.step() <= w.last_step) {
      // This worker's step was already applied here (a worker that resumed from a shard that
      // is behind this one re-pushes it): applying it again would count it twice.
      ++job->duplicates;
      response.set_duplicate(true);
      return response;
    }
    if (w.steps_in_progress.contains(request.step())) {
      // Another push of this step, with another request id, is being applied: a restarted
      // worker re-pushing what its previous incarnation sent. Once that one is done, the
      // client's retry is told it is a duplicate (or is applied, if the first one failed).
      return absl::AbortedError(absl::StrCat("Push: job ", request.job(), " worker ",
                                             request.worker(), " step ", request.step(),
                                             " is already being applied"));
    }
    w.recent_ids.emplace(request.request_id(), false);
    w.steps_in_progress.insert(request.step());
  }

  absl::Status st = job->policy->OnPush(update, [this, &job](const ChunkUpdate& u) {
    return ApplyUpdate(job.get(), u, /*replay=*/false);
  });
  {
    absl::MutexLock lock(&job->mu);
    WorkerRecord& w = job->workers[request.worker()];
    w.steps_in_progress.erase(request.step());
    if (!st.ok()) {
      // Not applied: forget the id so that a retry can succeed.
      auto it = w.recent_ids.find(request.request_id());
      if (it != w.recent_ids.end() && !it->second) w.recent_ids.erase(it);
      return st;
    }
  }
  for (Chunk* chunk : targets) {
    absl::MutexLock lock(&chunk->mu);
    response.add_new_versions(chunk->version);
  }
  // A failed periodic snapshot is logged; the push itself was applied (and, for
  // every_update, logged), so it still succeeds.
  (void)MaybeSnapshot(job.get(), /*force=*/false);
  return response;
}

absl::Status Shard::Pull(const PullRequest& request, PullResponse* response) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job()));
  RETURN_IF_ERROR(CheckWorker("Pull", job->layout, request.worker()));
  std::vector<Chunk*> targets;
  std::vector<int64_t> held;  // Version the worker holds of each target (-1: unknown).
  if (request.chunks_size() == 0) {
    for (int64_t idx : job->partition->shard_chunks(job->layout.shard_index())) {
      targets.push_back(job->chunks.at(idx).get());
      held.push_back(-1);
    }
  } else {
    for (const ChunkData& c : request.chunks()) {
      ASSIGN_OR_RETURN(auto owned, OwnedChunk("Pull", job->layout, *job->partition, job->chunks,
                                              c.tensor(), c.chunk()));
      targets.push_back(owned.second);
      held.push_back(c.version());
    }
  }
  const bool changes = request.codec() == "changes";
  std::shared_ptr<const Compressor> codec;
  if (!request.codec().empty() && !changes) {
    // Parameters may be sent narrower or as exact changes, never sparsified or randomised.
    if (request.codec() != "fp16" && request.codec() != "bf16") {
      return absl::InvalidArgumentError(
          absl::StrCat("Pull: job ", request.job(), " codec \"", request.codec(),
                       "\" is not one of \"\", fp16, bf16, changes"));
    }
    ASSIGN_OR_RETURN(codec, Codec(request.codec()));
  }
  RETURN_IF_ERROR(job->policy->BeforePull(request.worker()));
  response->mutable_chunks()->Reserve(static_cast<int>(targets.size()));
  const int32_t w = request.worker();
  for (size_t t = 0; t < targets.size(); ++t) {
    Chunk* chunk = targets[t];
    ChunkData* out = response->add_chunks();
    out->set_tensor(chunk->info.tensor);
    out->set_chunk(chunk->info.chunk);
    out->set_dtype(FLOAT32);
    absl::MutexLock lock(&chunk->mu);
    out->set_version(chunk->version);
    if (changes) {
      // Only what changed since the values this worker holds, if we know what it holds;
      // else (or when that is not smaller) the chunk dense, which it then holds.
      if (chunk->sent.empty()) {
        chunk->sent.resize(job->layout.num_workers());
        chunk->sent_version.assign(job->layout.num_workers(), -1);
      }
      std::vector<float>& sent = chunk->sent[w];
      const int64_t dense = chunk->info.numel * static_cast<int64_t>(sizeof(float));
      const bool known = held[t] >= 0 && held[t] == chunk->sent_version[w] &&
                         static_cast<int64_t>(sent.size()) == chunk->info.numel;
      if (known && EncodeChanges(chunk->values.data(), sent.data(), chunk->info.numel, dense,
                                 out->mutable_data())) {
        out->set_codec("changes");
      } else {
        sent = chunk->values;
        out->mutable_data()->assign(reinterpret_cast<const char*>(chunk->values.data()),
                                    static_cast<size_t>(dense));
      }
      chunk->sent_version[w] = chunk->version;
    } else if (codec != nullptr) {
      out->set_codec(request.codec());
      RETURN_IF_ERROR(Annotate(codec->Encode(chunk->values, /*seed=*/0, out->mutable_data()),
                               absl::StrCat("Pull: job ", request.job(), " chunk (",
                                            chunk->info.tensor, ",", chunk->info.chunk, ")")));
    } else {
      out->mutable_data()->assign(reinterpret_cast<const char*>(chunk->values.data()),
                                  chunk->values.size() * sizeof(float));
    }
  }
  return absl::OkStatus();
}

absl::Status Shard::Finish(const FinishRequest& request) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job()));
  RETURN_IF_ERROR(CheckWorker("Finish", job->layout, request.worker()));
  job->policy->OnFinish(request.worker());
  bool first = false;
  {
    absl::MutexLock lock(&job->mu);
    WorkerRecord& w = job->workers[request.worker()];
    if (!w.finished) {
      w.finished = true;
      first = true;
      LogInfo(options_.logger, "worker_finished",
              {Kv("job", request.job()), Kv("worker", request.worker()),
               Kv("step", request.step()), Kv("pushes_applied", w.pushes_applied)});
    }
  }
  // A durable job records each worker's Finish (a restarted shard must not wait for a worker
  // that is gone), and its final state when the last worker finishes.
  if (first && job->durability != Durability::kNone) {
    (void)MaybeSnapshot(job.get(), /*force=*/true);  // Logged on failure.
  }
  if (first) {
    // sync: workers removed from the barrier group push no more, so they do not count.
    std::vector<bool> counted(job->layout.num_workers(), !job->sync_mode);
    if (job->sync_mode) {
      absl::MutexLock lock(&job->group_mu);
      for (int32_t w : job->active_workers) counted[w] = true;
    }
    bool all = true;
    {
      absl::MutexLock lock(&job->mu);
      for (size_t w = 0; w < job->workers.size(); ++w) {
        all = all && (job->workers[w].finished || !counted[w]);
      }
    }
    if (all) {
      // The job's metrics, in one line.
      const ConsistencyStats ps = job->policy->stats();
      absl::MutexLock lock(&job->mu);
      LogInfo(options_.logger, "job_stats",
              {Kv("job", request.job()), Kv("mode", job->layout.consistency()),
               Kv("pushes_applied", job->pushes_applied),
               Kv("updates_applied", job->updates_applied),
               Kv("duplicates", job->duplicates),
               Kv("staleness_histogram", absl::StrJoin(job->staleness, ",")),
               Kv("max_clock_lead", ps.max_clock_lead),
               Kv("barrier_wait_s", absl::StrFormat("%.3f", ps.barrier_wait_s)),
               Kv("snapshots", job->snapshots),
               Kv("last_snapshot_ms", absl::StrFormat("%.1f", job->last_snapshot_s * 1e3)),
               Kv("last_snapshot_bytes", job->last_snapshot_bytes)});
    }
  }
  return absl::OkStatus();
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
  const ConsistencyStats ps = job->policy->stats();
  r.set_max_clock_lead(ps.max_clock_lead);
  r.set_barrier_wait_s(ps.barrier_wait_s);
  {
    absl::MutexLock lock(&job->group_mu);
    for (int32_t w : job->active_workers) r.add_active_workers(w);
    r.set_lr_scale(job->lr_scale);
  }
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
  r.set_updates_applied(job->updates_applied);
  r.set_snapshots(job->snapshots);
  r.set_last_snapshot_s(job->last_snapshot_s);
  r.set_last_snapshot_bytes(job->last_snapshot_bytes);
  r.set_snapshot_update(job->snapshot_update);
  r.set_restored(job->restored);
  r.set_replayed_updates(job->replayed);
  return r;
}

absl::Status Shard::SetSyncGroup(const std::string& job_name, const std::vector<int32_t>& active,
                                 double lr_scale) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_name));
  const std::string context = absl::StrCat("SetSyncGroup: job ", job_name);
  if (!job->sync_mode) {
    return absl::FailedPreconditionError(
        absl::StrCat(context, " has consistency mode ", job->layout.consistency(),
                     "; only sync jobs have a barrier group"));
  }
  if (!(lr_scale > 0 && lr_scale <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        context, ": lr_scale ", absl::StrFormat("%.9g", lr_scale), " not in (0, 1]"));
  }
  std::vector<int32_t> group = active;
  if (group.empty()) {
    for (int32_t w = 0; w < job->layout.num_workers(); ++w) group.push_back(w);
  }
  const float scale = static_cast<float>(lr_scale);
  absl::MutexLock lock(&job->group_mu);
  std::vector<int32_t> sorted = group;
  std::sort(sorted.begin(), sorted.end());
  // The coordinator re-sends the group on every heartbeat: unchanged is the common case.
  if (sorted == job->active_workers && scale == job->lr_scale) return absl::OkStatus();
  RETURN_IF_ERROR(Annotate(job->policy->SetGroup(group, scale), "SetSyncGroup"));
  LogInfo(options_.logger, "sync_group_changed",
          {Kv("job", job_name), Kv("active", absl::StrCat("[", absl::StrJoin(sorted, ","), "]")),
           Kv("lr_scale", scale),
           Kv("previous", absl::StrCat("[", absl::StrJoin(job->active_workers, ","), "]"))});
  job->active_workers = std::move(sorted);
  job->lr_scale = scale;
  return absl::OkStatus();
}

}  // namespace gradmesh
