// Small numeric helpers on raw float buffers (no tensor library).
//
// Thread safety: pure functions.
#ifndef GRADMESH_COMMON_NUMERIC_H_
#define GRADMESH_COMMON_NUMERIC_H_

#include <cstdint>

namespace gradmesh {

// Index of the first NaN or +-Inf in x[0, n), or -1 if all are finite. Runs at memory speed:
// a branch-free, vectorised scan (compiled with -O3), then a second pass only when something
// was found.
int64_t FirstNonFinite(const float* x, int64_t n);

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_NUMERIC_H_
