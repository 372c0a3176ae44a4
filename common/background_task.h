// BackgroundTask: one thread that runs one task at a time, started by one caller and waited
// for by it (e.g. a pipelined training step's exchange, worker/ps/ps_mode.cc).
//
//   BackgroundTask bg;
//   bg.Start([&] { return Exchange(step); });  // returns at once
//   ... compute ...
//   absl::Status st = bg.Wait();                // the task's status
//
// Start while a task is started and not yet waited for is FAILED_PRECONDITION (nothing
// changes). Wait with nothing started returns OK. The destructor waits for a running
// task (discarding its status) and joins the thread.
//
// Thread safety: Start and Wait from one thread at a time (the owner); pending() from any.
#ifndef GRADMESH_COMMON_BACKGROUND_TASK_H_
#define GRADMESH_COMMON_BACKGROUND_TASK_H_

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace gradmesh {

class BackgroundTask {
 public:
  BackgroundTask();
  ~BackgroundTask();

  BackgroundTask(const BackgroundTask&) = delete;
  BackgroundTask& operator=(const BackgroundTask&) = delete;

  // Runs `task` on the background thread.
  absl::Status Start(std::function<absl::Status()> task) ABSL_LOCKS_EXCLUDED(mu_);

  // Waits until the task started last has finished; returns its status (OK if none).
  absl::Status Wait() ABSL_LOCKS_EXCLUDED(mu_);

  // Whether a task is started and not yet waited for.
  bool pending() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  std::function<absl::Status()> task_ ABSL_GUARDED_BY(mu_);  // Set: to run.
  bool pending_ ABSL_GUARDED_BY(mu_) = false;                // Started, not waited for.
  bool done_ ABSL_GUARDED_BY(mu_) = false;                   // The pending task finished.
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool quit_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // Last: started after the fields above are initialised.
};

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_BACKGROUND_TASK_H_
