#include "server/job_state.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/job_name.h"
#include "common/status.h"

namespace gradmesh {
namespace {

int64_t Numel(const TensorSpec& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  return n;
}

absl::Status ValidateTensors(const InitJobRequest& r) {
  absl::flat_hash_set<std::string> names;
  for (int t = 0; t < r.tensors_size(); ++t) {
    const TensorSpec& ts = r.tensors(t);
    if (ts.name().empty() || !names.insert(ts.name()).second) {
      return absl::InvalidArgumentError(absl::StrCat("InitJob: job ", r.job(), " tensor ", t,
                                                     " has an empty or repeated name \"", ts.name(),
                                                     "\""));
    }
    int64_t numel = 1;
    for (int64_t d : ts.shape()) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrCat("InitJob: job ", r.job(), " tensor ",
                                                       ts.name(), " has a negative dimension"));
      }
      if (d != 0 && numel > (int64_t{1} << 40) / d) {
        return absl::InvalidArgumentError(absl::StrCat("InitJob: job ", r.job(), " tensor ",
                                                       ts.name(), " has more than 2^40 elements"));
      }
      numel *= d;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Durability> ParseDurability(const DurabilitySpec& d) {
  if (d.mode().empty() || d.mode() == "none") return Durability::kNone;
  if (d.mode() == "periodic") return Durability::kPeriodic;
  if (d.mode() == "every_update") return Durability::kEveryUpdate;
  return absl::InvalidArgumentError(absl::StrCat("unknown durability mode \"", d.mode(),
                                                 "\" (known: every_update, none, periodic)"));
}

absl::Status ValidateLayout(const InitJobRequest& r) {
  if (r.job().empty()) return absl::InvalidArgumentError("InitJob: job name is empty");
  RETURN_IF_ERROR(CheckName("InitJob: job", r.job()));
  if (r.tensors_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("InitJob: job ", r.job(), " has no tensors"));
  }
  RETURN_IF_ERROR(ValidateTensors(r));
  if (r.num_shards() <= 0 || r.shard_index() < 0 || r.shard_index() >= r.num_shards()) {
    return absl::InvalidArgumentError(absl::StrCat("InitJob: job ", r.job(), " shard_index ",
                                                   r.shard_index(), " not in [0, ", r.num_shards(),
                                                   ")"));
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
    return absl::InvalidArgumentError(
        absl::StrCat("InitJob: job ", r.job(), " snapshot intervals must be >= 0"));
  }
  return ParseDurability(d).status();
}

InitJobRequest NormalizedLayout(const InitJobRequest& request) {
  InitJobRequest layout = request;
  layout.clear_initial();
  if (layout.consistency().empty()) layout.set_consistency("async");
  if (layout.barrier_timeout_s() == 0) layout.set_barrier_timeout_s(120);
  // FLOAT32 and unset mean the same element type: one spelling, so that a layout from a worker
  // that names it and one stored before TensorSpec.dtype existed compare equal.
  for (TensorSpec& t : *layout.mutable_tensors()) {
    if (t.dtype() == FLOAT32) t.clear_dtype();
  }
  DurabilitySpec* d = layout.mutable_durability();
  if (d->mode().empty()) d->set_mode("none");
  if (d->snapshot_every_updates() == 0) d->set_snapshot_every_updates(1000);
  return layout;
}

absl::StatusOr<std::unique_ptr<JobState>> JobState::Create(const InitJobRequest& layout,
                                                           const OptimizerRegistry& optimizers,
                                                           const ConsistencyRegistry& consistency,
                                                           bool have_store, const Logger* logger) {
  std::unique_ptr<JobState> job(new JobState(layout));
  std::vector<int64_t> numels;
  for (const TensorSpec& t : layout.tensors()) numels.push_back(Numel(t));
  if (!Placement_IsValid(layout.placement())) {
    return absl::InvalidArgumentError(absl::StrCat("InitJob: job ", layout.job(), ": placement ",
                                                   layout.placement(), " is unknown"));
  }
  auto partition = Partition::Create(numels, layout.chunk_elems(), layout.num_shards(),
                                     static_cast<ChunkPlacement>(layout.placement()));
  if (!partition.ok()) {
    return Annotate(partition.status(), absl::StrCat("InitJob: job ", layout.job()));
  }
  job->partition_ = std::make_unique<Partition>(std::move(partition).value());
  for (const TensorSpec& t : layout.tensors()) job->buffer_tensors_.push_back(t.buffer());
  RETURN_IF_ERROR(job->BuildStrategies(optimizers, consistency, logger));
  ASSIGN_OR_RETURN(job->durability_, ParseDurability(layout.durability()));
  if (job->durability_ != Durability::kNone && !have_store) {
    return absl::FailedPreconditionError(absl::StrCat(
        "InitJob: job ", layout.job(), " asks for durability ", layout.durability().mode(),
        " but this shard has no data directory (start it with --data_dir)"));
  }
  job->BuildChunks();
  return job;
}

absl::Status JobState::BuildStrategies(const OptimizerRegistry& optimizers,
                                       const ConsistencyRegistry& consistency,
                                       const Logger* logger) {
  auto opt = optimizers.Create(layout_.optimizer());
  if (!opt.ok()) return Annotate(opt.status(), absl::StrCat("InitJob: job ", name()));
  optimizer_ = std::move(opt).value();
  ConsistencyConfig config;
  config.job = name();
  config.mode = layout_.consistency();
  config.num_workers = layout_.num_workers();
  config.barrier_timeout = absl::Seconds(layout_.barrier_timeout_s());
  config.logger = logger;
  auto policy = consistency.Create(config);
  if (!policy.ok()) return Annotate(policy.status(), absl::StrCat("InitJob: job ", name()));
  policy_ = std::move(policy).value();
  sync_mode_ = policy_->mode() == "sync";
  if (sync_mode_) {
    absl::MutexLock lock(&group_mu_);
    for (int32_t w = 0; w < layout_.num_workers(); ++w) active_workers_.push_back(w);
  }
  if (layout_.staleness_damping() && policy_->mode() != "async") {
    return absl::InvalidArgumentError(
        absl::StrCat("InitJob: job ", name(),
                     " asks for staleness_damping, which applies to async "
                     "mode only (mode is ",
                     policy_->mode(), ")"));
  }
  return absl::OkStatus();
}

void JobState::BuildChunks() {
  const Partition& p = *partition_;
  for (int64_t idx : p.shard_chunks(layout_.shard_index())) {
    auto chunk = std::make_unique<Chunk>(p.chunks()[idx]);
    // Buffers take plain deltas (no optimizer), so they have no slots.
    const int num_slots = is_buffer(chunk->info.tensor) ? 0 : optimizer_->num_slots();
    {
      absl::MutexLock lock(&chunk->mu);
      chunk->slots.assign(static_cast<size_t>(num_slots) * chunk->info.numel, 0.0f);
    }
    owned_slot_elements_ += chunk->info.numel * num_slots;
    chunks_.emplace(idx, std::move(chunk));
    owned_elements_ += p.chunks()[idx].numel;
  }
}

std::string JobState::ChunkName(int32_t t, int32_t c) const {
  const std::string tensor =
      t >= 0 && t < layout_.tensors_size() ? layout_.tensors(t).name() : absl::StrCat("#", t);
  return absl::StrCat("job ", name(), " tensor ", t, " (", tensor, ") chunk ", c);
}

absl::Status JobState::CheckWorker(const char* rpc, int32_t worker) const {
  if (worker >= 0 && worker < layout_.num_workers()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(rpc, ": job ", name(), " worker ", worker,
                                                 " not in [0, ", layout_.num_workers(), ")"));
}

absl::StatusOr<std::pair<int64_t, Chunk*>> JobState::OwnedChunk(const char* rpc, int32_t tensor,
                                                                int32_t chunk) const {
  const int64_t idx = partition_->Find(tensor, chunk);
  if (idx < 0) {
    return absl::NotFoundError(
        absl::StrCat(rpc, ": ", ChunkName(tensor, chunk), " does not exist"));
  }
  auto it = chunks_.find(idx);
  if (it == chunks_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat(rpc, ": ", ChunkName(tensor, chunk), " belongs to shard ",
                     partition_->chunks()[idx].shard, ", not shard ", layout_.shard_index()));
  }
  return std::make_pair(idx, it->second.get());
}

