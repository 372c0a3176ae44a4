#include "compression/float16.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define GM_HAVE_X86 1
#else
#define GM_HAVE_X86 0
#endif

namespace gradmesh {
namespace {

inline uint32_t FloatBits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// Branch-free so that the loops below vectorise. Requires a finite x.
//
// Normal results (|x| >= 2^-14): rebias the exponent and round the 13 dropped mantissa bits
// to nearest even by adding 0xfff plus the lowest kept bit, then shift (a carry out of the
// mantissa correctly increments the exponent). Subnormal results: adding 0.5f (whose ulp is
// 2^-24, fp16's subnormal step) lets the FPU do the RNE rounding; the result's low bits are
// the fp16 pattern (Giesen, "float->half variants", 2016). |x| >= 65520 would round to Inf:
// clamp to 0x7bff (65504).
inline uint16_t HalfFromBits(uint32_t f) {
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t a = f & 0x7fffffffu;
  const uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
  const uint32_t sub = FloatBits(BitsFloat(a) + 0.5f) - 0x3f000000u;
  uint32_t h = a < 0x38800000u ? sub : normal;
  h = a >= 0x477ff000u ? 0x7bffu : h;
  return static_cast<uint16_t>(h | sign);
}

// Exact. Subnormals (exponent 0) are m * 2^-24, computed through an int->float conversion so
// that no float subnormal is involved (correct even with denormals-are-zero set).
inline float HalfToFloatBits(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t normal = ((h & 0x7fffu) << 13) + 0x38000000u;
  const uint32_t sub = FloatBits(static_cast<float>(static_cast<int32_t>(h & 0x3ffu)) * 0x1p-24f);
  return BitsFloat(sign | ((h & 0x7c00u) == 0 ? sub : normal));
}

inline uint16_t BFloat16FromBits(uint32_t f) {
  const uint32_t a = f & 0x7fffffffu;
  const uint32_t rounded = (f + 0x7fffu + ((f >> 16) & 1u)) >> 16;
  const uint32_t clamped = ((f >> 16) & 0x8000u) | 0x7f7fu;
  return static_cast<uint16_t>(a >= 0x7f7f8000u ? clamped : rounded);
}

// The portable loops are compiled twice, for AVX2 and for baseline x86-64 (SSE2), and the
// loader picks one (GCC function multiversioning); same source, same results. Not under
// ThreadSanitizer: the loader runs the ifunc resolvers before TSan's runtime is up, and their
// instrumented entry crashes the process (tests/sanitizers.sh).
#if GM_HAVE_X86 && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define GM_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define GM_MULTIVERSION
#endif

int64_t FirstNonFiniteFloat(const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if ((FloatBits(in[i]) & 0x7f800000u) == 0x7f800000u) return i;
  }
  return -1;
}

int64_t FirstSpecial16(const uint16_t* in, int64_t n, uint16_t exp_mask) {
  for (int64_t i = 0; i < n; ++i) {
    if ((in[i] & exp_mask) == exp_mask) return i;
  }
  return -1;
}

GM_MULTIVERSION int64_t FloatToHalfPortable(const float* in, int64_t n, uint16_t* out) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t f = FloatBits(in[i]);
    bad |= static_cast<uint32_t>((f & 0x7f800000u) == 0x7f800000u);
    out[i] = HalfFromBits(f);
  }
  return bad ? FirstNonFiniteFloat(in, n) : -1;
}

GM_MULTIVERSION int64_t HalfToFloatPortable(const uint16_t* in, int64_t n, float* out) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t h = in[i];
    bad |= static_cast<uint32_t>((h & 0x7c00u) == 0x7c00u);
    out[i] = HalfToFloatBits(h);
  }
  return bad ? FirstSpecial16(in, n, 0x7c00u) : -1;
}

#if GM_HAVE_X86

// Reads libgcc's CPU model (filled in once at start-up) and CPUID leaf 1 for F16C (clang
// does not know "f16c" as a __builtin_cpu_supports feature); cheap enough to ask per call.
bool CpuHasF16c() {
  __builtin_cpu_init();
  unsigned eax, ebx, ecx, edx;
  return __builtin_cpu_supports("avx") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) &&
         (ecx & bit_F16C) != 0;
}

