// Small numeric helpers on raw float buffers (no tensor library).
//
// Thread safety: pure functions.
#ifndef GRADMESH_COMMON_NUMERIC_H_
#define GRADMESH_COMMON_NUMERIC_H_

#include <cstdint>
#include <cstring>

namespace gradmesh {

// Index of the first NaN or +-Inf in x[0, n), or -1 if all are finite. Branch-free scan that
// the compiler vectorises; then a second pass only when something was found.
inline int64_t FirstNonFinite(const float* x, int64_t n) {
  uint32_t any = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    any |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  if (!any) return -1;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    if ((bits & 0x7f800000u) == 0x7f800000u) return i;
  }
  return -1;
}

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_NUMERIC_H_
