// The TCP ring transport (see tcp_ring.h).
#include "worker/allreduce/tcp_ring.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/fd.h"
#include "common/status.h"
#include "rpc/auth.h"

namespace gradmesh {
namespace {

constexpr char kHelloMagic[8] = {'G', 'M', 'R', 'I', 'N', 'G', '0', '1'};
constexpr size_t kSecretBytes = 16;
constexpr size_t kHelloBytes = sizeof(kHelloMagic) + 4 + 4 + kSecretBytes;
constexpr size_t kHeaderBytes = 16;
// Larger messages than this are a protocol error (the ring's segments are a few MiB).
constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 31;
// Reads smaller than this go through the staging buffer (one read() for many small
// messages); larger payloads are read straight into their destination.
constexpr size_t kStageBytes = 64 << 10;
// Receive buffers kept for reuse.
constexpr size_t kPoolSize = 4;

void PutU64(uint64_t v, char* p) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}
void PutU32(uint32_t v, char* p) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

std::string ErrnoText(int err) { return std::strerror(err); }

absl::Status SetNonBlocking(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return absl::UnavailableError(absl::StrCat("ring tcp: fcntl: ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

// TCP_NODELAY, and the socket buffers when `buffer_bytes` > 0.
void TuneSocket(int fd, int64_t buffer_bytes) {
  const int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (buffer_bytes > 0) {
    const int b = static_cast<int>(std::min<int64_t>(buffer_bytes, 1 << 30));
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof(b));
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof(b));
  }
}

// A listening socket on an ephemeral port on every address (IPv6 dual stack where the host
// has IPv6, else IPv4). Returns the socket and its port.
absl::StatusOr<std::pair<Fd, int>> Listen() {
  Fd fd(socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() >= 0) {
    const int zero = 0;
    (void)setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    if (bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) fd.reset();
  }
  if (fd.get() < 0) {
    fd.reset(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    if (fd.get() < 0 || bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      return absl::UnavailableError(
          absl::StrCat("ring tcp: cannot bind a listening socket: ", ErrnoText(errno)));
    }
  }
  // Room for the previous rank's connection behind strangers' (their hellos are read side by
  // side once accepted, AcceptPrevious).
  if (listen(fd.get(), 128) != 0) {
    return absl::UnavailableError(absl::StrCat("ring tcp: listen: ", ErrnoText(errno)));
  }
  RETURN_IF_ERROR(SetNonBlocking(fd.get()));
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) {
    return absl::UnavailableError(absl::StrCat("ring tcp: getsockname: ", ErrnoText(errno)));
  }
  const int port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                            : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return std::make_pair(std::move(fd), port);
}

// Writes all of `data` to a non-blocking socket before `deadline`.
absl::Status WriteAll(int fd, const char* data, size_t size, absl::Time deadline,
                      const std::string& what, const RingAbort* abort) {
  while (size > 0) {
    const ssize_t w = send(fd, data, size, MSG_NOSIGNAL);
    if (w > 0) {
      data += w;
      size -= static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (poll(&p, 1, PollTimeoutMs(RingAbortSlice(deadline, abort))) == 0) {
        if (RingAborted(abort)) return RingAbortedError(absl::StrCat("ring tcp: ", what));
        if (absl::Now() >= deadline) {
          return absl::DeadlineExceededError(absl::StrCat("ring tcp: ", what, ": timed out"));
        }
      }
      continue;
    }
    return absl::UnavailableError(absl::StrCat("ring tcp: ", what, ": ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

// A connection to the listener that has not yet sent its whole hello.
struct PendingHello {
  Fd fd;
  char got[kHelloBytes];
  size_t have = 0;
  absl::Time until;  // It is dropped if its hello is not complete by then.
};

// Reads what `c` has of its hello without blocking: true once complete, false while more may
// come; a closed or failed connection is an error.
absl::StatusOr<bool> ReadHelloSome(PendingHello* c) {
  while (c->have < kHelloBytes) {
    const ssize_t r = recv(c->fd.get(), c->got + c->have, kHelloBytes - c->have, 0);
    if (r > 0) {
      c->have += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return absl::UnavailableError("hello: connection closed");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
    return absl::UnavailableError(absl::StrCat("hello: ", ErrnoText(errno)));
  }
  return true;
}

// Accepts connections on `listen_fd` until the previous rank's arrives with its hello: magic,
// rank `prev`, ring size `n` and this rank's `secret`. Hellos are read side by side, so silent
// or slow connections (a stranger's port scan, a slowloris) delay nobody: each is dropped 1 s
// after it was accepted, and beyond kMaxPendingHellos the oldest goes first.
absl::StatusOr<Fd> AcceptPrevious(int listen_fd, int prev, int n, const std::string& secret,
                                  absl::Time deadline, absl::Duration timeout,
                                  const std::string& prev_name, const RingAbort* abort) {
  constexpr size_t kMaxPendingHellos = 64;
  std::vector<PendingHello> pending;
  std::string rejected;
  std::vector<pollfd> polled;
  // Reads what `c` has sent (when `readable`): kMatch for the previous rank's hello, kDrop for
  // anything else whole, a broken or a timed-out connection (noting why in `rejected`).
  enum class Hello { kWait, kMatch, kDrop };
  const auto settle = [&](PendingHello& c, bool readable, absl::Time now) {
    absl::StatusOr<bool> whole = false;
    if (readable) whole = ReadHelloSome(&c);
    if (whole.ok() && *whole) {
      if (std::memcmp(c.got, kHelloMagic, sizeof(kHelloMagic)) == 0 &&
          GetU32(c.got + 8) == static_cast<uint32_t>(prev) &&
          GetU32(c.got + 12) == static_cast<uint32_t>(n) &&
          ConstantTimeEquals(absl::string_view(c.got + 16, kSecretBytes), secret)) {
        return Hello::kMatch;
      }
      rejected = "a connection without this ring's hello";
    } else if (!whole.ok()) {
      rejected = std::string(whole.status().message());
    } else if (now >= c.until) {
      rejected = "hello: timed out";
    } else {
      return Hello::kWait;
    }
    return Hello::kDrop;
  };
  while (true) {
    absl::Time wake = RingAbortSlice(deadline, abort);
    polled.assign(1, pollfd{listen_fd, POLLIN, 0});
    for (const PendingHello& c : pending) {
      polled.push_back(pollfd{c.fd.get(), POLLIN, 0});
      wake = std::min(wake, c.until);
    }
    if (poll(polled.data(), polled.size(), PollTimeoutMs(wake)) < 0 && errno != EINTR) {
      return absl::UnavailableError(
          absl::StrCat("ring tcp: waiting for ", prev_name, ": ", ErrnoText(errno)));
    }
    if (RingAborted(abort)) {
      return RingAbortedError(absl::StrCat("ring tcp: waiting for ", prev_name));
    }
    const absl::Time now = absl::Now();
    // Hellos first: `polled` lists the connections pending before this round's accepts.
    for (size_t i = pending.size(); i-- > 0;) {
      const Hello h = settle(pending[i], polled[i + 1].revents != 0, now);
      if (h == Hello::kMatch) return std::move(pending[i].fd);
      if (h == Hello::kDrop) pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
    }
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "ring tcp: ", prev_name, " did not connect within ", absl::FormatDuration(timeout),
          rejected.empty() ? "" : absl::StrCat(" (refused: ", rejected, ")")));
    }
    if ((polled[0].revents & POLLIN) == 0) continue;
    // At most kMaxPendingHellos per round, so a flood cannot keep this loop from the hellos.
    for (size_t accepted = 0; accepted < kMaxPendingHellos; ++accepted) {
      Fd c(accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (c.get() < 0) {
        const int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ECONNABORTED ||
            err == EPROTO) {
          break;
        }
        return absl::UnavailableError(
            absl::StrCat("ring tcp: accepting ", prev_name, ": ", ErrnoText(err)));
      }
      PendingHello added;
      added.fd = std::move(c);
      // The ring's ranks send their hello at once: it is usually here already.
      added.until = std::min(deadline, absl::Now() + absl::Seconds(1));
      const Hello h = settle(added, /*readable=*/true, absl::Now());
      if (h == Hello::kMatch) return std::move(added.fd);
      if (h == Hello::kDrop) continue;
      if (pending.size() == kMaxPendingHellos) {
        rejected = "hello: too many connections waiting";
        pending.erase(pending.begin());
      }
      pending.push_back(std::move(added));
    }
  }
}

// Connects to host:port before `deadline` (retrying refused connections) and returns a
// non-blocking socket.
absl::StatusOr<Fd> Connect(const std::string& host, int port, absl::Time deadline,
                           const std::string& name, const RingAbort* abort) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port_str = absl::StrCat(port);
  const int gai = getaddrinfo(host.c_str(), port_str.c_str(), &hints, &res);
  if (gai != 0) {
    return absl::UnavailableError(
        absl::StrCat("ring tcp: cannot resolve ", name, ": ", gai_strerror(gai)));
  }
  std::string last = "no address";
  absl::Duration backoff = absl::Milliseconds(10);
  while (true) {
    for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
      Fd fd(socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
      if (fd.get() < 0) {
        last = ErrnoText(errno);
        continue;
      }
      if (!SetNonBlocking(fd.get()).ok()) continue;
      int rc = connect(fd.get(), ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        // At most a few seconds per address, so a black-holed one does not starve the rest.
        const absl::Time attempt = std::min(deadline, absl::Now() + absl::Seconds(5));
        pollfd p{fd.get(), POLLOUT, 0};
        int ready;
        do {
          ready = poll(&p, 1, PollTimeoutMs(RingAbortSlice(attempt, abort)));
        } while ((ready < 0 && errno == EINTR) ||
                 (ready == 0 && !RingAborted(abort) && absl::Now() < attempt));
        if (ready <= 0) {
          last = ready == 0 ? "timed out" : ErrnoText(errno);
          continue;
        }
        int err = 0;
        socklen_t len = sizeof(err);
        getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      }
      if (rc == 0) {
        freeaddrinfo(res);
        return fd;
      }
      last = ErrnoText(errno);
    }
    if (absl::Now() + backoff >= deadline) break;
    // In slices, so an abort is seen within kRingAbortCheck.
    for (const absl::Time until = absl::Now() + backoff; absl::Now() < until;) {
      if (RingAborted(abort)) break;
      absl::SleepFor(std::min(until - absl::Now(), kRingAbortCheck));
    }
    if (RingAborted(abort)) break;
    backoff = std::min(backoff * 2, absl::Milliseconds(500));
  }
  freeaddrinfo(res);
  if (RingAborted(abort)) return RingAbortedError(absl::StrCat("ring tcp: connecting to ", name));
  return absl::UnavailableError(absl::StrCat("ring tcp: cannot connect to ", name, ": ", last));
}

class TcpRingTransport final : public RingTransport {
 public:
  TcpRingTransport(int rank, int size, Fd out, Fd in, std::string next_name, std::string prev_name,
                   absl::Duration close_timeout, const RingAbort* abort)
      : rank_(rank),
        n_(size),
        out_(std::move(out)),
        in_(std::move(in)),
        next_name_(std::move(next_name)),
        prev_name_(std::move(prev_name)),
        close_timeout_(close_timeout),
        abort_(abort),
        stage_(new char[kStageBytes]) {}

  ~TcpRingTransport() override {
    // Copies still queued (an all-gather's last block) are delivered. A queued in-place
    // message means a collective failed before its Flush: the caller's buffer may be gone
    // by now, so nothing of it is read; the next rank sees the connection close.
    bool in_place = false;
    for (const Item& item : queue_) in_place = in_place || item.owned == nullptr;
    if (error_.ok() && !in_place && !queue_.empty()) (void)Flush(absl::Now() + close_timeout_);
  }

  int rank() const override { return rank_; }
  int size() const override { return n_; }

  absl::Status Send(absl::Span<const char> data) override { return Enqueue(data, true); }
  absl::Status SendNoCopy(absl::Span<const char> data) override { return Enqueue(data, false); }

  absl::Status Flush(absl::Time deadline) override {
    while (error_.ok() && !queue_.empty()) {
      WriteSome();
      if (!error_.ok() || queue_.empty()) break;
      if (!Wait(/*read=*/false, deadline)) {
        error_ = absl::DeadlineExceededError(
            absl::StrCat(next_name_, " did not take the last ring messages in time"));
      }
    }
    return error_;
  }

  absl::StatusOr<RingMessage> Recv(absl::Time deadline) override {
    recv_start_ = absl::Now();
    ASSIGN_OR_RETURN(uint64_t size, ReadHeader(deadline));
    std::shared_ptr<Buffer> buf = TakeBuffer(size);
    RETURN_IF_ERROR(ReadBody(buf->data.get(), size, deadline));
    RingMessage msg;
    if (size > 0) msg.pieces.emplace_back(buf->data.get(), size);
    msg.owner = std::move(buf);
    return msg;
  }

  absl::StatusOr<size_t> RecvInto(absl::Span<char> dst, absl::Time deadline) override {
    recv_start_ = absl::Now();
    ASSIGN_OR_RETURN(uint64_t size, ReadHeader(deadline));
    if (size != dst.size()) {
      // The ring is out of step; the caller fails it. Make later calls fail too.
      error_ = absl::UnavailableError(absl::StrCat("ring link from ", prev_name_, " sent ", size,
                                                   " bytes where ", dst.size(), " were expected"));
      return static_cast<size_t>(size);
    }
    RETURN_IF_ERROR(ReadBody(dst.data(), size, deadline));
    return static_cast<size_t>(size);
  }

  std::string kind() const override { return "tcp"; }

  std::string PeerName(int rank) const override {
    if (rank == (rank_ + 1) % n_) return next_name_;
    if (rank == (rank_ + n_ - 1) % n_) return prev_name_;
    return absl::StrCat("rank ", rank);
  }

 private:
  struct Buffer {
    std::unique_ptr<char[]> data;
    size_t capacity = 0;
  };

  // One queued message: its header and its payload (copied into `owned`, or in place when
  // `owned` is null).
  struct Item {
    char header[kHeaderBytes];
    std::unique_ptr<char[]> owned;
    const char* data = nullptr;
    size_t size = 0;
    size_t written = 0;  // Of header + payload.
  };

  absl::Status Enqueue(absl::Span<const char> data, bool copy) {
    if (!error_.ok()) return error_;
    Item& item = queue_.emplace_back();
    PutU64(send_seq_++, item.header);
    PutU64(data.size(), item.header + 8);
    item.size = data.size();
    if (copy && !data.empty()) {
      item.owned.reset(new char[data.size()]);
      std::memcpy(item.owned.get(), data.data(), data.size());
      item.data = item.owned.get();
    } else {
      item.data = data.data();
    }
    WriteSome();  // Start at once; never blocks.
    return error_;
  }

  // Writes as much of the queue as the socket takes now (one sendmsg for many messages).
  void WriteSome() {
    while (error_.ok() && !queue_.empty()) {
      iovec iov[64];
      int count = 0;
      for (auto it = queue_.begin(); it != queue_.end() && count + 2 <= 64; ++it) {
        size_t skip = it->written;
        if (skip < kHeaderBytes) {
          iov[count++] = {const_cast<char*>(it->header) + skip, kHeaderBytes - skip};
          skip = 0;
        } else {
          skip -= kHeaderBytes;
        }
        if (it->size > skip) iov[count++] = {const_cast<char*>(it->data) + skip, it->size - skip};
      }
      msghdr mh{};
      mh.msg_iov = iov;
      mh.msg_iovlen = count;
      const ssize_t w = sendmsg(out_.get(), &mh, MSG_NOSIGNAL);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        error_ = absl::UnavailableError(
            absl::StrCat("ring link to ", next_name_, " broke while sending: ", ErrnoText(errno)));
        return;
      }
      size_t left = static_cast<size_t>(w);
      while (left > 0) {
        Item& front = queue_.front();
        const size_t rest = kHeaderBytes + front.size - front.written;
        if (left >= rest) {
          left -= rest;
          queue_.pop_front();
        } else {
          front.written += left;
          left = 0;
        }
      }
    }
  }

  // Waits until the incoming socket is readable (`read`) or, while messages are queued, the
  // outgoing one writable; false once `deadline` has passed; an abort sets error_ (and
  // returns true).
  bool Wait(bool read, absl::Time deadline) {
    pollfd p[2];
    int count = 0;
    if (read) p[count++] = {in_.get(), POLLIN, 0};
    if (!queue_.empty()) p[count++] = {out_.get(), POLLOUT, 0};
    if (count == 0) return true;
    const int rc = poll(p, count, PollTimeoutMs(RingAbortSlice(deadline, abort_)));
    if (RingAborted(abort_)) {
      error_ =
          RingAbortedError(absl::StrCat("ring tcp link between ", prev_name_, " and ", next_name_));
      return true;
    }
    if (rc == 0) return absl::Now() < deadline;
    return true;
  }

  // Reads up to `size` bytes into dst without blocking; the bytes read, 0 if none are there
  // yet, or sets error_.
  size_t ReadSome(char* dst, size_t size) {
    size_t got = 0;
    if (stage_begin_ < stage_end_) {
      got = std::min(size, stage_end_ - stage_begin_);
      std::memcpy(dst, stage_.get() + stage_begin_, got);
      stage_begin_ += got;
      return got;
    }
    ssize_t r;
    if (size >= kStageBytes) {
      r = recv(in_.get(), dst, size, 0);
      if (r > 0) return static_cast<size_t>(r);
    } else {
      r = recv(in_.get(), stage_.get(), kStageBytes, 0);
      if (r > 0) {
        stage_begin_ = 0;
        stage_end_ = static_cast<size_t>(r);
        return ReadSome(dst, size);
      }
    }
    if (r == 0) {
      error_ = absl::UnavailableError(
          absl::StrCat("ring link from ", prev_name_, " ended: connection closed (process gone?)"));
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      error_ = absl::UnavailableError(
          absl::StrCat("ring link from ", prev_name_, " broke: ", ErrnoText(errno)));
    }
    return 0;
  }

  // Fills dst[0, size) from the incoming socket, writing queued messages meanwhile.
  absl::Status ReadExactly(char* dst, size_t size, absl::Time deadline) {
    size_t done = 0;
    while (done < size) {
      if (!error_.ok()) return error_;
      const size_t got = ReadSome(dst + done, size - done);
      done += got;
      if (done == size || !error_.ok()) continue;
      if (!queue_.empty()) WriteSome();
      if (got > 0 || !error_.ok()) continue;
      if (!Wait(/*read=*/true, deadline)) {
        error_ = absl::DeadlineExceededError(
            absl::StrCat("nothing from ", prev_name_, " within ",
                         absl::FormatDuration(absl::Now() - recv_start_),
                         done > 0 ? " (a message arrived in part)" : ""));
      }
    }
    return error_;
  }

  absl::StatusOr<uint64_t> ReadHeader(absl::Time deadline) {
    if (!error_.ok()) return error_;
    char header[kHeaderBytes];
    RETURN_IF_ERROR(ReadExactly(header, kHeaderBytes, deadline));
    const uint64_t seq = GetU64(header);
    const uint64_t size = GetU64(header + 8);
    if (seq != recv_seq_ || size > kMaxMessageBytes) {
      error_ = absl::UnavailableError(
          absl::StrCat("ring link from ", prev_name_, " broke the protocol: message ", seq, " of ",
                       size, " bytes where message ", recv_seq_, " was expected"));
      return error_;
    }
    ++recv_seq_;
    return size;
  }

  absl::Status ReadBody(char* dst, uint64_t size, absl::Time deadline) {
    return ReadExactly(dst, static_cast<size_t>(size), deadline);
  }

  // A receive buffer of at least `size` bytes that no RingMessage holds.
  std::shared_ptr<Buffer> TakeBuffer(uint64_t size) {
    std::shared_ptr<Buffer> buf;
    for (auto& b : pool_) {
      if (b.use_count() == 1) {
        buf = b;
        break;
      }
    }
    if (buf == nullptr) {
      buf = std::make_shared<Buffer>();
      if (pool_.size() < kPoolSize) pool_.push_back(buf);
    }
    if (buf->capacity < size) {
      buf->data.reset(new char[size]);
      buf->capacity = size;
    }
    return buf;
  }

  const int rank_;
  const int n_;
  Fd out_;
  Fd in_;
  const std::string next_name_;
  const std::string prev_name_;
  const absl::Duration close_timeout_;
  const RingAbort* const abort_;  // Not owned; may be null.
  absl::Status error_;
  uint64_t send_seq_ = 0;
  uint64_t recv_seq_ = 0;
  absl::Time recv_start_;  // When the current Recv/RecvInto began (for messages).
  std::deque<Item> queue_;
  std::unique_ptr<char[]> stage_;
  size_t stage_begin_ = 0, stage_end_ = 0;
  std::vector<std::shared_ptr<Buffer>> pool_;
};

}  // namespace

std::string HostOfAddress(const std::string& address) {
  if (!address.empty() && address[0] == '[') {
    const size_t close = address.find(']');
    return close == std::string::npos ? address.substr(1) : address.substr(1, close - 1);
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || address.find(':') != colon) return address;
  return address.substr(0, colon);
}

int64_t TcpRingSocketBuffer(const std::vector<std::string>& peers, int rank,
                            const TcpRingOptions& options, int hardware_threads) {
  if (options.socket_buffer_bytes >= 0) return options.socket_buffer_bytes;
  if (rank < 0 || rank >= static_cast<int>(peers.size()) || hardware_threads <= 0) return 0;
  const std::string host = HostOfAddress(peers[rank]);
  int here = 0;
  for (const std::string& p : peers) here += HostOfAddress(p) == host ? 1 : 0;
  return here > hardware_threads ? kOversubscribedSocketBuffer : 0;
}

absl::StatusOr<std::unique_ptr<RingTransport>> ConnectTcpRing(RingTransport* bootstrap,
                                                              const std::vector<std::string>& peers,
                                                              const TcpRingOptions& options) {
  const absl::Duration timeout = options.timeout;
  const int n = bootstrap->size();
  const int r = bootstrap->rank();
  if (static_cast<int>(peers.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring tcp: ", peers.size(), " peer addresses for a ring of ", n));
  }
  if (n < 2) {
    return absl::InvalidArgumentError("ring tcp: a ring of one rank has no links");
  }
  ASSIGN_OR_RETURN(auto listener, Listen());
  Fd& listen_fd = listener.first;

  // Port and secret of every rank.
  std::string mine(8 + kSecretBytes, '\0');
  PutU64(static_cast<uint64_t>(listener.second), mine.data());
  {
    std::random_device urandom;  // getrandom(2): the secret authenticates the hello.
    for (size_t i = 0; i < kSecretBytes; i += 4) PutU32(urandom(), mine.data() + 8 + i);
  }
  RingOptions ro;
  ro.timeout = timeout;
  ASSIGN_OR_RETURN(std::vector<std::string> all, RingAllgather(bootstrap, mine, ro));
  // Connecting and accepting get the whole timeout once every rank is listening.
  const absl::Time deadline = absl::Now() + timeout;
  for (int i = 0; i < n; ++i) {
    if (all[i].size() != mine.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ring tcp: rank ", i, " sent a malformed address (", all[i].size(), " bytes)"));
    }
  }
  const int next = (r + 1) % n;
  const int prev = (r + n - 1) % n;
  const auto port_of = [&](int i) { return static_cast<int>(GetU64(all[i].data())); };
  const std::string next_host = HostOfAddress(peers[next]);
  // Ranks are named by their peer-service address, as everywhere else.
  const std::string next_name = absl::StrCat("rank ", next, " (", peers[next], ")");
  const std::string prev_name = absl::StrCat("rank ", prev, " (", peers[prev], ")");

  // Connect and say hello (the listener's backlog takes it before the peer accepts).
  ASSIGN_OR_RETURN(
      Fd out, Connect(next_host, port_of(next), deadline,
                      absl::StrCat(next_name, " at data port ", port_of(next)), options.abort));
  const int64_t buffer_bytes =
      TcpRingSocketBuffer(peers, r, options, static_cast<int>(std::thread::hardware_concurrency()));
  TuneSocket(out.get(), buffer_bytes);
  char hello[kHelloBytes];
  std::memcpy(hello, kHelloMagic, sizeof(kHelloMagic));
  PutU32(static_cast<uint32_t>(r), hello + 8);
  PutU32(static_cast<uint32_t>(n), hello + 12);
  std::memcpy(hello + 16, all[next].data() + 8, kSecretBytes);
  RETURN_IF_ERROR(WriteAll(out.get(), hello, sizeof(hello), deadline,
                           absl::StrCat("hello to ", next_name), options.abort));

  // Accept until the previous rank shows up with this rank's secret.
  ASSIGN_OR_RETURN(Fd in, AcceptPrevious(listen_fd.get(), prev, n, mine.substr(8), deadline,
                                         timeout, prev_name, options.abort));
  TuneSocket(in.get(), buffer_bytes);
  return std::unique_ptr<RingTransport>(new TcpRingTransport(
      r, n, std::move(out), std::move(in), next_name, prev_name, timeout, options.abort));
}

}  // namespace gradmesh
