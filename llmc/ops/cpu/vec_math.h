// exp for the CPU ops' inner loops (softmax, sigmoid, GELU), in plain arithmetic that g++
// vectorises inside an `omp simd` loop: std::exp is a library call that keeps such a loop scalar.
//   float: exp(x) = 2^n e^r, n = round(x / ln 2), r = x - n ln 2 (two-part ln 2, |r| <= ln2 / 2),
//          e^r by its Taylor polynomial of degree 7 (truncation below 6e-9 relative), 2^n built
//          in the exponent bits. Max error under 1 ulp over [-87, 88] (against double exp:
//          scripts/bench_cpu.sh prints it, test_ops checks it). Out of range the result stays
//          finite: at most 2.8e38 above x = 88.7, at least 7e-39 below x = -87.3, instead of inf
//          or a subnormal or 0 (callers that need an exact 0, a masked softmax entry, select
//          it); NaN stays NaN.
//   double: std::exp, clamped above at 700 so that it stays finite like the float one (the double
//          build of the ops is the tests' oracle path: exact to the library).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace cpu {

inline float exp_fast(float x) {
    // adding 1.5 * 2^23 rounds x / ln2 to an integer n held in the low mantissa bits of t
    const float t = x * 1.44269504088896341f + 12582912.0f;
    uint32_t tb;
    std::memcpy(&tb, &t, 4);
    int32_t n = (int32_t)(tb - 0x4B400000u);  // 0x4B400000: the bits of 1.5 * 2^23
    // out of range (and inf, NaN): 2^n stays a normal float and r within the polynomial's reach;
    // the clamps are on computed values, not on x, so that g++ does not fold a clamped x into a
    // constant result and split the vector loop into one masked path per case
    n = n < -126 ? -126 : n;
    n = n > 127 ? 127 : n;
    const float nf = (float)n;
    float r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;  // ln2 = 0.693359375 - 2.12194440e-4
    r = r < -0.5f ? -0.5f : r;
    r = r > 0.5f ? 0.5f : r;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const uint32_t bits = (uint32_t)(n + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}
inline double exp_fast(double x) { return std::exp(x < 700.0 ? x : 700.0); }  // finite, as the float one

}  // namespace cpu
