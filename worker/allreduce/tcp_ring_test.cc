// Tests of the TCP ring transport (tcp_ring.h): real sockets on 127.0.0.1, ranks as threads,
// connected over an in-process bootstrap ring (local_ring.h).
#include "worker/allreduce/tcp_ring.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/fd.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "worker/allreduce/local_ring.h"
#include "worker/allreduce/ring.h"

namespace gradmesh {
namespace {

std::vector<std::string> Peers(int n) {
  std::vector<std::string> p;
  for (int i = 0; i < n; ++i) p.push_back(absl::StrCat("127.0.0.1:", 7000 + i));
  return p;
}

// A bootstrap transport that lets the test see each all-gathered message as it arrives.
class Spy final : public RingTransport {
 public:
  Spy(std::unique_ptr<RingTransport> inner, std::function<void(const std::string&)> on_recv)
      : inner_(std::move(inner)), on_recv_(std::move(on_recv)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Status Send(absl::Span<const char> d) override { return inner_->Send(d); }
  absl::StatusOr<RingMessage> Recv(absl::Time deadline) override {
    absl::StatusOr<RingMessage> m = inner_->Recv(deadline);
    if (m.ok() && on_recv_) {
      std::string s;
      for (auto p : m->pieces) s.append(p.data(), p.size());
      on_recv_(s);
    }
    return m;
  }
  std::string PeerName(int r) const override { return inner_->PeerName(r); }

 private:
  std::unique_ptr<RingTransport> inner_;
  std::function<void(const std::string&)> on_recv_;
};

// Connects n TCP ring transports at once (rank r's bootstrap wrapped by spies[r] if given).
std::vector<std::unique_ptr<RingTransport>> ConnectAll(
    int n, std::vector<std::function<void(const std::string&)>> spies = {},
    const RingAbort* abort = nullptr) {
  spies.resize(n);
  std::vector<std::unique_ptr<RingTransport>> boot = NewLocalRing(n);
  std::vector<std::unique_ptr<RingTransport>> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      Spy spy(std::move(boot[r]), spies[r]);
      absl::StatusOr<std::unique_ptr<RingTransport>> t =
          ConnectTcpRing(&spy, Peers(n), TcpRingOptions{absl::Seconds(20), -1, abort});
      EXPECT_OK(t.status()) << "rank " << r;
      if (t.ok()) out[r] = *std::move(t);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// Runs fn(rank, transport) on every rank at once.
void OnEveryRank(std::vector<std::unique_ptr<RingTransport>>& ts,
                 const std::function<void(int, RingTransport*)>& fn) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ts.size(); ++r) {
    threads.emplace_back([&, r] { fn(static_cast<int>(r), ts[r].get()); });
  }
  for (auto& t : threads) t.join();
}

float Input(int rank, int64_t i) { return static_cast<float>((i % 97) * (rank + 1) - rank); }

TEST(TcpRingTest, AllreduceSumsExactlyForEveryLengthAndRingSize) {
  for (int n : {2, 3, 4}) {
    std::vector<std::unique_ptr<RingTransport>> ts = ConnectAll(n);
    for (auto& t : ts) ASSERT_NE(t, nullptr);
    EXPECT_EQ(ts[1]->rank(), 1);
    EXPECT_EQ(ts[1]->size(), n);
    // Segments of 64 KiB + 4: many messages, some read through the staging buffer, some
    // straight into place; lengths that do not divide by n.
    RingOptions ro;
    ro.segment_bytes = (64 << 10) + 4;
    ro.timeout = absl::Seconds(20);
    for (int64_t len :
         {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{1001}, int64_t{(3 << 20) / 4 + 7}}) {
      OnEveryRank(ts, [&](int r, RingTransport* t) {
        std::vector<float> v(len);
        for (int64_t i = 0; i < len; ++i) v[i] = Input(r, i);
        int64_t sent = 0;
        ASSERT_OK(RingAllreduce(t, absl::MakeSpan(v), ro, &sent)) << "n=" << n << " len=" << len;
        for (int64_t i = 0; i < len; ++i) {
          float want = 0;
          for (int q = 0; q < n; ++q) want += Input(q, i);
          ASSERT_EQ(v[i], want) << "n=" << n << " len=" << len << " rank " << r << " i " << i;
        }
        // Each rank sends every chunk but one twice around the ring... except its own.
        int64_t want_sent = 0;
        for (int step = 0; step < 2 * (n - 1); ++step) {
          const ChunkRange c = RingChunkRange(len, n, ((r - step) % n + n) % n);
          want_sent += (c.end - c.begin) * 4;
        }
        EXPECT_EQ(sent, want_sent) << "n=" << n << " len=" << len << " rank " << r;
      });
    }
  }
}

TEST(TcpRingTest, AllgatherCarriesEmptySmallAndLargeStrings) {
  std::vector<std::unique_ptr<RingTransport>> ts = ConnectAll(3);
  for (auto& t : ts) ASSERT_NE(t, nullptr);
  auto mine = [](int r) {
    if (r == 0) return std::string();
    if (r == 1) return std::string("x");
    std::string big(300000, '\0');
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7);
    return big;
  };
  RingOptions ro;
  ro.timeout = absl::Seconds(20);
  for (int round = 0; round < 3; ++round) {
    OnEveryRank(ts, [&](int r, RingTransport* t) {
      ASSERT_OK_AND_ASSIGN(std::vector<std::string> all, RingAllgather(t, mine(r), ro));
      ASSERT_EQ(all.size(), 3u);
      for (int q = 0; q < 3; ++q) EXPECT_EQ(all[q], mine(q)) << "rank " << r << " from " << q;
    });
  }
}

TEST(TcpRingTest, ManySmallMessagesArriveInOrder) {
  std::vector<std::unique_ptr<RingTransport>> ts = ConnectAll(2);
  for (auto& t : ts) ASSERT_NE(t, nullptr);
  constexpr int kMessages = 5000;
  OnEveryRank(ts, [&](int r, RingTransport* t) {
    std::thread sender([&] {
      for (int i = 0; i < kMessages; ++i) {
        const std::string m = absl::StrCat(r, ":", i, std::string(i % 37, 'p'));
        ASSERT_OK(t->Send(absl::Span<const char>(m.data(), m.size())));
      }
    });
    sender.join();  // Queued; written while receiving and flushing below.
    for (int i = 0; i < kMessages; ++i) {
      ASSERT_OK_AND_ASSIGN(RingMessage msg, t->Recv(absl::Now() + absl::Seconds(20)));
      std::string got;
      for (auto p : msg.pieces) got.append(p.data(), p.size());
      ASSERT_EQ(got, absl::StrCat(1 - r, ":", i, std::string(i % 37, 'p')));
    }
    ASSERT_OK(t->Flush(absl::Now() + absl::Seconds(20)));
  });
}

TEST(TcpRingTest, DeadPeerFailsItsNeighboursFastNamingIt) {
  std::vector<std::unique_ptr<RingTransport>> ts = ConnectAll(3);
  for (auto& t : ts) ASSERT_NE(t, nullptr);
  ts[1].reset();  // Rank 1's process is gone: both its connections close.
  const absl::Time start = absl::Now();
  // Rank 2 receives from rank 1.
  absl::StatusOr<RingMessage> m = ts[2]->Recv(start + absl::Seconds(30));
  EXPECT_STATUS_MSG(m.status(), absl::StatusCode::kUnavailable,
                    "ring link from rank 1 (127.0.0.1:");
  EXPECT_STATUS_MSG(m.status(), absl::StatusCode::kUnavailable, "ended");
  // Rank 0 sends to rank 1: a write fails once the peer has reset the connection.
  std::vector<char> block(1 << 20, 'x');
  absl::Status st;
  for (int i = 0; i < 200 && st.ok(); ++i) {
    st = ts[0]->Send(absl::MakeConstSpan(block));
    if (st.ok()) st = ts[0]->Flush(absl::Now() + absl::Seconds(30));
  }
  EXPECT_STATUS_MSG(st, absl::StatusCode::kUnavailable, "ring link to rank 1 (127.0.0.1:");
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // The failure sticks.
  EXPECT_STATUS(ts[0]->Send(absl::MakeConstSpan(block)), absl::StatusCode::kUnavailable);
}

TEST(TcpRingTest, RecvIntoAWrongSizeReportsTheSizeAndFailsTheTransport) {
  std::vector<std::unique_ptr<RingTransport>> ts = ConnectAll(2);
  for (auto& t : ts) ASSERT_NE(t, nullptr);
  EXPECT_EQ(ts[0]->kind(), "tcp");
  const std::string eight = "12345678";
  ASSERT_OK(ts[1]->Send(absl::Span<const char>(eight.data(), eight.size())));
  ASSERT_OK(ts[1]->Flush(absl::Now() + absl::Seconds(10)));
  char dst[12];
  ASSERT_OK_AND_ASSIGN(size_t got,
                       ts[0]->RecvInto(absl::MakeSpan(dst), absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(got, 8u);
  // The stream is out of step: every later call fails.
  EXPECT_STATUS_MSG(ts[0]->Recv(absl::Now() + absl::Seconds(1)).status(),
                    absl::StatusCode::kUnavailable, "sent 8 bytes where 12 were expected");
  // And a message of the right size lands in place.
  std::vector<std::unique_ptr<RingTransport>> fresh = ConnectAll(2);
  ASSERT_OK(fresh[1]->Send(absl::Span<const char>(eight.data(), eight.size())));
  char exact[8];
  ASSERT_OK_AND_ASSIGN(got,
                       fresh[0]->RecvInto(absl::MakeSpan(exact), absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(got, 8u);
  EXPECT_EQ(std::string(exact, 8), eight);
}

TEST(TcpRingTest, AFlushThatTimesOutFailsTheTransportAndClosingDropsInPlaceMessages) {
  std::vector<std::unique_ptr<RingTransport>> ts = ConnectAll(2);
  for (auto& t : ts) ASSERT_NE(t, nullptr);
  // 64 MiB in place: far more than the socket buffers hold while rank 1 does not read.
  auto block = std::make_unique<std::vector<char>>(64 << 20, 'b');
  ASSERT_OK(ts[0]->SendNoCopy(absl::MakeConstSpan(*block)));
  EXPECT_STATUS_MSG(ts[0]->Flush(absl::Now() + absl::Milliseconds(200)),
                    absl::StatusCode::kDeadlineExceeded,
                    "rank 1 (127.0.0.1:7001) did not take the last ring messages in time");
  EXPECT_STATUS(ts[0]->Send(absl::MakeConstSpan(*block).subspan(0, 4)),
                absl::StatusCode::kDeadlineExceeded);
  // Closing neither waits the 20 s close timeout nor reads the in-place block again.
  const absl::Time start = absl::Now();
  ts[0].reset();
  block.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  // Rank 1 sees part of the message, then the end of the connection.
  EXPECT_STATUS_MSG(ts[1]->Recv(absl::Now() + absl::Seconds(10)).status(),
                    absl::StatusCode::kUnavailable, "ring link from rank 0 (127.0.0.1:7000) ended");
}

TEST(TcpRingTest, ClosingDeliversQueuedCopies) {
  std::vector<std::unique_ptr<RingTransport>> ts = ConnectAll(2);
  for (auto& t : ts) ASSERT_NE(t, nullptr);
  std::string big(16 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 13 + 1);
  ASSERT_OK(ts[0]->Send(absl::Span<const char>(big.data(), big.size())));
  std::thread closer([&] { ts[0].reset(); });  // Writes the rest while rank 1 reads.
  ASSERT_OK_AND_ASSIGN(RingMessage msg, ts[1]->Recv(absl::Now() + absl::Seconds(20)));
  std::string got;
  for (auto p : msg.pieces) got.append(p.data(), p.size());
  EXPECT_TRUE(got == big) << "got " << got.size() << " bytes";
  closer.join();
  EXPECT_STATUS(ts[1]->Recv(absl::Now() + absl::Seconds(10)).status(),
                absl::StatusCode::kUnavailable);
}

TEST(TcpRingTest, SilentPeerIsDeadlineExceededNamingIt) {
  std::vector<std::unique_ptr<RingTransport>> ts = ConnectAll(2);
  for (auto& t : ts) ASSERT_NE(t, nullptr);
  const absl::Time start = absl::Now();
  EXPECT_STATUS_MSG(ts[0]->Recv(start + absl::Milliseconds(300)).status(),
                    absl::StatusCode::kDeadlineExceeded, "nothing from rank 1 (127.0.0.1:");
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(290));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST(TcpRingTest, BuffersOfDifferentLengthsAreInternalNamingThePeer) {
  std::vector<std::unique_ptr<RingTransport>> ts = ConnectAll(2);
  for (auto& t : ts) ASSERT_NE(t, nullptr);
  RingOptions ro;
  ro.timeout = absl::Seconds(2);
  std::vector<absl::Status> st(2);
  OnEveryRank(ts, [&](int r, RingTransport* t) {
    std::vector<float> v(r == 0 ? 10 : 14, 1.0f);
    st[r] = RingAllreduce(t, absl::MakeSpan(v), ro);
  });
  // Rank 0 receives rank 1's 7-float chunk where it expects 5 floats (and vice versa).
  EXPECT_STATUS_MSG(st[0], absl::StatusCode::kInternal, "rank 1 (127.0.0.1:");
  EXPECT_STATUS_MSG(st[0], absl::StatusCode::kInternal, "sent 28 bytes where 20 were expected");
  EXPECT_STATUS_MSG(st[1], absl::StatusCode::kInternal, "sent 20 bytes where 28 were expected");
}

// Strangers connect to rank 1's listener before rank 0 does (they learn the port, and rank 1's
// secret, from rank 0's bootstrap message): without the secret, with garbage, with the secret
// but the wrong rank or ring size. All are dropped and the real ring works.
// Connects to 127.0.0.1:port (the port as a ring rank announces it: u64 little-endian); the
// socket, or -1 (a failure recorded) when the connection is refused.
int ConnectTo(const std::string& announced) {
  uint64_t port = 0;
  for (int i = 0; i < 8; ++i)
    port |= static_cast<uint64_t>(static_cast<unsigned char>(announced[i])) << (8 * i);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const int connected = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  EXPECT_EQ(connected, 0);
  if (connected != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

TEST(TcpRingTest, StrangersWithoutTheRingsSecretAreRefused) {
  std::vector<int> strangers;
  auto spy = [&](const std::string& msg) {
    ASSERT_EQ(msg.size(), 24u);  // port (u64) + 16 secret bytes.
    // kind 0: no secret; 1: garbage; 2: rank 1's secret but claiming to be rank 1;
    // 3: the secret and rank 0, but a ring of 3.
    for (int kind = 0; kind < 4; ++kind) {
      const int fd = ConnectTo(msg);
      ASSERT_GE(fd, 0);
      char hello[32] = {'G', 'M', 'R', 'I', 'N', 'G', '0', '1', 0, 0, 0, 0, 2, 0, 0, 0};
      if (kind == 1) std::memset(hello, 'z', sizeof(hello));
      if (kind >= 2) std::memcpy(hello + 16, msg.data() + 8, 16);
      if (kind == 2) hello[8] = 1;
      if (kind == 3) hello[12] = 3;
      ASSERT_EQ(write(fd, hello, sizeof(hello)), 32);
      strangers.push_back(fd);
    }
  };
  std::vector<std::unique_ptr<RingTransport>> ts = ConnectAll(2, {spy, nullptr});
  ASSERT_EQ(strangers.size(), 4u);
  for (auto& t : ts) ASSERT_NE(t, nullptr);
  RingOptions ro;
  ro.timeout = absl::Seconds(20);
  OnEveryRank(ts, [&](int r, RingTransport* t) {
    std::vector<float> v = {1.0f + r, 10.0f * (r + 1), -3.0f};
    ASSERT_OK(RingAllreduce(t, absl::MakeSpan(v), ro));
    EXPECT_EQ(v, (std::vector<float>{3, 30, -6}));
  });
  for (int fd : strangers) close(fd);
}

TEST(TcpRingTest, SilentConnectionsDoNotDelayTheRing) {
  // 100 strangers connect to rank 0's data port before rank 1 can, and say nothing or half a
  // hello: read one at a time (1 s each) they held the ring for 100 s, past its 20 s timeout.
  std::vector<int> strangers;
  auto spy = [&](const std::string& msg) {
    for (int i = 0; i < 100; ++i) {
      const int fd = ConnectTo(msg);
      if (i % 2 == 1) {
        EXPECT_EQ(write(fd, "GMRING01", 8), 8);
      }
      strangers.push_back(fd);
    }
  };
  const absl::Time start = absl::Now();
  std::vector<std::unique_ptr<RingTransport>> ts = ConnectAll(2, {spy, nullptr});
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_EQ(strangers.size(), 100u);
  for (auto& t : ts) ASSERT_NE(t, nullptr);
  RingOptions ro;
  ro.timeout = absl::Seconds(20);
  OnEveryRank(ts, [&](int r, RingTransport* t) {
    std::vector<float> v = {1.0f + r, -2.0f};
    ASSERT_OK(RingAllreduce(t, absl::MakeSpan(v), ro));
    EXPECT_EQ(v, (std::vector<float>{3, -4}));
  });
  for (int fd : strangers) close(fd);
}

// Sets `*abort` after `delay` on a thread of its own (joined by the destructor).
class AbortAfter {
 public:
  AbortAfter(RingAbort* abort, absl::Duration delay)
      : thread_([abort, delay] {
          absl::SleepFor(delay);
          abort->store(true);
        }) {}
  ~AbortAfter() { thread_.join(); }

 private:
  std::thread thread_;
};

TEST(TcpRingTest, AnAbortEndsTheSetUpAtOnce) {
  // Rank 1 takes part in the rendezvous (its port and secret, over the bootstrap ring), then
  // never connects: rank 0 waits in accept for it until the 20 s timeout, unless aborted.
  std::vector<std::unique_ptr<RingTransport>> boot = NewLocalRing(2);
  Fd listener(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(listener.get(), 4), 0);
  socklen_t len = sizeof(a);
  ASSERT_EQ(getsockname(listener.get(), reinterpret_cast<sockaddr*>(&a), &len), 0);
  std::string mine(24, '\0');
  const uint16_t port = ntohs(a.sin_port);
  mine[0] = static_cast<char>(port & 0xff);
  mine[1] = static_cast<char>(port >> 8);
  std::thread rank1([&] {
    RingOptions ro;
    ro.timeout = absl::Seconds(20);
    EXPECT_OK(RingAllgather(boot[1].get(), mine, ro).status());
  });
  RingAbort abort{false};
  const absl::Time start = absl::Now();
  absl::Status st;
  {
    AbortAfter later(&abort, absl::Milliseconds(300));
    st = ConnectTcpRing(boot[0].get(), Peers(2), TcpRingOptions{absl::Seconds(20), -1, &abort})
             .status();
  }
  EXPECT_STATUS_MSG(st, absl::StatusCode::kAborted, "aborted");
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  rank1.join();
}

TEST(TcpRingTest, AnAbortEndsAWaitingReceiveAndFailsTheTransport) {
  RingAbort abort{false};
  std::vector<std::unique_ptr<RingTransport>> ts = ConnectAll(2, {}, &abort);
  for (auto& t : ts) ASSERT_NE(t, nullptr);
  const absl::Time start = absl::Now();
  absl::Status st;
  {
    AbortAfter later(&abort, absl::Milliseconds(300));
    st = ts[0]->Recv(start + absl::Seconds(20)).status();  // Rank 1 sends nothing.
  }
  EXPECT_STATUS_MSG(st, absl::StatusCode::kAborted, "aborted");
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_STATUS(ts[0]->Send(absl::MakeConstSpan("x", 1)), absl::StatusCode::kAborted);
}

TEST(TcpRingTest, BadArgumentsAreInvalidArgument) {
  std::vector<std::unique_ptr<RingTransport>> boot = NewLocalRing(2);
  EXPECT_STATUS_MSG(
      ConnectTcpRing(boot[0].get(), Peers(3), TcpRingOptions{absl::Seconds(1)}).status(),
      absl::StatusCode::kInvalidArgument, "3 peer addresses for a ring of 2");
  std::vector<std::unique_ptr<RingTransport>> one = NewLocalRing(1);
  EXPECT_STATUS_MSG(
      ConnectTcpRing(one[0].get(), Peers(1), TcpRingOptions{absl::Seconds(1)}).status(),
      absl::StatusCode::kInvalidArgument, "a ring of one rank");
}

TEST(TcpRingTest, SocketBuffersAreFixedOnlyWhenTheHostsRanksOversubscribeItsCores) {
  const std::vector<std::string> four_here = Peers(4);
  const std::vector<std::string> spread = {"a:1", "a:2", "b:1", "b:2"};
  TcpRingOptions o;  // -1: decide.
  EXPECT_EQ(TcpRingSocketBuffer(four_here, 0, o, 2), kOversubscribedSocketBuffer);
  EXPECT_EQ(TcpRingSocketBuffer(four_here, 3, o, 4), 0);  // 4 ranks, 4 threads: auto-tune.
  EXPECT_EQ(TcpRingSocketBuffer(spread, 2, o, 2), 0);     // 2 on host b.
  EXPECT_EQ(TcpRingSocketBuffer(spread, 2, o, 1), kOversubscribedSocketBuffer);
  EXPECT_EQ(TcpRingSocketBuffer(four_here, 0, o, 0), 0);  // Unknown core count.
  o.socket_buffer_bytes = 0;
  EXPECT_EQ(TcpRingSocketBuffer(four_here, 0, o, 2), 0);
  o.socket_buffer_bytes = 123456;
  EXPECT_EQ(TcpRingSocketBuffer(spread, 2, o, 64), 123456);
}

TEST(TcpRingTest, HostOfAddress) {
  EXPECT_EQ(HostOfAddress("127.0.0.1:7101"), "127.0.0.1");
  EXPECT_EQ(HostOfAddress("worker-3.example:80"), "worker-3.example");
  EXPECT_EQ(HostOfAddress("[::1]:7101"), "::1");
  EXPECT_EQ(HostOfAddress("::1"), "::1");
  EXPECT_EQ(HostOfAddress("host"), "host");
  EXPECT_EQ(HostOfAddress(""), "");
}

}  // namespace
}  // namespace gradmesh
