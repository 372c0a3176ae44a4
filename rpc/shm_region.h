// Shared memory between a worker and a shard on the same machine (ParameterService.OpenShm,
// BytePS's inter-process path): one region per (worker, shard) channel carries that worker's
// pushes and pulls to the shard and the answers back without loopback TCP, HTTP/2 or gRPC's
// threads. The framing is the Stream's: a request area holds one encoded StreamRequest, a
// response area one encoded StreamResponse (rpc/tensor_wire.h), so the shard decodes, checks
// and applies exactly what it would from the Stream.
//
// The shard makes the region: an anonymous memfd, sized and sealed against shrinking and
// growing (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), so nothing the worker does can take its
// pages from under the shard (a shrunk file would raise SIGBUS in the shard). The worker opens
// it through /proc/<shard pid>/fd/<fd>, which the kernel allows only to a process that may
// inspect the shard (same user, same PID namespace), and checks a 16-byte random nonce that the
// shard wrote into the header and sent over the (authenticated, possibly TLS) gRPC call. The
// shard closes its descriptor when the first request arrives (the worker has mapped the region
// by then) or after kShmAttachWindow: from then on no other process can open the region.
//
// Layout: a header page, then the request area, then the response area, each `area_bytes`.
// One operation at a time: the worker writes the request bytes, then publishes them by
// incrementing request_seq (release) and waking the shard's futex on it; the shard answers
// into the response area and sets response_seq to the request's sequence number. Either side
// sets `closed` to end the channel. The shard treats everything in the region as untrusted:
// it reads each length once, bounds it by the area and copies the request into its own memory
// before decoding it with the Stream's decoder, so nothing the worker writes meanwhile reaches
// the decoder, the checks or the optimizer.
//
// Thread safety: a ShmRegion is a mapping; the header's words are atomics shared by both
// processes, the areas belong to whichever side the protocol above says.
#ifndef GRADMESH_RPC_SHM_REGION_H_
#define GRADMESH_RPC_SHM_REGION_H_

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace gradmesh {

inline constexpr uint64_t kShmMagic = 0x31306d68736d6772;  // "rgmshm01", little-endian.
inline constexpr size_t kShmHeaderBytes = 4096;
inline constexpr size_t kShmNonceBytes = 16;
// Bounds on an area (each of the two): at least a page, at most 1 GiB.
inline constexpr size_t kShmMinAreaBytes = 4096;
inline constexpr size_t kShmMaxAreaBytes = size_t{1} << 30;
// How long the shard keeps its descriptor open for the worker to open the region.
inline constexpr absl::Duration kShmAttachWindow = absl::Seconds(10);

struct ShmHeader {
  uint64_t magic;
  uint64_t area_bytes;
  unsigned char nonce[kShmNonceBytes];
  // Worker -> shard: the number of the request now in the request area (futex word).
  alignas(64) std::atomic<uint32_t> request_seq;
  // Either side: nonzero once the channel is closed; no operation is taken or answered after.
  std::atomic<uint32_t> closed;
  std::atomic<uint64_t> request_bytes;
  // Shard -> worker: the number of the request whose answer is in the response area, and
  // its length; kShmAnswerTooLarge when the answer did not fit the area (the operation ran:
  // the worker sends it again over the Stream, where a push's request id makes it count once).
  alignas(64) std::atomic<uint32_t> response_seq;
  std::atomic<uint64_t> response_bytes;
};
inline constexpr uint64_t kShmAnswerTooLarge = UINT64_MAX;
static_assert(sizeof(ShmHeader) <= kShmHeaderBytes, "header must fit its page");
static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "the header's atomics must be address-free to be shared between processes");

class ShmRegion {
 public:
  // The shard's side: a new sealed region with two areas of `area_bytes` (rounded up to a
  // page; InvalidArgument outside [kShmMinAreaBytes, kShmMaxAreaBytes]) and a fresh nonce.
  // Its descriptor stays open (fd()) until CloseFd, for the worker to open.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Create(size_t area_bytes);
  // The worker's side: opens /proc/<pid>/fd/<fd>, checks that it is a region of `area_bytes`
  // areas sealed against resizing whose header carries `nonce`, and maps it.
  // FailedPrecondition naming what did not hold (not the same user or PID namespace: EACCES or
  // EPERM; another file; another nonce); Unavailable when the descriptor is gone (the shard
  // exited or closed it) or this process is out of descriptors or memory.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Attach(pid_t pid, int fd,
                                                           absl::string_view nonce,
                                                           size_t area_bytes);
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  int fd() const { return fd_; }
  void CloseFd();
  size_t area_bytes() const { return area_bytes_; }
  std::string nonce() const;
  ShmHeader* header() const { return reinterpret_cast<ShmHeader*>(base_); }
  char* request_area() const { return base_ + kShmHeaderBytes; }
  char* response_area() const { return base_ + kShmHeaderBytes + area_bytes_; }

 private:
  ShmRegion(char* base, size_t map_bytes, size_t area_bytes, int fd)
      : base_(base), map_bytes_(map_bytes), area_bytes_(area_bytes), fd_(fd) {}

  char* const base_;
  const size_t map_bytes_;
  const size_t area_bytes_;
  int fd_;
};

// Blocks while *word == expected, for at most `timeout` (a futex on a shared mapping); may
// return early (a wake-up, a signal). The caller looks at the word again.
void ShmWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout);
// Wakes every thread, in any process, blocked in ShmWait on `word`.
void ShmWake(std::atomic<uint32_t>* word);

// Whether a gRPC peer string (grpc::ServerContext::peer(), e.g. "ipv4:10.1.2.3:5555") is a
// connection from this machine: a Unix domain socket, a loopback address, or an address of one
// of this machine's interfaces (a worker reaching a shard by the host's name).
bool IsLocalPeer(absl::string_view peer);

}  // namespace gradmesh

#endif  // GRADMESH_RPC_SHM_REGION_H_
