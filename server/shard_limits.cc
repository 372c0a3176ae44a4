#include "server/shard_limits.h"

#include <unistd.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace gradmesh {

absl::Status ValidateShardLimits(const ShardLimits& l) {
  auto check = [](const char* name, int64_t v) {
    if (v > 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("ShardLimits.", name, " must be > 0, got ", v));
  };
  for (absl::Status st :
       {check("max_memory_bytes", l.max_memory_bytes),
        check("max_tensors_per_job", l.max_tensors_per_job),
        check("max_elements_per_tensor", l.max_elements_per_tensor),
        check("max_chunks_per_job", l.max_chunks_per_job),
        check("max_num_shards", l.max_num_shards), check("max_num_workers", l.max_num_workers),
        check("max_jobs", l.max_jobs), check("max_waiting_pushes", l.max_waiting_pushes),
        check("max_tensor_name_bytes", l.max_tensor_name_bytes)}) {
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

int64_t DefaultMaxMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return int64_t{8} << 30;
  return static_cast<int64_t>(static_cast<double>(pages) * static_cast<double>(page) * 0.8);
}

std::string FormatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return absl::StrFormat("%.1f GiB", b / (1 << 30));
  if (bytes >= (int64_t{1} << 20)) return absl::StrFormat("%.1f MiB", b / (1 << 20));
  if (bytes >= (int64_t{1} << 10)) return absl::StrFormat("%.1f KiB", b / (1 << 10));
  return absl::StrCat(bytes, " B");
}

absl::Status MemoryBudget::Reserve(int64_t bytes, const std::string& what,
                                   const std::string& detail) {
  absl::MutexLock lock(&mu_);
  const int64_t left = limit_ - used_;
  if (bytes <= left) {
    used_ += bytes;
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(
      absl::StrCat(what, " needs ", FormatBytes(bytes), detail.empty() ? "" : " (", detail,
                   detail.empty() ? "" : ")", "; ", FormatBytes(left), " of the ",
                   FormatBytes(limit_), " budget is left (--max_memory_bytes)"));
}

bool MemoryBudget::TryReserve(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (bytes > limit_ - used_) return false;
  used_ += bytes;
  return true;
}

void MemoryBudget::ForceReserve(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  used_ += bytes;
}

void MemoryBudget::Release(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  used_ -= bytes;
}

int64_t MemoryBudget::used() const {
  absl::MutexLock lock(&mu_);
  return used_;
}

MemoryReservation::MemoryReservation(MemoryReservation&& other) noexcept
    : budget_(std::exchange(other.budget_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

MemoryReservation& MemoryReservation::operator=(MemoryReservation&& other) noexcept {
  if (this != &other) {
    if (budget_ != nullptr) budget_->Release(bytes_);
    budget_ = std::exchange(other.budget_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

MemoryReservation::~MemoryReservation() {
  if (budget_ != nullptr) budget_->Release(bytes_);
}

absl::Status WaitCounter::Enter(const std::string& what) {
  absl::MutexLock lock(&mu_);
  if (waiting_ >= limit_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": ", waiting_,
                     " requests already wait at barriers on this shard, the most it allows "
                     "(--max_waiting_pushes)"));
  }
  ++waiting_;
  return absl::OkStatus();
}

void WaitCounter::Exit() {
  absl::MutexLock lock(&mu_);
  --waiting_;
}

int64_t WaitCounter::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_;
}

}  // namespace gradmesh
