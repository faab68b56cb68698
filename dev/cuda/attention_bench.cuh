// What the attention benchmarks (attention_forward.cu, attention_backward.cu) share: the validation
// rows, the timing of both versions on packed and unpacked rows of one shape, and the run (the
// validation shapes, then the sweep of shapes).
#pragma once
#include <string>
#include <vector>
#include "dev/cuda/common.cuh"

namespace attention_bench {

using namespace bench;

// doc_start of B validation rows of T tokens: row b % 3 == 0 documents of 3 tokens, 1 one document,
// 2 the benchmark's packed distribution (seed seed0 + b)
inline std::vector<int> validation_doc_start(int B, int T, uint64_t seed0) {
    std::vector<int> ds((size_t)B * T);
    for (int b = 0; b < B; b++) {
        const std::vector<int> r = make_doc_start(1, T, true, seed0 + b);
        for (int t = 0; t < T; t++) ds[(size_t)b * T + t] = b % 3 == 0 ? t - t % 3 : (b % 3 == 1 ? 0 : r[t]);
    }
    return ds;
}

// Times versions[0] (with_v1) and versions[1] (each has a name) on unpacked, then packed rows of
// B x T tokens: prepare(d_ds) once per row kind (untimed), run(v, d_ds) the timed call of version v;
// FLOPs are flops_per_pair x hs x n_head per visible pair. Prints each time, each version's packed
// speed-up next to the ratio of visible work, and v2 / v1.
template <typename Version, typename Prepare, typename Run>
inline void time_versions(const Version (&versions)[2], int B, int T, int n_head, int hs, double flops_per_pair,
                          bool with_v1, Prepare&& prepare, Run&& run) {
    double flops[2];
    float ms[2][2] = {};
    for (int packed = 0; packed < 2; packed++) {
        const std::vector<int> ds = make_doc_start(B, T, packed, 1000 + T);
        int* d_ds = to_device(ds);
        flops[packed] = flops_per_pair * hs * n_head * visible_pairs(ds, T);
        prepare(d_ds);
        for (int v = with_v1 ? 0 : 1; v < 2; v++) {
            const int reps = v == 0 ? 3 : (T >= 4096 ? 10 : 20);
            ms[v][packed] = bench::time_ms([&] { run(v, d_ds); }, 1, reps);
            const std::string what = std::string("  ") + versions[v].name + (packed ? " packed  " : " unpacked");
            bench::print_flops(what, ms[v][packed], flops[packed], 0);
        }
        cudaCheck(cudaFree(d_ds));
    }
    for (int v = with_v1 ? 0 : 1; v < 2; v++)
        printf("  %s packed speed-up %.2fx (visible work ratio %.2fx)\n", versions[v].name, ms[v][0] / ms[v][1],
               flops[0] / flops[1]);
    if (with_v1)
        printf("  v2 / v1 speed: unpacked %.1fx, packed %.1fx\n", ms[0][0] / ms[1][0], ms[0][1] / ms[1][1]);
}

// The benchmark's main: validate(B, T, n_head, n_kv_head, hs, alibi) on four small shapes (exit 1 on a
// mismatch), then time_shape(hs, T, GQA ratio, with_v1) over B*T = 65536 tokens, n_head 16, hs 64 and 128,
// T 1024 .. 8192, GQA 1 / 4 / 8; version 1 only at GQA 4, T 1024 and 4096 (it is ~20x slower).
inline int run_all(const char* name, const char* units, bool (*validate)(int, int, int, int, int, bool),
                   void (*time_shape)(int, int, int, bool)) {
    bench::print_header(name);
    bool ok = true;
    ok = validate(3, 300, 4, 1, 64, true) && ok;
    ok = validate(3, 257, 6, 2, 128, true) && ok;
    ok = validate(2, 130, 4, 4, 64, false) && ok;
    ok = validate(3, 200, 8, 1, 128, false) && ok;
    require_valid(ok);
    printf("B*T = 65536 tokens, n_head 16, alibi; TFLOP/s over visible score elements (%s)\n", units);
    for (int hs : {64, 128})
        for (int T : {1024, 2048, 4096, 8192})
            for (int ratio : {1, 4, 8}) {
                printf("hs %d T %d GQA %d (n_kv_head %d, B %d)\n", hs, T, ratio, 16 / ratio, 65536 / T);
                time_shape(hs, T, ratio, ratio == 4 && (T == 1024 || T == 4096));
            }
    return 0;
}

}  // namespace attention_bench
