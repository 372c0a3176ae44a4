// Conversions between float32 and the 16-bit formats IEEE binary16 ("fp16") and bfloat16.
//
// Narrowing rounds to nearest, ties to even (RNE), like a hardware conversion, except that
// values beyond the format's largest finite value are clamped to it (keeping the sign)
// instead of becoming Inf:
//   fp16: |x| >= 65520 (which RNE would turn into Inf) becomes +-65504 (kFloat16Max); values
//         below 2^-14 become fp16 subnormals (RNE on the 2^-24 grid), below 2^-25 zero.
//   bf16: |x| >= 0x7f7f8000 (~3.3961e38) becomes +-0x7f7f (kBFloat16Max, ~3.3895e38).
// Inputs must be finite: the narrowing functions report the first NaN/Inf and their output is
// then unspecified. Widening is exact; the decoders report the first Inf/NaN bit pattern
// (which no encoder here produces). Signed zeros keep their sign.
//
// Implementations: "portable" loops of integer and float bit manipulation that GCC vectorises
// at -O3 (the library is compiled with -O3), and, for fp16 only, an F16C path
// (vcvtps2ph/vcvtph2ps, 8 lanes) used when the CPU supports it (checked at run time once).
// Both give bit-identical results (tested on every float32 bit pattern).
//
// Thread safety: pure functions.
#ifndef GRADMESH_COMPRESSION_FLOAT16_H_
#define GRADMESH_COMPRESSION_FLOAT16_H_

#include <cstdint>

namespace gradmesh {

inline constexpr float kFloat16Max = 65504.0f;
inline constexpr float kBFloat16Max = 0x1.fep127f;  // ~3.3895e38, bit pattern 0x7f7f0000

enum class Float16Backend {
  kAuto,      // kF16c when available, else kPortable
  kPortable,  // plain C++ (SSE2 vectorised)
  kF16c,      // x86 F16C + AVX; falls back to kPortable on a CPU without them
};

// Whether `backend` would really run here (kAuto and kPortable: always).
bool Float16BackendAvailable(Float16Backend backend);

// fp16: out[i] = RNE(in[i]) with clamping (see above), for i in [0, n). Returns -1 when every
// input is finite, else the index of the first NaN/Inf (out is then unspecified).
int64_t FloatToHalf(const float* in, int64_t n, uint16_t* out,
                    Float16Backend backend = Float16Backend::kAuto);

// fp16 -> float32, exact. Returns -1, or the index of the first Inf/NaN pattern (exponent
// bits all ones); out is then unspecified.
int64_t HalfToFloat(const uint16_t* in, int64_t n, float* out,
                    Float16Backend backend = Float16Backend::kAuto);

// bf16: out[i] = RNE(in[i]) with clamping; returns as FloatToHalf.
int64_t FloatToBFloat16(const float* in, int64_t n, uint16_t* out);

// bf16 -> float32, exact; returns as HalfToFloat.
int64_t BFloat16ToFloat(const uint16_t* in, int64_t n, float* out);

// Single-value forms of the portable conversions (same results; for tests and tails).
// The narrowing ones require a finite input.
uint16_t FloatToHalfScalar(float x);
float HalfToFloatScalar(uint16_t h);
uint16_t FloatToBFloat16Scalar(float x);
float BFloat16ToFloatScalar(uint16_t h);

}  // namespace gradmesh

#endif  // GRADMESH_COMPRESSION_FLOAT16_H_
