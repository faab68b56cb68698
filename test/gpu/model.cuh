// The CUDA trainer (gpu::) against the CPU reference trainer (ref::): the same config, params and
// batches. One training step: loss within 1e-2 relative, every gradient within bf16 tolerance.
// 20 steps: the loss curves agree within 2%. Two GPU runs: bitwise-identical losses and params.
#pragma once
#include <cstring>

namespace gpu_test {

struct ModelCase {
    ref::GPTConfig config;
    int B, T, steps;
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
    g.finalize();
    return g;
}

// the gradient of one tensor, as floats, from either build
inline std::vector<float> ref_grad(const ref::GPT& m, const ref::ParamTensor& t) {
    return std::vector<float>(m.grads + t.offset, m.grads + t.offset + t.numel);
}
inline std::vector<float> gpu_grad(const gpu::GPT& m, const gpu::ParamTensor& t) {
    std::vector<floatX> h(t.numel);
    cudaCheck(cudaMemcpy(h.data(), m.grads + t.offset, t.numel * sizeof(floatX), cudaMemcpyDeviceToHost));
    return std::vector<float>(h.begin(), h.end());
}

}  // namespace gpu_test

TEST_CASE("model: one training step of the CUDA build matches the CPU build") {
    using namespace gpu_test;
    for (int variant = 0; variant < 2; variant++) {
        ref::GPTConfig rc = model_test_config();
        if (variant == 1) { rc.mlp = ref::MLP_GELU; rc.pos = ref::POS_LEARNED; rc.n_kv_head = rc.n_head; rc.ffn_hidden = 0; rc.finalize(); }
        CAPTURE(variant);
        const int B = 4, T = 100;
        ref::GPT r;
        ref::gpt_allocate(r, rc, B, T);
        ref::gpt_init_params(r, 11);
        gpu::GPT g;
        gpu::gpt_allocate(g, convert_config<gpu::GPTConfig>(rc), B, T);
        std::vector<float> p(r.n_params), zeros(r.n_params, 0.0f);
        ref::gpt_get_state(r, p.data(), nullptr, nullptr);
        // the CPU model gets the bf16-rounded params, so both start from the same point
        std::vector<float> p_bf16 = bf16_round(p);
        ref::gpt_set_state(r, p_bf16.data(), zeros.data(), zeros.data());
        gpu::gpt_set_state(g, p_bf16.data(), zeros.data(), zeros.data());

        std::vector<int> in, tgt, ds;
        model_test_batch(B, T, 5, in, tgt, ds);
        tgt[3] = -1;
        ref::gpt_zero_grad(r);
        gpu::gpt_zero_grad(g);
        float loss_ref = ref::gpt_forward(r, in.data(), tgt.data(), ds.data(), B, T, 1.0f);
        float loss_gpu = gpu::gpt_forward(g, in.data(), tgt.data(), ds.data(), B, T, 1.0f);
        INFO("loss cpu " << loss_ref << " gpu " << loss_gpu);
        CHECK(std::fabs(loss_gpu - loss_ref) <= 1e-2 * std::fabs(loss_ref));
        ref::gpt_backward(r);
        gpu::gpt_backward(g);
        for (size_t k = 0; k < r.table.size(); k++) {
            std::vector<float> want = ref_grad(r, r.table[k]), got = gpu_grad(g, g.table[k]);
            if (r.table[k].name == "wte") {  // padded rows have zero gradient in both: compare the real ones
                want.resize((size_t)rc.vocab_size * rc.n_embd);
                got.resize(want.size());
            }
            CHECK_CLOSE("grad " + r.table[k].name, rel_l2(got, want), BF16_TOL);
        }
        ref::gpt_free(r);
        gpu::gpt_free(g);
    }
}

namespace gpu_test {
// after a backward, as train_main does: the leaf gradient into the fp32 accumulator gpt_update reads
inline void accumulate_leaf(ref::GPT& m) { cpu::grad_accumulate<float>(m.grad_acc, m.grads, m.n_params); }
inline void accumulate_leaf(gpu::GPT& m) { ::grad_accumulate(m.grad_acc, m.grads, m.n_params); }

// n AdamW steps on batches model_test_batch(seed = step); returns the per-step losses
template <typename M, typename Opt>
std::vector<float> train_steps(M& m, float (*forward)(M&, const int*, const int*, const int*, int, int, float),
                               void (*backward)(M&), void (*zero)(M&), float (*update)(M&, const Opt&, float, int),
                               int B, int T, int steps) {
    std::vector<float> losses;
    std::vector<int> in, tgt, ds;
    Opt opt;
    for (int s = 0; s < steps; s++) {
        zero(m);
        model_test_batch(B, T, 100 + s, in, tgt, ds);
        losses.push_back(forward(m, in.data(), tgt.data(), ds.data(), B, T, 1.0f));
        backward(m);
        accumulate_leaf(m);  // one micro-step per optimizer step
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
