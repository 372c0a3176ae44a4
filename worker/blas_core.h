// OpenBLAS kernel selection for the worker process.
//
// Debian's OpenBLAS (0.3.21, DYNAMIC_ARCH) picks its kernels from the CPU model when the
// library loads. CPUs it does not know by model fall back to "Prescott" (SSE3) kernels even
// when the CPU has AVX2 or AVX-512: on the virtualised Xeons these sessions run on, it does,
// and the workers' matrix products run at about half the speed the CPU allows (MLP allreduce
// 1.8-2x samples/s with SkylakeX kernels, the same accuracy). OPENBLAS_CORETYPE overrides the
// choice, but only if set before the library loads, i.e. before main().
//
// So the worker checks at the top of main() which kernels OpenBLAS chose; if they are older
// than the CPU's instruction set allows and nobody set OPENBLAS_CORETYPE, it sets it and
// re-executes itself (same pid, same arguments) once. GRADMESH_BLAS_CORE=keep turns this off.
//
// Thread safety: call ReexecWithBetterBlasCore first thing in main(), before any thread.
#ifndef GRADMESH_WORKER_BLAS_CORE_H_
#define GRADMESH_WORKER_BLAS_CORE_H_

#include <string>

#include "absl/strings/string_view.h"

namespace gradmesh {

struct CpuVectorSupport {
  bool avx2_fma = false;  // AVX2 and FMA: OpenBLAS "Haswell" kernels.
  bool avx512 = false;    // AVX-512 F, BW, DQ, VL: "SkylakeX" kernels.
};

// The OPENBLAS_CORETYPE worth forcing when OpenBLAS chose `detected` (its core name, any
// case) on a CPU with `cpu`: "SkylakeX" or "Haswell" when `detected` is a pre-AVX2 core
// (Prescott, Core2, Penryn, Dunnington, Nehalem, Sandybridge, Atom, ...) and the CPU can do
// better; "" when the choice is already as good or the name is unknown.
std::string BetterBlasCore(absl::string_view detected, const CpuVectorSupport& cpu);

// This CPU's support (__builtin_cpu_supports).
CpuVectorSupport ThisCpu();

// The core name the loaded OpenBLAS reports (openblas_get_corename, looked up with dlsym), or
// "" when the process has no OpenBLAS.
std::string LoadedBlasCore();

// If OPENBLAS_CORETYPE and GRADMESH_BLAS_CORE are unset and BetterBlasCore names a core:
// sets OPENBLAS_CORETYPE to it and GRADMESH_BLAS_DETECTED to the loaded core, then execv's
// this binary (the path /proc/self/exe points to, so the process keeps its name) with
// `argv`. Returns only if nothing was to be done or exec failed.
void ReexecWithBetterBlasCore(char** argv);

// For the start log: "core=<loaded> detected=<what OpenBLAS chose itself>" fields, or the
// loaded core alone when no re-exec happened.
struct BlasCoreReport {
  std::string core;      // The loaded OpenBLAS's kernels ("" without OpenBLAS).
  std::string detected;  // What OpenBLAS had chosen before the re-exec ("" if none).
};
BlasCoreReport ReportBlasCore();

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_BLAS_CORE_H_
