// GPU attention (llmc/ops/attention.cuh) vs the CPU twin (llmc/ops/cpu/attention.h), both implementations:
// the flash path (tensor cores, hs 64 and 128, what attention_forward / attention_backward dispatch to
// for those head sizes) and the simple path (any hs; called directly for hs 64 and 128 as well, so
// both are checked on the same grid points and against each other).
// Shapes cover: T not a multiple of the 64-row flash tiles, the 16-row simple tiles or the 32-row
// chunks (1, 37, 61, 64, 100, 130, 257), T = 1024, 2048, 4096 (the online-softmax rescaling over many key
// tiles; single-document rows up to T = 2048 and packed rows at 4096 for hs 64 / 128, as the CPU
// reference's backward runs one thread per (row, kv head) and a 4096-token document takes it ~20 s
// at hs 64; single-document rows of 8192 tokens are checked flash vs simple below), packed rows with documents of length 1 and rows that begin mid-document (doc_start 0 for
// the first segment), rows that are one single document (plain causal), packed long documents, an
// arbitrary doc_start (each query its own window, not the loader's order: masks everywhere),
// multi-query (n_kv_head 1), GQA ratios 1, 2, 3, 4, 6, 8, non power-of-two head counts for ALiBi
// (3, 6, 12), alibi on and off, hs 8, 16, 32, 64, 128, and a larger qkv spread (sharper softmax).
// Every grid point of the simple path (hs 8, 16, 32) has a sibling at hs 64 or 128 for the flash path.
// Every flash grid point also runs both flash variants forced (single- and double-buffered tiles: what a
// 99 KB card runs and what an H200 runs), each against the CPU and bitwise against each other.
// Tolerances: out and each of dq, dk, dv (bf16) relative L2 <= 1e-2; lse (fp32, computed from the
// same bf16 inputs in fp32 both sides, values of order 1..10) relative max <= 1e-3, where the real
// difference is a few fp32 ulps plus the fast exp/log (~1e-6). The flash path also rounds P and dS to
// bf16 before its products (as FlashAttention does): ~3e-3 relative L2, well inside 1e-2.
// The backward comparison is isolated from the forward: every backward call gets the same bf16-rounded
// CPU out and the same CPU lse. Determinism: each implementation runs twice, outputs compared bytewise.
// A GPU-only test compares the two implementations at T = 8192 with GQA 8 and 4 (too long for the CPU
// reference, whose backward runs one thread per (row, kv head)), and a
// last test runs a training-size batch (B*T = 65536), checks two of its rows against the CPU,
// determinism, and prints the times of both implementations.

