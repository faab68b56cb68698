// Encoder benchmark (llmc/ops/encoder.cuh: token + learned-position embedding, forward and backward).
//   1. validates encoder_forward / encoder_backward against the CPU twin (llmc/ops/cpu/encoder.h) on
//      random bf16-rounded inputs (C = 768 and a ragged C = 37, Zipf-distributed tokens, packed
//      documents), the backward row by row and twice (bitwise determinism); exits 1 on a mismatch
//   2. times B*T = 64 x 1024 = 65536 tokens at C = 768 and 2048, tokens Zipf-distributed over GPT-2's
//      50257 (like text: a few tokens are several % of the batch), documents of ~500 tokens.
// Bytes counted:
//   forward   out written + one wte row and one wpe row read per token + tokens and doc_start
//   backward  dout read + every touched dwte / dwpe row read and written once + tokens and doc_start
//             (the sort's traffic, the keys and the fp32 partials are not counted: they are the cost
//             of determinism, which the "sort only" line shows separately)
// Build: nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -I. dev/cuda/encoder.cu -lcublasLt -lcublas -o encoder
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/encoder.h"
#include "llmc/ops/encoder.cuh"

using namespace bench;  // the validation helpers (host_random, to_device_floatX, ...): dev/cuda/common.cuh

// worst relative L2 error over the rows of [rows, C]
static double max_row_rel_l2(const std::vector<float>& got, const std::vector<float>& want, int C) {
    double worst = 0;
    for (size_t r = 0; r < got.size() / C; r++) {
        double num = 0, den = 0;
        for (int c = 0; c < C; c++) {
            const double g = got[r * C + c], w = want[r * C + c];
            if (!std::isfinite(g)) return INFINITY;
            num += (g - w) * (g - w);
            den += w * w;
        }
        worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
    }
    return worst;
}

// Zipf-like tokens (p(k) ~ 1/(k+1)) and packed documents of mean length mean_doc
static std::vector<int> zipf_tokens(size_t n, int V, Rng& rng) {
    std::vector<int> t(n);
    for (int& x : t) x = std::min(V - 1, (int)std::floor(std::exp(rng.uniform() * std::log((double)V))) - 1);
    return t;
}
static std::vector<int> doc_starts(int B, int T, int mean_doc, Rng& rng) {
    std::vector<int> ds((size_t)B * T);
    for (int b = 0; b < B; b++) {
        int start = 0;
        for (int t = 0; t < T; t++) {
            if (t > 0 && rng.below(mean_doc) == 0) start = t;
            ds[(size_t)b * T + t] = start;
        }
    }
    return ds;
}

static bool validate(int B, int T, int C, int V) {
    Rng rng(1234 + C);
    const size_t n = (size_t)B * T;
    const std::vector<int> tokens = zipf_tokens(n, V, rng), ds = doc_starts(B, T, 100, rng);
    const std::vector<float> wte = host_random((size_t)V * C, rng), wpe = host_random((size_t)T * C, rng);
    const std::vector<float> dout = host_random(n * C, rng), dwte0 = host_random((size_t)V * C, rng, 0.5f),
                             dwpe0 = host_random((size_t)T * C, rng, 0.5f);
    std::vector<float> out(n * C), dwte = dwte0, dwpe = dwpe0;
    cpu::encoder_forward<float>(out.data(), tokens.data(), ds.data(), wte.data(), wpe.data(), B, T, C, 0, V);
    cpu::encoder_backward<float>(dwte.data(), dwpe.data(), dout.data(), tokens.data(), ds.data(), B, T, C, 0, V);

    cuda_scratch_reserve(encoder_scratch_bytes(B, T, C));
    int *d_tokens = to_device(tokens), *d_ds = to_device(ds);
    floatX *d_wte = to_device_floatX(wte), *d_wpe = to_device_floatX(wpe), *d_dout = to_device_floatX(dout);
    floatX* d_out;
    cudaCheck(cudaMalloc(&d_out, n * C * sizeof(floatX)));
    cudaCheck(cudaMemset(d_out, 0xFF, n * C * sizeof(floatX)));  // NaN: unwritten outputs fail
    encoder_forward(d_out, d_tokens, d_ds, d_wte, d_wpe, B, T, C, 0, V);
    const double e_out = max_row_rel_l2(to_host_floatX(d_out, n * C), out, C);
    std::vector<float> got_wte[2], got_wpe[2];
    for (int rep = 0; rep < 2; rep++) {
        float *d_dwte = to_device(dwte0), *d_dwpe = to_device(dwpe0);  // fp32 gradients
        encoder_backward(d_dwte, d_dwpe, d_dout, d_tokens, d_ds, B, T, C, 0, V);
        got_wte[rep] = to_host(d_dwte, (size_t)V * C);
        got_wpe[rep] = to_host(d_dwpe, (size_t)T * C);
        cudaCheck(cudaFree(d_dwte));
        cudaCheck(cudaFree(d_dwpe));
    }
    const double e_wte = max_row_rel_l2(got_wte[0], dwte, C), e_wpe = max_row_rel_l2(got_wpe[0], dwpe, C);
    const bool same = got_wte[0] == got_wte[1] && got_wpe[0] == got_wpe[1];
    const double tol = 1e-2, f32_tol = 1e-5;  // bf16 output; fp32 gradients (sums reordered)
    const bool ok = e_out <= tol && e_wte <= f32_tol && e_wpe <= f32_tol && same;
    printf("validate B=%d T=%d C=%d V=%d: out %.2e, dwte %.2e, dwpe %.2e (worst row rel L2), deterministic %s: %s\n",
           B, T, C, V, e_out, e_wte, e_wpe, same ? "yes" : "NO", ok ? "ok" : "MISMATCH");
    for (void* p : {(void*)d_tokens, (void*)d_ds, (void*)d_wte, (void*)d_wpe, (void*)d_dout, (void*)d_out})
        cudaCheck(cudaFree(p));
    return ok;
}

