// A small, portable, seedable RNG (splitmix64) so that a seed means the same stream on every
// platform and in the checkpoint (the whole state is one uint64). Normals by Box-Muller.
#pragma once
#include <cmath>
#include <cstdint>

struct Rng {
    uint64_t state;
    explicit Rng(uint64_t seed = 1337) : state(seed) {}
    uint64_t next_u64() {
        uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    // uniform in [0, 1) with 24 random bits
    float uniform() { return (next_u64() >> 40) * (1.0f / 16777216.0f); }
    // uniform integer in [0, n)
    uint64_t below(uint64_t n) { return next_u64() % n; }
    float normal(float mean, float std) {
        // 53-bit uniforms in (0, 1] for the log, then Box-Muller; one normal per call keeps state simple
        double u1 = ((next_u64() >> 11) + 1) * (1.0 / 9007199254740992.0);
        double u2 = (next_u64() >> 11) * (1.0 / 9007199254740992.0);
        return (float)(mean + std * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
    }
};

// Fisher-Yates shuffle of [0, n) with a fresh generator, so a permutation depends only on its seed.
#include <vector>
inline std::vector<int64_t> random_permutation(int64_t n, uint64_t seed) {
    std::vector<int64_t> p(n);
    for (int64_t i = 0; i < n; i++) p[i] = i;
    Rng rng(seed);
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)rng.below((uint64_t)i + 1);
        int64_t t = p[i]; p[i] = p[j]; p[j] = t;
    }
    return p;
}
