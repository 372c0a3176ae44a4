// Plumbing for code that drives sockets itself (worker/allreduce/tcp_ring.cc, the metrics
// endpoint in common/metrics_http.cc): an owned file descriptor, and poll() timeouts from
// deadlines.
//
// Thread safety: an Fd is used by one thread at a time; PollTimeoutMs is pure.
#ifndef GRADMESH_COMMON_FD_H_
#define GRADMESH_COMMON_FD_H_

#include <unistd.h>

#include <algorithm>
#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace gradmesh {

// Owns a file descriptor (-1: none) and closes it on destruction or reset.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    reset(o.release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  // Gives up ownership.
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// Milliseconds until `deadline` for poll(): rounded up (so a wait never ends just before the
// deadline and spins), at least 0, at most ~24 days (InfiniteFuture included).
inline int PollTimeoutMs(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(
      absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))), (int64_t{1} << 31) - 1));
}

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_FD_H_
