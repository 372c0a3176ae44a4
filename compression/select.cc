#include "compression/select.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>

#include "compression/rng.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace gradmesh {
namespace {

constexpr uint32_t kNonFiniteKey = 0x7f800000u;

// Sampled elements expected above the threshold for the exact top-k's fast path.
constexpr size_t kExactSampleFactor = 64;

inline uint32_t Key(const float* x, size_t i) {
  uint32_t u;
  std::memcpy(&u, x + i, sizeof(u));
  return u & 0x7fffffffu;
}

bool AllFinite(const float* x, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= static_cast<uint32_t>(Key(x, i) >= kNonFiniteKey);
  return bad == 0;
}

// The bucket holding the need-th largest (1-based, need <= total count) of a histogram whose
// higher buckets hold larger keys; *above = count in the buckets above it.
int FindBucket(const uint32_t* hist, int buckets, size_t need, size_t* above) {
  size_t acc = 0;
  for (int b = buckets - 1; b > 0; --b) {
    if (acc + hist[b] >= need) {
      *above = acc;
      return b;
    }
    acc += hist[b];
  }
  *above = acc;
  return 0;
}

// `cand` holds ascending indices whose keys agree above bit 20 (they all fell in one bucket of
// the first level); returns the `need` (1 <= need < cand.size()) best of them by (key
// descending, index ascending), ascending. Two more 10-bit histograms find the exact key T of
// the need-th best and how many elements equal to T it takes; one pass then keeps them in
// order.
std::vector<uint32_t> Refine(const float* x, const std::vector<uint32_t>& cand, size_t need) {
  std::vector<uint32_t> chosen;
  chosen.reserve(need);
  uint32_t hist[1024] = {};
  for (uint32_t i : cand) ++hist[(Key(x, i) >> 10) & 1023u];
  size_t above = 0;
  const uint32_t b2 = static_cast<uint32_t>(FindBucket(hist, 1024, need, &above));
  need -= above;
  std::fill(hist, hist + 1024, 0u);
  for (uint32_t i : cand) {
    const uint32_t key = Key(x, i);
    if (((key >> 10) & 1023u) == b2) ++hist[key & 1023u];
  }
  const uint32_t b3 = static_cast<uint32_t>(FindBucket(hist, 1024, need, &above));
  size_t ties = need - above;  // elements with key == threshold to keep, lowest index first
  const uint32_t threshold = (Key(x, cand[0]) & ~0xfffffu) | (b2 << 10) | b3;
  for (uint32_t i : cand) {
    const uint32_t key = Key(x, i);
    if (key > threshold || (key == threshold && ties > 0)) {
      ties -= key == threshold;
      chosen.push_back(i);
    }
  }
  return chosen;
}

// Whether any of x[0, 16) has a key >= lim (1 <= lim <= 0x7fffffff). Lets the selection
// passes skip the (usual) blocks without a hit at close to memory speed.
inline bool AnyKeyAtLeast16(const float* x, uint32_t lim) {
#if defined(__SSE2__)
  const __m128i mask = _mm_set1_epi32(0x7fffffff);
  const __m128i below = _mm_set1_epi32(static_cast<int32_t>(lim - 1));
  __m128i hit = _mm_setzero_si128();
  for (int q = 0; q < 16; q += 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + q));
    hit = _mm_or_si128(hit, _mm_cmpgt_epi32(_mm_and_si128(v, mask), below));
  }
  return _mm_movemask_epi8(hit) != 0;
#else
  uint32_t hit = 0;
  for (int q = 0; q < 16; ++q) hit |= static_cast<uint32_t>(Key(x, q) >= lim);
  return hit != 0;
#endif
}

// Appends to *idx/*val (ascending) every j with Key(x, j) >= lim (lim >= 1), and returns
// false as soon as more than `cap` have been found (the outputs are then incomplete).
bool CollectAtLeast(const float* x, size_t n, uint32_t lim, size_t cap, std::vector<uint32_t>* idx,
                    std::vector<float>* val) {
  idx->resize(cap + 16);
  val->resize(cap + 16);
  uint32_t* oi = idx->data();
  float* ov = val->data();
  size_t c = 0;
  size_t j = 0;
  for (; j + 16 <= n; j += 16) {
    if (!AnyKeyAtLeast16(x + j, lim)) continue;
    for (size_t q = j; q < j + 16; ++q) {  // branch-free: hits may be frequent here
      oi[c] = static_cast<uint32_t>(q);
      ov[c] = x[q];
      c += Key(x, q) >= lim;
    }
    if (c > cap) return false;
  }
  for (; j < n; ++j) {
    oi[c] = static_cast<uint32_t>(j);
    ov[c] = x[j];
    c += Key(x, j) >= lim;
  }
  if (c > cap) return false;
  idx->resize(c);
  val->resize(c);
  return true;
}

