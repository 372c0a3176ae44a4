#include "worker/blas_core.h"

#include <dlfcn.h>
#include <limits.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "absl/strings/ascii.h"

namespace gradmesh {

std::string BetterBlasCore(absl::string_view detected, const CpuVectorSupport& cpu) {
  static constexpr absl::string_view kPreAvx2[] = {
      "prescott", "core2",      "penryn",    "dunnington", "nehalem",   "sandybridge", "atom",
      "katmai",   "coppermine", "northwood", "banias",     "barcelona", "bobcat"};
  const std::string name = absl::AsciiStrToLower(detected);
  bool old = false;
  for (absl::string_view c : kPreAvx2) old |= name == c;
  if (!old) return "";
  if (cpu.avx512) return "SkylakeX";
  if (cpu.avx2_fma) return "Haswell";
  return "";
}

CpuVectorSupport ThisCpu() {
  __builtin_cpu_init();
  CpuVectorSupport s;
  s.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  s.avx512 = s.avx2_fma && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl");
  return s;
}

std::string LoadedBlasCore() {
  using CoreName = char* (*)();
  auto fn = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (fn == nullptr) return "";
  const char* name = fn();
  return name == nullptr ? "" : name;
}

void ReexecWithBetterBlasCore(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  if (std::getenv("GRADMESH_BLAS_CORE") != nullptr) return;  // "keep": the user's choice.
  const std::string detected = LoadedBlasCore();
  const std::string better = BetterBlasCore(detected, ThisCpu());
  if (better.empty()) return;
  // Exec the binary's real path, not /proc/self/exe: the process name (comm, what ps, top
  // and pkill show) is taken from the path's last component.
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return;
  self[n] = '\0';
  setenv("OPENBLAS_CORETYPE", better.c_str(), 1);
  setenv("GRADMESH_BLAS_DETECTED", detected.c_str(), 1);
  execv(self, argv);
  // exec failed: go on with the kernels we have (the start log shows which).
  std::fprintf(stderr, "gradmesh_worker: could not re-exec with OPENBLAS_CORETYPE=%s\n",
               better.c_str());
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv("GRADMESH_BLAS_DETECTED");
}

BlasCoreReport ReportBlasCore() {
  BlasCoreReport r;
  r.core = LoadedBlasCore();
  const char* detected = std::getenv("GRADMESH_BLAS_DETECTED");
  if (detected != nullptr) r.detected = detected;
  return r;
}

}  // namespace gradmesh
