// DelayProxy (see delay_proxy.h).
#include "tests/proxy/delay_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace gradmesh {
namespace testutil {
namespace {

sockaddr_in Loopback(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DelayProxy>> DelayProxy::Start(int target_port,
                                                              absl::Duration delay) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in a = Loopback(0);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd, 64) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("proxy listen: ", std::strerror(err)));
  }
  auto proxy =
      std::unique_ptr<DelayProxy>(new DelayProxy(fd, ntohs(a.sin_port), target_port, delay));
  proxy->acceptor_ = std::thread(&DelayProxy::Accept, proxy.get());
  return proxy;
}

DelayProxy::DelayProxy(int listen_fd, int port, int target_port, absl::Duration delay)
    : listen_fd_(listen_fd), port_(port), target_port_(target_port), delay_(delay) {}

DelayProxy::~DelayProxy() {
  stop_ = true;
  shutdown(listen_fd_, SHUT_RDWR);
  acceptor_.join();
  close(listen_fd_);
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);
    threads.swap(forwarders_);
  }
  for (std::thread& t : threads) t.join();
  absl::MutexLock lock(&mu_);
  for (int fd : fds_) close(fd);
}

std::string DelayProxy::address() const { return absl::StrCat("127.0.0.1:", port_); }

void DelayProxy::Accept() {
  while (!stop_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    const int upstream = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a = Loopback(target_port_);
    if (upstream < 0 || connect(upstream, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      close(client);
      if (upstream >= 0) close(upstream);
      continue;
    }
    absl::MutexLock lock(&mu_);
    const int id = accepted_.fetch_add(1);
    fds_.push_back(client);
    fds_.push_back(upstream);
    forwarders_.emplace_back(&DelayProxy::Forward, this, client, upstream, id);
    forwarders_.emplace_back(&DelayProxy::Forward, this, upstream, client, id);
  }
}

void DelayProxy::Forward(int from, int to, int id) {
  char buf[64 << 10];
  while (!stop_) {
    const ssize_t n = read(from, buf, sizeof(buf));
    if (n <= 0) break;
    if (id < frozen_below_.load()) continue;  // Frozen: dropped.
    absl::SleepFor(delay_);
    for (ssize_t done = 0; done < n;) {
      // send with MSG_NOSIGNAL: a peer that closed its side must end this forwarding, not
      // raise SIGPIPE in the test process.
      const ssize_t w = send(to, buf + done, static_cast<size_t>(n - done), MSG_NOSIGNAL);
      if (w <= 0) {
        shutdown(from, SHUT_RDWR);
        return;
      }
      done += w;
    }
  }
  shutdown(to, SHUT_RDWR);
}

}  // namespace testutil
}  // namespace gradmesh