std::vector<int64_t> JobState::ApplyToChunks(const ChunkUpdate& u) const {
  const Optimizer& opt = *optimizer_;
  const OptimizerSpec& spec = layout_.optimizer();
  const bool damping = layout_.staleness_damping();
  std::vector<float*> slot_ptrs(opt.num_slots());
  std::vector<int64_t> staleness(u.chunks.size(), 0);
  for (size_t i = 0; i < u.chunks.size(); ++i) {
    Chunk& chunk = *chunks_.at(u.chunks[i]);
    absl::MutexLock lock(&chunk.mu);
    const int64_t n = chunk.info.numel;
    staleness[i] = u.base_versions[i] < chunk.version ? chunk.version - u.base_versions[i] : 0;
    if (is_buffer(chunk.info.tensor)) {
      // A buffer's "gradient" is how far the workers' forward passes moved it (sync: the mean
      // over the step's workers): added as is, with no learning rate, schedule, damping or
      // group factor (TensorSpec.buffer).
      const float* delta = u.grads[i];
      float* values = chunk.values.data();
      for (int64_t e = 0; e < n; ++e) values[e] += delta[e];
      ++chunk.version;
      continue;
    }
    for (int s = 0; s < opt.num_slots(); ++s) slot_ptrs[s] = chunk.slots.data() + s * n;
    float scale = LrScheduleFactor(spec, chunk.version);
    if (damping) scale /= static_cast<float>(1 + staleness[i]);
    scale *= u.lr_scale;
    ++chunk.version;
    opt.Apply(chunk.version, scale, u.grads[i], chunk.values.data(), slot_ptrs.data(), n);
  }
  return staleness;
}