// m keys at positions drawn uniformly with replacement; returns the r-th largest
// (1 <= r <= m) and sets *finite to whether all sampled keys were finite.
uint32_t SampledKey(const float* x, size_t n, size_t m, size_t r, uint64_t seed, bool* finite) {
  std::vector<uint32_t> sample(m);
  Rng rng(seed);
  uint32_t bad = 0;
  for (size_t j = 0; j < m; ++j) {
    sample[j] = Key(x, rng.Uniform(n));
    bad |= static_cast<uint32_t>(sample[j] >= kNonFiniteKey);
  }
  *finite = bad == 0;
  if (m > 4096) {
    // Narrow down with an 11-bit histogram first: nth_element then sorts out one bucket.
    uint32_t hist[2048] = {};
    for (uint32_t key : sample) ++hist[key >> 20];
    size_t above = 0;
    const uint32_t bucket = static_cast<uint32_t>(FindBucket(hist, 2048, r, &above));
    size_t c = 0;
    for (uint32_t key : sample) {
      sample[c] = key;
      c += (key >> 20) == bucket;
    }
    sample.resize(c);
    r -= above;
  }
  std::nth_element(sample.begin(), sample.begin() + (r - 1), sample.end(),
                   std::greater<uint32_t>());
  return sample[r - 1];
}

void SelectAll(size_t n, std::vector<uint32_t>* indices) {
  indices->resize(n);
  std::iota(indices->begin(), indices->end(), 0u);
}

// Exact radix select for 0 < k < n (see TopKMagnitude).
bool RadixTopK(const float* x, size_t n, size_t k, std::vector<uint32_t>* indices) {
  // Pass 1: histogram of the top 11 magnitude bits; four copies break the dependency chains
  // of repeated increments of one bucket (most values share a few exponents).
  constexpr int kBuckets = 2048;
  std::vector<uint32_t> hists(4 * kBuckets, 0);
  uint32_t* h0 = hists.data();
  uint32_t* h1 = h0 + kBuckets;
  uint32_t* h2 = h1 + kBuckets;
  uint32_t* h3 = h2 + kBuckets;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    ++h0[Key(x, i) >> 20];
    ++h1[Key(x, i + 1) >> 20];
    ++h2[Key(x, i + 2) >> 20];
    ++h3[Key(x, i + 3) >> 20];
  }
  for (; i < n; ++i) ++h0[Key(x, i) >> 20];
  for (int b = 0; b < kBuckets; ++b) h0[b] += h1[b] + h2[b] + h3[b];
  bool finite = true;
  for (int b = kNonFiniteKey >> 20; b < kBuckets; ++b) finite &= h0[b] == 0;

  size_t above = 0;
  const uint32_t bucket = static_cast<uint32_t>(FindBucket(h0, kBuckets, k, &above));
  const size_t in_bucket = h0[bucket];
  const size_t need = k - above;

  // Pass 2: keep the higher buckets (written straight into *indices) and collect the
  // bucket's elements as candidates (unless all of them are needed). Branch-free: both
  // stores happen, the counters advance only when they apply (one slack slot each); blocks
  // of 16 without any element in or above the bucket are skipped.
  const bool take_bucket = need == in_bucket;
  indices->resize(k + 1);
  std::vector<uint32_t> cand(take_bucket ? 1 : in_bucket + 1);
  {
    uint32_t* sel = indices->data();
    uint32_t* cnd = cand.data();
    const uint32_t keep_from = take_bucket ? bucket : bucket + 1;
    size_t a = 0, c = 0;
    auto visit = [&](size_t j) {
      const uint32_t b = Key(x, j) >> 20;
      sel[a] = static_cast<uint32_t>(j);
      cnd[c] = static_cast<uint32_t>(j);
      a += b >= keep_from;
      c += !take_bucket && b == bucket;
    };
    size_t j = 0;
    if (bucket > 0) {
      for (; j + 16 <= n; j += 16) {
        if (!AnyKeyAtLeast16(x + j, bucket << 20)) continue;
        for (size_t q = j; q < j + 16; ++q) visit(q);
      }
    }
    for (; j < n; ++j) visit(j);
  }
  if (take_bucket) {
    indices->resize(k);
    return finite;
  }
  cand.resize(in_bucket);
  const std::vector<uint32_t> chosen = Refine(x, cand, need);

  // Merge the two ascending runs indices[0, above) and chosen[0, need) from the back, in
  // place.
  uint32_t* out = indices->data();
  ptrdiff_t ia = static_cast<ptrdiff_t>(above) - 1;
  ptrdiff_t ic = static_cast<ptrdiff_t>(need) - 1;
  for (ptrdiff_t o = static_cast<ptrdiff_t>(k) - 1; ic >= 0; --o) {
    if (ia >= 0 && out[ia] > chosen[ic]) {
      out[o] = out[ia--];
    } else {
      out[o] = chosen[ic--];
    }
  }
  indices->resize(k);
  return finite;
}

// indices[j] = subset[pos[j]]; pos is ascending, so this can run in place.
void MapPositions(const std::vector<uint32_t>& pos, std::vector<uint32_t>* subset) {
  for (size_t j = 0; j < pos.size(); ++j) (*subset)[j] = (*subset)[pos[j]];
  subset->resize(pos.size());
}

}  // namespace

