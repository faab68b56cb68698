// Per-op throughput of the CPU build's ops (llmc/ops/cpu/*.h) at one model shape, as the trainer calls
// them, against this machine's own rooflines: a large square gemm (the matmul kernel itself) for
// the matmuls and the attention, and a streaming pass of the same bytes for the activations.
// Run by scripts/bench_cpu.sh (a benchmark, not a test): OMP_NUM_THREADS sets the threads.
//   bench_cpu_ops --roofline                       machine figures + exp_fast / GELU accuracy
//   bench_cpu_ops L C H B T gelu|swiglu SHARD      one shape (doc_start from the shard's first rows)
// Each figure is the median of `reps` timed calls after one warm-up call (other jobs on the
// machine make single calls noisy; the median ignores the outliers).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>
#include <ctime>

#include "llmc/ops/cpu/attention.h"
#include "llmc/ops/cpu/matmul.h"
#include "llmc/ops/cpu/mlp.h"

namespace {

// wall-clock and process CPU milliseconds of one call (medians). With one thread on a loaded
// machine the CPU time is what the call costs when it runs; with more threads it includes the time
// threads spend waiting at barriers.
struct Ms {
    double wall, cpu;
};
double cpu_now_s() {
    timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
Ms time_call(const std::function<void()>& f, int reps) {
    f();
    std::vector<double> w, c;
    for (int r = 0; r < reps; r++) {
        const double t0 = omp_get_wtime(), c0 = cpu_now_s();
        f();
        w.push_back((omp_get_wtime() - t0) * 1e3);
        c.push_back((cpu_now_s() - c0) * 1e3);
    }
    std::sort(w.begin(), w.end());
    std::sort(c.begin(), c.end());
    return {w[w.size() / 2], c[c.size() / 2]};
}
double median_ms(const std::function<void()>& f, int reps) { return time_call(f, reps).wall; }

std::vector<float> rand_vec(size_t n, std::mt19937& g, float sd = 1.0f) {
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<float> v(n);
    for (auto& x : v) x = d(g);
    return v;
}

// a 1536^3 product through the matmul kernel: GFLOP/s of the wall clock and per thread of CPU time
Ms gemm_peak_gflops() {
    const int N = 1536;
    std::mt19937 g(1);
    auto a = rand_vec((size_t)N * N, g), b = rand_vec((size_t)N * N, g);
    std::vector<float> c((size_t)N * N);
    const Ms ms = time_call([&] { cpu::gemm<float>(c.data(), a.data(), N, 1, b.data(), N, N, N, false); }, 5);
    return {2.0 * N * N * N / ms.wall / 1e6, 2.0 * N * N * N / ms.cpu / 1e6};
}

// y = 2 x over n floats: bytes read + written per second, the bound of an elementwise op of that size
double stream_gbps(size_t n) {
    std::vector<float> x(n, 1.0f), y(n);
    const double ms = median_ms(
        [&] {
#pragma omp parallel for schedule(static)
            for (long i = 0; i < (long)n; i++) y[i] = 2.0f * x[i];
        },
        9);
    return 2.0 * n * 4 / ms / 1e6;
}

double ulps(float got, double want) {
    const float w = (float)want;
    const double ulp = std::nextafter(std::fabs(w), INFINITY) - std::fabs(w);
    return std::fabs(got - want) / ulp;
}

void roofline() {
    const Ms peak = gemm_peak_gflops();
    printf("gemm peak (1536^3, %d threads): %.1f GFLOP/s, per thread from CPU time %.1f GFLOP/s\n",
           omp_get_max_threads(), peak.wall, peak.cpu);
    printf("stream y = 2 x over 8 MB: %.1f GB/s\n", stream_gbps(1 << 20));
    // accuracy of the float approximations against double, over every 7th float of the range
    double e_max = 0;
    std::vector<float> xs, eo, gi;
    for (uint64_t b = 0; b < 0x100000000ull; b += 7) {
        const uint32_t u = (uint32_t)b;
        float x;
        std::memcpy(&x, &u, 4);
        if (x >= -87.0f && x <= 88.0f) xs.push_back(x);
    }
    eo.resize(xs.size());
#pragma omp parallel for simd
    for (size_t i = 0; i < xs.size(); i++) eo[i] = cpu::exp_fast(xs[i]);
    for (size_t i = 0; i < xs.size(); i++) e_max = std::max(e_max, ulps(eo[i], std::exp((double)xs[i])));
    printf("exp_fast: max %.2f ulp (%zu floats in [-87, 88])\n", e_max, xs.size());
    for (float x : xs)
        if (x >= -10.0f && x <= 10.0f) gi.push_back(x);
    const size_t n = gi.size();
    std::vector<float> go(n), gbo(n), ones(n, 1.0f);
    cpu::gelu_forward(go.data(), gi.data(), (long)n);
    cpu::gelu_backward(gbo.data(), ones.data(), gi.data(), (long)n);
    // GELU in double is the reference; the float tanh formula (std::tanh, as PyTorch's) beside it.
    // Forward: ulps of the result for x >= -3; below, the input's rounding is amplified by |2z| and
    // the tanh form cancels, so the error is given in units of 2^-23 (an ulp of 1.0) as for the
    // backward, whose value crosses 0 (no relative measure there).
    const double k = std::sqrt(2.0 / std::acos(-1.0)), one_ulp = std::ldexp(1.0, -23);
    double f_ulp[2] = {0, 0}, f_abs[2] = {0, 0}, b_abs[2] = {0, 0};
    for (size_t i = 0; i < n; i++) {
        const double x = gi[i], z = k * (x + 0.044715 * x * x * x), e = std::exp(-2 * z), s = 1 / (1 + e);
        const double want = x * s, dwant = s + 2 * x * s * (e * s) * k * (1 + 3 * 0.044715 * x * x);
        const float xf = gi[i], th = std::tanh(float(k) * (xf + 0.044715f * xf * xf * xf));
        const float old = 0.5f * xf * (1.0f + th);
        const float dold = 0.5f * (1.0f + th) + 0.5f * xf * ((1.0f - th * th) * float(k) * (1.0f + float(3 * 0.044715) * xf * xf));
        const float got[2] = {go[i], old}, dgot[2] = {gbo[i], dold};
        for (int m = 0; m < 2; m++) {
            if (x >= -3) f_ulp[m] = std::max(f_ulp[m], ulps(got[m], want));
            f_abs[m] = std::max(f_abs[m], std::fabs(got[m] - want) / one_ulp);
            b_abs[m] = std::max(b_abs[m], std::fabs(dgot[m] - dwant) / one_ulp);
        }
    }
    for (int m = 0; m < 2; m++)
        printf("gelu %-22s forward max %.2f ulp (x >= -3), max |err| %.2f ulp(1) (%zu floats in [-10, 10]); "
               "backward max |err| %.2f ulp(1)\n", m ? "(float std::tanh form):" : "(exp_fast):", f_ulp[m], f_abs[m],
               n, b_abs[m]);
}

struct Row {
    std::string op;
    Ms ms;
    double work;  // GFLOP or GB per call
    bool bytes;
    int calls;  // per training step
};

void shape(int L, int C, int H, int B, int T, bool gelu, const char* shard) {
    const int BT = B * T, hs = C / H, Vp = 384;  // the byte vocabulary (257) padded to 128
    const int ffn = gelu ? 4 * C : (8 * C / 3 + 31) / 32 * 32, fc_out = gelu ? ffn : 2 * ffn;
    // the first B rows of the shard (64-byte header, uint16 tokens) for the documents' boundaries
    std::vector<int> tokens((size_t)BT), ds((size_t)BT);
    FILE* f = fopen(shard, "rb");
    if (!f) {
        fprintf(stderr, "bench_cpu_ops: cannot open %s\n", shard);
        exit(1);
    }
    unsigned char hdr[64];
    std::vector<uint16_t> raw((size_t)BT);
    if (fread(hdr, 1, 64, f) != 64 || fread(raw.data(), 2, raw.size(), f) != raw.size()) {
        fprintf(stderr, "bench_cpu_ops: %s holds fewer than %d tokens\n", shard, BT);
        exit(1);
    }
    fclose(f);
    uint32_t eot;
    std::memcpy(&eot, hdr + 28, 4);
    long pairs = 0;  // visible (query, key) pairs per head: the attention's useful work
    for (int b = 0; b < B; b++) {
        int start = 0;
        for (int t = 0; t < T; t++) {
            if (raw[(size_t)b * T + t] == eot) start = t;
            ds[(size_t)b * T + t] = start;
            pairs += t - start + 1;
        }
    }
    std::mt19937 g(2);
    const int reps = 9;
    std::vector<Row> rows;
    struct Mm {
        const char* name;
        int K, OC;
        int calls;
    };
    const Mm mms[] = {{"qkv", C, 3 * C, L}, {"attproj", C, C, L}, {"fc", C, fc_out, L}, {"fcproj", ffn, C, L},
                      {"lm_head", C, Vp, 1}};
    for (const Mm& m : mms) {
        auto x = rand_vec((size_t)BT * m.K, g), w = rand_vec((size_t)m.OC * m.K, g, 0.02f), b = rand_vec(m.OC, g);
        auto dout = rand_vec((size_t)BT * m.OC, g);
        std::vector<float> out((size_t)BT * m.OC), dx((size_t)BT * m.K), dw((size_t)m.OC * m.K), db(m.OC);
        const double gf = 2.0 * BT * m.K * m.OC / 1e9;
        const std::string s = std::string(m.name) + " " + std::to_string(BT) + "x" + std::to_string(m.K) + "x" +
                              std::to_string(m.OC);
        const float* bias = std::string(m.name) == "lm_head" ? nullptr : b.data();
        rows.push_back({"matmul fwd " + s, time_call([&] {
                            cpu::matmul_forward(out.data(), x.data(), w.data(), bias, BT, m.K, m.OC);
                        }, reps), gf, false, m.calls});
        rows.push_back({"matmul dinp " + s, time_call([&] {
                            cpu::matmul_backward(dx.data(), (float*)nullptr, (float*)nullptr, dout.data(), x.data(),
                                                 w.data(), BT, m.K, m.OC);
                        }, reps), gf, false, m.calls});
        rows.push_back({"matmul dweight " + s, time_call([&] {
                            cpu::matmul_backward((float*)nullptr, dw.data(), bias ? db.data() : nullptr, dout.data(),
                                                 x.data(), w.data(), BT, m.K, m.OC);
                        }, reps), gf, false, m.calls});
    }
    {
        const int row = 3 * C;
        auto qkv = rand_vec((size_t)BT * row, g), dout = rand_vec((size_t)BT * C, g);
        std::vector<float> out((size_t)BT * C), lse((size_t)B * H * T), dqkv(qkv.size());
        const double fwd = 4.0 * pairs * H * hs / 1e9, bwd = 10.0 * pairs * H * hs / 1e9;
        const std::string s = "B" + std::to_string(B) + " T" + std::to_string(T) + " H" + std::to_string(H) + " hs" +
                              std::to_string(hs);
        rows.push_back({"attention fwd " + s, time_call([&] {
                            cpu::attention_forward(out.data(), lse.data(), qkv.data(), ds.data(), B, T, H, H, hs, 0, 0);
                        }, reps), fwd, false, L});
        rows.push_back({"attention bwd " + s, time_call([&] {
                            cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(),
                                                    ds.data(), B, T, H, H, hs, 0, 0);
                        }, reps), bwd, false, L});
    }
    {
        const size_t n = (size_t)BT * ffn;
        auto a = rand_vec((size_t)BT * fc_out, g), dout = rand_vec(n, g);
        std::vector<float> out(n), din((size_t)BT * fc_out);
        const std::string s = std::to_string(BT) + "x" + std::to_string(ffn);
        if (gelu) {
            rows.push_back({"gelu fwd " + s, time_call([&] { cpu::gelu_forward(out.data(), a.data(), (long)n); }, reps),
                            2.0 * n * 4 / 1e9, true, L});
            rows.push_back({"gelu bwd " + s, time_call([&] {
                                cpu::gelu_backward(din.data(), dout.data(), a.data(), (long)n);
                            }, reps), 3.0 * n * 4 / 1e9, true, L});
        } else {
            rows.push_back({"swiglu fwd " + s, time_call([&] { cpu::swiglu_forward(out.data(), a.data(), BT, ffn); },
                                                          reps), 3.0 * n * 4 / 1e9, true, L});
            rows.push_back({"swiglu bwd " + s, time_call([&] {
                                cpu::swiglu_backward(din.data(), dout.data(), a.data(), BT, ffn);
                            }, reps), 5.0 * n * 4 / 1e9, true, L});
        }
    }
    double total = 0;
    for (const Row& r : rows) total += r.ms.wall * r.calls;
    printf("| op | ms/call | calls/step | throughput | from CPU time (1 thread) | share of these ops |\n"
           "|---|---|---|---|---|---|\n");
    for (const Row& r : rows) {
        const char* unit = r.bytes ? "GB/s" : "GFLOP/s";
        // the process CPU clock of a short call counts the other threads only at scheduler ticks:
        // the CPU-time figure is given for one thread
        char cpu_col[64] = "-";
        if (omp_get_max_threads() == 1) snprintf(cpu_col, sizeof cpu_col, "%.1f %s", r.work / r.ms.cpu * 1e3, unit);
        printf("| %s | %.3f | %d | %.1f %s | %s | %.1f%% |\n", r.op.c_str(), r.ms.wall, r.calls,
               r.work / r.ms.wall * 1e3, unit, cpu_col, 100.0 * r.ms.wall * r.calls / total);
    }
    printf("\nthese ops: %.1f ms per step; attention: %ld visible (query, key) pairs per head (of %ld causal)\n",
           total, pairs, (long)B * T * (T + 1) / 2);
    printf("stream y = 2 x over the activation's %.1f MB: %.1f GB/s\n", BT * ffn * 8.0 / 1e6, stream_gbps((size_t)BT * ffn));
}

}  // namespace

int main(int argc, char** argv) {
    if (argc == 2 && std::string(argv[1]) == "--roofline") {
        roofline();
        return 0;
    }
    if (argc != 8) {
        fprintf(stderr, "usage: bench_cpu_ops --roofline | L C H B T gelu|swiglu SHARD\n");
        return 2;
    }
    const std::string mlp = argv[6];
    if (mlp != "gelu" && mlp != "swiglu") {
        fprintf(stderr, "bench_cpu_ops: mlp %s: expected gelu or swiglu\n", argv[6]);
        return 2;
    }
    shape(atoi(argv[1]), atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), mlp == "gelu", argv[7]);
    return 0;
}
