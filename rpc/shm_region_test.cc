// ShmRegion: the shared-memory region of an OpenShm channel (the shard makes it, the worker
// attaches to it through /proc), its futex waits and the local-peer check.
#include "rpc/shm_region.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

// A region can be opened only with the nonce it carries and its exact size; the shard's
// descriptor cannot resize it (sealed), and once closed it cannot be opened at all.
TEST(ShmRegionTest, AttachChecksNonceSizeAndSeals) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> r, ShmRegion::Create(5000));
  EXPECT_EQ(r->area_bytes(), 8192u);  // Rounded up to pages.
  const pid_t pid = getpid();
  EXPECT_NE(ftruncate(r->fd(), 4096), 0);     // F_SEAL_SHRINK.
  EXPECT_NE(ftruncate(r->fd(), 1 << 26), 0);  // F_SEAL_GROW.
  std::string wrong = r->nonce();
  wrong[0] ^= 1;
  EXPECT_EQ((ShmRegion::Attach(pid, r->fd(), wrong, 8192).status()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((ShmRegion::Attach(pid, r->fd(), r->nonce(), 4096).status()).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> w,
                       ShmRegion::Attach(pid, r->fd(), r->nonce(), 8192));
  w->request_area()[100] = 'x';
  EXPECT_EQ(r->request_area()[100], 'x');  // The same memory.
  const int fd = r->fd();
  r->CloseFd();
  // Gone: the region can no longer be opened (UNAVAILABLE, as when the shard exited).
  EXPECT_EQ((ShmRegion::Attach(pid, fd, r->nonce(), 8192).status()).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ((ShmRegion::Create(100).status()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((ShmRegion::Create(kShmMaxAreaBytes + 1).status()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ShmRegionTest, LocalPeers) {
  EXPECT_TRUE(IsLocalPeer("ipv4:127.0.0.1:5000"));
  EXPECT_TRUE(IsLocalPeer("ipv6:[::1]:5000"));
  EXPECT_TRUE(IsLocalPeer("unix:/tmp/sock"));
  EXPECT_TRUE(IsLocalPeer("ipv6:%5B::ffff:127.0.0.1%5D:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv6:[::ffff:10.255.1.7]:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv4:not-an-address:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv4:10.0.0.7:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv6:[fe80::1]:5000"));
  EXPECT_FALSE(IsLocalPeer(""));
  // Every IPv4 address of this machine's interfaces is local (a worker reaching its shard by
  // the host's name connects from one of them).
  struct ifaddrs* all = nullptr;
  ASSERT_EQ(getifaddrs(&all), 0);
  for (const struct ifaddrs* a = all; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN];
    ASSERT_NE(inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, text,
                        sizeof(text)),
              nullptr);
    EXPECT_TRUE(IsLocalPeer(absl::StrCat("ipv4:", text, ":7001"))) << text;
  }
  freeifaddrs(all);
}

// A wake-up ends a wait at once; without one the wait lasts its timeout.
TEST(ShmRegionTest, WaitEndsOnWakeOrTimeout) {
  std::atomic<uint32_t> word{0};
  absl::Time start = absl::Now();
  ShmWait(&word, 0, absl::Milliseconds(50));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(40));
  std::thread waker([&] {
    absl::SleepFor(absl::Milliseconds(20));
    word.store(1);
    ShmWake(&word);
  });
  start = absl::Now();
  while (word.load() == 0) ShmWait(&word, 0, absl::Seconds(10));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  waker.join();
}

}  // namespace
}  // namespace gradmesh
