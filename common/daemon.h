// Process plumbing shared by the daemons' main() functions.
//
// Thread safety: BlockTerminationSignals() must be called before any thread is started;
// WaitForTerminationSignal() blocks the calling thread.
#ifndef GRADMESH_COMMON_DAEMON_H_
#define GRADMESH_COMMON_DAEMON_H_

#include <string>

#include "absl/status/status.h"

namespace gradmesh {

// Blocks SIGTERM and SIGINT in the calling thread and every thread it starts later, so they
// can be received synchronously by WaitForTerminationSignal().
void BlockTerminationSignals();

// Waits for SIGTERM or SIGINT; returns the signal's name.
std::string WaitForTerminationSignal();

// Keeps large message buffers (up to 256 MiB) in the malloc heap instead of mmap()ing and
// unmapping each one: tensor messages of several MiB are allocated per RPC, and fresh
// mappings cost page faults and zeroing on every message (measured: +25-40% push/pull
// goodput at 4 MiB). Freed memory is kept for reuse up to 1 GiB above the heap top.
// Call once at the start of main().
void TuneAllocatorForLargeMessages();

// The malloc this process runs on: "tcmalloc" where gperftools' TCMalloc is linked in
// (//bazel:tcmalloc: the daemons and benchmarks, unless built with
// --define=gradmesh_malloc=system, as the sanitizer builds are), else "system" (libc's, or a
// sanitizer's). The mallopt settings of TuneAllocatorForLargeMessages apply to
// libc's only; TCMalloc keeps freed large spans for reuse by itself.
const char* MallocName();

// Turns off absl::Mutex's deadlock detection for this process. Debian builds Abseil without
// NDEBUG, which leaves it on: every Lock of a mutex that others were held with walks and
// updates a global lock-order graph (GraphCycles, under one global spin lock), a per-op cost
// that showed in the profile of 4 KiB pushes. Daemons and benchmarks call this once at start;
// unit tests keep the detection on, so a lock-order inversion still fails them.
void DisableMutexDeadlockDetection();

// This machine's host name ("unknown" if it cannot be read); the default node name in logs.
std::string HostName();

// Writes `port` to `path` atomically (write to a temp file, then rename), so a launcher that
// started the daemon with --port=0 can read the bound port as soon as the file exists.
absl::Status WritePortFile(const std::string& path, int port);

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_DAEMON_H_
