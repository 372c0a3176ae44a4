#include "server/init_job_validation.h"

#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/job_name.h"
#include "common/status.h"
#include "server/job_state.h"
#include "server/push_decoding.h"

namespace gradmesh {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

int64_t SatAdd(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_add_overflow(a, b, &r) ? kInt64Max : r;
}

int64_t SatMul(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_mul_overflow(a, b, &r) ? kInt64Max : r;
}

absl::Status Invalid(const InitJobRequest& r, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("InitJob: job ", r.job(), " ", what));
}

// The counts that bound every allocation below, checked before anything iterates the lists.
absl::Status CheckCounts(const InitJobRequest& r, const ShardLimits& limits) {
  if (r.tensors_size() > limits.max_tensors_per_job) {
    return Invalid(r,
                   absl::StrCat("has ", r.tensors_size(), " tensors; this shard accepts at most ",
                                limits.max_tensors_per_job, " (--max_tensors_per_job)"));
  }
  if (r.num_shards() > limits.max_num_shards) {
    return Invalid(r, absl::StrCat("num_shards ", r.num_shards(), " exceeds this shard's limit ",
                                   limits.max_num_shards, " (--max_num_shards)"));
  }
  if (r.num_workers() > limits.max_num_workers) {
    return Invalid(r, absl::StrCat("num_workers ", r.num_workers(), " exceeds this shard's limit ",
                                   limits.max_num_workers, " (--max_num_workers)"));
  }
  for (int t = 0; t < r.tensors_size(); ++t) {
    const TensorSpec& ts = r.tensors(t);
    if (static_cast<int64_t>(ts.name().size()) > limits.max_tensor_name_bytes) {
      return Invalid(r, absl::StrCat("tensors[", t, "].name has ", ts.name().size(),
                                     " bytes; at most ", limits.max_tensor_name_bytes));
    }
    if (ts.shape_size() > 64) {
      return Invalid(r, absl::StrCat("tensors[", t, "] (", ts.name(), ") has ", ts.shape_size(),
                                     " dimensions; at most 64"));
    }
  }
  // Every initial entry is a chunk; the partition check below bounds the chunks.
  if (r.initial_size() > limits.max_chunks_per_job) {
    return Invalid(r,
                   absl::StrCat("carries ", r.initial_size(), " initial chunks; a job has at most ",
                                limits.max_chunks_per_job, " chunks (--max_chunks_per_job)"));
  }
  return absl::OkStatus();
}

// Element and chunk counts, with overflow checked before each product.
absl::Status CheckSizes(const InitJobRequest& r, const ShardLimits& limits) {
  if (r.chunk_elems() <= 0 || r.chunk_elems() > kMaxChunkElems) {
    return Invalid(r, absl::StrCat("chunk_elems must be > 0 and at most ", kMaxChunkElems,
                                   " (1 GiB of float32), got ", r.chunk_elems()));
  }
  int64_t chunks = 0;
  for (int t = 0; t < r.tensors_size(); ++t) {
    const TensorSpec& ts = r.tensors(t);
    int64_t numel = 1;
    for (int64_t d : ts.shape()) {
      if (d < 0) {
        return Invalid(r, absl::StrCat("tensors[", t, "] (", ts.name(), ") has dimension ", d));
      }
      if (d != 0 && numel > limits.max_elements_per_tensor / d) {
        return Invalid(r, absl::StrCat("tensors[", t, "] (", ts.name(), ") has more than ",
                                       limits.max_elements_per_tensor,
                                       " elements (--max_elements_per_tensor)"));
      }
      numel *= d;
    }
    chunks += numel / r.chunk_elems() + (numel % r.chunk_elems() != 0 ? 1 : 0);
    if (chunks > limits.max_chunks_per_job) {
      return Invalid(
          r, absl::StrCat("needs more than ", limits.max_chunks_per_job, " chunks of chunk_elems ",
                          r.chunk_elems(), " (--max_chunks_per_job); raise chunk_elems"));
    }
  }
  return absl::OkStatus();
}

