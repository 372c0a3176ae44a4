// Resource limits of one parameter-server shard (issue #15 item 3): what a single InitJob may
// ask for, how many jobs and waiting pushes the shard holds, and a memory budget that every
// job (and every open shared-memory channel) reserves from before anything of it is
// allocated.
//
// ShardLimits is plain data (part of ShardOptions; server/server_main.cc fills it from flags).
// MemoryBudget counts bytes reserved against `max_memory_bytes`; a job holds a
// MemoryReservation for its values, optimizer slots and fixed per-worker/per-chunk state, and
// the caches that grow while it runs (the "changes" pull encoder's last-sent copies) reserve
// more as they grow, or go without. WaitCounter bounds the pushes (and ssp pulls) that wait
// in a consistency policy at the same time.
//
// Thread safety: ShardLimits is a value. MemoryBudget and WaitCounter are thread-safe (one
// internal mutex each, a leaf: no other lock is taken while it is held; calls never block on
// anything else). A MemoryReservation is owned by one object and not shared.
#ifndef GRADMESH_SERVER_SHARD_LIMITS_H_
#define GRADMESH_SERVER_SHARD_LIMITS_H_

#include <cstdint>
#include <limits>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace gradmesh {

struct ShardLimits {
  // Bytes of job state the shard may hold: every job's values, optimizer slots, sync barrier
  // copies, durable-snapshot buffers, request ledgers, per-chunk and per-worker bookkeeping,
  // and the "changes" pull caches; and the open shared-memory channels' regions and request
  // copies (OpenShm). InitJob or OpenShm beyond it is RESOURCE_EXHAUSTED. Default here: no
  // budget (int64 max); gradmesh_server's --max_memory_bytes defaults to 80% of physical RAM
  // (DefaultMaxMemoryBytes()).
  int64_t max_memory_bytes = std::numeric_limits<int64_t>::max();
  // InitJobRequest.tensors entries. Default 65,536.
  int32_t max_tensors_per_job = 65536;
  // Elements of one tensor (product of its shape). Default 2^34 (64 GiB of float32).
  int64_t max_elements_per_tensor = int64_t{1} << 34;
  // Chunks of a job's whole layout (every shard's; the partition lists them all, and placing
  // them costs chunks x num_shards steps). Default 2^18 (256 GiB at the default 1 MiB chunk).
  int64_t max_chunks_per_job = int64_t{1} << 18;
  // InitJobRequest.num_shards. Default 1,024.
  int32_t max_num_shards = 1024;
  // InitJobRequest.num_workers (per-worker state: ledgers, clocks, barrier slots, caches).
  // Default 4,096.
  int32_t max_num_workers = 4096;
  // Jobs held by the shard at once (jobs are held until the shard restarts). Default 1,024.
  int32_t max_jobs = 1024;
  // Pushes (sync barrier) and pulls (ssp) waiting in a consistency policy at once, over all
  // jobs; one more is RESOURCE_EXHAUSTED. Default 4,096.
  int32_t max_waiting_pushes = 4096;
  // Bytes of a tensor name. Default 1,024.
  int32_t max_tensor_name_bytes = 1024;
};

// InvalidArgument naming the field unless every limit is > 0.
absl::Status ValidateShardLimits(const ShardLimits& limits);

// 80% of this machine's physical memory (sysconf), or 8 GiB if it cannot be read.
int64_t DefaultMaxMemoryBytes();

// "1.5 GiB", "12.0 MiB", "512 B": a byte count for messages.
std::string FormatBytes(int64_t bytes);

// Thread safety: thread-safe (see the file comment). Bytes reserved against a limit.
class MemoryBudget {
 public:
  explicit MemoryBudget(int64_t limit_bytes) : limit_(limit_bytes) {}
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // Reserves `bytes` (>= 0) if they fit; else RESOURCE_EXHAUSTED "<what> needs X (<detail>);
  // Y of the Z budget is left (--max_memory_bytes)" and nothing is reserved.
  absl::Status Reserve(int64_t bytes, const std::string& what, const std::string& detail = "");
  // Reserves `bytes` if they fit; false (nothing reserved) otherwise.
  bool TryReserve(int64_t bytes);
  // Reserves `bytes` even beyond the limit (restoring jobs a shard already held).
  void ForceReserve(int64_t bytes);
  // Returns bytes reserved before.
  void Release(int64_t bytes);

  int64_t limit() const { return limit_; }
  int64_t used() const;

 private:
  const int64_t limit_;
  mutable absl::Mutex mu_;
  int64_t used_ ABSL_GUARDED_BY(mu_) = 0;
};

// Thread safety: not thread-safe; owned by one object. Bytes reserved from a MemoryBudget,
// released on destruction. Move-only.
class MemoryReservation {
 public:
  MemoryReservation() = default;
  // Takes over `bytes` already reserved in `budget` (may be null: nothing to release).
  MemoryReservation(MemoryBudget* budget, int64_t bytes) : budget_(budget), bytes_(bytes) {}
  MemoryReservation(MemoryReservation&& other) noexcept;
  MemoryReservation& operator=(MemoryReservation&& other) noexcept;
  ~MemoryReservation();

  int64_t bytes() const { return bytes_; }

 private:
  MemoryBudget* budget_ = nullptr;
  int64_t bytes_ = 0;
};

// Thread safety: thread-safe. Counts requests waiting at once against a limit.
class WaitCounter {
 public:
  explicit WaitCounter(int64_t limit) : limit_(limit) {}
  WaitCounter(const WaitCounter&) = delete;
  WaitCounter& operator=(const WaitCounter&) = delete;

  // Counts one more waiter, or RESOURCE_EXHAUSTED "<what>: N requests already wait on this
  // shard (--max_waiting_pushes)" when `limit` already wait. Pair an OK Enter with Exit.
  absl::Status Enter(const std::string& what);
  void Exit();
  int64_t waiting() const;

 private:
  const int64_t limit_;
  mutable absl::Mutex mu_;
  int64_t waiting_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_SHARD_LIMITS_H_
