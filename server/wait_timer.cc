#include "server/wait_timer.h"

#include "absl/time/clock.h"

namespace gradmesh {

WaitTimer::~WaitTimer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    wake_.Signal();
  }
  if (thread_.joinable()) thread_.join();
  // Drain: what is still pending runs now, in order, so no completion is lost.
  absl::MutexLock lock(&mu_);
  while (!queue_.empty()) {
    auto first = queue_.begin();
    std::function<void()> fn = std::move(first->second);
    when_.erase(first->first.second);
    queue_.erase(first);
    mu_.Unlock();
    fn();
    fn = nullptr;
    mu_.Lock();
  }
}

WaitTimer::Id WaitTimer::Schedule(absl::Time when, std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  const Id id = next_id_++;
  queue_.emplace(std::make_pair(when, id), std::move(fn));
  when_[id] = when;
  wake_.Signal();
  if (!started_ && !stop_) {
    started_ = true;
    thread_ = std::thread([this] { Loop(); });
  }
  return id;
}

bool WaitTimer::Cancel(Id id) {
  absl::MutexLock lock(&mu_);
  auto it = when_.find(id);
  if (it == when_.end()) return false;
  queue_.erase(std::make_pair(it->second, id));
  when_.erase(it);
  return true;
}

size_t WaitTimer::pending() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

void WaitTimer::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    if (queue_.empty()) {
      wake_.Wait(&mu_);
      continue;
    }
    auto first = queue_.begin();
    if (first->first.first > absl::Now()) {
      // Until the earliest is due, or Schedule (perhaps of an earlier one) or stop signals.
      wake_.WaitWithDeadline(&mu_, first->first.first);
      continue;
    }
    std::function<void()> fn = std::move(first->second);
    when_.erase(first->first.second);
    queue_.erase(first);
    mu_.Unlock();
    fn();
    fn = nullptr;  // Whatever it holds is released outside the lock too.
    mu_.Lock();
  }
}

}  // namespace gradmesh
