// C entry points of the attention ops (llmc/ops/attention.cuh) for scripts/bench_attention.py, which loads
// them with ctypes next to PyTorch and hands over raw device pointers of its tensors:
//   nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -Xcompiler -fPIC -shared -DLLMC_ATTENTION_LIB -I. \
//        dev/cuda/attention_lib.cu -o /tmp/libllmc_attention.so
// version: 0 = attention_forward / attention_backward (what the trainer runs), 1 = the simple kernels,
// 2 = the flash kernels. alibi: 0 or 1 (ALiBi over all n_head heads: alibi_n_head = n_head, head0 = 0).
// Every call returns 0, or 1 with the reason in llmc_attention_last_error().
// The kernels run on llmc_stream() (the per-thread default stream, which synchronises with PyTorch's
// legacy default stream), and nothing here synchronises: time with events on the default stream.
// Without -DLLMC_ATTENTION_LIB (as `make dev_cuda` builds every dev/cuda file) this is a small program
// that checks the entry points against the ops called directly.
#include <cstdio>
#include <string>
#include "llmc/ops/cuda_common.cuh"
#include "llmc/ops/attention.cuh"

static std::string g_last_error;

extern "C" {

const char* llmc_attention_last_error() { return g_last_error.c_str(); }

int llmc_attention_forward(void* out, void* lse, const void* qkv, const void* doc_start, int B, int T, int n_head,
                           int n_kv_head, int hs, int alibi, int version) {
    try {
        floatX* o = (floatX*)out;
        float* l = (float*)lse;
        const floatX* x = (const floatX*)qkv;
        const int* ds = (const int*)doc_start;
        const int nh = alibi ? n_head : 0;  // ALiBi over all n_head heads, or none
        if (version == 0) attention_forward(o, l, x, ds, B, T, n_head, n_kv_head, hs, nh, 0);
        else if (version == 1) attention_detail::forward_simple(o, l, x, ds, B, T, n_head, n_kv_head, hs, nh, 0);
        else if (version == 2) attention_detail::forward_flash(o, l, x, ds, B, T, n_head, n_kv_head, hs, nh, 0);
        else LLMC_FAIL("llmc_attention_forward: version %d (0 = dispatch, 1 = simple, 2 = flash)", version);
        return 0;
    } catch (const std::exception& e) {
        g_last_error = e.what();
        return 1;
    }
}

// scratch (D = dO.O) is reserved here on first use for the largest shape seen (cudaMalloc: do a warm-up
// call before timing)
int llmc_attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const void* lse,
                            const void* doc_start, int B, int T, int n_head, int n_kv_head, int hs, int alibi,
                            int version) {
    try {
        cuda_scratch_reserve(attention_scratch_bytes(B, T, n_head));
        floatX* d = (floatX*)dqkv;
        const floatX *dO = (const floatX*)dout, *x = (const floatX*)qkv, *o = (const floatX*)out;
        const float* l = (const float*)lse;
        const int* ds = (const int*)doc_start;
        const int nh = alibi ? n_head : 0;  // ALiBi over all n_head heads, or none
        if (version == 0) attention_backward(d, dO, x, o, l, ds, B, T, n_head, n_kv_head, hs, nh, 0);
        else if (version == 1) attention_detail::backward_simple(d, dO, x, o, l, ds, B, T, n_head, n_kv_head, hs, nh, 0);
        else if (version == 2) attention_detail::backward_flash(d, dO, x, o, l, ds, B, T, n_head, n_kv_head, hs, nh, 0);
        else LLMC_FAIL("llmc_attention_backward: version %d (0 = dispatch, 1 = simple, 2 = flash)", version);
        return 0;
    } catch (const std::exception& e) {
        g_last_error = e.what();
        return 1;
    }
}

// waits for the work queued by the calls above; 0 or 1 (error in llmc_attention_last_error())
int llmc_attention_sync() {
    try {
        cudaCheck(cudaStreamSynchronize(llmc_stream()));
        return 0;
    } catch (const std::exception& e) {
        g_last_error = e.what();
        return 1;
    }
}

}  // extern "C"

#ifndef LLMC_ATTENTION_LIB
#include <cstring>
#include <vector>
// As a program: the entry points give the same bits as the ops called directly (hs 64, one packed row).
int main() {
    const int B = 1, T = 300, NH = 4, KVH = 2, hs = 64, row = (NH + 2 * KVH) * hs;
    std::vector<floatX> qkv_h((size_t)T * row);
    for (size_t i = 0; i < qkv_h.size(); i++) qkv_h[i] = float_to_floatX((float)((i * 2654435761u) % 1000) / 500.f - 1.f);
    std::vector<int> ds_h(T);
    for (int t = 0; t < T; t++) ds_h[t] = t - t % 37;
    floatX *qkv, *out, *out2, *dqkv, *dqkv2;
    float *lse, *lse2;
    int* ds;
    cudaCheck(cudaMalloc(&qkv, qkv_h.size() * sizeof(floatX)));
    cudaCheck(cudaMalloc(&dqkv, qkv_h.size() * sizeof(floatX)));
    cudaCheck(cudaMalloc(&dqkv2, qkv_h.size() * sizeof(floatX)));
    cudaCheck(cudaMalloc(&out, (size_t)T * NH * hs * sizeof(floatX)));
    cudaCheck(cudaMalloc(&out2, (size_t)T * NH * hs * sizeof(floatX)));
    cudaCheck(cudaMalloc(&lse, (size_t)T * NH * sizeof(float)));
    cudaCheck(cudaMalloc(&lse2, (size_t)T * NH * sizeof(float)));
    cudaCheck(cudaMalloc(&ds, T * sizeof(int)));
    cudaCheck(cudaMemcpy(qkv, qkv_h.data(), qkv_h.size() * sizeof(floatX), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(ds, ds_h.data(), T * sizeof(int), cudaMemcpyHostToDevice));
    cuda_scratch_reserve(attention_scratch_bytes(B, T, NH));
    attention_forward(out, lse, qkv, ds, B, T, NH, KVH, hs, NH, 0);
    attention_backward(dqkv, out, qkv, out, lse, ds, B, T, NH, KVH, hs, NH, 0);  // out as dout: any bf16 tensor
    bool ok = llmc_attention_forward(out2, lse2, qkv, ds, B, T, NH, KVH, hs, 1, 0) == 0 &&
              llmc_attention_backward(dqkv2, out, qkv, out, lse, ds, B, T, NH, KVH, hs, 1, 0) == 0 &&
              llmc_attention_sync() == 0;
    auto same = [](const void* a, const void* b, size_t bytes) {
        std::vector<char> x(bytes), y(bytes);
        cudaCheck(cudaMemcpy(x.data(), a, bytes, cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(y.data(), b, bytes, cudaMemcpyDeviceToHost));
        return x == y;
    };
    ok = ok && same(out, out2, (size_t)T * NH * hs * sizeof(floatX)) && same(lse, lse2, (size_t)T * NH * sizeof(float)) &&
         same(dqkv, dqkv2, qkv_h.size() * sizeof(floatX));
    ok = ok && llmc_attention_forward(out2, lse2, qkv, ds, B, T, NH, KVH, hs, 1, 7) == 1;  // a bad version is refused
    printf("attention_lib: the ctypes entry points of scripts/bench_attention.py match the ops: %s\n",
           ok ? "ok" : "MISMATCH");
    return ok ? 0 : 1;
}
#endif
