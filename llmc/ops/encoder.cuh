// Token (+ learned position) embedding on the GPU: the twin of llmc/ops/cpu/encoder.h.
//   forward   out[i,:] = (v_i in range ? wte[v_i - vocab_begin,:] : 0) + wpe[p_i,:],  v_i = tokens[i],
//             p_i = (i % T) - doc_start[i] (position inside the document); wpe == nullptr (ALiBi models)
//             means no position term; "in range": vocab_begin <= v_i < vocab_begin + vocab_count.
//   backward  dwte[v - vocab_begin,:] += sum_{i : v_i == v} dout[i,:] for v in range,
//             dwpe[p,:] += sum_{i : p_i == p} dout[i,:] (every token)
//             dwte, dwpe fp32; each row gets its sum in one add (the gradient-path contract)
// Vocab-parallel embedding (tensor parallelism): each rank holds the rows [vocab_begin, vocab_begin +
//   vocab_count) of wte; the ranks' outputs sum to the full embedding (out-of-range tokens give exact
//   zeros), and their dwte rows are the full table's rows. Without it: vocab_begin 0, vocab_count = rows.
//
// forward: a gather-add, memory bound. One thread per 8 channels (16-byte loads/stores) when
//   C % 8 == 0 and the pointers are 16-byte aligned, else one thread per channel.
//
// backward: a token can repeat thousands of times in a batch (", " and " the" are ~4% of English
//   text), so a scatter-add with float atomics would be slow (contention on one row) and, worse, its
//   summation order would change from run to run. Instead every gradient row is a sum in a fixed order:
//   1. group the B*T positions by key (the local token row for dwte, the position in the document for
//      dwpe) with cub::DeviceRadixSort::SortPairs (part of the CUDA toolkit, header only). It is a stable
//      sort, so each group lists its positions in increasing order, and it needs no host sync. Tokens
//      outside the vocab range get the key SKIP (0xffffffff), which sorts after every real row: their
//      entries form the tail of the sorted list, which the chunk kernels skip.
//   2. encoder_chunk_sum_kernel: the sorted list is cut into CHUNK = 64 entries; a block owns one
//      chunk x one slice of channels (a thread owns VEC channels) and walks the chunk in order,
//      summing dout rows in fp32 registers (UNROLL rows loaded at a time). A run of equal keys that
//      lies wholly inside the chunk is added to its gradient row at once (fp32 read-modify-write:
//      no other block touches that row). A run that crosses a chunk boundary instead leaves its fp32
//      partial in scratch: slot 0 of a chunk is its first run when that run started in an earlier
//      chunk, slot 1 its last run when that run started here and continues into the next chunk.
//   3. encoder_combine_kernel: the chunk where a crossing run starts (its "owner") adds its slot 1
//      and the slot 0 of each following chunk the run covers, in chunk order, and adds the total to
//      the gradient row. Other blocks exit at once.
//   Work per block is bounded by CHUNK rows whatever the token distribution (all tokens equal is
//   just one long run: 64 rows per block, then one owner summing n/64 partials).
//
// Scratch (cuda_scratch, encoder_scratch_bytes(B, T, C)): with n = B*T, four int arrays of n (sort
//   keys and values, in and out), 2*C floats per chunk (ceil(n/64) chunks) and cub's temporary
//   storage (about 8n bytes + the lookback; bounded by 12n + 64 KiB, llmc/ops/op_scratch.h, and checked
//   at each call). At B*T = 65536, C = 768: ~8 MB.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include "llmc/ops/cuda_common.cuh"
#include "llmc/ops/op_scratch.h"  // CHUNK and the scratch layout (encoder_scratch_bytes)

