#include "common/numeric.h"

#include <cstring>

namespace gradmesh {

int64_t FirstNonFinite(const float* x, int64_t n) {
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
