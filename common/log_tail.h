// LogTail: the last lines of a log, bounded in lines and bytes, each with a sequence number
// (1, 2, ... in the order appended), for `gradmesh logs`: a worker daemon keeps one per task
// (the task's Logger lines), and the coordinator one per (job, rank) of what the heartbeats
// brought.
//
// Bounds: after Append, the tail holds at most max_lines lines and max_bytes bytes (the sum of
// the lines' sizes); the oldest lines are dropped first. A line longer than max_line_bytes is
// cut to that size (a "..." suffix marks the cut).
//
// Thread safety: all methods may be called concurrently.
#ifndef GRADMESH_COMMON_LOG_TAIL_H_
#define GRADMESH_COMMON_LOG_TAIL_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace gradmesh {

class LogTail {
 public:
  struct Options {
    size_t max_lines = 200;
    size_t max_bytes = 64 << 10;
    size_t max_line_bytes = 2048;
  };
  using Line = std::pair<int64_t, std::string>;  // (sequence, text)

  explicit LogTail(Options options) : options_(options) {}

  // Appends `line` (cut to max_line_bytes) and returns its sequence number.
  int64_t Append(std::string line) ABSL_LOCKS_EXCLUDED(mu_);
  // Appends `line` under a sequence number the caller chose (e.g. one counter over several
  // tails); a number not above last_sequence() is raised to last_sequence() + 1. Returns it.
  int64_t AppendAs(int64_t sequence, std::string line) ABSL_LOCKS_EXCLUDED(mu_);
  // The kept lines with sequence > `after`, oldest first; when there are more than
  // `max_lines` of them or they exceed `max_bytes`, the oldest of them (a gap in the sequence
  // numbers tells a reader that lines were skipped).
  std::vector<Line> Since(int64_t after, size_t max_lines = SIZE_MAX,
                          size_t max_bytes = SIZE_MAX) const ABSL_LOCKS_EXCLUDED(mu_);
  // Sequence number of the last line appended (0 before any).
  int64_t last_sequence() const ABSL_LOCKS_EXCLUDED(mu_);
  // Lines and bytes kept now.
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t bytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const Options options_;
  mutable absl::Mutex mu_;
  std::deque<Line> lines_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_LOG_TAIL_H_
