#include "rpc/shm_region.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <linux/futex.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"

namespace gradmesh {
namespace {

constexpr size_t kPage = 4096;

size_t RoundUpToPage(size_t n) { return (n + kPage - 1) / kPage * kPage; }

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

absl::StatusOr<char*> Map(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return absl::InternalError(Errno("shared memory: mmap"));
  return static_cast<char*>(p);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Create(size_t area_bytes) {
  if (area_bytes < kShmMinAreaBytes || area_bytes > kShmMaxAreaBytes) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory: an area of ", area_bytes,
                                                   " bytes is outside [", kShmMinAreaBytes, ", ",
                                                   kShmMaxAreaBytes, "]"));
  }
  area_bytes = RoundUpToPage(area_bytes);
  const size_t total = kShmHeaderBytes + 2 * area_bytes;
  const int fd =
      static_cast<int>(syscall(SYS_memfd_create, "gradmesh-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd < 0) return absl::UnavailableError(Errno("shared memory: memfd_create"));
  if (ftruncate(fd, static_cast<off_t>(total)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const std::string error = Errno("shared memory: sizing and sealing the memfd");
    close(fd);
    return absl::UnavailableError(error);
  }
  absl::StatusOr<char*> base = Map(fd, total);
  if (!base.ok()) {
    close(fd);
    return base.status();
  }
  std::unique_ptr<ShmRegion> region(new ShmRegion(*base, total, area_bytes, fd));
  ShmHeader* h = new (*base) ShmHeader{};
  h->magic = kShmMagic;
  h->area_bytes = area_bytes;
  std::random_device random;
  for (size_t i = 0; i < kShmNonceBytes; ++i) h->nonce[i] = static_cast<unsigned char>(random());
  return region;
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Attach(pid_t pid, int fd,
                                                             absl::string_view nonce,
                                                             size_t area_bytes) {
  const std::string path = absl::StrCat("/proc/", pid, "/fd/", fd);
  const int mine = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (mine < 0) {
    const int error = errno;
    const std::string what =
        absl::StrCat("shared memory: cannot open ", path, " (", std::strerror(error), ")");
    if (error == EACCES || error == EPERM) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": the shard is not a process of this user and PID namespace"));
    }
    return absl::UnavailableError(what);
  }
  const size_t total = kShmHeaderBytes + area_bytes;  // + the second area, checked below.
  struct stat st;
  const int seals = fcntl(mine, F_GET_SEALS);
  const bool sealed = seals >= 0 && (seals & F_SEAL_SHRINK) != 0 && (seals & F_SEAL_GROW) != 0;
  if (area_bytes == 0 || area_bytes > kShmMaxAreaBytes || fstat(mine, &st) != 0 || !sealed ||
      static_cast<size_t>(st.st_size) != total + area_bytes) {
    close(mine);
    return absl::FailedPreconditionError(absl::StrCat(
        "shared memory: ", path, " is not a sealed region of two ", area_bytes, "-byte areas"));
  }
  absl::StatusOr<char*> base = Map(mine, total + area_bytes);
  if (!base.ok()) {
    close(mine);
    return base.status();
  }
  std::unique_ptr<ShmRegion> region(new ShmRegion(*base, total + area_bytes, area_bytes, mine));
  region->CloseFd();  // The mapping keeps the memory.
  const ShmHeader* h = region->header();
  if (h->magic != kShmMagic || h->area_bytes != area_bytes || nonce.size() != kShmNonceBytes ||
      std::memcmp(h->nonce, nonce.data(), kShmNonceBytes) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("shared memory: ", path, " is not the region the shard announced"));
  }
  return region;
}

ShmRegion::~ShmRegion() {
  munmap(base_, map_bytes_);
  CloseFd();
}

void ShmRegion::CloseFd() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

std::string ShmRegion::nonce() const {
  return std::string(reinterpret_cast<const char*>(header()->nonce), kShmNonceBytes);
}

void ShmWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  const struct timespec ts = absl::ToTimespec(timeout);
  // Not FUTEX_PRIVATE_FLAG: the word is in memory shared with another process.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void ShmWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

bool IsLocalPeer(absl::string_view peer) {
  if (absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:")) return true;
  int family;
  std::string host;
  if (absl::ConsumePrefix(&peer, "ipv4:")) {
    family = AF_INET;
    host = std::string(peer.substr(0, peer.rfind(':')));
  } else if (absl::ConsumePrefix(&peer, "ipv6:")) {
    family = AF_INET6;
    // "[addr]:port", brackets possibly percent-encoded; a zone ("%25eth0") is dropped.
    std::string p = absl::StrReplaceAll(peer, {{"%5B", "["}, {"%5D", "]"}});
    const size_t open = p.find('['), close = p.find(']');
    if (open == std::string::npos || close == std::string::npos || close < open) return false;
    host = p.substr(open + 1, close - open - 1);
    host = host.substr(0, host.find('%'));
  } else {
    return false;
  }
  unsigned char want[16];
  if (inet_pton(family, host.c_str(), want) != 1) return false;
  static const unsigned char kMappedPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (family == AF_INET6 && std::memcmp(want, kMappedPrefix, 12) == 0) {
    // An IPv4 client of a dual-stack listener ("ipv6:[::ffff:10.1.2.3]:port").
    family = AF_INET;
    std::memmove(want, want + 12, 4);
  }
  if (family == AF_INET && want[0] == 127) return true;
  static const unsigned char kLoopback6[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  if (family == AF_INET6 && std::memcmp(want, kLoopback6, 16) == 0) return true;
  struct ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return false;
  bool found = false;
  for (const struct ifaddrs* a = all; a != nullptr && !found; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != family) continue;
    const void* have =
        family == AF_INET
            ? static_cast<const void*>(
                  &reinterpret_cast<const struct sockaddr_in*>(a->ifa_addr)->sin_addr)
            : static_cast<const void*>(
                  &reinterpret_cast<const struct sockaddr_in6*>(a->ifa_addr)->sin6_addr);
    found = std::memcmp(have, want, family == AF_INET ? 4 : 16) == 0;
  }
  freeifaddrs(all);
  return found;
}

}  // namespace gradmesh