__attribute__((target("avx,f16c"))) int64_t FloatToHalfF16c(const float* in, int64_t n,
                                                            uint16_t* out) {
  const __m256 hi = _mm256_set1_ps(kFloat16Max);
  const __m256 lo = _mm256_set1_ps(-kFloat16Max);
  // x - x is +0 (all bits clear) for finite x and NaN for +-Inf/NaN.
  __m256 special = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(in + i);
    special = _mm256_or_ps(special, _mm256_sub_ps(x, x));
    const __m256 c = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(c, _MM_FROUND_TO_NEAREST_INT));
  }
  uint32_t bad = static_cast<uint32_t>(
      !_mm256_testz_si256(_mm256_castps_si256(special), _mm256_castps_si256(special)));
  for (; i < n; ++i) {
    const uint32_t f = FloatBits(in[i]);
    bad |= static_cast<uint32_t>((f & 0x7f800000u) == 0x7f800000u);
    out[i] = HalfFromBits(f);
  }
  return bad ? FirstNonFiniteFloat(in, n) : -1;
}

__attribute__((target("avx,f16c"))) int64_t HalfToFloatF16c(const uint16_t* in, int64_t n,
                                                            float* out) {
  const __m128i mask = _mm_set1_epi16(0x7c00);
  __m128i special = _mm_setzero_si128();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    special = _mm_or_si128(special, _mm_cmpeq_epi16(_mm_and_si128(h, mask), mask));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  uint32_t bad = static_cast<uint32_t>(!_mm_testz_si128(special, special));
  for (; i < n; ++i) {
    const uint32_t h = in[i];
    bad |= static_cast<uint32_t>((h & 0x7c00u) == 0x7c00u);
    out[i] = HalfToFloatBits(h);
  }
  return bad ? FirstSpecial16(in, n, 0x7c00u) : -1;
}

#else

bool CpuHasF16c() { return false; }

#endif

bool UseF16c(Float16Backend backend) {
  return backend != Float16Backend::kPortable && CpuHasF16c();
}

}  // namespace

bool Float16BackendAvailable(Float16Backend backend) {
  return backend != Float16Backend::kF16c || CpuHasF16c();
}

int64_t FloatToHalf(const float* in, int64_t n, uint16_t* out, Float16Backend backend) {
#if GM_HAVE_X86
  if (UseF16c(backend)) return FloatToHalfF16c(in, n, out);
#else
  (void)backend;
#endif
  return FloatToHalfPortable(in, n, out);
}

int64_t HalfToFloat(const uint16_t* in, int64_t n, float* out, Float16Backend backend) {
#if GM_HAVE_X86
  if (UseF16c(backend)) return HalfToFloatF16c(in, n, out);
#else
  (void)backend;
#endif
  return HalfToFloatPortable(in, n, out);
}

namespace {

GM_MULTIVERSION int64_t FloatToBFloat16Loop(const float* in, int64_t n, uint16_t* out) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t f = FloatBits(in[i]);
    bad |= static_cast<uint32_t>((f & 0x7f800000u) == 0x7f800000u);
    out[i] = BFloat16FromBits(f);
  }
  return bad ? FirstNonFiniteFloat(in, n) : -1;
}

GM_MULTIVERSION int64_t BFloat16ToFloatLoop(const uint16_t* in, int64_t n, float* out) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t h = in[i];
    bad |= static_cast<uint32_t>((h & 0x7f80u) == 0x7f80u);
    out[i] = BitsFloat(h << 16);
  }
  return bad ? FirstSpecial16(in, n, 0x7f80u) : -1;
}

}  // namespace

int64_t FloatToBFloat16(const float* in, int64_t n, uint16_t* out) {
  return FloatToBFloat16Loop(in, n, out);
}

int64_t BFloat16ToFloat(const uint16_t* in, int64_t n, float* out) {
  return BFloat16ToFloatLoop(in, n, out);
}

uint16_t FloatToHalfScalar(float x) { return HalfFromBits(FloatBits(x)); }
float HalfToFloatScalar(uint16_t h) { return HalfToFloatBits(h); }
uint16_t FloatToBFloat16Scalar(float x) { return BFloat16FromBits(FloatBits(x)); }
float BFloat16ToFloatScalar(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

}  // namespace gradmesh