namespace encoder_detail {

constexpr int UNROLL = 4;        // dout rows loaded together (loads in flight per thread)
constexpr int MAX_THREADS = 128; // channel threads per backward block (C wider: more blocks in y)
constexpr unsigned SKIP = 0xffffffffu;  // sort key of a token outside the vocab range (sorts last)

__host__ __device__ inline bool in_vocab_range(int token, int vocab_begin, int vocab_count) {
    return token >= vocab_begin && token - vocab_begin < vocab_count;
}

using namespace floatx8;  // aligned16, load_floatX / store_floatX, ... (llmc/ops/cuda_common.cuh)

// fp32 partials: VEC == 8 is two 16-byte accesses (p 32-byte aligned)
template <int VEC>
__device__ inline void load_f32(float (&f)[VEC], const float* p) {
    if constexpr (VEC == 8) {
        const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) f[k] = p[k];
    }
}
template <int VEC>
__device__ inline void store_f32(float* p, const float (&f)[VEC]) {
    if constexpr (VEC == 8) {
        reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
        reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) p[k] = f[k];
    }
}
// row[c .. c+VEC) += acc: the fp32 gradient row's one add of its run's sum
template <int VEC>
__device__ inline void add_to_row(float* row, const float (&acc)[VEC]) {
    float old[VEC];
    load_f32<VEC>(old, row);
#pragma unroll
    for (int k = 0; k < VEC; k++) old[k] = __fadd_rn(old[k], acc[k]);
    store_f32<VEC>(row, old);
}

// one thread per VEC channels of one output row (VEC divides C)
template <int VEC>
__global__ void encoder_forward_kernel(floatX* __restrict__ out, const int* __restrict__ tokens,
                                       const int* __restrict__ doc_start, const floatX* __restrict__ wte,
                                       const floatX* __restrict__ wpe, int T, int C, int vocab_begin,
                                       int vocab_count, size_t n_units) {
    const size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= n_units) return;
    const int units_per_row = C / VEC;
    const size_t i = u / units_per_row;
    const int c = (int)(u % units_per_row) * VEC;
    float e[VEC];
    const int tok = tokens[i];
    if (in_vocab_range(tok, vocab_begin, vocab_count)) {
        load_floatX<VEC>(e, wte + (size_t)(tok - vocab_begin) * C + c);
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) e[k] = 0.0f;
    }
    if (wpe != nullptr) {
        const int pos = (int)(i % T) - doc_start[i];
        float p[VEC];
        load_floatX<VEC>(p, wpe + (size_t)pos * C + c);
#pragma unroll
        for (int k = 0; k < VEC; k++) e[k] += p[k];
    }
    store_floatX<VEC>(out + i * C + c, e);
}

// sort input: key = local token row (by_position false; SKIP outside the vocab range) or position
// inside the document; value = index
__global__ void encoder_keys_kernel(unsigned* keys, int* vals, const int* tokens, const int* doc_start, int T,
                                    int n, bool by_position, int vocab_begin, int vocab_count) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (by_position) keys[i] = (unsigned)(i % T - doc_start[i]);
    else keys[i] = in_vocab_range(tokens[i], vocab_begin, vocab_count) ? (unsigned)(tokens[i] - vocab_begin) : SKIP;
    vals[i] = i;
}

// Step 2 (see the top of the file). keys/rows: the sorted keys and their dout row indices.
// partials: [n_chunks][2][C] fp32. grid (n_chunks, channel slices), blockDim.x * VEC channels each.
template <int VEC>
__global__ void encoder_chunk_sum_kernel(float* __restrict__ grad, float* __restrict__ partials,
                                         const floatX* __restrict__ dout, const unsigned* __restrict__ keys,
                                         const int* __restrict__ rows, int n, int C) {
    __shared__ unsigned s_key[CHUNK];
    __shared__ int s_row[CHUNK];
    const int chunk = blockIdx.x;
    const int begin = chunk * CHUNK;
    if (keys[begin] == SKIP) return;  // the sorted tail of out-of-range tokens (block-uniform)
    int len = min(CHUNK, n - begin);
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        s_key[j] = keys[begin + j];
        s_row[j] = rows[begin + j];
    }
    __syncthreads();
    while (s_key[len - 1] == SKIP) len--;  // the chunk where the tail starts: its real entries only
    // does the first run continue from the previous chunk, the last one into the next? (a run never
    // continues into the SKIP tail: its key differs)
    const bool open_left = begin > 0 && keys[begin - 1] == s_key[0];
    const bool open_right = begin + len < n && keys[begin + len] == s_key[len - 1];
    const int c = VEC * (blockIdx.y * blockDim.x + threadIdx.x);
    if (c >= C) return;  // (no barrier below)

    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) acc[k] = 0.0f;
    int run_begin = 0;  // chunk index where the current run starts
    for (int j0 = 0; j0 < len; j0 += UNROLL) {
        Packed<VEC> row[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            if (j0 + u < len) row[u] = load_packed<VEC>(dout + (size_t)s_row[j0 + u] * C + c);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int j = j0 + u;
            if (j >= len) break;
            float x[VEC];
            unpack<VEC>(x, row[u]);
#pragma unroll
            for (int k = 0; k < VEC; k++) acc[k] += x[k];
            if (j < len - 1 && s_key[j + 1] == s_key[j]) continue;  // the run goes on
            // the run [run_begin, j] ends in this chunk
            const bool starts_here = run_begin > 0 || !open_left;
            const bool ends_here = j < len - 1 || !open_right;
            if (starts_here && ends_here) {
                add_to_row<VEC>(grad + (size_t)s_key[j] * C + c, acc);
            } else {
                store_f32<VEC>(partials + ((size_t)chunk * 2 + (starts_here ? 1 : 0)) * C + c, acc);
            }
#pragma unroll
            for (int k = 0; k < VEC; k++) acc[k] = 0.0f;
            run_begin = j + 1;
        }
    }
}