// Element types a model tensor may have: parameters a floating type (float32, or the float64 /
// float16 / bfloat16 of a module the worker trains as float32); buffers any type torch.save
// writes for them. Both are stored and trained as float32 on the shards and written back with
// this type on export. DType values this build does not know are refused rather than passed
// on to exports that could not write them.
absl::Status CheckDTypes(const InitJobRequest& r) {
  for (int t = 0; t < r.tensors_size(); ++t) {
    const TensorSpec& ts = r.tensors(t);
    const int dtype = static_cast<int>(ts.dtype());
    const std::string what = absl::StrCat("tensors[", t, "] (", ts.name(), ")");
    if (!DType_IsValid(dtype)) {
      return Invalid(r, absl::StrCat(what, " has unknown dtype ", dtype));
    }
    const bool floating = ts.dtype() == DTYPE_UNSPECIFIED || ts.dtype() == FLOAT32 ||
                          ts.dtype() == FLOAT64 || ts.dtype() == FLOAT16 || ts.dtype() == BFLOAT16;
    if (!ts.buffer() && !floating) {
      return Invalid(r, absl::StrCat(what, " is a parameter of dtype ", DType_Name(ts.dtype()),
                                     "; parameters must be floating-point (FLOAT32, FLOAT64, "
                                     "FLOAT16, BFLOAT16; only buffers may have other element "
                                     "types)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTimeouts(const InitJobRequest& r) {
  if (!(r.barrier_timeout_s() >= 0 && r.barrier_timeout_s() <= kMaxBarrierTimeoutS)) {
    return Invalid(r, absl::StrCat("barrier_timeout_s must be >= 0 and at most ",
                                   kMaxBarrierTimeoutS, ", got ", r.barrier_timeout_s()));
  }
  const DurabilitySpec& d = r.durability();
  if (d.snapshot_every_updates() < 0) {
    return Invalid(r, absl::StrCat("snapshot intervals must be >= 0: "
                                   "durability.snapshot_every_updates is ",
                                   d.snapshot_every_updates()));
  }
  if (d.has_snapshot_every_seconds() &&
      !(d.snapshot_every_seconds() >= 0 && d.snapshot_every_seconds() <= 1e9)) {
    return Invalid(r, absl::StrCat("snapshot intervals must be >= 0: "
                                   "durability.snapshot_every_seconds must be in [0, 1e9], got ",
                                   d.snapshot_every_seconds()));
  }
  return absl::OkStatus();
}

absl::Status CheckStrategies(const InitJobRequest& r, const OptimizerRegistry& optimizers,
                             const ConsistencyRegistry& consistency) {
  RETURN_IF_ERROR(
      ValidateOptimizerSpec(r.optimizer(), optimizers, absl::StrCat("InitJob: job ", r.job())));
  // A dry run of the policy: num_workers is bounded by now, so its per-worker state is small.
  ConsistencyConfig config;
  config.job = r.job();
  config.mode = r.consistency().empty() ? "async" : r.consistency();
  config.num_workers = r.num_workers();
  // 0 is the default, NormalizedLayout's 120 s.
  config.barrier_timeout = absl::Seconds(r.barrier_timeout_s() == 0 ? 120 : r.barrier_timeout_s());
  auto policy = consistency.Create(config);
  if (!policy.ok()) return Annotate(policy.status(), absl::StrCat("InitJob: job ", r.job()));
  if (r.commit_steps() && (*policy)->mode() != "sync") {
    return Invalid(r, absl::StrCat("commit_steps applies to sync mode only (mode is ",
                                   (*policy)->mode(), ")"));
  }
  const double v = r.clip_grad_value();
  if (!(std::isfinite(v) && v >= 0 && v <= 1e30)) {
    return Invalid(r, absl::StrCat("clip_grad_value ", v, " is not a finite number in [0, 1e30]"));
  }
  if (v > 0 && !r.commit_steps()) {
    return Invalid(r, "clip_grad_value is applied by the shards only with commit_steps");
  }
  if (!Placement_IsValid(r.placement())) {
    return Invalid(r,
                   absl::StrCat("placement ", r.placement(),
                                " is unknown; known: 0 (PLACEMENT_GREEDY), 1 (PLACEMENT_ORDERED)"));
  }
  if (r.staleness_damping() && (*policy)->mode() != "async") {
    return Invalid(r, absl::StrCat("staleness_damping applies to async mode only (mode is ",
                                   (*policy)->mode(), ")"));
  }
  return absl::OkStatus();
}

// `v` must be finite and in [lo, hi) (hi_open) or [lo, hi], also as a float32.
absl::Status CheckReal(const std::string& context, const char* field, double v, double lo,
                       double hi, bool hi_open) {
  const float f = static_cast<float>(v);
  const bool ok = std::isfinite(v) && std::isfinite(f) && v >= lo && f >= lo &&
                  (hi_open ? (v < hi && f < hi) : (v <= hi && f <= hi));
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(context, " optimizer.", field, " ", v,
                                                 " is not a finite float32 in [", lo, ", ", hi,
                                                 hi_open ? ")" : "]"));
}

}  // namespace

absl::Status ValidateOptimizerSpec(const OptimizerSpec& s, const OptimizerRegistry& optimizers,
                                   const std::string& context) {
  const float lr = static_cast<float>(s.lr());
  if (!(std::isfinite(s.lr()) && std::isfinite(lr) && lr >= FLT_MIN)) {
    return absl::InvalidArgumentError(absl::StrCat(
        context, " optimizer.lr ", s.lr(), " is not a finite float32 > 0 (normal, >= 1.2e-38)"));
  }
  RETURN_IF_ERROR(CheckReal(context, "momentum", s.momentum(), 0, 1, true));
  RETURN_IF_ERROR(CheckReal(context, "dampening", s.dampening(), 0, 1, true));
  RETURN_IF_ERROR(CheckReal(context, "weight_decay", s.weight_decay(), 0, 1e9, true));
  RETURN_IF_ERROR(CheckReal(context, "beta1", s.beta1(), 0, 1, true));
  RETURN_IF_ERROR(CheckReal(context, "beta2", s.beta2(), 0, 1, true));
  RETURN_IF_ERROR(CheckReal(context, "eps", s.eps(), 0, 1, true));
  // eps divides: a value that rounds to 0 or a subnormal float32 would let 0/0 through.
  if (s.eps() != 0 && static_cast<float>(s.eps()) < FLT_MIN) {
    return absl::InvalidArgumentError(absl::StrCat(
        context, " optimizer.eps ", s.eps(), " is below the smallest normal float32 (1.2e-38)"));
  }
  RETURN_IF_ERROR(CheckReal(context, "min_lr_fraction", s.min_lr_fraction(), 0, 1, false));
  if (s.decay_updates() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, " optimizer.decay_updates ", s.decay_updates(), " must be >= 0"));
  }
  if (s.warmup_updates() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, " optimizer.warmup_updates ", s.warmup_updates(), " must be >= 0"));
  }
  auto opt = optimizers.Create(s);  // Known name; the optimizer's own checks (nesterov, ...).
  if (!opt.ok()) return Annotate(opt.status(), context);
  return absl::OkStatus();
}

