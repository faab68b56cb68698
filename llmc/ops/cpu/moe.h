// Mixture-of-experts FFN with expert-choice routing (Zhou et al., "Mixture-of-Experts with
// Expert Choice Routing", NeurIPS 2022): every expert picks the tokens it processes, so each
// expert gets exactly `capacity` tokens by construction and no balancing loss is needed.
//
//   scores S[i, e] = softmax_e(x_i . Wr_e)                         (fp32, router has no bias)
//   each expert e takes the top tokens of column S[:, e] inside a routing group
//     group = the whole micro-batch (moe_group=batch), k = min(n, ceil(n c / E)) tokens
//     (c read as the decimal the user typed: moe_group_capacity),
//     or the B tokens at one position t (moe_group=position), min(B, ceil(B c / E)) per position;
//     ties go to the lower token index, so routing is deterministic
//   out_i = sum over the experts e that took token i of S[i, e] * FFN_e(x_i)   (0 if none took it)
//
// Routing is stored twice, once per direction of the data movement:
//   expert_tokens [E, capacity]  the tokens of expert e, ascending token index (gather)
//   token_slots   [n, E]         slot of token i in expert e's list, or -1   (combine, scatter)
// so every output element is owned by one thread and summed in expert order (deterministic).
// The backward treats the selection as constant, as the paper does: gradients flow into the
// experts and, through the gate values S[i, e], into the router.
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

namespace cpu {

// ceil(m * capacity_factor / E), capped at m, with the factor read as the decimal the user typed.
// capacity_factor is a float: 1.2 arrives as 1.20000005, and ceil(320 * 1.20000005 / 4) =
// ceil(96.0000038) = 97 where 96 is meant. The float is within 2^-24 (6e-8) relative of the typed
// decimal, so a quotient within 1e-6 relative of an integer is that integer (the typed value gives
// it exactly); anything further away is a real fraction and rounds up. (The one casualty would be
// a factor that itself differs from a round one by less than 1e-6 relative: not a useful setting.)
inline int moe_group_capacity(int m, int n_expert, float capacity_factor) {
    const double x = (double)m * (double)capacity_factor / n_expert;
    if (!(x < (double)m)) return m;  // capped in double before the conversion: any factor gives a valid count
    const double nearest = std::round(x);
    const double k = std::fabs(x - nearest) <= 1e-6 * std::max(1.0, x) ? nearest : std::ceil(x);
    return (int)std::min((double)m, k);
}

// tokens each expert takes in total (the size of one expert's list)
inline int moe_capacity(int B, int T, int n_expert, float capacity_factor, bool group_by_position) {
    if (group_by_position) return T * moe_group_capacity(B, n_expert, capacity_factor);
    return moe_group_capacity(B * T, n_expert, capacity_factor);
}

// scores [n, E] = softmax over experts of x [n, C] . router_w [E, C]^T, in fp32
// (S is the score type: float in the model, double in the finite-difference tests)
template <typename T, typename S>
void moe_router_forward(S* scores, const T* x, const T* router_w, int n, int C, int E) {
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) {
        S* s = scores + (size_t)i * E;
        S mx = -INFINITY;
        for (int e = 0; e < E; e++) {
            S dot = 0;
            for (int c = 0; c < C; c++) dot += (S)x[(size_t)i * C + c] * (S)router_w[(size_t)e * C + c];
            s[e] = dot;
            mx = std::max(mx, dot);
        }
        S sum = 0;
        for (int e = 0; e < E; e++) sum += (s[e] = std::exp(s[e] - mx));
        for (int e = 0; e < E; e++) s[e] /= sum;
    }
}

// Expert-choice selection over [B, T] tokens (token i = b * T + t). Writes expert_tokens
// [E, capacity] and token_slots [n, E] (see the top of this file).
template <typename S>
void moe_select(int* expert_tokens, int* token_slots, const S* scores, int B, int T, int E, float capacity_factor,
                bool group_by_position) {
    const int n = B * T, cap = moe_capacity(B, T, E, capacity_factor, group_by_position);
    std::fill_n(token_slots, (size_t)n * E, -1);
#pragma omp parallel for schedule(static)
    for (int e = 0; e < E; e++) {
        auto better = [&](int a, int b) {  // higher score first, then lower token index
            S sa = scores[(size_t)a * E + e], sb = scores[(size_t)b * E + e];
            return sa > sb || (sa == sb && a < b);
        };
        std::vector<int> chosen;
        chosen.reserve(cap);
        if (!group_by_position) {
            std::vector<int> order(n);
            for (int i = 0; i < n; i++) order[i] = i;
            std::partial_sort(order.begin(), order.begin() + cap, order.end(), better);
            chosen.assign(order.begin(), order.begin() + cap);
        } else {
            const int per_position = cap / T;
            std::vector<int> group(B);
            for (int t = 0; t < T; t++) {
                for (int b = 0; b < B; b++) group[b] = b * T + t;
                std::partial_sort(group.begin(), group.begin() + per_position, group.end(), better);
                chosen.insert(chosen.end(), group.begin(), group.begin() + per_position);
            }
        }
        std::sort(chosen.begin(), chosen.end());
        for (int j = 0; j < cap; j++) {
            expert_tokens[(size_t)e * cap + j] = chosen[j];
            token_slots[(size_t)chosen[j] * E + e] = j;
        }
    }
}

