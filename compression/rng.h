// A small, fast, deterministic random number generator for the stochastic codecs.
//
// Codecs never use a process-wide RNG: every stochastic choice (random-k indices, QSGD
// rounding, top-k-approx sampling) is a function of the `seed` passed to Encode, so a worker
// can reproduce a step exactly and two workers can choose independently.
//
// Rng is SplitMix64 (Steele, Lea, Flood 2014): state += 0x9e3779b97f4a7c15, then a 64-bit
// mixing function. It passes BigCrush, has period 2^64, and its output sequence for a given
// seed is fixed forever (it is part of what makes payloads reproducible). `Mix` is the
// counter-based form: Mix(seed, i) is the i-th output without stepping through 0..i-1.
//
// Thread safety: an Rng is a value; do not share one between threads without a lock. Mix is
// pure.
#ifndef GRADMESH_COMPRESSION_RNG_H_
#define GRADMESH_COMPRESSION_RNG_H_

#include <cstdint>

namespace gradmesh {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}

  // SplitMix64's finaliser: a bijection of 64-bit words with good avalanche.
  static uint64_t Finalize(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  // The i-th (0-based) output of Rng(seed), in O(1).
  static uint64_t Mix(uint64_t seed, uint64_t i) {
    return Finalize(seed + (i + 1) * 0x9e3779b97f4a7c15ULL);
  }

  // Next uniformly distributed 64-bit word.
  uint64_t Next() {
    state_ += 0x9e3779b97f4a7c15ULL;
    return Finalize(state_);
  }

  // Uniform integer in [0, bound), bound >= 1, without modulo bias (Lemire 2019: multiply,
  // reject the few low products that would over-represent some values).
  uint64_t Uniform(uint64_t bound) {
    unsigned __int128 m = static_cast<unsigned __int128>(Next()) * bound;
    uint64_t low = static_cast<uint64_t>(m);
    if (low < bound) {
      const uint64_t threshold = (0 - bound) % bound;
      while (low < threshold) {
        m = static_cast<unsigned __int128>(Next()) * bound;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }

  // Uniform float in [0, 1) on the grid k * 2^-24 (every value exactly representable).
  float UniformFloat() { return static_cast<float>(Next() >> 40) * (1.0f / 16777216.0f); }

 private:
  uint64_t state_;
};

}  // namespace gradmesh

#endif  // GRADMESH_COMPRESSION_RNG_H_