static void run_bench(int B, int T, int C, int V, int Vp) {
    Rng rng(77);
    const size_t n = (size_t)B * T;
    const std::vector<int> tokens = zipf_tokens(n, V, rng), ds = doc_starts(B, T, 500, rng);
    std::vector<char> seen_tok(V, 0), seen_pos(T, 0);
    size_t distinct_tok = 0, distinct_pos = 0;
    for (size_t i = 0; i < n; i++) {
        distinct_tok += !seen_tok[tokens[i]];
        seen_tok[tokens[i]] = 1;
        const int p = (int)(i % T) - ds[i];
        distinct_pos += !seen_pos[p];
        seen_pos[p] = 1;
    }
    cuda_scratch_reserve(encoder_scratch_bytes(B, T, C));
    int *d_tokens = to_device(tokens), *d_ds = to_device(ds);
    floatX *wte = alloc_random((size_t)Vp * C, 1, 0.1f), *wpe = alloc_random((size_t)T * C, 2, 0.1f);
    float *dwte = alloc_zeros_f32((size_t)Vp * C), *dwpe = alloc_zeros_f32((size_t)T * C);
    floatX *out = alloc_random(n * C, 5, 1.0f), *dout = alloc_random(n * C, 6, 1.0f);
    // dout rows are bf16; a gradient row is read and written once, in fp32
    const double row = (double)C * sizeof(floatX), grow = (double)C * sizeof(float), ids = 2.0 * n * sizeof(int);
    printf("B*T = %zu tokens (%zu distinct, %zu distinct positions), C = %d\n", n, distinct_tok, distinct_pos, C);

    float ms = bench::time_ms([&] { encoder_forward(out, d_tokens, d_ds, wte, wpe, B, T, C, 0, Vp); });
    bench::print_bandwidth("  forward (wte + wpe)", ms, 3.0 * n * row + ids);
    ms = bench::time_ms([&] { encoder_forward(out, d_tokens, d_ds, wte, nullptr, B, T, C, 0, Vp); });
    bench::print_bandwidth("  forward (wte only, ALiBi)", ms, 2.0 * n * row + ids);
    ms = bench::time_ms([&] { encoder_backward(dwte, dwpe, dout, d_tokens, d_ds, B, T, C, 0, Vp); });
    bench::print_bandwidth("  backward (dwte + dwpe)", ms, n * row + 2.0 * (distinct_tok + distinct_pos) * grow + ids);
    ms = bench::time_ms([&] { encoder_backward(dwte, nullptr, dout, d_tokens, d_ds, B, T, C, 0, Vp); });
    bench::print_bandwidth("  backward (dwte only)", ms, n * row + 2.0 * distinct_tok * grow + ids);
    // the sort alone (keys + cub radix sort of the token ids): the price of determinism
    {
        using namespace encoder_detail;
        const Scratch s = scratch_layout(B, T, C);
        char* base = cuda_scratch<char>(s.total, "bench");
        ms = bench::time_ms([&] {
            encoder_keys_kernel<<<ceil_div((int)n, 256), 256, 0, llmc_stream()>>>(
                (unsigned*)(base + s.keys_in), (int*)(base + s.vals_in), d_tokens, d_ds, T, (int)n, false, 0, Vp);
            size_t bytes = s.cub_bytes;
            cudaCheck(cub::DeviceRadixSort::SortPairs(base + s.cub, bytes, (unsigned*)(base + s.keys_in),
                                                      (unsigned*)(base + s.keys_out), (int*)(base + s.vals_in),
                                                      (int*)(base + s.vals_out), (int)n, 0, 32, llmc_stream()));
        });
        printf("  %-46s %9.3f ms\n", "(of which the token sort)", ms);
    }
    for (void* p : {(void*)d_tokens, (void*)d_ds, (void*)wte, (void*)wpe, (void*)dwte, (void*)dwpe, (void*)out,
                    (void*)dout})
        cudaCheck(cudaFree(p));
}

int main() {
    bench::print_header("encoder");
    bool ok = validate(4, 256, 768, 5000);
    ok = validate(3, 100, 37, 301) && ok;
    require_valid(ok);
    for (int C : {768, 2048}) run_bench(64, 1024, C, 50257, 50304);
    return 0;
}
