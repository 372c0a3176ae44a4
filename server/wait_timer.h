// WaitTimer: runs callbacks at given times on one thread of its own. A shard uses one for the
// deadlines of the pushes and pulls that wait in its consistency policies
// (server/consistency.h), and for work a caller hands off so as not to do it on its own thread
// (a sync step completed by SetGroup), so no waiting call needs a thread.
//
// Thread safety: every method may be called concurrently, also from a callback. Callbacks run
// one at a time on the timer's thread, in time order (ties in scheduling order), never under
// the timer's lock; a slow callback delays the later ones. The thread starts with the first
// Schedule. The destructor joins the thread, then runs what is still pending at once, in
// order, on the destroying thread (deadlines are cut short, no completion is lost); it must
// not run on the timer's thread (from a callback).
#ifndef GRADMESH_SERVER_WAIT_TIMER_H_
#define GRADMESH_SERVER_WAIT_TIMER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace gradmesh {

class WaitTimer {
 public:
  using Id = uint64_t;  // 0 is never an id.

  WaitTimer() = default;
  ~WaitTimer();
  WaitTimer(const WaitTimer&) = delete;
  WaitTimer& operator=(const WaitTimer&) = delete;

  // Runs `fn` at `when` (as soon as possible if that has passed). Returns its id for Cancel.
  Id Schedule(absl::Time when, std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_);

  // Removes a callback that has not started: true if it was removed, false if it has started,
  // run, or was never scheduled. Never waits for a running callback.
  bool Cancel(Id id) ABSL_LOCKS_EXCLUDED(mu_);

  // Callbacks scheduled that have not started.
  size_t pending() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  // By (time, id): time order, then scheduling order.
  std::map<std::pair<absl::Time, Id>, std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Id, absl::Time> when_ ABSL_GUARDED_BY(mu_);
  Id next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::CondVar wake_;  // Signalled by Schedule and the destructor: the thread re-reads.
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // Started under mu_ by the first Schedule; joined by the destructor.
};

}  // namespace gradmesh

#endif  // GRADMESH_SERVER_WAIT_TIMER_H_