absl::Status ValidateInitJob(const InitJobRequest& r, const ShardLimits& limits,
                             const OptimizerRegistry& optimizers,
                             const ConsistencyRegistry& consistency) {
  // The name first: the messages below quote it.
  if (!IsValidJobName(r.job())) return ValidateLayout(r);
  RETURN_IF_ERROR(CheckCounts(r, limits));
  RETURN_IF_ERROR(CheckDTypes(r));
  RETURN_IF_ERROR(CheckTimeouts(r));
  // Name, tensor names, shard index, worker count, durability mode.
  RETURN_IF_ERROR(ValidateLayout(r));
  RETURN_IF_ERROR(CheckSizes(r, limits));
  return CheckStrategies(r, optimizers, consistency);
}

absl::StatusOr<Partition> LayoutPartition(const InitJobRequest& r) {
  std::vector<int64_t> numels;
  numels.reserve(r.tensors_size());
  for (const TensorSpec& t : r.tensors()) {
    int64_t n = 1;
    for (int64_t d : t.shape()) n = SatMul(n, d);
    numels.push_back(n);
  }
  if (!Placement_IsValid(r.placement())) {
    return Invalid(r, absl::StrCat("placement ", r.placement(), " is unknown"));
  }
  auto p = Partition::Create(numels, r.chunk_elems(), r.num_shards(),
                             static_cast<ChunkPlacement>(r.placement()));
  if (!p.ok()) return Annotate(p.status(), absl::StrCat("InitJob: job ", r.job()));
  return p;
}

