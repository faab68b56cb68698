// exp for the CPU ops' inner loops (softmax, sigmoid, GELU), in plain arithmetic that g++
// vectorises inside an `omp simd` loop: std::exp is a library call that keeps such a loop scalar.
//   float: exp(x) = 2^n e^r, n = round(x / ln 2), r = x - n ln 2 (two-part ln 2, |r| <= ln2 / 2),
//          e^r by its Taylor polynomial of degree 7 (truncation below 6e-9 relative), 2^n built
//          in the exponent bits. Max error 2 ulps over [-87, 88] (measured against double exp:
//          scripts/bench_cpu.sh prints it). Inputs are clamped to [-87, 88]: below, the result
//          is ~1.6e-38 instead of a smaller number or 0 (callers that need an exact 0, a masked
//          softmax entry, select it); NaN stays NaN.
//   double: std::exp, clamped above at 700 so that it stays finite like the float one (the double
//          build of the ops is the tests' oracle path: exact to the library).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace cpu {

inline float exp_fast(float x) {
    x = x > 88.0f ? 88.0f : x;
    x = x < -87.0f ? -87.0f : x;
    // adding 1.5 * 2^23 rounds x / ln2 to an integer n held in the low mantissa bits of t
    const float t = x * 1.44269504088896341f + 12582912.0f;
    const float n = t - 12582912.0f;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln2 = 0.693359375 - 2.12194440e-4
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t ti;
    std::memcpy(&ti, &t, 4);
    const int32_t bits = (ti - 0x4B400000 + 127) << 23;  // 0x4B400000: the bits of 1.5 * 2^23
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}
inline double exp_fast(double x) { return std::exp(x < 700.0 ? x : 700.0); }  // finite, as the float one

}  // namespace cpu