namespace attention_test {

using namespace gpu_test;

struct Case {
    const char* name;
    int B, T, n_head, n_kv_head, hs;
    bool alibi;
    float std;               // spread of q, k, v: larger gives sharper softmax rows
    bool arbitrary = false;  // doc_start[i] drawn in [i - 40, i] independently per i
    int first_pattern = 0;   // row b has pattern (b + first_pattern) % 3 (see make_doc_start)
    // tensor-parallel head slice: the n_head local heads are the model's heads [head0, head0 + n_head) of
    // alibi_heads (0: the local heads are the whole model, head0 0)
    int alibi_heads = 0, head0 = 0;
};

// doc_start per row, by row pattern ((b + first_pattern) % 3):
//   0: packed, starting mid-document (the first segment has doc_start 0), document lengths drawn
//      from {1, 1, 1, 2, 3, 5, 17, 40, 70} (many of length 1)
//   1: one single document
//   2: packed long documents (20..300 tokens)
// arbitrary: doc_start[i] uniform in [max(0, i - 40), i], not monotonic (the kernels must not rely on
// the loader's order)
inline std::vector<int> make_doc_start(int B, int T, uint64_t seed, bool arbitrary = false, int first_pattern = 0) {
    Rng rng(seed);
    const int short_lengths[] = {1, 1, 1, 2, 3, 5, 17, 40, 70};
    std::vector<int> ds((size_t)B * T);
    for (int b = 0; b < B; b++) {
        if (arbitrary) {
            for (int t = 0; t < T; t++) ds[(size_t)b * T + t] = std::max(0, t - (int)rng.below(41));
            continue;
        }
        const int pattern = (b + first_pattern) % 3;
        int start = 0;
        int next = pattern == 0 ? 1 + (int)rng.below(12) : 20 + (int)rng.below(281);  // first document boundary
        for (int t = 0; t < T; t++) {
            if (pattern != 1 && t == next) {
                start = t;
                next = t + (pattern == 0 ? short_lengths[rng.below(9)] : 20 + (int)rng.below(281));
            }
            ds[(size_t)b * T + t] = start;
        }
    }
    return ds;
}

// the q, k and v parts of a [B*T, (n_head + 2 n_kv_head) hs] gradient, as separate tensors
inline std::vector<float> columns(const std::vector<float>& x, int rows, int row_len, int begin, int end) {
    std::vector<float> r;
    r.reserve((size_t)rows * (end - begin));
    for (int i = 0; i < rows; i++)
        for (int c = begin; c < end; c++) r.push_back(x[(size_t)i * row_len + c]);
    return r;
}

template <typename T>
inline bool same_bytes(const DeviceBuffer<T>& a, const DeviceBuffer<T>& b) {
    const std::vector<T> x = download(a), y = download(b);
    return std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0;
}

// max-norm tolerance of attention outputs: the flash path rounds P and dS to bf16 before its products,
// so an element carries a few bf16 roundings (~3x one op's FLOATX_MAX_TOL); a wrong or missing row is
// still an O(0.1..1) error
constexpr double ATT_MAX_TOL = 3e-2;

// rel_l2 <= FLOATX_TOL and rel_max <= ATT_MAX_TOL; a part that is exactly zero in the reference (dq and dk
// when every document has length 1: p = 1 and dp = D) is checked absolutely instead, where a relative
// error means nothing
inline void check_part(const char* what, const std::vector<float>& got, const std::vector<float>& want) {
    double norm = 0;
    for (float x : want) norm += (double)x * x;
    if (norm > 0) {
        check_floatX(what, got, want, FLOATX_TOL, ATT_MAX_TOL);
    } else {
        double mx = 0;
        for (float x : got) mx = std::isfinite(x) ? std::max(mx, (double)std::fabs(x)) : INFINITY;
        CHECK_CLOSE(what, mx, 1e-5);
    }
}
inline void check_dqkv(const std::vector<float>& got, const std::vector<float>& want, int rows, int n_head,
                       int n_kv_head, int hs) {
    const int row = (n_head + 2 * n_kv_head) * hs, q_end = n_head * hs, k_end = (n_head + n_kv_head) * hs;
    check_part("backward dq", columns(got, rows, row, 0, q_end), columns(want, rows, row, 0, q_end));
    check_part("backward dk", columns(got, rows, row, q_end, k_end), columns(want, rows, row, q_end, k_end));
    check_part("backward dv", columns(got, rows, row, k_end, row), columns(want, rows, row, k_end, row));
}

using ForwardFn = void (*)(floatX*, float*, const floatX*, const int*, int, int, int, int, int, int, int);
using BackwardFn = void (*)(floatX*, const floatX*, const floatX*, const floatX*, const float*, const int*, int, int,
                            int, int, int, int, int);
struct Impl {
    const char* name;
    ForwardFn forward;
    BackwardFn backward;
};

// The flash kernels with one variant forced (attention_detail::flash_plan: 1 = single-buffered, the
// variant a 99 KB card runs at hs 128 backward; 2 = double-buffered), whatever the device would pick;
// the emulated shared-memory limit in force, if any, is kept
template <int STAGES>
inline void forward_forced(floatX* out, float* lse, const floatX* qkv, const int* ds, int B, int T, int n_head,
                           int n_kv_head, int hs, int alibi_n_head, int head0) {
    attention_detail::FlashOverrideGuard g(attention_detail::flash_override_state().smem_limit, STAGES);
    attention_detail::forward_flash(out, lse, qkv, ds, B, T, n_head, n_kv_head, hs, alibi_n_head, head0);
}
template <int STAGES>
inline void backward_forced(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse,
                            const int* ds, int B, int T, int n_head, int n_kv_head, int hs, int alibi_n_head,
                            int head0) {
    attention_detail::FlashOverrideGuard g(attention_detail::flash_override_state().smem_limit, STAGES);
    attention_detail::backward_flash(dqkv, dout, qkv, out, lse, ds, B, T, n_head, n_kv_head, hs, alibi_n_head, head0);
}

inline void run_case(const Case& c, uint64_t seed) {
    INFO("case " << c.name << ": B=" << c.B << " T=" << c.T << " n_head=" << c.n_head << " n_kv_head=" << c.n_kv_head
                 << " hs=" << c.hs << " alibi=" << c.alibi << " arbitrary doc_start=" << c.arbitrary
                 << " alibi_heads=" << c.alibi_heads << " head0=" << c.head0);
    const int B = c.B, T = c.T, NH = c.n_head, KVH = c.n_kv_head, hs = c.hs;
    // ALiBi over the NH heads or, for a head slice, the model's alibi_heads from head0; or none
    const int alibi_nh = c.alibi ? (c.alibi_heads > 0 ? c.alibi_heads : NH) : 0, head0 = c.head0;
    const int row = (NH + 2 * KVH) * hs, C = NH * hs;
    const size_t BT = (size_t)B * T;

    const std::vector<float> qkv = floatX_round(random_vector(BT * row, seed, c.std, 0.1f));
    const std::vector<float> dout = floatX_round(random_vector(BT * C, seed + 1, 1.0f, 0.05f));
    const std::vector<int> ds = make_doc_start(B, T, seed + 2, c.arbitrary, c.first_pattern);

    std::vector<float> out_ref(BT * C), lse_ref((size_t)B * NH * T);
    cpu::attention_forward<float>(out_ref.data(), lse_ref.data(), qkv.data(), ds.data(), B, T, NH, KVH, hs, alibi_nh,
                                  head0);
    const std::vector<float> out_r = floatX_round(out_ref);
    std::vector<float> dqkv_ref(qkv.size());
    cpu::attention_backward<float>(dqkv_ref.data(), dout.data(), qkv.data(), out_r.data(), lse_ref.data(), ds.data(), B,
                                   T, NH, KVH, hs, alibi_nh, head0);

    DeviceBuffer<floatX> d_qkv(qkv.size()), d_dout(dout.size()), d_out_r(out_r.size());
    upload_floatX(d_qkv, qkv);
    upload_floatX(d_dout, dout);
    upload_floatX(d_out_r, out_r);
    DeviceBuffer<int> d_ds(ds.size());
    upload(d_ds, ds);
    DeviceBuffer<float> d_lse_ref(lse_ref.size());
    upload(d_lse_ref, lse_ref);
    cuda_scratch_reserve(attention_scratch_bytes(B, T, NH));

    // the public ops (flash for hs 64 / 128, in the variants this device picks), and the simple kernels
    // called directly where they are not what the public ops run; then both flash variants forced (each
    // checked against the CPU like the others, and against each other bitwise below: same math, same
    // order, only the buffering of the tiles differs)
    std::vector<Impl> impls = {{attention_detail::flash_supported(hs) ? "flash" : "simple", attention_forward,
                                attention_backward}};
    if (attention_detail::flash_supported(hs)) {
        impls.push_back({"simple", attention_detail::forward_simple, attention_detail::backward_simple});
        impls.push_back({"flash 1-stage (forced)", forward_forced<1>, backward_forced<1>});
        // the 2-stage kernels only where this device (or the emulated limit: LLMC_ATTENTION_SMEM_LIMIT,
        // the device check's 99 KB run) can launch all three; the variant test below checks the refusal
        const attention_detail::FlashPlan& p = attention_detail::flash_plan(hs);
        bool two_fit = true;
        const attention_detail::FlashVariant* vs[3] = {&p.fwd, &p.dq, &p.dkdv};
        for (int k = 0; k < 3; k++) two_fit = two_fit && (vs[k]->stages == 2 || p.alt_fits[k]);
        if (two_fit) impls.push_back({"flash 2-stage (forced)", forward_forced<2>, backward_forced<2>});
        else MESSAGE("hs " << hs << ": the 2-stage flash kernels do not fit this device's shared memory: not forced");
    }
    std::vector<std::vector<float>> outs, lses, dqkvs;
    for (const Impl& im : impls) {
        INFO("implementation " << im.name);
        DeviceBuffer<floatX> d_out(out_ref.size()), d_out2(out_ref.size());
        DeviceBuffer<float> d_lse(lse_ref.size()), d_lse2(lse_ref.size());
        d_out.poison();
        d_lse.poison();
        d_out2.poison();
        d_lse2.poison();
        im.forward(d_out, d_lse, d_qkv, d_ds, B, T, NH, KVH, hs, alibi_nh, head0);
        im.forward(d_out2, d_lse2, d_qkv, d_ds, B, T, NH, KVH, hs, alibi_nh, head0);
        outs.push_back(download_floatX(d_out));
        lses.push_back(download(d_lse));
        check_part("forward out", outs.back(), out_ref);
        CHECK_CLOSE("forward lse", rel_max(lses.back(), lse_ref), 1e-3);
        CHECK_MESSAGE(same_bytes(d_out, d_out2), "forward out differs between two runs");
        CHECK_MESSAGE(same_bytes(d_lse, d_lse2), "forward lse differs between two runs");

        DeviceBuffer<floatX> d_dqkv(qkv.size()), d_dqkv2(qkv.size());
        d_dqkv.poison();
        d_dqkv2.poison();
        im.backward(d_dqkv, d_dout, d_qkv, d_out_r, d_lse_ref, d_ds, B, T, NH, KVH, hs, alibi_nh, head0);
        im.backward(d_dqkv2, d_dout, d_qkv, d_out_r, d_lse_ref, d_ds, B, T, NH, KVH, hs, alibi_nh, head0);
        dqkvs.push_back(download_floatX(d_dqkv));
        check_dqkv(dqkvs.back(), dqkv_ref, (int)BT, NH, KVH, hs);
        CHECK_MESSAGE(same_bytes(d_dqkv, d_dqkv2), "backward dqkv differs between two runs");

        if (attention_detail::flash_supported(hs) && std::string(im.name) == "flash") {
            // the public op really is the flash kernel: the same bits as forward_flash / backward_flash
            attention_detail::forward_flash(d_out2, d_lse2, d_qkv, d_ds, B, T, NH, KVH, hs, alibi_nh, head0);
            attention_detail::backward_flash(d_dqkv2, d_dout, d_qkv, d_out_r, d_lse_ref, d_ds, B, T, NH, KVH, hs,
                                             alibi_nh, head0);
            CHECK_MESSAGE(same_bytes(d_out, d_out2), "attention_forward is not the flash kernel for this hs");
            CHECK_MESSAGE(same_bytes(d_dqkv, d_dqkv2), "attention_backward is not the flash kernel for this hs");
        }
    }
    if (impls.size() >= 3) {  // flash vs simple on the GPU, and the flash variants against each other
        INFO("flash vs simple");
        check_part("forward out", outs[0], outs[1]);
        CHECK_CLOSE("forward lse", rel_max(lses[0], lses[1]), 1e-3);
        check_dqkv(dqkvs[0], dqkvs[1], (int)BT, NH, KVH, hs);
        auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
            return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
        };
        // the device's choice and the forced 1-stage, each against the forced 2-stage (where it fits;
        // else the device's choice against the forced 1-stage)
        const int ref = (int)impls.size() - 1;
        for (int k : {0, 2})
            if (k != ref)
                CHECK_MESSAGE((same(outs[k], outs[ref]) && same(lses[k], lses[ref]) && same(dqkvs[k], dqkvs[ref])),
                              impls[k].name << " differs bitwise from " << impls[ref].name);
    }
}