absl::Status CheckInitialValues(const InitJobRequest& r, const Partition& p) {
  const int32_t me = r.shard_index();
  const std::vector<int64_t>& owned = p.shard_chunks(me);
  if (r.initial_size() != static_cast<int64_t>(owned.size())) {
    return Invalid(
        r, absl::StrCat("shard ", me, " owns ", owned.size(),
                        " chunks but the request carries initial values for ", r.initial_size()));
  }
  absl::flat_hash_set<int64_t> seen;
  seen.reserve(owned.size());
  for (int i = 0; i < r.initial_size(); ++i) {
    const ChunkData& c = r.initial(i);
    const std::string tensor = c.tensor() >= 0 && c.tensor() < r.tensors_size()
                                   ? r.tensors(c.tensor()).name()
                                   : absl::StrCat("#", c.tensor());
    const std::string where = absl::StrCat("InitJob: job ", r.job(), " tensor ", c.tensor(), " (",
                                           tensor, ") chunk ", c.chunk());
    const int64_t idx = p.Find(c.tensor(), c.chunk());
    if (idx < 0) return absl::InvalidArgumentError(absl::StrCat(where, " does not exist"));
    if (p.chunks()[idx].shard != me) {
      return absl::InvalidArgumentError(absl::StrCat(where, " is not owned by shard ", me));
    }
    if (!seen.insert(idx).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, " appears twice"));
    }
    // A buffer may hold infinities (a causal mask of -inf); workers push it a zero delta
    // where their forward left it unchanged, so it stays as it is.
    const bool buffer =
        c.tensor() >= 0 && c.tensor() < r.tensors_size() && r.tensors(c.tensor()).buffer();
    RETURN_IF_ERROR(CheckDenseFloats(c, p.chunks()[idx].numel, where, buffer));
  }
  return absl::OkStatus();
}

int64_t JobMemory::total() const {
  int64_t t = 0;
  for (int64_t part : {values, slots, barrier, snapshot, ledger, bookkeeping}) t = SatAdd(t, part);
  return t;
}

std::string JobMemory::Describe(const std::string& optimizer) const {
  std::vector<std::string> parts;
  auto add = [&parts](const std::string& name, int64_t bytes) {
    if (bytes > 0) parts.push_back(absl::StrCat(name, " ", FormatBytes(bytes)));
  };
  add("values", values);
  add(absl::StrCat(optimizer, " slots"), slots);
  add("sync barrier copies", barrier);
  add("snapshot buffer", snapshot);
  add("request ledgers", ledger);
  add("bookkeeping", bookkeeping);
  return absl::StrJoin(parts, ", ");
}

JobMemory EstimateJobMemory(const InitJobRequest& r, const Partition& p, int num_slots,
                            int64_t dedupe_window) {
  const int32_t me = r.shard_index();
  const int64_t owned = p.shard_elements(me);
  const int64_t owned_chunks = static_cast<int64_t>(p.shard_chunks(me).size());
  // Buffer chunks have no optimizer slots (JobState::BuildChunks).
  int64_t owned_params = owned;
  for (int64_t idx : p.shard_chunks(me)) {
    const ChunkInfo& c = p.chunks()[idx];
    if (c.tensor < r.tensors_size() && r.tensors(c.tensor).buffer()) owned_params -= c.numel;
  }
  const int64_t total_chunks = static_cast<int64_t>(p.chunks().size());
  const int64_t workers = r.num_workers();
  const int64_t bytes = SatMul(owned, sizeof(float));
  JobMemory m;
  m.values = bytes;
  m.slots = SatMul(SatMul(owned_params, sizeof(float)), num_slots);
  if (r.consistency() == "sync") m.barrier = SatMul(bytes, workers);
  if (!r.durability().mode().empty() && r.durability().mode() != "none") {
    m.snapshot = SatAdd(m.values, m.slots);
  }
  // Per remembered id: a hash-map slot (~32 B at its load factor) and a deque entry.
  m.ledger = SatMul(workers, SatAdd(SatMul(dedupe_window, 48), 256));
  // Partition: ChunkInfo + index per chunk, per-shard lists; per owned chunk: the Chunk, its
  // map entries, the pull record and its per-worker vectors; the layout kept twice.
  int64_t book = SatMul(total_chunks, 64);
  book = SatAdd(book, SatMul(r.num_shards(), 64));
  book = SatAdd(book, SatMul(owned_chunks, SatAdd(384, SatMul(workers, 40))));
  book = SatAdd(book, SatMul(workers, 256));
  int64_t layout_bytes = 0;
  for (const TensorSpec& t : r.tensors()) {
    layout_bytes = SatAdd(layout_bytes, 96 + static_cast<int64_t>(t.name().size()) +
                                            8 * static_cast<int64_t>(t.shape_size()));
  }
  m.bookkeeping = SatAdd(book, SatMul(layout_bytes, 2));
  return m;
}

}  // namespace gradmesh
