// Index selection for the sparsifying codecs: exact top-k by magnitude, approximate top-k
// (sampled threshold), and uniformly random k-subsets.
//
// Every function returns indices in ascending order, without duplicates, as uint32: inputs
// have at most kMaxSelectElements (2^32 - 1) elements. Magnitudes are ordered by the bit
// pattern of |x| (sign bit cleared), which for finite floats is the numeric order of |x|
// (+0 and -0 are equal); NaN and Inf sort above every finite value. The functions accept any
// bit patterns and report whether they saw a non-finite value, so that a codec needs no
// separate scan.
//
// Thread safety: pure functions (randomness comes only from the `seed` arguments).
#ifndef GRADMESH_COMPRESSION_SELECT_H_
#define GRADMESH_COMPRESSION_SELECT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace gradmesh {

inline constexpr size_t kMaxSelectElements = 0xffffffffu;

// The k elements of largest magnitude; among equal magnitudes the lower index wins (so the
// result is unique). k >= x.size() selects everything, k == 0 nothing. Replaces *indices.
// Returns false when x holds a NaN or Inf (the selection is still made, in bit order).
//
// Usually one pass over x: a threshold is estimated from a random sample of 64 n / k
// positions (fixed internal seed: the result never depends on it, only the speed) and lowered
// by four standard deviations of the sample count; the elements at or above it (~1.5k for
// Gaussian data) are collected in index order, and since they are almost surely at least k,
// they contain the top k, which an exact radix select among them finds. When fewer than k or
// far too many pass (ties), or the input is small (sample > n / 4), an exact radix select on
// the 31 magnitude bits runs on all of x: an 11-bit histogram pass, then a pass keeping the
// higher buckets and collecting the k-th's bucket as candidates, refined by two 10-bit
// histograms over the candidates. Extra memory: O(k + candidates); the candidates are ~n/500
// for Gaussian data but can be up to n when most values are equal (e.g. mostly zeros).
bool TopKMagnitude(absl::Span<const float> x, size_t k, std::vector<uint32_t>* indices);

// Approximate top-k: estimates the threshold magnitude t from a sample of
// kApproxSampleFactor / (k/n) positions drawn uniformly (with replacement, from `seed`),
// t = the sample's ceil(sample * k / n)-th largest magnitude, then selects every element with
// |x| >= t (and |x| > 0) in one pass. The count is close to k but not exact: the relative
// error has a standard deviation of about 1/sqrt(kApproxSampleFactor) = 6% (measured by the
// benchmark). Safeguards: if more than 2k elements pass the threshold (ties, or an unlucky
// sample), the exact top-k of them is kept; when the sample would be more than a quarter of
// the input, the exact TopKMagnitude is used instead. Zeros are never selected, so the result
// can be smaller than k when x has fewer than k non-zeros. Returns false on NaN/Inf.
inline constexpr size_t kApproxSampleFactor = 256;
bool ApproxTopKMagnitude(absl::Span<const float> x, size_t k, uint64_t seed,
                         std::vector<uint32_t>* indices);

// k distinct indices drawn uniformly from [0, n) (every k-subset equally likely), a function
// of (n, k, seed) only. k >= n selects everything. Replaces *indices.
void RandomKIndices(size_t n, size_t k, uint64_t seed, std::vector<uint32_t>* indices);

}  // namespace gradmesh

#endif  // GRADMESH_COMPRESSION_SELECT_H_