// Step 3: the owner of a run crossing chunk boundaries sums its partials in chunk order.
template <int VEC>
__global__ void encoder_combine_kernel(float* __restrict__ grad, const float* __restrict__ partials,
                                       const unsigned* __restrict__ keys, int n, int C) {
    const int chunk = blockIdx.x;
    const int begin = chunk * CHUNK;
    const int end = min(n, begin + CHUNK);
    const unsigned key = keys[end - 1];
    if (key == SKIP) return;                          // out-of-range tokens: no gradient row
    if (end >= n || keys[end] != key) return;         // the last run ends inside this chunk
    if (begin > 0 && keys[begin - 1] == key) return;  // it started in an earlier chunk, the owner
    const int c = VEC * (blockIdx.y * blockDim.x + threadIdx.x);
    if (c >= C) return;
    float acc[VEC], x[VEC];
    load_f32<VEC>(acc, partials + ((size_t)chunk * 2 + 1) * C + c);
    for (int next = chunk + 1;; next++) {  // the run covers the start of chunk `next`: its slot 0
        load_f32<VEC>(x, partials + ((size_t)next * 2 + 0) * C + c);
#pragma unroll
        for (int k = 0; k < VEC; k++) acc[k] += x[k];
        const int next_end = min(n, (next + 1) * CHUNK);
        if (next_end >= n || keys[next_end] != key) break;  // ... and ends inside it
    }
    add_to_row<VEC>(grad + (size_t)key * C + c, acc);
}

inline int position_bits(int T) {  // bits of the largest position, T - 1 (at least 1)
    int bits = 1;
    while (bits < 31 && (1u << bits) < (unsigned)T) bits++;
    return bits;
}