absl::Status JobState::SetSyncGroup(const std::vector<int32_t>& active, double lr_scale,
                                    const Logger* logger) {
  const std::string context = absl::StrCat("SetSyncGroup: job ", name());
  if (!sync_mode_) {
    return absl::FailedPreconditionError(absl::StrCat(context, " has consistency mode ",
                                                      layout_.consistency(),
                                                      "; only sync jobs have a barrier group"));
  }
  if (!(lr_scale > 0 && lr_scale <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": lr_scale ", absl::StrFormat("%.9g", lr_scale), " not in (0, 1]"));
  }
  std::vector<int32_t> group = active;
  if (group.empty()) {
    for (int32_t w = 0; w < layout_.num_workers(); ++w) group.push_back(w);
  }
  const float scale = static_cast<float>(lr_scale);
  absl::MutexLock lock(&group_mu_);
  std::vector<int32_t> sorted = group;
  std::sort(sorted.begin(), sorted.end());
  // The coordinator re-sends the group on every heartbeat: unchanged is the common case.
  if (sorted == active_workers_ && scale == lr_scale_) return absl::OkStatus();
  RETURN_IF_ERROR(Annotate(policy_->SetGroup(group, scale), "SetSyncGroup"));
  LogInfo(logger, "sync_group_changed",
          {Kv("job", name()), Kv("active", absl::StrCat("[", absl::StrJoin(sorted, ","), "]")),
           Kv("lr_scale", scale),
           Kv("previous", absl::StrCat("[", absl::StrJoin(active_workers_, ","), "]"))});
  active_workers_ = std::move(sorted);
  lr_scale_ = scale;
  return absl::OkStatus();
}

std::pair<std::vector<int32_t>, float> JobState::SyncGroup() const {
  absl::MutexLock lock(&group_mu_);
  return {active_workers_, lr_scale_};
}

std::vector<bool> JobState::CountedWorkers() const {
  std::vector<bool> counted(layout_.num_workers(), !sync_mode_);
  if (sync_mode_) {
    absl::MutexLock lock(&group_mu_);
    for (int32_t w : active_workers_) counted[w] = true;
  }
  return counted;
}

}  // namespace gradmesh
