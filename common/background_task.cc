#include "common/background_task.h"

#include <utility>

namespace gradmesh {

BackgroundTask::BackgroundTask() : thread_([this] { Loop(); }) {}

BackgroundTask::~BackgroundTask() {
  {
    absl::MutexLock lock(&mu_);
    quit_ = true;
  }
  thread_.join();
}

absl::Status BackgroundTask::Start(std::function<absl::Status()> task) {
  absl::MutexLock lock(&mu_);
  if (pending_) {
    return absl::FailedPreconditionError(
        "BackgroundTask::Start: the previous task was not waited for");
  }
  task_ = std::move(task);
  pending_ = true;
  done_ = false;
  return absl::OkStatus();
}

absl::Status BackgroundTask::Wait() {
  absl::MutexLock lock(&mu_);
  if (!pending_) return absl::OkStatus();
  mu_.Await(absl::Condition(&done_));
  pending_ = false;
  return std::move(status_);
}

bool BackgroundTask::pending() const {
  absl::MutexLock lock(&mu_);
  return pending_;
}

void BackgroundTask::Loop() {
  while (true) {
    std::function<absl::Status()> task;
    {
      absl::MutexLock lock(&mu_);
      // On quit, a task already started still runs (its owner may be waiting for it).
      mu_.Await(absl::Condition(
          +[](BackgroundTask* t)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu_) { return t->quit_ || t->task_ != nullptr; },
          this));
      if (task_ == nullptr) return;
      task = std::move(task_);
      task_ = nullptr;
    }
    absl::Status st = task();
    absl::MutexLock lock(&mu_);
    status_ = std::move(st);
    done_ = true;
  }
}

}  // namespace gradmesh