// xe [E, cap, C] = rows of x [n, C] listed in expert_tokens
template <typename T>
void moe_gather(T* xe, const T* x, const int* expert_tokens, int E, int cap, int C) {
#pragma omp parallel for schedule(static)
    for (long r = 0; r < (long)E * cap; r++)
        std::copy_n(x + (size_t)expert_tokens[r] * C, C, xe + (size_t)r * C);
}

// dx [n, C] += sum over the slots of token i of dxe (expert order)
template <typename T>
void moe_gather_backward(T* dx, const T* dxe, const int* token_slots, int n, int E, int cap, int C) {
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++)
        for (int e = 0; e < E; e++) {
            int j = token_slots[(size_t)i * E + e];
            if (j < 0) continue;
            const T* src = dxe + ((size_t)e * cap + j) * C;
            for (int c = 0; c < C; c++) dx[(size_t)i * C + c] += src[c];
        }
}

// out [n, C] = sum over the experts that took token i of scores[i, e] * ye [e, slot] (overwritten)
template <typename T, typename S>
void moe_combine_forward(T* out, const T* ye, const S* scores, const int* token_slots, int n, int E, int cap,
                         int C) {
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) {
        T* o = out + (size_t)i * C;
        std::fill_n(o, C, T(0));
        for (int e = 0; e < E; e++) {
            int j = token_slots[(size_t)i * E + e];
            if (j < 0) continue;
            const T g = (T)scores[(size_t)i * E + e];
            const T* y = ye + ((size_t)e * cap + j) * C;
            for (int c = 0; c < C; c++) o[c] += g * y[c];
        }
    }
}

// dye [E, cap, C] = gate * dout (overwritten); dscores [n, E] = dout . ye for taken (token,
// expert) pairs, 0 elsewhere (overwritten)
template <typename T, typename S>
void moe_combine_backward(T* dye, S* dscores, const T* dout, const T* ye, const S* scores,
                          const int* expert_tokens, const int* token_slots, int n, int E, int cap, int C) {
#pragma omp parallel for schedule(static)
    for (long r = 0; r < (long)E * cap; r++) {
        const int e = (int)(r / cap), i = expert_tokens[r];
        const T g = (T)scores[(size_t)i * E + e];
        for (int c = 0; c < C; c++) dye[(size_t)r * C + c] = g * dout[(size_t)i * C + c];
    }
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++)
        for (int e = 0; e < E; e++) {
            int j = token_slots[(size_t)i * E + e];
            S d = 0;
            if (j >= 0) {
                const T* y = ye + ((size_t)e * cap + j) * C;
                for (int c = 0; c < C; c++) d += (S)dout[(size_t)i * C + c] * (S)y[c];
            }
            dscores[(size_t)i * E + e] = d;
        }
}

// Through the softmax: dlogit[i, e] = S[i, e] (dS[i, e] - sum_f S[i, f] dS[i, f]); then
// drouter_w [E, C] += dlogit^T x (each element one addition of its complete sum over the tokens, in
// token order), dx [n, C] += dlogit router_w. Either may be null (the split backward).
// G: the router gradient's type (float; double in the finite-difference tests).
template <typename T, typename S, typename G>
void moe_router_backward(T* dx, G* drouter_w, const S* dscores, const S* scores, const T* x, const T* router_w,
                         int n, int C, int E) {
    std::vector<S> dlogit((size_t)n * E);
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) {
        const S* s = scores + (size_t)i * E;
        const S* ds = dscores + (size_t)i * E;
        S dot = 0;
        for (int e = 0; e < E; e++) dot += s[e] * ds[e];
        for (int e = 0; e < E; e++) {
            S dl = s[e] * (ds[e] - dot);
            dlogit[(size_t)i * E + e] = dl;
            if (dx)
                for (int c = 0; c < C; c++) dx[(size_t)i * C + c] += (T)dl * router_w[(size_t)e * C + c];
        }
    }
    if (!drouter_w) return;
#pragma omp parallel
    {
        std::vector<G> sum(C);  // one expert's row, summed over the tokens before the one addition
#pragma omp for schedule(static)
        for (int e = 0; e < E; e++) {
            std::fill(sum.begin(), sum.end(), G(0));
            for (int i = 0; i < n; i++) {
                const T dl = (T)dlogit[(size_t)i * E + e];
                for (int c = 0; c < C; c++) sum[c] += (G)(dl * x[(size_t)i * C + c]);
            }
            for (int c = 0; c < C; c++) drouter_w[(size_t)e * C + c] += sum[c];
        }
    }
}

}  // namespace cpu