// dwte or dwpe += dout rows grouped by key (local token rows of the tokens in the vocab range, or
// positions in the document when by_position)
inline void grouped_row_sum(float* grad, const floatX* dout, const int* tokens, const int* doc_start, int B, int T,
                            int C, bool by_position, int vocab_begin, int vocab_count) {
    const int n = B * T;
    const Scratch s = scratch_layout(B, T, C);
    char* base = cuda_scratch<char>(s.total, "encoder_backward");
    unsigned* keys_in = (unsigned*)(base + s.keys_in);
    unsigned* keys_out = (unsigned*)(base + s.keys_out);
    int* vals_in = (int*)(base + s.vals_in);
    int* vals_out = (int*)(base + s.vals_out);
    float* partials = (float*)(base + s.partials);

    encoder_keys_kernel<<<ceil_div(n, 256), 256, 0, llmc_stream()>>>(keys_in, vals_in, tokens, doc_start, T, n,
                                                                     by_position, vocab_begin, vocab_count);
    cudaCheckLaunch();
    // cub's own need for this sort, within the bound the plan reserved (llmc/ops/op_scratch.h)
    const int key_bits = by_position ? position_bits(T) : 32;
    size_t cub_bytes = 0;
    cudaCheck(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, (const unsigned*)nullptr, (unsigned*)nullptr,
                                              (const int*)nullptr, (int*)nullptr, n, 0, key_bits, llmc_stream()));
    LLMC_CHECK(cub_bytes <= s.cub_bytes, "internal: encoder_backward: cub's radix sort of %d pairs needs %zu bytes, more "
               "than the %zu of cub_sort_bytes_bound (llmc/ops/op_scratch.h)", n, cub_bytes, s.cub_bytes);
    cudaCheck(cub::DeviceRadixSort::SortPairs(base + s.cub, cub_bytes, keys_in, keys_out, vals_in, vals_out, n, 0, key_bits,
                                              llmc_stream()));
    cudaCheckLaunch();

    const bool vec = C % 8 == 0 && aligned16(grad) && aligned16(dout);
    const int units = vec ? C / 8 : C;  // thread work units across a row
    const int threads = std::min(MAX_THREADS, ceil_div(units, 32) * 32);
    const dim3 grid(ceil_div(n, CHUNK), ceil_div(units, threads));
    cudaStream_t st = llmc_stream();
    if (vec) {
        encoder_chunk_sum_kernel<8><<<grid, threads, 0, st>>>(grad, partials, dout, keys_out, vals_out, n, C);
        cudaCheckLaunch();
        encoder_combine_kernel<8><<<grid, threads, 0, st>>>(grad, partials, keys_out, n, C);
    } else {
        encoder_chunk_sum_kernel<1><<<grid, threads, 0, st>>>(grad, partials, dout, keys_out, vals_out, n, C);
        cudaCheckLaunch();
        encoder_combine_kernel<1><<<grid, threads, 0, st>>>(grad, partials, keys_out, n, C);
    }
    cudaCheckLaunch();
}

}  // namespace encoder_detail

// out [B*T, C] overwritten; tokens, doc_start [B*T]; wte [vocab_count, C] (the global rows
// [vocab_begin, vocab_begin + vocab_count)); wpe [max_T, C] or nullptr
inline void encoder_forward(floatX* out, const int* tokens, const int* doc_start, const floatX* wte,
                            const floatX* wpe, int B, int T, int C, int vocab_begin, int vocab_count) {
    using namespace encoder_detail;
    const bool vec = C % 8 == 0 && aligned16(out) && aligned16(wte) && (wpe == nullptr || aligned16(wpe));
    const size_t n_units = (size_t)B * T * (vec ? C / 8 : C);
    if (n_units == 0) return;
    const int threads = 256;
    const unsigned blocks = (unsigned)((n_units + threads - 1) / threads);
    cudaStream_t st = llmc_stream();
    if (vec)
        encoder_forward_kernel<8><<<blocks, threads, 0, st>>>(out, tokens, doc_start, wte, wpe, T, C, vocab_begin,
                                                              vocab_count, n_units);
    else
        encoder_forward_kernel<1><<<blocks, threads, 0, st>>>(out, tokens, doc_start, wte, wpe, T, C, vocab_begin,
                                                              vocab_count, n_units);
    cudaCheckLaunch();
}

// dwte [vocab_count, C] += (rows of the tokens in range), dwpe [max_T, C] += (or nullptr); fp32, one
// add per row per call; deterministic. Scratch: encoder_scratch_bytes.
inline void encoder_backward(float* dwte, float* dwpe, const floatX* dout, const int* tokens, const int* doc_start,
                             int B, int T, int C, int vocab_begin, int vocab_count) {
    if ((size_t)B * T == 0 || C == 0) return;
    LLMC_CHECK((size_t)B * T < (size_t)INT32_MAX, "encoder_backward: B*T = %zu too large", (size_t)B * T);
    LLMC_CHECK(vocab_begin >= 0 && vocab_count >= 0, "encoder_backward: vocab range [%d, %d + %d) is invalid",
               vocab_begin, vocab_begin, vocab_count);
    encoder_detail::grouped_row_sum(dwte, dout, tokens, doc_start, B, T, C, false, vocab_begin, vocab_count);
    if (dwpe != nullptr)
        encoder_detail::grouped_row_sum(dwpe, dout, tokens, doc_start, B, T, C, true, vocab_begin, vocab_count);
}
