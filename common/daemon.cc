#include "common/daemon.h"

#include <dlfcn.h>
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace gradmesh {

void BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

std::string WaitForTerminationSignal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  return sig == SIGTERM ? "SIGTERM" : "SIGINT";
}

void TuneAllocatorForLargeMessages() {
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

const char* MallocName() {
  // TCMalloc exports its entry points under tc_* names too; libc and the sanitizers do not.
  return dlsym(RTLD_DEFAULT, "tc_malloc") != nullptr ? "tcmalloc" : "system";
}

void DisableMutexDeadlockDetection() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

std::string HostName() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return absl::InternalError(absl::StrCat("cannot write port file ", tmp));
  std::fprintf(f, "%d\n", port);
  std::fclose(f);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace gradmesh