bool TopKMagnitude(absl::Span<const float> xs, size_t k, std::vector<uint32_t>* indices) {
  const float* x = xs.data();
  const size_t n = xs.size();
  if (k >= n || k == 0) {
    if (k == 0) {
      indices->clear();
    } else {
      SelectAll(n, indices);
    }
    return AllFinite(x, n);
  }
  // Fast path: a threshold estimated from a sample, lowered by a safety margin (4 standard
  // deviations of the sample count), so that almost surely at least k elements pass it. Then
  // the passing elements are a superset of the top k (the k-th largest is >= the threshold),
  // and an exact selection among them (kept in index order, so ties still go to the lower
  // index) is the exact answer. One pass over x instead of two; when fewer than k pass, or
  // far too many (ties at the threshold), the full radix select runs instead.
  const size_t m = (kExactSampleFactor * n + k - 1) / k;
  if (m <= n / 4) {
    const size_t r = (m * k + n - 1) / n;
    const size_t r_low =
        std::min(m, r + static_cast<size_t>(4.0 * std::sqrt(static_cast<double>(r))) + 4);
    bool sample_finite = true;
    // The result does not depend on the sample, only the speed does: a fixed seed.
    const uint32_t lim = SampledKey(x, n, m, r_low, Rng::Mix(0x70b4c0de, n), &sample_finite);
    const size_t expected = (r_low * n + m - 1) / m;
    std::vector<uint32_t> idx;
    std::vector<float> val;
    if (sample_finite && lim > 0 && CollectAtLeast(x, n, lim, 2 * expected + 64, &idx, &val) &&
        idx.size() >= k) {
      // Every non-finite key is >= lim, so it would have been collected.
      std::vector<uint32_t> pos;
      if (RadixTopK(val.data(), val.size(), k, &pos)) {
        MapPositions(pos, &idx);
        indices->swap(idx);
        return true;
      }
    }
  }
  return RadixTopK(x, n, k, indices);
}

bool ApproxTopKMagnitude(absl::Span<const float> xs, size_t k, uint64_t seed,
                         std::vector<uint32_t>* indices) {
  const float* x = xs.data();
  const size_t n = xs.size();
  if (k == 0 || k >= n) return TopKMagnitude(xs, k, indices);
  // Sample size: about kApproxSampleFactor sampled elements above the threshold.
  const size_t m = (kApproxSampleFactor * n + k - 1) / k;
  if (m > n / 4) return TopKMagnitude(xs, k, indices);
  const size_t r = (m * k + n - 1) / n;  // 1 <= r <= m
  bool sample_finite = true;
  const uint32_t lim = std::max<uint32_t>(SampledKey(x, n, m, r, seed, &sample_finite), 1u);
  if (!sample_finite) return TopKMagnitude(xs, k, indices);  // reports the NaN/Inf
  std::vector<float> val;
  if (!CollectAtLeast(x, n, lim, 2 * k, indices, &val)) {
    // More than 2k pass (ties or an unlucky sample): then the top k all pass, so the exact
    // top k is also the exact top k of the passing elements.
    return TopKMagnitude(xs, k, indices);
  }
  // Every non-finite key is >= lim (which is finite), so it would have been collected.
  return AllFinite(val.data(), val.size());
}

void RandomKIndices(size_t n, size_t k, uint64_t seed, std::vector<uint32_t>* indices) {
  if (k >= n) {
    SelectAll(n, indices);
    return;
  }
  indices->clear();
  if (k == 0) return;
  Rng rng(seed);
  if (k * 512 < n) {
    // Sparse: draw, sort, drop duplicates, redraw the shortfall. The result is the set of
    // distinct values of an i.i.d. uniform stream, stopped when it has k: uniform over
    // k-subsets by symmetry.
    while (indices->size() < k) {
      const size_t missing = k - indices->size();
      for (size_t j = 0; j < missing; ++j) {
        indices->push_back(static_cast<uint32_t>(rng.Uniform(n)));
      }
      std::sort(indices->begin(), indices->end());
      indices->erase(std::unique(indices->begin(), indices->end()), indices->end());
    }
    return;
  }
  // Dense: rejection sampling into a bitmap. For k > n/2 the complement (n - k elements) is
  // drawn instead, so at most half the draws are rejected.
  const bool complement = k > n / 2;
  const size_t draw = complement ? n - k : k;
  std::vector<uint64_t> bits((n + 63) / 64, 0);
  for (size_t have = 0; have < draw;) {
    const uint64_t j = rng.Uniform(n);
    const uint64_t bit = uint64_t{1} << (j & 63);
    uint64_t& word = bits[j >> 6];
    have += (word & bit) == 0;
    word |= bit;
  }
  indices->resize(k);
  uint32_t* out = indices->data();
  size_t c = 0;
  for (size_t w = 0; w < bits.size(); ++w) {
    uint64_t word = complement ? ~bits[w] : bits[w];
    if (w == bits.size() - 1 && (n & 63) != 0) word &= (uint64_t{1} << (n & 63)) - 1;
    while (word != 0) {
      out[c++] = static_cast<uint32_t>(w * 64 + __builtin_ctzll(word));
      word &= word - 1;
    }
  }
}

}  // namespace gradmesh
