// A TCP proxy on 127.0.0.1 that delays what it forwards: a slow link for tests. Each piece of
// data read from one side is written to the other `delay` later (pieces keep their order), in
// both directions, for every connection accepted. Closing either side closes the other.
// Freeze() makes the connections open so far a black hole (what they carry is read and
// dropped, nothing is closed: a connection that died silently), while new ones work.
//
// Thread safety: construct with Start(), destroy from one thread; the proxy runs its own
// threads (one accepting, two per connection).
#ifndef GRADMESH_TESTS_PROXY_DELAY_PROXY_H_
#define GRADMESH_TESTS_PROXY_DELAY_PROXY_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace gradmesh {
namespace testutil {

class DelayProxy {
 public:
  // Listens on a free port of 127.0.0.1 and forwards to `target_port` there.
  static absl::StatusOr<std::unique_ptr<DelayProxy>> Start(int target_port, absl::Duration delay);
  ~DelayProxy();  // Closes every connection and joins the threads.

  DelayProxy(const DelayProxy&) = delete;
  DelayProxy& operator=(const DelayProxy&) = delete;

  int port() const { return port_; }
  void Freeze() { frozen_below_ = accepted_.load(); }
  int accepted() const { return accepted_.load(); }  // Connections accepted so far.
  std::string address() const;                       // "127.0.0.1:<port>".

 private:
  DelayProxy(int listen_fd, int port, int target_port, absl::Duration delay);
  void Accept();
  void Forward(int from, int to, int id);

  const int listen_fd_;
  const int port_;
  const int target_port_;
  const absl::Duration delay_;
  std::atomic<bool> stop_{false};
  std::atomic<int> accepted_{0};
  std::atomic<int> frozen_below_{0};  // Connections with a lower id carry nothing.
  std::thread acceptor_;
  absl::Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> forwarders_ ABSL_GUARDED_BY(mu_);
};

}  // namespace testutil
}  // namespace gradmesh

#endif  // GRADMESH_TESTS_PROXY_DELAY_PROXY_H_
