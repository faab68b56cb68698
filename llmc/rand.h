// A small, portable, seedable RNG (splitmix64) so that a seed means the same stream on every
// platform and in the checkpoint (the whole state is one uint64). Normals by Box-Muller.
//
// splitmix64 is a counter run through a mixing function: output k of the stream seeded with s is
// mix(s + (k + 1) * golden). So any output can be computed without the ones before it
// (splitmix64_at), and normal_at(seed, i) is the i-th normal of Rng(seed) (outputs 2i and 2i + 1):
// the parameter init uses it to give table element i a value that depends only on (seed, i), so
// any rank fills any part of the table, in parallel, in any layout.
#pragma once
#include <cmath>
#include <cstdint>

constexpr uint64_t SPLITMIX_GOLDEN = 0x9E3779B97F4A7C15ull;
inline uint64_t splitmix64_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
// output k (0, 1, ...) of Rng(seed)'s stream
inline uint64_t splitmix64_at(uint64_t seed, uint64_t k) { return splitmix64_mix(seed + (k + 1) * SPLITMIX_GOLDEN); }
// Box-Muller of two outputs: 53-bit uniforms, the first in (0, 1] for the log; one normal per pair
inline float box_muller(uint64_t a, uint64_t b, float mean, float std) {
    double u1 = ((a >> 11) + 1) * (1.0 / 9007199254740992.0);
    double u2 = (b >> 11) * (1.0 / 9007199254740992.0);
    return (float)(mean + std * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}
// the i-th Rng(seed).normal(mean, std), without drawing the i before it
inline float normal_at(uint64_t seed, uint64_t i, float mean, float std) {
    return box_muller(splitmix64_at(seed, 2 * i), splitmix64_at(seed, 2 * i + 1), mean, std);
}

struct Rng {
    uint64_t state;
    explicit Rng(uint64_t seed = 1337) : state(seed) {}
    uint64_t next_u64() { return splitmix64_mix(state += SPLITMIX_GOLDEN); }
    // uniform in [0, 1) with 24 random bits
    float uniform() { return (next_u64() >> 40) * (1.0f / 16777216.0f); }
    // uniform integer in [0, n)
    uint64_t below(uint64_t n) { return next_u64() % n; }
    float normal(float mean, float std) {
        const uint64_t a = next_u64();  // sequenced: a is output 2i, b output 2i + 1
        return box_muller(a, next_u64(), mean, std);
    }
};