// inputs uniform in [-1, 1) from a hash of the index: 100M+ normal draws on the host would take seconds
inline void fill_hash(std::vector<float>& v, uint64_t salt, float scale = 1.0f) {
    for (size_t i = 0; i < v.size(); i++) {
        uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ salt;
        z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ull;
        z ^= z >> 29;
        float x = ((float)((z >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f) * scale;
        v[i] = floatX_to_float(float_to_floatX(x == 0.0f ? 1e-3f : x));
    }
}

}  // namespace attention_test

TEST_CASE("attention: forward and backward vs the CPU twin, flash and simple paths") {
    using attention_test::Case;
    const Case cases[] = {
        // simple path (hs not 64 / 128), each followed by its flash-path sibling(s)
        {"ragged T, GQA 4/2, hs 16, alibi", 2, 37, 4, 2, 16, true, 1.0f},
        {"ragged T, GQA 4/2, hs 64, alibi", 2, 37, 4, 2, 64, true, 1.0f},
        {"ragged T, GQA 4/2, hs 128, alibi", 2, 37, 4, 2, 128, true, 1.0f},
        {"n_kv_head == n_head = 12, hs 32, no alibi", 2, 257, 12, 12, 32, false, 1.0f},
        {"n_kv_head == n_head = 12, hs 64, no alibi", 2, 257, 12, 12, 64, false, 1.0f},
        {"hs 8, 3 heads, alibi", 3, 61, 3, 3, 8, true, 1.0f},
        {"hs 128, 3 heads, alibi", 3, 61, 3, 3, 128, true, 1.0f},
        {"T = 1, hs 16", 3, 1, 2, 1, 16, true, 1.0f},
        {"T = 1, hs 64", 3, 1, 2, 1, 64, true, 1.0f},
        {"T = 1, hs 128", 3, 1, 2, 1, 128, true, 1.0f},
        {"T = 1024, hs 16, no alibi, sharp softmax", 2, 1024, 2, 1, 16, false, 3.0f},
        {"T = 1024, hs 128, no alibi, sharp softmax", 2, 1024, 2, 1, 128, false, 3.0f},
        {"T = 4096, multi-query, hs 16, alibi", 2, 4096, 2, 1, 16, true, 1.0f},
        {"T = 4096, multi-query, hs 64, alibi, packed rows", 2, 4096, 2, 1, 64, true, 1.0f, false, 2},
        // flash path (and the simple one on the same points)
        {"multi-query, 6 heads (non power-of-two alibi), hs 64", 3, 100, 6, 1, 64, true, 1.0f},
        {"12 heads over 3 kv heads, hs 64, alibi, sharp softmax", 3, 257, 12, 3, 64, true, 2.5f},
        {"hs 128, multi-query, no alibi", 3, 130, 2, 1, 128, false, 1.0f},
        {"hs 128, GQA 4/2, alibi, sharp softmax", 2, 61, 4, 2, 128, true, 2.0f},
        {"T = 64 (one whole tile), GQA 8/1, hs 64", 3, 64, 8, 1, 64, true, 1.0f},
        {"T = 1024, GQA 4/2, hs 64, alibi", 2, 1024, 4, 2, 64, true, 1.5f},
        {"T = 1024, GQA 8/1, hs 64, alibi (packed, single, long docs)", 3, 1024, 8, 1, 64, true, 1.0f},
        {"T = 2048, GQA 4/1, hs 128, alibi, packed rows", 2, 2048, 4, 1, 128, true, 1.0f, false, 2},
        {"T = 2048, hs 128, alibi (packed, single, long docs)", 3, 2048, 2, 2, 128, true, 1.0f},
        {"T = 4096, GQA 4/2, hs 128, packed rows", 2, 4096, 4, 2, 128, false, 1.5f, false, 2},
        {"arbitrary doc_start, GQA 4/2, hs 64", 2, 300, 4, 2, 64, true, 1.0f, true},
        {"arbitrary doc_start, multi-query, hs 128", 2, 200, 2, 1, 128, true, 1.0f, true},
        {"arbitrary doc_start, hs 32", 2, 200, 2, 1, 32, true, 1.0f, true},
    };
    uint64_t seed = 1000;
    for (const Case& c : cases) {
        attention_test::run_case(c, seed);
        seed += 10;
    }
}

// small shapes for compute-sanitizer (scripts/device_check.sh: test_gpu -tc='sanitizer*'): the flash
// kernels (hs 64 and 128; run_case also runs the simple ones on the same points) over two 64-row tiles
// with a ragged end, packed rows, GQA and ALiBi, the simple path alone (hs 16), and tensor-parallel
// head slices (head0, alibi_n_head)
TEST_CASE("sanitizer: attention forward and backward, flash and simple, small shapes") {
    using attention_test::Case;
    const Case cases[] = {
        {"sanitizer hs 64, GQA 4/2, alibi", 2, 100, 4, 2, 64, true, 1.0f},
        {"sanitizer hs 128, multi-query, packed", 1, 130, 2, 1, 128, true, 1.0f, false, 2},
        {"sanitizer hs 16, GQA 4/2", 2, 37, 4, 2, 16, true, 1.0f},
        // tensor-parallel slices: head0 and the model's head count for the slopes (alibi_n_head)
        {"sanitizer TP heads 3..5 of 6 (one kv group), hs 128", 1, 70, 3, 1, 128, true, 1.0f, false, 2, 6, 3},
        {"sanitizer TP heads 6..7 of 8, hs 64, packed", 1, 100, 2, 1, 64, true, 1.5f, false, 2, 8, 6},
    };
    uint64_t seed = 5000;
    for (const Case& c : cases) attention_test::run_case(c, seed += 10);
}

// Tensor parallelism: a rank runs a slice of the heads with its head0 and the model's head count for the
// ALiBi slopes (alibi_n_head); the GPU slice against the CPU slice (same local qkv), both paths. The
// slices: heads 2..5 of 6 (GQA 6/2 as one call: each query head with its own copy of its kv head),
// heads 3..5 of 6 (a whole kv group), rank 3 of 4 of 8 heads / 2 kv heads (heads 6, 7, one kv head),
// rank 1 of 2 of 12 heads / 12 kv heads (non power-of-two slopes: heads 6..11 take the interleaved ones).
TEST_CASE("attention: tensor-parallel head slices (head0, alibi_n_head) vs the CPU twin, flash and simple") {
    using attention_test::Case;
    const Case cases[] = {
        {"TP heads 2..5 of 6 (kv copies), hs 16", 2, 100, 4, 4, 16, true, 1.0f, false, 0, 6, 2},
        {"TP heads 2..5 of 6 (kv copies), hs 64", 2, 100, 4, 4, 64, true, 1.0f, false, 0, 6, 2},
        {"TP heads 3..5 of 6 (one kv group), hs 128", 2, 130, 3, 1, 128, true, 1.0f, false, 2, 6, 3},
        {"TP rank 3 of 4: heads 6..7 of 8, one kv head, hs 64, packed", 2, 257, 2, 1, 64, true, 1.5f, false, 2, 8, 6},
        {"TP rank 3 of 4: heads 6..7 of 8, one kv head, hs 32", 2, 257, 2, 1, 32, true, 1.5f, false, 0, 8, 6},
        {"TP rank 1 of 2: heads 6..11 of 12, hs 64", 2, 61, 6, 6, 64, true, 1.0f, false, 0, 12, 6},
        {"TP rank 1 of 2: heads 6..11 of 12, hs 8", 2, 61, 6, 6, 8, true, 1.0f, false, 0, 12, 6},
        {"TP slice without ALiBi (head0 ignored), hs 64", 2, 100, 2, 1, 64, false, 1.0f, false, 0, 8, 6},
    };
    uint64_t seed = 7000;
    for (const Case& c : cases) attention_test::run_case(c, seed += 10);
}

TEST_CASE("attention: flash and simple kernels agree at T = 8192 (packed, single-document, long documents)") {
    using namespace gpu_test;
    for (const int2 shape : {make_int2(64, 1), make_int2(128, 2)}) {  // (hs, n_kv_head): GQA 8 and 4
        const int hs = shape.x, B = 3, T = 8192, NH = 8, KVH = shape.y;
        const int alibi_nh = NH;  // ALiBi over the NH heads
        INFO("hs " << hs << ", n_kv_head " << KVH);
        const int row = (NH + 2 * KVH) * hs, C = NH * hs;
        const size_t BT = (size_t)B * T;
        std::vector<float> qkv(BT * row), dout(BT * C);
        attention_test::fill_hash(qkv, 0x4242 + hs, 2.0f);
        attention_test::fill_hash(dout, 0x4343 + hs);
        const std::vector<int> ds = attention_test::make_doc_start(B, T, 91);
        DeviceBuffer<floatX> d_qkv(qkv.size()), d_dout(dout.size());
        upload_floatX(d_qkv, qkv);
        upload_floatX(d_dout, dout);
        DeviceBuffer<int> d_ds(ds.size());
        upload(d_ds, ds);
        cuda_scratch_reserve(attention_scratch_bytes(B, T, NH));
        DeviceBuffer<floatX> out_f(BT * C), out_s(BT * C), dqkv_f(qkv.size()), dqkv_s(qkv.size());
        DeviceBuffer<float> lse_f((size_t)B * NH * T), lse_s((size_t)B * NH * T);
        for (auto* p : {&out_f, &out_s, &dqkv_f, &dqkv_s}) p->poison();
        lse_f.poison();
        lse_s.poison();
        attention_detail::forward_flash(out_f, lse_f, d_qkv, d_ds, B, T, NH, KVH, hs, alibi_nh, 0);
        attention_detail::forward_simple(out_s, lse_s, d_qkv, d_ds, B, T, NH, KVH, hs, alibi_nh, 0);
        attention_test::check_part("forward out, flash vs simple", download_floatX(out_f), download_floatX(out_s));
        CHECK_CLOSE("forward lse, flash vs simple", rel_max(download(lse_f), download(lse_s)), 1e-3);
        // both backwards on the flash forward's saved state
        attention_detail::backward_flash(dqkv_f, d_dout, d_qkv, out_f, lse_f, d_ds, B, T, NH, KVH, hs, alibi_nh, 0);
        attention_detail::backward_simple(dqkv_s, d_dout, d_qkv, out_f, lse_f, d_ds, B, T, NH, KVH, hs, alibi_nh, 0);
        attention_test::check_dqkv(download_floatX(dqkv_f), download_floatX(dqkv_s), (int)BT, NH, KVH, hs);
    }
}

// The variant choice (attention_detail::flash_plan) on this device and on emulated smaller cards: an RTX
// 3090/4090 or L4 (101376 B per block) must run the hs 128 backward 1-stage (the 2-stage kernels take
// 102 KB + static), the results must be the same bits as the 2-stage kernels', forcing a variant that
// does not fit is an error, and a limit no variant fits is an error (never a silent fallback).
TEST_CASE("attention: flash variant chosen from the device's shared memory, emulated 99 KB and A100 cards") {
    using namespace gpu_test;
    using namespace attention_detail;
    MESSAGE(attention_kernels_summary(64));
    MESSAGE(attention_kernels_summary(128));
    MESSAGE(attention_kernels_summary(96));
    for (int hs : {64, 128}) {
        const FlashPlan& p = flash_plan(hs);
        for (const FlashVariant* v : {&p.fwd, &p.dq, &p.dkdv}) {
            CHECK(v->smem <= p.dev.smem_block);
            CHECK(v->blocks_per_sm >= 1);
        }
    }
    {
        FlashOverrideGuard g(101376, 0);  // RTX 3090 / 4090 / L4
        const FlashPlan& p = flash_plan(128);
        CHECK(p.dev.smem_block == 101376);
        CHECK(p.dq.stages == 1);
        CHECK(p.dkdv.stages == 1);
        CHECK(p.fwd.stages == 2);  // 85 KB fits, and the 1-stage one (51 KB) gets no more blocks on 100 KB
        for (const FlashVariant* v : {&p.fwd, &p.dq, &p.dkdv}) CHECK(v->smem <= 101376);
        const std::string line = attention_kernels_summary(128);
        MESSAGE(line);
        CHECK(line.find("does not fit") != std::string::npos);
        MESSAGE(attention_kernels_summary(64));
    }
    {
        FlashOverrideGuard g(166912, 0);  // A100
        MESSAGE(attention_kernels_summary(64));
        MESSAGE(attention_kernels_summary(128));
    }

    // the public ops under the emulated 99 KB limit vs the device's own choice: the same bits
    const int B = 2, T = 300, NH = 4, KVH = 2, hs = 128, row = (NH + 2 * KVH) * hs, C = NH * hs;
    const size_t BT = (size_t)B * T;
    std::vector<float> qkv(BT * row), dout(BT * C);
    attention_test::fill_hash(qkv, 0x77, 2.0f);
    attention_test::fill_hash(dout, 0x78);
    const std::vector<int> ds = attention_test::make_doc_start(B, T, 5);
    DeviceBuffer<floatX> d_qkv(qkv.size()), d_dout(dout.size());
    upload_floatX(d_qkv, qkv);
    upload_floatX(d_dout, dout);
    DeviceBuffer<int> d_ds(ds.size());
    upload(d_ds, ds);
    cuda_scratch_reserve(attention_scratch_bytes(B, T, NH));
    DeviceBuffer<floatX> out1(BT * C), out2(BT * C), dqkv1(qkv.size()), dqkv2(qkv.size());
    DeviceBuffer<float> lse1((size_t)B * NH * T), lse2((size_t)B * NH * T);
    for (auto* p : {&out1, &out2, &dqkv1, &dqkv2}) p->poison();
    lse1.poison();
    lse2.poison();
    attention_forward(out1, lse1, d_qkv, d_ds, B, T, NH, KVH, hs, NH, 0);
    attention_backward(dqkv1, d_dout, d_qkv, out1, lse1, d_ds, B, T, NH, KVH, hs, NH, 0);
    {
        FlashOverrideGuard g(101376, 0);
        attention_forward(out2, lse2, d_qkv, d_ds, B, T, NH, KVH, hs, NH, 0);
        attention_backward(dqkv2, d_dout, d_qkv, out1, lse1, d_ds, B, T, NH, KVH, hs, NH, 0);
        // the 2-stage backward does not fit 99 KB: forcing it is refused
        FlashOverrideGuard g2(101376, 2);
        CHECK_THROWS_AS(attention_backward(dqkv2, d_dout, d_qkv, out1, lse1, d_ds, B, T, NH, KVH, hs, NH, 0), LlmcError);
    }
    CHECK_MESSAGE(attention_test::same_bytes(out1, out2), "forward differs under the 99 KB variant choice");
    CHECK_MESSAGE(attention_test::same_bytes(lse1, lse2), "forward lse differs under the 99 KB variant choice");
    CHECK_MESSAGE(attention_test::same_bytes(dqkv1, dqkv2), "backward differs under the 99 KB variant choice");
    {
        FlashOverrideGuard g(48 * 1024, 0);  // no flash variant fits at hs 128: an error, not a slow path
        CHECK_THROWS_AS(attention_forward(out2, lse2, d_qkv, d_ds, B, T, NH, KVH, hs, NH, 0), LlmcError);
        CHECK_THROWS_AS(attention_backward(dqkv2, d_dout, d_qkv, out1, lse1, d_ds, B, T, NH, KVH, hs, NH, 0),
                        LlmcError);
    }
    // the guards restored the device's own choice
    CHECK(flash_override_state().smem_limit == 0);
    CHECK(flash_override_state().stages == 0);
}

TEST_CASE("attention: rejects unsupported shapes with a clear error") {
    gpu_test::DeviceBuffer<floatX> qkv(4 * 3 * 136), out(4 * 2 * 136), dqkv(4 * 3 * 136);
    gpu_test::DeviceBuffer<float> lse(4 * 2);
    gpu_test::DeviceBuffer<int> ds(4);
    cudaCheck(cudaMemset(ds.ptr, 0, 4 * sizeof(int)));
    // head size not a multiple of 8, head size above 128, n_kv_head not dividing n_head
    CHECK_THROWS_AS(attention_forward(out, lse, qkv, ds, 1, 4, 2, 1, 12, 0, 0), LlmcError);
    CHECK_THROWS_AS(attention_forward(out, lse, qkv, ds, 1, 4, 1, 1, 136, 0, 0), LlmcError);
    CHECK_THROWS_AS(attention_forward(out, lse, qkv, ds, 1, 4, 3, 2, 16, 0, 0), LlmcError);
    CHECK_THROWS_AS(attention_backward(dqkv, out, qkv, out, lse, ds, 1, 4, 2, 1, 12, 0, 0), LlmcError);
    // the flash kernels only take hs 64 and 128; misaligned tensors are refused by both paths
    CHECK_THROWS_AS(attention_detail::forward_flash(out, lse, qkv, ds, 1, 4, 2, 1, 32, 0, 0), LlmcError);
    CHECK_THROWS_AS(attention_detail::backward_flash(dqkv, out, qkv, out, lse, ds, 1, 4, 2, 1, 32, 0, 0), LlmcError);
    CHECK_THROWS_AS(attention_forward(out, lse, qkv.ptr + 1, ds, 1, 4, 1, 1, 64, 0, 0), LlmcError);
    // a head slice outside the model's ALiBi heads
    CHECK_THROWS_AS(attention_forward(out, lse, qkv, ds, 1, 4, 2, 1, 64, 2, 1), LlmcError);
    CHECK_THROWS_AS(attention_backward(dqkv, out, qkv, out, lse, ds, 1, 4, 2, 1, 64, 4, -1), LlmcError);
}

// Training size (B*T = 65536 tokens, GPT-2 small-like heads with GQA): runs, is deterministic, and
// matches the CPU twin on two full rows (one single 1024-token document, one packed row); prints the
// times of the flash path (what attention_forward runs at hs 64) and of the simple one.
TEST_CASE("attention: training size, one packed and one single-document row vs the CPU, deterministic, timed") {
    using namespace gpu_test;
    const int B = 64, T = 1024, NH = 12, KVH = 4, hs = 64;
    const int alibi_nh = NH;  // ALiBi over the NH heads
    const int row = (NH + 2 * KVH) * hs, C = NH * hs;
    const size_t BT = (size_t)B * T;
    std::vector<float> qkv(BT * row), dout(BT * C);
    attention_test::fill_hash(qkv, 0x1234);
    attention_test::fill_hash(dout, 0x5678);
    const std::vector<int> ds = attention_test::make_doc_start(B, T, 77);

    DeviceBuffer<floatX> d_qkv(qkv.size()), d_dout(dout.size());
    upload_floatX(d_qkv, qkv);
    upload_floatX(d_dout, dout);
    DeviceBuffer<int> d_ds(ds.size());
    upload(d_ds, ds);
    DeviceBuffer<floatX> d_out(BT * C), d_out2(BT * C), d_dqkv(qkv.size()), d_dqkv2(qkv.size());
    DeviceBuffer<float> d_lse((size_t)B * NH * T), d_lse2((size_t)B * NH * T);
    d_out.poison();
    d_out2.poison();
    d_lse.poison();
    d_lse2.poison();
    d_dqkv.poison();
    d_dqkv2.poison();
    cuda_scratch_reserve(attention_scratch_bytes(B, T, NH));

    cudaEvent_t e0, e1, e2;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    cudaCheck(cudaEventCreate(&e2));
    double pairs = 0;  // visible (query, key) pairs, all heads
    for (size_t t = 0; t < BT; t++) pairs += (double)((int)(t % T) - ds[t] + 1) * NH;
    // the simple kernels first (timing only), into the buffers the public ops overwrite next
    const attention_test::Impl impls[] = {
        {"simple", attention_detail::forward_simple, attention_detail::backward_simple},
        {"flash (attention_forward / attention_backward)", attention_forward, attention_backward}};
    for (const attention_test::Impl& im : impls) {
        im.forward(d_out2, d_lse2, d_qkv, d_ds, B, T, NH, KVH, hs, alibi_nh, 0);  // warm-up, and the second run
        im.backward(d_dqkv2, d_dout, d_qkv, d_out2, d_lse2, d_ds, B, T, NH, KVH, hs, alibi_nh, 0);
        cudaCheck(cudaEventRecord(e0, llmc_stream()));
        im.forward(d_out, d_lse, d_qkv, d_ds, B, T, NH, KVH, hs, alibi_nh, 0);
        cudaCheck(cudaEventRecord(e1, llmc_stream()));
        im.backward(d_dqkv, d_dout, d_qkv, d_out, d_lse, d_ds, B, T, NH, KVH, hs, alibi_nh, 0);
        cudaCheck(cudaEventRecord(e2, llmc_stream()));
        cudaCheck(cudaEventSynchronize(e2));
        float fwd_ms = 0, bwd_ms = 0;
        cudaCheck(cudaEventElapsedTime(&fwd_ms, e0, e1));
        cudaCheck(cudaEventElapsedTime(&bwd_ms, e1, e2));
        MESSAGE("attention " << im.name << " B=" << B << " T=" << T << " n_head=" << NH << " n_kv_head=" << KVH
                             << " hs=" << hs << ": forward " << fwd_ms << " ms ("
                             << 4.0 * hs * pairs / (fwd_ms * 1e-3) / 1e12
                             << " TFLOP/s at 4 hs flops per visible pair), backward " << bwd_ms << " ms ("
                             << 10.0 * hs * pairs / (bwd_ms * 1e-3) / 1e12 << " TFLOP/s at 10 hs)");
    }
    cudaCheck(cudaEventDestroy(e0));
    cudaCheck(cudaEventDestroy(e1));
    cudaCheck(cudaEventDestroy(e2));

    // d_out, d_lse, d_dqkv: the public ops; d_out2, d_lse2, d_dqkv2: their warm-up run
    CHECK_MESSAGE(attention_test::same_bytes(d_out, d_out2), "forward out differs between two runs");
    CHECK_MESSAGE(attention_test::same_bytes(d_lse, d_lse2), "forward lse differs between two runs");
    CHECK_MESSAGE(attention_test::same_bytes(d_dqkv, d_dqkv2), "backward dqkv differs between two runs");

    const std::vector<float> out = download_floatX(d_out), dqkv = download_floatX(d_dqkv);
    const std::vector<float> lse = download(d_lse);
    for (int b : {0, 1}) {  // row 0: packed, starting mid-document; row 1: one document
        INFO("row " << b);
        const size_t r0 = (size_t)b * T;
        const std::vector<float> qkv_b(qkv.begin() + r0 * row, qkv.begin() + (r0 + T) * row);
        const std::vector<int> ds_b(ds.begin() + r0, ds.begin() + r0 + T);
        std::vector<float> out_ref((size_t)T * C), lse_ref((size_t)NH * T);
        cpu::attention_forward<float>(out_ref.data(), lse_ref.data(), qkv_b.data(), ds_b.data(), 1, T, NH, KVH, hs,
                                      alibi_nh, 0);
        const std::vector<float> out_b(out.begin() + r0 * C, out.begin() + (r0 + T) * C);
        const std::vector<float> lse_b(lse.begin() + (size_t)b * NH * T, lse.begin() + (size_t)(b + 1) * NH * T);
        attention_test::check_part("forward out", out_b, out_ref);
        CHECK_CLOSE("forward lse", rel_max(lse_b, lse_ref), 1e-3);
        // backward of the row on the GPU's own saved state (its bf16 out and its lse), as in training
        const std::vector<float> dout_b(dout.begin() + r0 * C, dout.begin() + (r0 + T) * C);
        std::vector<float> dqkv_ref((size_t)T * row);
        cpu::attention_backward<float>(dqkv_ref.data(), dout_b.data(), qkv_b.data(), out_b.data(), lse_b.data(),
                                       ds_b.data(), 1, T, NH, KVH, hs, alibi_nh, 0);
        const std::vector<float> dqkv_b(dqkv.begin() + r0 * row, dqkv.begin() + (r0 + T) * row);
        attention_test::check_dqkv(dqkv_b, dqkv_ref, T, NH, KVH, hs);
    }
}
