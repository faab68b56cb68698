// Fused softmax + cross-entropy + dlogits over the real vocabulary (the first V of Vp padded
// columns). Targets equal to -1 are ignored. losses[n] gets the per-token loss (0 when ignored);
// when dloss != 0 the logits are overwritten in place with dloss * (softmax - onehot) (padded and
// ignored positions get 0), so the probabilities are never stored separately.
#pragma once
#include <algorithm>
#include <cmath>

namespace cpu {

template <typename T>
void fused_classifier(T* logits, T* losses, const int* targets, T dloss, int N, int V, int Vp) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        T* x = logits + (size_t)n * Vp;
        const int tgt = targets[n];
        T mx = -INFINITY;
        for (int v = 0; v < V; v++) mx = std::max(mx, x[v]);
        T sum = 0;
        for (int v = 0; v < V; v++) sum += std::exp(x[v] - mx);
        const T lse = mx + std::log(sum);
        losses[n] = tgt < 0 ? T(0) : lse - x[tgt];
        if (dloss != T(0)) {
            const T d = tgt < 0 ? T(0) : dloss;
            for (int v = 0; v < V; v++) x[v] = d * (std::exp(x[v] - lse) - (v == tgt ? T(1) : T(0)));
            for (int v = V; v < Vp; v++) x[v] = 0;
        }
    }
}

}  // namespace cpu
