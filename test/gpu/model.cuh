// The CUDA trainer (gpu::) against the CPU reference trainer (ref::): the same config, params and
// batches.
//  - One optimizer step's gradients, over a grid of configs: head sizes 16 (simple attention
//    kernels), 64 and 128 (the flash kernels inside the full step), GELU + learned positions, MoE
//    where every expert takes every token (no routing decision that bf16 could flip), MoE with a
//    real selection (routing compared token set by token set, flips bounded and explained by the
//    score noise), and gradient accumulation over 4 micro-steps. Loss within 1e-2 relative; every
//    gradient tensor relative L2 <= 1e-2 AND max-norm error <= MODEL_MAX_TOL.
//  - 20 steps: the loss curves agree within 2%. Two GPU runs: bitwise-identical losses and params.
// Model internals (gradient buffer, routing buffers) are read only through gpu_grad / ref_grad and
// gpu_routing / ref_routing below: their layout is the trainer's business.
#pragma once
#include <cfloat>
#include <cstring>
#include "test/gpu/moe.cuh"  // moe_test::compare_routing

namespace gpu_test {

// max |got - want| / max |want| of a whole step's gradients: the bf16 errors of several ops compound
// through the layers (each op alone is within FLOATX_MAX_TOL = 1e-2); a wrong or missing row of typical
// size is an O(0.1..1) error
constexpr double MODEL_MAX_TOL = 5e-2;

struct ModelCase {
    const char* name;
    ref::GPTConfig config;
    int B, T;
    int micro_steps = 1;      // gradient accumulation: micro-batches per optimizer step
    bool moe_routing = false;  // a real selection: compare the routing first (flips possible)
};

inline ref::GPTConfig model_test_config() {
    ref::GPTConfig c;
    c.vocab_size = 257;
    c.n_layer = 2;
    c.n_embd = 64;
    c.n_head = 4;
    c.n_kv_head = 2;
    c.max_seq_len = 128;
    c.finalize();
    return c;
}

// the configs of the one-step test
inline std::vector<ModelCase> model_cases() {
    std::vector<ModelCase> cases;
    auto shape = [](int n_embd, int n_head, int n_kv_head) {
        ref::GPTConfig c = model_test_config();
        c.n_embd = n_embd;
        c.n_head = n_head;
        c.n_kv_head = n_kv_head;
        c.ffn_hidden = 0;
        c.finalize();
        return c;
    };
    cases.push_back({"hs 16, GQA 4/2, swiglu, alibi (simple attention kernels)", shape(64, 4, 2), 4, 100});
    ref::GPTConfig gelu = shape(64, 4, 4);
    gelu.mlp = ref::MLP_GELU;
    gelu.pos = ref::POS_LEARNED;
    gelu.ffn_hidden = 0;
    gelu.finalize();
    cases.push_back({"hs 16, gelu, learned positions", gelu, 4, 100});
    // T = 100: one full 64-row flash tile and a ragged one
    cases.push_back({"hs 64, GQA 2/1 (flash kernels)", shape(128, 2, 1), 4, 100});
    cases.push_back({"hs 128, GQA 2/1 (flash kernels)", shape(256, 2, 1), 2, 100});
    cases.push_back({"hs 64, 4 micro-steps of gradient accumulation", shape(128, 2, 1), 2, 64, 4});
    // MoE, every expert takes every token (capacity = group size): router, gather, batched expert
    // matmuls, gates and their backward in the full step, with nothing bf16 could flip
    ref::GPTConfig all = shape(64, 4, 2);
    all.n_expert = 2;
    all.capacity_factor = 2.0f;
    all.moe_every = 1;
    all.expert_hidden = 96;
    all.moe_group = ref::MOE_GROUP_POSITION;
    all.finalize();
    cases.push_back({"MoE E 2, every expert takes every token, both layers", all, 4, 64});
    // MoE with a real choice: 4 experts take 8 of 32 tokens each in the last layer
    ref::GPTConfig choice = shape(64, 4, 2);
    choice.n_expert = 4;
    choice.capacity_factor = 1.0f;
    choice.moe_every = 2;
    choice.expert_hidden = 64;
    choice.moe_group = ref::MOE_GROUP_BATCH;
    choice.finalize();
    cases.push_back({"MoE E 4, expert choice of 8 in 32 tokens, last layer", choice, 2, 16, 1, true});
    // the open models' shape: rope (the table from the host), RMSNorm, the biases it has, an untied head
    ref::GPTConfig llama = shape(128, 2, 1);
    llama.pos = ref::POS_ROPE;
    llama.rope.theta = 5e5;
    llama.rope.scaling = cpu::ROPE_SCALING_LLAMA3;
    llama.rope.original_max_pos = 32;
    llama.norm = ref::NORM_RMSNORM;
    llama.bias = ref::BIAS_NONE;
    llama.tie_embeddings = 0;
    llama.finalize();
    cases.push_back({"Llama shape: hs 64 (flash), rope llama3, rmsnorm, no biases, untied head", llama, 4, 100});
    ref::GPTConfig qwen = shape(64, 4, 2);
    qwen.pos = ref::POS_ROPE;
    qwen.rope.theta = 1e6;
    qwen.norm = ref::NORM_RMSNORM;
    qwen.norm_eps = 1e-6f;
    qwen.bias = ref::BIAS_QKV;
    qwen.finalize();
    cases.push_back({"Qwen2 shape: hs 16 (simple kernels), rope, rmsnorm 1e-6, q/k/v biases, tied", qwen, 4, 100});
    return cases;
}

// Packed rows of byte-like documents with EOT = 256, deterministic per (seed, step).
inline void model_test_batch(int B, int T, uint64_t seed, std::vector<int>& in, std::vector<int>& tgt,
                             std::vector<int>& ds) {
    Rng rng(seed);
    std::vector<int> stream(B * T + 1);
    for (int& t : stream) t = rng.below(12) == 0 ? 256 : 'a' + (int)rng.below(20);
    in.assign(stream.begin(), stream.end() - 1);
    tgt.assign(stream.begin() + 1, stream.end());
    ds.resize(B * T);
    for (int b = 0; b < B; b++) compute_doc_start(ds.data() + b * T, in.data() + b * T, T, 256);
}

template <typename Config>
Config convert_config(const ref::GPTConfig& c) {
    Config g;
    g.vocab_size = c.vocab_size; g.n_layer = c.n_layer; g.n_embd = c.n_embd; g.n_head = c.n_head;
    g.n_kv_head = c.n_kv_head; g.ffn_hidden = c.ffn_hidden; g.max_seq_len = c.max_seq_len; g.mlp = c.mlp;
    g.pos = c.pos;
    g.n_expert = c.n_expert; g.moe_every = c.moe_every; g.expert_hidden = c.expert_hidden;
    g.capacity_factor = c.capacity_factor; g.moe_group = c.moe_group;
    g.norm = c.norm; g.norm_eps = c.norm_eps; g.bias = c.bias; g.tie_embeddings = c.tie_embeddings; g.rope = c.rope;
    g.finalize();
    return g;
}

// The gradient of one tensor, as floats, from either build (the only place that knows where the
// trainers keep their gradients: the fp32 accumulators, laid out by ZeRO, see gpt_grads)
inline std::vector<float> ref_grad(const ref::GPT& m, const ref::ParamTensor& t) {
    const std::vector<float> all = ref::gpt_grads(m);
    return std::vector<float>(all.begin() + t.offset, all.begin() + t.offset + t.numel);
}
inline std::vector<float> gpu_grad(const gpu::GPT& m, const gpu::ParamTensor& t) {
    const std::vector<float> all = gpu::gpt_grads(m);
    return std::vector<float>(all.begin() + t.offset, all.begin() + t.offset + t.numel);
}

// The routing of MoE layer l in the last forward: expert_tokens [E, cap] and scores [BT, E]
struct LayerRouting {
    std::vector<int> expert_tokens;
    std::vector<float> scores;
};
inline LayerRouting ref_routing(const ref::GPT& m, int l) {
    const size_t rows = (size_t)m.config.n_expert * m.config.moe_capacity(m.B, m.T);
    const size_t n = (size_t)m.B * m.T * m.config.n_expert;
    return {std::vector<int>(gpt_layer_acts(m, l).expert_tokens, gpt_layer_acts(m, l).expert_tokens + rows),
            std::vector<float>(gpt_layer_acts(m, l).moe_scores, gpt_layer_acts(m, l).moe_scores + n)};
}
inline LayerRouting gpu_routing(const gpu::GPT& m, int l) {
    LayerRouting r;
    r.expert_tokens.resize((size_t)m.config.n_expert * m.config.moe_capacity(m.B, m.T));
    r.scores.resize((size_t)m.B * m.T * m.config.n_expert);
    cudaCheck(cudaMemcpy(r.expert_tokens.data(), gpt_layer_acts(m, l).expert_tokens, r.expert_tokens.size() * sizeof(int),
                         cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(r.scores.data(), gpt_layer_acts(m, l).moe_scores, r.scores.size() * sizeof(float),
                         cudaMemcpyDeviceToHost));
    return r;
}

// Compares the routing of every MoE layer of the last forward. Every flip (a token one side's expert
// took and the other's did not) must sit within the measured score noise of that expert's threshold,
// and there may be at most max_flips of them in all. Returns the number of flips.
inline int check_model_routing(const ref::GPT& r, const gpu::GPT& g, int max_flips) {
    const ref::GPTConfig& c = r.config;
    int flips = 0;
    for (int l = 0; l < c.n_layer; l++) {
        if (!c.is_moe(l)) continue;
        CAPTURE(l);
        const LayerRouting want = ref_routing(r, l), got = gpu_routing(g, l);
        // the scores come from activations that differ by the bf16 rounding of every op before them
        check_floatX("router scores", got.scores, want.scores, FLOATX_TOL, MODEL_MAX_TOL);
        double noise = 0;
        for (size_t i = 0; i < want.scores.size(); i++)
            noise = std::max(noise, (double)std::fabs(got.scores[i] - want.scores[i]));
        const moe_test::RoutingDiff d =
            moe_test::compare_routing(want.expert_tokens, got.expert_tokens, want.scores, r.B, r.T, c.n_expert,
                                      c.moe_capacity(r.B, r.T), c.moe_group == ref::MOE_GROUP_POSITION);
        INFO("layer " << l << ": " << d.flips << " routing flips, worst gap to the threshold " << d.worst_gap
                      << ", score noise (max |gpu - cpu|) " << noise);
        CHECK(d.worst_gap <= 2 * noise);  // a flip needs two scores within the noise of each other
        flips += d.flips;
    }
    CHECK(flips <= max_flips);
    return flips;
}

}  // namespace gpu_test

namespace gpu_test {
// The CPU build's initial parameters of rc (gpt_init_params at seed): what the GPU runs start from
inline std::vector<float> initial_params(const ref::GPTConfig& rc, int B, int T, uint64_t seed) {
    ref::GPT r;
    ref::gpt_allocate(r, rc, B, T);
    ref::gpt_init_params(r, seed);
    std::vector<float> p(r.n_params);
    ref::gpt_get_state(r, p.data(), nullptr, nullptr);
    ref::gpt_free(r);
    return p;
}
// r (the CPU build) and g (the GPU build, with layout) of rc for B x T from the same point: the CPU's
// initial parameters at seed rounded to bf16, zero moments
inline void twin_models(ref::GPT& r, gpu::GPT& g, const ref::GPTConfig& rc, int B, int T, uint64_t seed,
                        const gpu::Layout& layout = gpu::Layout()) {
    ref::gpt_allocate(r, rc, B, T);
    ref::gpt_init_params(r, seed);
    gpu::gpt_allocate(g, convert_config<gpu::GPTConfig>(rc), B, T, layout);
    REQUIRE(g.n_params == r.n_params);
    std::vector<float> p(r.n_params), zeros(r.n_params, 0.0f);
    ref::gpt_get_state(r, p.data(), nullptr, nullptr);
    p = floatX_round(p);
    ref::gpt_set_state(r, p.data(), zeros.data(), zeros.data());
    gpu::gpt_set_state(g, p.data(), zeros.data(), zeros.data());
}

// every gradient tensor of the two builds' last backward (the wte padding rows: zero in both)
inline void check_model_grads(const ref::GPT& r, const gpu::GPT& g) {
    const ref::GPTConfig& rc = r.config;
    for (size_t t = 0; t < r.table.size(); t++) {
        REQUIRE(g.table[t].name == r.table[t].name);
        std::vector<float> want = ref_grad(r, r.table[t]), got = gpu_grad(g, g.table[t]);
        if (r.table[t].name == "wte") {
            // padded rows: no token uses them, zero gradient in both builds
            bool pad_zero = true;
            for (size_t i = (size_t)rc.vocab_size * rc.n_embd; i < got.size(); i++)
                pad_zero &= got[i] == 0.0f && want[i] == 0.0f;
            CHECK_MESSAGE(pad_zero, "gradient of the wte padding rows is not zero");
            want.resize((size_t)rc.vocab_size * rc.n_embd);
            got.resize(want.size());
        }
        check_floatX("grad " + r.table[t].name, got, want, FLOATX_TOL, MODEL_MAX_TOL);
    }
}
}  // namespace gpu_test

TEST_CASE("model: one training step of the CUDA build matches the CPU build (hs 16/64/128, GELU, MoE, accumulation)") {
    using namespace gpu_test;
    for (const ModelCase& mc : model_cases()) {
        const ref::GPTConfig& rc = mc.config;
        INFO("case: " << mc.name << " (B " << mc.B << ", T " << mc.T << ", micro-steps " << mc.micro_steps << ")");
        const int B = mc.B, T = mc.T;
        ref::GPT r;
        gpu::GPT g;
        twin_models(r, g, rc, B, T, 11);

        // a routing-flip-free batch for the MoE selection case: up to 4 tries, each try's flips
        // checked (bounded, within the score noise); the other cases take the first batch
        std::vector<int> in, tgt, ds;
        uint64_t batch_seed = 5;
        bool compare_grads = true;
        if (mc.moe_routing) {
            compare_grads = false;
            for (int attempt = 0; attempt < 4; attempt++) {
                const uint64_t seed_try = 5 + 100 * attempt;
                model_test_batch(B, T, seed_try, in, tgt, ds);
                ref::gpt_forward(r, in.data(), tgt.data(), ds.data(), B, T, 1.0f);
                gpu::gpt_forward(g, in.data(), tgt.data(), ds.data(), B, T, 1.0f);
                const int flips = check_model_routing(r, g, 2);
                MESSAGE(mc.name << ": batch seed " << seed_try << ": " << flips << " routing flips");
                if (flips == 0) {
                    batch_seed = seed_try;
                    compare_grads = true;
                    break;
                }
            }
            if (!compare_grads) MESSAGE(mc.name << ": every try had routing flips: gradients not compared");
        }
        if (compare_grads) {
            ref::gpt_zero_grad(r);
            gpu::gpt_zero_grad(g);
            const float scale = 1.0f / mc.micro_steps;
            for (int k = 0; k < mc.micro_steps; k++) {
                CAPTURE(k);
                model_test_batch(B, T, batch_seed + 1000 * k, in, tgt, ds);
                if (k == 0) tgt[3] = -1;  // an ignored target
                const float loss_ref = ref::gpt_forward(r, in.data(), tgt.data(), ds.data(), B, T, scale);
                const float loss_gpu = gpu::gpt_forward(g, in.data(), tgt.data(), ds.data(), B, T, scale);
                INFO("micro-step " << k << " loss cpu " << loss_ref << " gpu " << loss_gpu);
                CHECK(std::fabs(loss_gpu - loss_ref) <= 1e-2 * std::fabs(loss_ref));
                if (mc.moe_routing) check_model_routing(r, g, 0);  // the batch chosen above: no flips
                ref::gpt_backward(r);
                gpu::gpt_backward(g);
            }
            check_model_grads(r, g);
        }
        ref::gpt_free(r);
        gpu::gpt_free(g);
    }
}

// The lm head over token chunks on the GPU (head_forward: per chunk of 7 tokens, which does not
// divide B*T, the logits matmul, the fused classifier in place and the two backward matmuls, the
// head's weight gradient accumulated over the chunks): the logits of a forward without targets
// (every chunk's, through the sink), the loss and one backward's gradients, against the CPU build
// in one chunk, to the one-step test's tolerances. The GPU logits are poisoned first.
TEST_CASE("model: the lm head over token chunks of 7 on the GPU matches the CPU build's whole micro-batch") {
    using namespace gpu_test;
    const ref::GPTConfig rc = model_test_config();
    const int B = 2, T = 50, BT = B * T, Vp = rc.padded_vocab_size;
    gpu::Layout layout;
    layout.logits_chunk = 7;
    ref::GPT r;
    gpu::GPT g;
    twin_models(r, g, rc, B, T, 13, layout);
    REQUIRE(r.logits_chunk >= BT);
    REQUIRE(g.logits_chunk == 7);
    std::vector<int> in, tgt, ds;
    model_test_batch(B, T, 21, in, tgt, ds);
    tgt[9] = -1;  // an ignored target

    const std::vector<float> want_logits = ref::gpt_logits(r, in.data(), ds.data(), B, T);
    const std::vector<floatX> poison((size_t)7 * Vp, float_to_floatX(NAN));  // the chunk buffer
    gpu::copy_to_buffer(g.logits, poison.data(), poison.size() * sizeof(floatX));
    const std::vector<floatX> got_bf16 = gpu::gpt_logits(g, in.data(), ds.data(), B, T);
    REQUIRE(got_bf16.size() == (size_t)BT * Vp);
    std::vector<float> got_logits(got_bf16.size());
    for (size_t i = 0; i < got_bf16.size(); i++) got_logits[i] = floatX_to_float(got_bf16[i]);
    check_floatX("logits, chunks of 7", got_logits, want_logits, FLOATX_TOL, MODEL_MAX_TOL);

    ref::gpt_zero_grad(r);
    gpu::gpt_zero_grad(g);
    const float loss_ref = ref::gpt_forward(r, in.data(), tgt.data(), ds.data(), B, T, 1.0f);
    const float loss_gpu = gpu::gpt_forward(g, in.data(), tgt.data(), ds.data(), B, T, 1.0f);
    INFO("loss cpu " << loss_ref << " gpu " << loss_gpu);
    CHECK(std::fabs(loss_gpu - loss_ref) <= 1e-2 * std::fabs(loss_ref));
    ref::gpt_backward(r);
    gpu::gpt_backward(g);
    check_model_grads(r, g);
    ref::gpt_free(r);
    gpu::gpt_free(g);
}

TEST_CASE("model: init leaves the wte padding rows at zero in both builds") {
    using namespace gpu_test;
    const ref::GPTConfig rc = model_test_config();
    ref::GPT r;
    ref::gpt_allocate(r, rc, 1, 8);
    ref::gpt_init_params(r, 7);
    gpu::GPT g;
    gpu::gpt_allocate(g, convert_config<gpu::GPTConfig>(rc), 1, 8);
    gpu::gpt_init_params(g, 7);
    std::vector<float> pr(r.n_params), pg(g.n_params);
    ref::gpt_get_state(r, pr.data(), nullptr, nullptr);
    gpu::gpt_get_state(g, pg.data(), nullptr, nullptr);
    const ref::ParamTensor& wte = r.table[0];
    REQUIRE(wte.name == "wte");
    size_t nonzero = 0, real_nonzero = 0;
    for (size_t i = 0; i < wte.numel; i++) {
        const bool pad = i >= (size_t)rc.vocab_size * rc.n_embd;
        if (pad) nonzero += pr[wte.offset + i] != 0.0f || pg[wte.offset + i] != 0.0f;
        else real_nonzero += pr[wte.offset + i] != 0.0f;
    }
    CHECK(nonzero == 0);
    CHECK(real_nonzero > 0);  // the real rows are random
    ref::gpt_free(r);
    gpu::gpt_free(g);
}

namespace gpu_test {
// n AdamW steps on batches model_test_batch(seed = step); returns the per-step losses (Sink: the
// build's LogitsSink, unused with targets)
template <typename M, typename Opt, typename Sink>
std::vector<float> train_steps(M& m, float (*forward)(M&, const int*, const int*, const int*, int, int, float, const Sink&),
                               void (*backward)(M&), void (*zero)(M&), float (*update)(M&, const Opt&, float, int),
                               int B, int T, int steps) {
    std::vector<float> losses;
    std::vector<int> in, tgt, ds;
    Opt opt;
    for (int s = 0; s < steps; s++) {
        zero(m);
        model_test_batch(B, T, 100 + s, in, tgt, ds);
        losses.push_back(forward(m, in.data(), tgt.data(), ds.data(), B, T, 1.0f, Sink()));
        backward(m);
        update(m, opt, 3e-3f * std::min(1.0f, (s + 1) / 5.0f), s);
    }
    return losses;
}
}  // namespace gpu_test

TEST_CASE("model: 20 steps follow the CPU loss curve within 2%, and GPU runs are bitwise reproducible") {
    using namespace gpu_test;
    ref::GPTConfig rc = model_test_config();
    const int B = 8, T = 128, steps = 20;
    ref::GPT r;
    ref::gpt_allocate(r, rc, B, T);
    ref::gpt_init_params(r, 3);
    std::vector<float> p(r.n_params), zeros(r.n_params, 0.0f);
    ref::gpt_get_state(r, p.data(), nullptr, nullptr);
    std::vector<float> cpu_losses = train_steps<ref::GPT, ref::OptimizerConfig>(
        r, ref::gpt_forward, ref::gpt_backward, ref::gpt_zero_grad, ref::gpt_update, B, T, steps);

    std::vector<std::vector<float>> gpu_losses(2), gpu_params(2);
    for (int run = 0; run < 2; run++) {
        gpu::GPT g;
        gpu::gpt_allocate(g, convert_config<gpu::GPTConfig>(rc), B, T);
        gpu::gpt_set_state(g, p.data(), zeros.data(), zeros.data());
        gpu_losses[run] = train_steps<gpu::GPT, gpu::OptimizerConfig>(
            g, gpu::gpt_forward, gpu::gpt_backward, gpu::gpt_zero_grad, gpu::gpt_update, B, T, steps);
        gpu_params[run].resize(g.n_params);
        gpu::gpt_get_state(g, gpu_params[run].data(), nullptr, nullptr);
        gpu::gpt_free(g);
    }
    for (int s = 0; s < steps; s++) {
        INFO("step " << s << ": cpu " << cpu_losses[s] << " gpu " << gpu_losses[0][s]);
        CHECK(std::fabs(gpu_losses[0][s] - cpu_losses[s]) <= 0.02 * cpu_losses[s]);
    }
    CHECK(cpu_losses.back() < cpu_losses.front() - 0.5f);  // it did train
    CHECK(memcmp(gpu_losses[0].data(), gpu_losses[1].data(), steps * sizeof(float)) == 0);
    CHECK(memcmp(gpu_params[0].data(), gpu_params[1].data(), gpu_params[0].size() * sizeof(float)) == 0);
    ref::gpt_free(r);
}

// -r 1 and -r 2 recompute in the backward exactly what the forward computed (the same kernels on the
// same inputs, deterministic): the GPU build's losses and parameters after a few steps are bitwise
// those of -r 0, dense and MoE; and -r 2 keeps fewer activation bytes than -r 1, which keeps fewer than -r 0.
TEST_CASE("model: activation recomputation (-r 1, -r 2) gives bitwise the -r 0 training on the GPU") {
    using namespace gpu_test;
    for (int moe = 0; moe < 2; moe++) {
        ref::GPTConfig rc = model_test_config();
        if (moe) { rc.n_expert = 4; rc.moe_every = 2; rc.expert_hidden = 96; rc.finalize(); }
        CAPTURE(moe);
        const int B = 4, T = 64, steps = 3;
        const std::vector<float> p = initial_params(rc, B, T, 7), zeros(p.size(), 0.0f);
        std::vector<float> losses[3], params[3];
        double act_bytes[3];
        for (int level = 0; level < 3; level++) {
            gpu::Layout layout;
            layout.recompute = level;
            gpu::GPT g;
            gpu::gpt_allocate(g, convert_config<gpu::GPTConfig>(rc), B, T, layout);
            act_bytes[level] = g.activation_bytes;
            gpu::gpt_set_state(g, p.data(), zeros.data(), zeros.data());
            losses[level] = train_steps<gpu::GPT, gpu::OptimizerConfig>(
                g, gpu::gpt_forward, gpu::gpt_backward, gpu::gpt_zero_grad, gpu::gpt_update, B, T, steps);
            params[level].resize(g.n_params);
            gpu::gpt_get_state(g, params[level].data(), nullptr, nullptr);
            gpu::gpt_free(g);
        }
        for (int level = 1; level < 3; level++) {
            CAPTURE(level);
            CHECK(memcmp(losses[level].data(), losses[0].data(), steps * sizeof(float)) == 0);
            CHECK(memcmp(params[level].data(), params[0].data(), params[0].size() * sizeof(float)) == 0);
            CHECK(act_bytes[level] < act_bytes[level - 1]);
        }
    }
}

// --offload optimizer: the AdamW step on the host (llmc/parallel/offload.h: the CPU twin, then the kernel's
// stochastic rounding, per piece over side streams) gives the device optimizer's training: the
// same losses, bf16 params and master weights bit for bit, and the same moments except where a
// value is denormal (the kernel's --use_fast_math flushes denormals to zero, the host keeps them).
TEST_CASE("model: --offload optimizer (AdamW on the host) trains bitwise as the device optimizer on the GPU") {
    using namespace gpu_test;
    for (int zero = 0; zero <= 3; zero += 3) {
        CAPTURE(zero);
        ref::GPTConfig rc = model_test_config();
        const int B = 4, T = 64, steps = 4;
        const std::vector<float> p = initial_params(rc, B, T, 9), zeros(p.size(), 0.0f);
        std::vector<float> losses[2], master[2], m[2], v[2];
        std::vector<floatX> bf16[2];
        for (int off = 0; off < 2; off++) {
            gpu::Layout layout;
            layout.zero_stage = zero;
            layout.offload = off ? OFFLOAD_OPTIMIZER : OFFLOAD_NONE;
            gpu::GPT g;
            const size_t host0 = gpu::host_bytes_allocated();
            gpu::gpt_allocate(g, convert_config<gpu::GPTConfig>(rc), B, T, layout);
            const MemoryEstimate e = gpu::gpt_memory_estimate(convert_config<gpu::GPTConfig>(rc), B, T, layout);
            CHECK(e.host_arenas() == (double)(gpu::host_bytes_allocated() - host0));
            gpu::gpt_set_state(g, p.data(), zeros.data(), zeros.data());
            losses[off] = train_steps<gpu::GPT, gpu::OptimizerConfig>(
                g, gpu::gpt_forward, gpu::gpt_backward, gpu::gpt_zero_grad, gpu::gpt_update, B, T, steps);
            for (auto* x : {&master[off], &m[off], &v[off]}) x->resize(g.n_params);
            gpu::gpt_get_state(g, master[off].data(), m[off].data(), v[off].data());
            bf16[off].resize(g.zero.params_elems());
            cudaCheck(cudaMemcpy(bf16[off].data(), g.params, bf16[off].size() * sizeof(floatX), cudaMemcpyDeviceToHost));
            gpu::gpt_free(g);
        }
        CHECK(memcmp(losses[1].data(), losses[0].data(), steps * sizeof(float)) == 0);
        CHECK(memcmp(bf16[1].data(), bf16[0].data(), bf16[0].size() * sizeof(floatX)) == 0);
        auto tiny = [](float x) { return std::fabs(x) < FLT_MIN; };  // zero or denormal
        size_t moment_diffs = 0, bad_moments = 0, bad_master = 0;
        for (size_t i = 0; i < p.size(); i++) {
            bool moments_differ = false;
            for (auto* x : {&m, &v})
                if (memcmp(&(*x)[0][i], &(*x)[1][i], 4) != 0) {
                    moments_differ = true;
                    bad_moments += !(tiny((*x)[0][i]) && tiny((*x)[1][i]));
                }
            moment_diffs += moments_differ;
            bad_master += !moments_differ && memcmp(&master[0][i], &master[1][i], 4) != 0;
        }
        MESSAGE("zero " << zero << ": " << moment_diffs << " elements with a denormal moment on one side");
        CHECK(bad_moments == 0);
        CHECK(bad_master == 0);
    }
}

// The memory plan is what the device gives out: the growth of the device memory in use
// (cudaMemGetInfo) from before gpt_allocate to after two training steps, i.e. the arenas plus
// whatever a library or the driver allocates on the way (cudaMalloc's 2 MiB granularity, kernels'
// local memory), within 5% of the plan's buffers, dense and MoE, at -r 0 and -r 2. The model is
// large enough (~0.4-0.6 GiB) that the granularity alone stays below 1%.
TEST_CASE("model: the device memory a training step uses is the plan's within 5% (-r 0 and -r 2, dense and MoE)") {
    using namespace gpu_test;
    for (int moe = 0; moe < 2; moe++)
        for (int level = 0; level <= 2; level += 2) {
            CAPTURE(moe);
            CAPTURE(level);
            ref::GPTConfig rc = model_test_config();
            rc.n_layer = 4;
            rc.n_embd = 512;
            rc.n_head = 8;
            rc.n_kv_head = 4;
            rc.max_seq_len = 512;
            rc.ffn_hidden = 0;
            if (moe) { rc.n_expert = 4; rc.moe_every = 2; rc.expert_hidden = 0; }
            rc.finalize();
            const gpu::GPTConfig gc = convert_config<gpu::GPTConfig>(rc);
            const int B = 8, T = 512;
            auto in_use = [] {
                size_t free_b = 0, total_b = 0;
                cudaCheck(cudaDeviceSynchronize());
                cudaCheck(cudaMemGetInfo(&free_b, &total_b));
                return (double)(total_b - free_b);
            };
            const double before = in_use();
            gpu::Layout layout;
            layout.recompute = level;
            gpu::GPT g;
            gpu::gpt_allocate(g, gc, B, T, layout);
            gpu::gpt_init_params(g, 5);
            train_steps<gpu::GPT, gpu::OptimizerConfig>(g, gpu::gpt_forward, gpu::gpt_backward, gpu::gpt_zero_grad,
                                                        gpu::gpt_update, B, T, 2);
            const double used = in_use() - before;
            const double plan = gpu::gpt_memory_estimate(gc, B, T, layout).buffers();
            gpu::gpt_free(g);
            MESSAGE("moe " << moe << ", -r " << level << ": plan " << plan / 1048576.0 << " MiB, device memory grew by "
                           << used / 1048576.0 << " MiB (" << 100.0 * (used - plan) / plan << "%)");
            CHECK(plan > 300.0 * 1048576.0);  // large enough for the granularity not to matter
            CHECK(std::fabs(used - plan) <= 0.05 * plan);
        }
}

// The GPU step does not wait on the host: on a tiny dense model (L = 2 blocks, SwiGLU, ALiBi, hs 16:
// the simple attention kernels), the sequence train_step runs (llmc/gpt/driver.h's caller in
// train_gpt.cu: gpt_pipeline_step, gpt_grad_norm, the losses, gpt_apply_update), counted on its
// second step (the first includes one-time work: cuBLASLt plans, the pinned staging areas' growth).
//  - host syncs: none in the micro-batches (their uploads are queued from the upload ring, their
//    loss sums stay on the device), exactly one for the norm (all the rank's ranges in one batch;
//    the losses' copy was queued before it, so reading them costs none), none in the update.
//  - launches of the update: ceil(pieces / ADAMW_MAX_PIECES) (one per tensor before); of the norm:
//    2 ceil(ranges / GN_MAX_RANGES) (the ranges are the 2L + 2 segments: a block's two halves; the tied head's gradient
//    joined the embedding's in the backward, before its reduction).
//  - launches of the whole step below a bound summed from each op's most launches (a cuBLASLt call
//    or a cub sort counts one; a tensor-parallel sum over one rank is its leaf and at most one copy):
//      embedding forward 1, backward 4 (keys, sort, chunk sums, combine) + its fold 1, + the tied
//        head's gradient added to it 1
//      a block's forward <= 10: LayerNorm (or fused residual + LayerNorm) 2, the four matmuls 4,
//        attention <= 2, SwiGLU 1, + 1 slack for a stream copy
//      a block's backward <= 36: four matmul backwards 4 x 4 (dbias 2, dinp 1, dweight 1), SwiGLU 1,
//        attention <= 4, two LayerNorms 2 x 5 (dinp 1; weight gradients 2 + their two fp32 adds),
//        the fold 1, + 4 slack for the stream's gradient copies and adds
//      the head: logits 1, loss 1, loss sum 1, dweight 1 + its fold 1, dinp <= 2, final LayerNorm
//        5 + its fold 1 = 13
//      plus the norm and the update as above.
TEST_CASE("model: a GPU training step has at most one host sync, and a bounded, derived number of launches") {
    using namespace gpu_test;
    const ref::GPTConfig rc = model_test_config();  // L 2, C 64, 4 heads of 16
    const int B = 2, T = 64, L = rc.n_layer;
    gpu::GPT g;
    gpu::gpt_allocate(g, convert_config<gpu::GPTConfig>(rc), B, T);
    gpu::gpt_init_params(g, 3);
    REQUIRE(g.pipe.M == 1);
    const gpu::OptimizerConfig opt;
    std::vector<int> in, tgt, ds;
    for (int step = 0; step < 2; step++) {
        model_test_batch(B, T, 40 + step, in, tgt, ds);
        const std::vector<gpu::MicroBatch> batches = {{in.data(), tgt.data(), ds.data()}};
        const gpu::BackendCounts c0 = gpu::backend_counts();
        gpu::gpt_zero_grad(g);
        gpu::gpt_pipeline_step(g, batches, B, T, 1.0f, false, nullptr);
        const gpu::BackendCounts c1 = gpu::backend_counts();
        const float norm = gpu::gpt_grad_norm(g);
        const gpu::BackendCounts c2 = gpu::backend_counts();
        const std::vector<double> losses = gpu::take_losses(g);
        const gpu::BackendCounts c3 = gpu::backend_counts();
        gpu::gpt_apply_update(g, opt, 1e-3f, step, norm);
        const gpu::BackendCounts c4 = gpu::backend_counts();
        REQUIRE(losses.size() == 1);
        CHECK(std::isfinite(losses[0]));
        CHECK(std::isfinite(norm));
        if (step == 0) continue;
        const size_t pieces = g.update_pieces.size(), ranges = g.zero.segs.size();
        REQUIRE(ranges == 2 * (size_t)L + 2);  // each block is two segments (its attention and FFN halves)
        INFO("micro-batches: " << c1.launches - c0.launches << " launches, " << c1.host_syncs - c0.host_syncs
                               << " syncs; norm " << c2.launches - c1.launches << " / " << c2.host_syncs - c1.host_syncs
                               << "; losses " << c3.host_syncs - c2.host_syncs << " syncs; update "
                               << c4.launches - c3.launches << " / " << c4.host_syncs - c3.host_syncs);
        CHECK(c1.host_syncs - c0.host_syncs == 0);
        CHECK(c2.host_syncs - c1.host_syncs == 1);
        CHECK(c3.host_syncs - c2.host_syncs == 0);
        CHECK(c4.host_syncs - c3.host_syncs == 0);
        const uint64_t update_launches = (pieces + ADAMW_MAX_PIECES - 1) / ADAMW_MAX_PIECES;
        const uint64_t norm_launches = 2 * ((ranges + GN_MAX_RANGES - 1) / GN_MAX_RANGES);
        CHECK(c4.launches - c3.launches == update_launches);
        CHECK(c2.launches - c1.launches == norm_launches);
        const uint64_t bound = (1 + 4 + 1 + 1) + (uint64_t)L * (10 + 36) + 13 + norm_launches + update_launches;
        INFO("whole step: " << c4.launches - c0.launches << " launches, bound " << bound);
        CHECK(c4.launches - c0.launches <= bound);
        CHECK(c4.host_syncs - c0.host_syncs <= 1);
    }
    gpu::gpt_free(g);
}
