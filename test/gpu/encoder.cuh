// GPU encoder_forward / encoder_backward (llmc/ops/encoder.cuh) vs the CPU twin (llmc/ops/cpu/encoder.h), the
// whole vocabulary and vocab ranges (tensor parallel: a rank holds the wte rows [vocab_begin,
// vocab_begin + vocab_count)).
#pragma once
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>
#include "test/gpu/harness.cuh"
#include "llmc/ops/cpu/encoder.h"
#include "llmc/ops/encoder.cuh"

namespace encoder_test {
using namespace gpu_test;

// Row-relative document starts of packed rows: each row may begin mid-document (doc_start 0),
// then a new document starts at each position with probability 1 / mean_len.
inline std::vector<int> make_doc_start(int B, int T, int mean_len, uint64_t seed) {
    Rng rng(seed);
    std::vector<int> ds((size_t)B * T);
    for (int b = 0; b < B; b++) {
        int start = 0;
        for (int t = 0; t < T; t++) {
            if (t > 0 && rng.below(mean_len) == 0) start = t;
            ds[(size_t)b * T + t] = start;
        }
    }
    return ds;
}

inline std::vector<int> random_tokens(size_t n, int V, uint64_t seed) {
    Rng rng(seed);
    std::vector<int> t(n);
    for (int& x : t) x = (int)rng.below(V);
    return t;
}

// Tokens in runs of the given lengths (token r for run r), then shuffled: after the sort, runs that
// end exactly on, just before and just after the 64-entry chunk boundaries of the backward.
inline std::vector<int> run_tokens(const std::vector<int>& lengths, size_t n, uint64_t seed) {
    std::vector<int> t;
    for (size_t r = 0; t.size() < n; r++)
        for (int k = 0; k < lengths[r % lengths.size()] && t.size() < n; k++) t.push_back((int)r);
    Rng rng(seed);
    for (size_t i = n - 1; i > 0; i--) std::swap(t[i], t[rng.below(i + 1)]);
    return t;
}

// The worst relative L2 error over the rows of [rows, C] matrices: a missing or misplaced
// contribution to a single gradient row cannot hide in the norm of a large table.
inline double max_row_rel_l2(const std::vector<float>& got, const std::vector<float>& want, int C) {
    REQUIRE(got.size() == want.size());
    double worst = 0;
    for (size_t r = 0; r < got.size() / C; r++) {
        std::vector<float> g(got.begin() + r * C, got.begin() + (r + 1) * C);
        std::vector<float> w(want.begin() + r * C, want.begin() + (r + 1) * C);
        worst = std::max(worst, rel_l2(g, w));
    }
    return worst;
}

// A forward case's inputs on the host and the device: B x T tokens in [0, V), packed documents (mean 17
// tokens), bf16-exact wte [V, C] and wpe [T, C] (0.5 the scale), drawn with seeds seed0 .. seed0 + 3
struct ForwardInputs {
    size_t n;
    std::vector<int> tokens, doc_start;
    std::vector<float> wte, wpe;
    DeviceBuffer<int> d_tokens, d_ds;
    std::unique_ptr<DeviceBuffer<floatX>> d_wte, d_wpe;
    ForwardInputs(int B, int T, int C, int V, uint64_t seed0)
        : n((size_t)B * T), tokens(random_tokens(n, V, seed0)), doc_start(make_doc_start(B, T, 17, seed0 + 1)),
          wte(floatX_round(random_vector((size_t)V * C, seed0 + 2))),
          wpe(floatX_round(random_vector((size_t)T * C, seed0 + 3, 0.5f))), d_tokens(n), d_ds(n),
          d_wte(to_device_floatX(wte)), d_wpe(to_device_floatX(wpe)) {
        upload(d_tokens, tokens);
        upload(d_ds, doc_start);
    }
};

TEST_CASE("encoder_forward: bitwise equal to the CPU twin rounded to bf16 (ragged C, packed docs, with/without wpe)") {
    const int V = 97;
    for (int C : {7, 37, 768, 769})
        for (auto bt : {std::pair<int, int>{1, 5}, std::pair<int, int>{3, 100}})
            for (bool with_wpe : {true, false}) {
                const int B = bt.first, T = bt.second;
                CAPTURE(C);
                CAPTURE(B);
                CAPTURE(T);
                CAPTURE(with_wpe);
                const ForwardInputs in(B, T, C, V, 11 + C);
                const size_t n = in.n;
                std::vector<float> want(n * C);
                cpu::encoder_forward<float>(want.data(), in.tokens.data(), in.doc_start.data(), in.wte.data(),
                                            with_wpe ? in.wpe.data() : nullptr, B, T, C, 0, V);

                DeviceBuffer<floatX> d_out(n * C);
                d_out.poison();
                encoder_forward(d_out, in.d_tokens, in.d_ds, *in.d_wte, with_wpe ? in.d_wpe->ptr : nullptr, B, T, C,
                                0, V);
                const std::vector<float> got = download_floatX(d_out);
                // the GPU adds the same two bf16 values in fp32 and rounds once: exactly bf16(want)
                const std::vector<float> want_bf16 = floatX_round(want);
                CHECK(std::memcmp(got.data(), want_bf16.data(), got.size() * sizeof(float)) == 0);
                CHECK_CLOSE("out", rel_l2(got, want), FLOATX_TOL);
            }
}

// One backward case over the vocab range [v0, v0 + nv) (the whole vocabulary: 0, V; tensor parallel: a
// rank's wte rows): GPU vs CPU on prefilled (non-zero) gradients, every row of the range's dwte and of
// dwpe (every token) checked; rows no token of the range hits come back bit-identical to the
// prefill, and the call adds once (the same call into zeros). Documents of mean_doc tokens.
inline void check_backward_range(const std::vector<int>& tokens, int B, int T, int C, bool with_wpe, int v0,
                                 int nv, int mean_doc, uint64_t seed) {
    CAPTURE(B);
    CAPTURE(T);
    CAPTURE(C);
    CAPTURE(with_wpe);
    CAPTURE(v0);
    CAPTURE(nv);
    const size_t n = (size_t)B * T;
    const std::vector<int> doc_start = make_doc_start(B, T, mean_doc, seed);
    const std::vector<float> dout = floatX_round(random_vector(n * C, seed + 1));
    const std::vector<float> dwte0 = random_vector((size_t)nv * C, seed + 2, 0.5f);  // fp32 gradients
    const std::vector<float> dwpe0 = random_vector((size_t)T * C, seed + 3, 0.5f);
    std::vector<float> want_wte = dwte0, want_wpe = dwpe0;
    cpu::encoder_backward<float>(want_wte.data(), with_wpe ? want_wpe.data() : nullptr, dout.data(), tokens.data(),
                                 doc_start.data(), B, T, C, v0, nv);

    cuda_scratch_reserve(encoder_scratch_bytes(B, T, C));
    DeviceBuffer<int> d_tokens(n), d_ds(n);
    upload(d_tokens, tokens);
    upload(d_ds, doc_start);
    std::unique_ptr<DeviceBuffer<floatX>> d_dout(to_device_floatX(dout));
    std::unique_ptr<DeviceBuffer<float>> d_wte(to_device(dwte0)), d_wpe(to_device(dwpe0));
    encoder_backward(*d_wte, with_wpe ? d_wpe->ptr : nullptr, *d_dout, d_tokens, d_ds, B, T, C, v0, nv);
    const std::vector<float> got_wte = download(*d_wte), got_wpe = download(*d_wpe);
    if (nv > 0) CHECK_CLOSE("dwte rows of the range (worst row)", max_row_rel_l2(got_wte, want_wte, C), F32_TOL);
    // without wpe, dwpe must be untouched (want_wpe is still the prefill)
    CHECK_CLOSE("dwpe (worst row)", max_row_rel_l2(got_wpe, want_wpe, C), with_wpe ? F32_TOL : 0.0);
    std::vector<char> hit(nv, 0);
    for (int t : tokens)
        if (t >= v0 && t < v0 + nv) hit[t - v0] = 1;
    size_t changed = 0;
    for (int v = 0; v < nv; v++)
        if (!hit[v]) changed += std::memcmp(&got_wte[(size_t)v * C], &dwte0[(size_t)v * C], C * sizeof(float)) != 0;
    CHECK_MESSAGE(changed == 0, changed << " rows without a token of the range changed");
    // one add per row of a sum independent of the destination: the same call into zeros
    std::unique_ptr<DeviceBuffer<float>> z_wte(to_device(std::vector<float>(dwte0.size(), 0.0f))),
        z_wpe(to_device(std::vector<float>(dwpe0.size(), 0.0f)));
    encoder_backward(*z_wte, with_wpe ? z_wpe->ptr : nullptr, *d_dout, d_tokens, d_ds, B, T, C, v0, nv);
    check_single_add("dwte", dwte0, got_wte, download(*z_wte));
    if (with_wpe) check_single_add("dwpe", dwpe0, got_wpe, download(*z_wpe));
}
// the whole vocabulary of V tokens
inline void check_backward(const std::vector<int>& tokens, int V, int B, int T, int C, bool with_wpe, int mean_doc,
                           uint64_t seed) {
    check_backward_range(tokens, B, T, C, with_wpe, 0, V, mean_doc, seed);
}

TEST_CASE("encoder_backward: accumulates like the CPU twin (ragged C, random tokens, with/without wpe)") {
    for (int C : {7, 37, 768, 769})
        for (auto bt : {std::pair<int, int>{1, 5}, std::pair<int, int>{3, 100}, std::pair<int, int>{4, 512}})
            for (bool with_wpe : {true, false}) {
                const int B = bt.first, T = bt.second, V = 301;
                check_backward(random_tokens((size_t)B * T, V, 21 + C + T), V, B, T, C, with_wpe, 40, 22 + C + T);
            }
}

TEST_CASE("encoder_backward: heavily repeated tokens (all equal, 3 distinct, runs around the chunk size)") {
    const int B = 4, T = 512, n = B * T;
    std::string what;  // the case, reported with any failure
    CAPTURE(what);
    for (int C : {37, 768}) {
        what = "all tokens equal: one run over all 32 chunks";
        check_backward(std::vector<int>(n, 5), 11, B, T, C, true, 100, 31);
        what = "3 distinct tokens";
        check_backward(random_tokens(n, 3, 32), 3, B, T, C, true, 100, 33);
        what = "run lengths 1, 63, 64, 65, 128, 129, 200, 2 (shuffled)";
        const std::vector<int> runs = run_tokens({1, 63, 64, 65, 128, 129, 200, 2}, n, 34);
        check_backward(runs, *std::max_element(runs.begin(), runs.end()) + 1, B, T, C, true, 60, 35);
        what = "runs of exactly 64 entries, aligned to the chunks";
        std::vector<int> aligned(n);
        for (int i = 0; i < n; i++) aligned[i] = i / 64;
        check_backward(aligned, n / 64, B, T, C, true, 60, 36);
        what = "7 tokens of 64-entry blocks: each token's group is several whole chunks";
        for (int i = 0; i < n; i++) aligned[i] = (i / 64) % 7;
        check_backward(aligned, 7, B, T, C, false, 60, 37);
        what = "T = 1: all 300 positions add to dwpe row 0";
        check_backward(random_tokens(300, 4, 38), 4, 300, 1, C, true, 1, 39);
    }
}

TEST_CASE("encoder_backward: bitwise deterministic (repeated tokens, wpe)") {
    const int B = 8, T = 1024, C = 768, V = 50, n = B * T;
    // Zipf-like: a few very frequent tokens spanning many chunks, many rare ones
    Rng rng(41);
    std::vector<int> tokens(n);
    for (int& t : tokens) t = std::min(V - 1, (int)std::floor(std::exp(rng.uniform() * std::log((double)V))) - 1);
    const std::vector<int> doc_start = make_doc_start(B, T, 300, 42);
    const std::vector<float> dout = random_vector((size_t)n * C, 43);
    const std::vector<float> dwte0 = random_vector((size_t)V * C, 44), dwpe0 = random_vector((size_t)T * C, 45);
    cuda_scratch_reserve(encoder_scratch_bytes(B, T, C));
    DeviceBuffer<int> d_tokens(n), d_ds(n);
    upload(d_tokens, tokens);
    upload(d_ds, doc_start);
    std::unique_ptr<DeviceBuffer<floatX>> d_dout(to_device_floatX(dout));
    std::vector<std::vector<float>> wte_runs, wpe_runs;
    for (int rep = 0; rep < 2; rep++) {
        std::unique_ptr<DeviceBuffer<float>> d_wte(to_device(dwte0)), d_wpe(to_device(dwpe0));
        encoder_backward(*d_wte, *d_wpe, *d_dout, d_tokens, d_ds, B, T, C, 0, V);
        wte_runs.push_back(download(*d_wte));
        wpe_runs.push_back(download(*d_wpe));
    }
    CHECK(same_bytes(wte_runs[0], wte_runs[1]));
    CHECK(same_bytes(wpe_runs[0], wpe_runs[1]));
}

// Vocab ranges, forward: every range's output is bitwise bf16 of the CPU twin's (the position term on
// range 0 only), and the ranges' outputs summed in fp32 and rounded to bf16 are bitwise the full
// vocabulary's output (out-of-range tokens give exact zeros).
TEST_CASE("encoder_forward: vocab ranges (tensor parallel) vs the CPU twin; their sum is the full output") {
    const int V = 97, B = 3, T = 100;
    const std::vector<std::vector<int>> splits = {{0, 48, 97}, {0, 24, 48, 72, 97}, {0, 0, 96, 97}};
    for (int C : {37, 768})
        for (bool with_wpe : {true, false}) {
            CAPTURE(C);
            CAPTURE(with_wpe);
            const ForwardInputs in(B, T, C, V, 51 + C);
            const size_t n = in.n;
            DeviceBuffer<floatX> d_full(n * C);
            d_full.poison();
            encoder_forward(d_full, in.d_tokens, in.d_ds, *in.d_wte, with_wpe ? in.d_wpe->ptr : nullptr, B, T, C, 0, V);
            const std::vector<float> full = download_floatX(d_full);
            for (const std::vector<int>& bounds : splits) {
                CAPTURE(bounds.size() - 1);
                std::vector<float> sum(n * C, 0.0f);
                for (size_t k = 0; k + 1 < bounds.size(); k++) {
                    CAPTURE(k);
                    const int v0 = bounds[k], nv = bounds[k + 1] - bounds[k];
                    const std::vector<float> rows(in.wte.begin() + (size_t)v0 * C,
                                                  in.wte.begin() + (size_t)(v0 + nv) * C);
                    const float* pe = with_wpe && k == 0 ? in.wpe.data() : nullptr;
                    std::vector<float> want(n * C);
                    cpu::encoder_forward<float>(want.data(), in.tokens.data(), in.doc_start.data(), rows.data(), pe,
                                                B, T, C, v0, nv);
                    std::unique_ptr<DeviceBuffer<floatX>> d_rows(to_device_floatX(rows));
                    DeviceBuffer<floatX> d_out(n * C);
                    d_out.poison();
                    encoder_forward(d_out, in.d_tokens, in.d_ds, *d_rows, pe ? in.d_wpe->ptr : nullptr, B, T, C, v0,
                                    nv);
                    const std::vector<float> got = download_floatX(d_out);
                    CHECK(same_bytes(got, floatX_round(want)));
                    for (size_t i = 0; i < sum.size(); i++) sum[i] += got[i];
                }
                CHECK_MESSAGE(same_bytes(floatX_round(sum), full), "the ranges' outputs do not sum to the full output");
            }
        }
}

TEST_CASE("encoder_backward: vocab ranges (tensor parallel) accumulate like the CPU twin") {
    const int V = 301;
    for (int C : {37, 768}) {
        for (auto bt : {std::pair<int, int>{1, 5}, std::pair<int, int>{4, 512}})
            for (bool with_wpe : {true, false}) {
                const int B = bt.first, T = bt.second;
                const std::vector<int> tokens = random_tokens((size_t)B * T, V, 61 + C + T);
                uint64_t seed = 62 + C + T;
                for (const std::pair<int, int>& range : {std::pair<int, int>{0, 150}, std::pair<int, int>{150, 151},
                                                         std::pair<int, int>{100, 1}, std::pair<int, int>{0, 0},
                                                         std::pair<int, int>{V, 50}})
                    check_backward_range(tokens, B, T, C, with_wpe, range.first, range.second, 50, seed += 10);
            }
        // heavy repeats around the 64-entry chunks of the sorted list, cut by the range
        const int B = 4, T = 512, n = B * T;
        const std::vector<int> runs = run_tokens({1, 63, 64, 65, 128, 129, 200, 2}, n, 64);
        const int n_tok = *std::max_element(runs.begin(), runs.end()) + 1;
        check_backward_range(runs, B, T, C, true, 0, n_tok / 2, 50, 65);
        check_backward_range(runs, B, T, C, true, n_tok / 3, n_tok - n_tok / 3, 50, 66);
        check_backward_range(std::vector<int>(n, 5), B, T, C, true, 5, 1, 50, 67);  // one run over all chunks
        check_backward_range(std::vector<int>(n, 5), B, T, C, true, 6, 10, 50, 68); // no token in range
    }
}

// small shapes for compute-sanitizer: the forward of a vocab range whose tokens mostly fall outside it
// (the out-of-range tail: exact zeros), the backward of an in-range, a one-row and an empty range
TEST_CASE("sanitizer: encoder forward and backward, vocab ranges with out-of-range tokens, small shapes") {
    const int V = 97, B = 2, T = 40, C = 40;
    const size_t n = (size_t)B * T;
    const std::vector<int> tokens = random_tokens(n, V, 81), doc_start = make_doc_start(B, T, 9, 82);
    const int v0 = 60, nv = V - v0;
    const std::vector<float> rows = floatX_round(random_vector((size_t)nv * C, 83));
    const std::vector<float> wpe = floatX_round(random_vector((size_t)T * C, 84, 0.5f));
    std::vector<float> want(n * C);
    cpu::encoder_forward<float>(want.data(), tokens.data(), doc_start.data(), rows.data(), wpe.data(), B, T, C, v0, nv);
    DeviceBuffer<int> d_tokens(n), d_ds(n);
    upload(d_tokens, tokens);
    upload(d_ds, doc_start);
    std::unique_ptr<DeviceBuffer<floatX>> d_rows(to_device_floatX(rows)), d_wpe(to_device_floatX(wpe));
    DeviceBuffer<floatX> d_out(n * C);
    d_out.poison();
    encoder_forward(d_out, d_tokens, d_ds, *d_rows, d_wpe->ptr, B, T, C, v0, nv);
    CHECK(same_bytes(download_floatX(d_out), floatX_round(want)));
    for (const std::pair<int, int>& range : {std::pair<int, int>{0, 48}, std::pair<int, int>{96, 1},
                                             std::pair<int, int>{V, 0}})
        check_backward_range(tokens, B, T, C, true, range.first, range.second, 50, 85 + range.first);
    check_backward(tokens, V, B, T, C, true, 9, 90);
}

}  // namespace encoder_test

// The memory plan bounds cub's radix-sort temporaries by 12n + 64 KiB (llmc/ops/op_scratch.h, from cub's
// onesweep allocation list); cub's own answer on this GPU must stay within it for the sort the
// encoder backward runs (n pairs, 32 key bits for tokens, fewer for positions).
TEST_CASE("encoder_backward: cub's sort temporaries are within the plan's bound (llmc/ops/op_scratch.h)") {
    for (int n : {1, 100, 4096, 8192, 65536, 1 << 20, 1 << 22})
        for (int bits : {1, 10, 12, 32}) {
            size_t bytes = 0;
            cudaCheck(cub::DeviceRadixSort::SortPairs(nullptr, bytes, (const unsigned*)nullptr, (unsigned*)nullptr,
                                                      (const int*)nullptr, (int*)nullptr, n, 0, bits, llmc_stream()));
            CAPTURE(n);
            CAPTURE(bits);
            CHECK(bytes <= encoder_detail::cub_sort_bytes_bound((size_t)n));
        }
}
