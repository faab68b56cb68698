// Unit tests of the CPU reference ops (llmc/ops/cpu/*.h):
//  - every forward against a naive definition written here straight from the math (float and double),
//  - every backward against central finite differences in double (L = sum(out * R), dout = R),
//  - accumulate (+=) vs overwrite semantics: overwritten outputs are poisoned with NaN first,
//    accumulated ones are pre-filled and must end as prefill + contribution,
//  - bitwise independence of the result from the OpenMP thread count,
//  - the gradient-path contract of the weight gradients: an op accumulating into acc gives bitwise
//    acc + (the op on zeros), one addition of a complete sum per element.
#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iomanip>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "llmc/ops/cpu/accumulate.h"
#include "llmc/ops/cpu/adamw.h"
#include "llmc/ops/cpu/attention.h"
#include "llmc/ops/cpu/classifier.h"
#include "llmc/ops/cpu/encoder.h"
#include "llmc/ops/cpu/global_norm.h"
#include "llmc/ops/cpu/layernorm.h"
#include "llmc/ops/cpu/matmul.h"
#include "llmc/ops/cpu/mlp.h"
#include "llmc/ops/cpu/moe.h"
#include "llmc/ops/cpu/rmsnorm.h"
#include "llmc/ops/cpu/rope.h"
#include "llmc/ops/cpu/vec_math.h"
#include "llmc/ops/op_scratch.h"
#include "test_util.h"

namespace {

using std::vector;

// ------------------------------------------------------------------------------------------------
// helpers: test_util.h (Rng, rand_vec, nan_vec, to_d, dot, sub, tname, fwd_rtol, check_close,
// check_bitwise, fd_check)

using namespace test_util;

vector<double> add(const vector<double>& a, const vector<double>& b) {
    vector<double> c(a.size());
    for (size_t i = 0; i < a.size(); i++) c[i] = a[i] + b[i];
    return c;
}


// doc_start for packed rows: doc_start[t] = last EOT position <= t, or 0. With B > 1 row 0 has no
// EOT at all (it starts mid-document); the other rows have random EOTs plus a document of length 1
// inside the row and one at its end.
vector<int> make_doc_start(int B, int T, Rng& r, double p_eot = 0.25) {
    vector<int> ds((size_t)B * T);
    for (int b = 0; b < B; b++) {
        vector<char> eot(T, 0);
        if (!(B > 1 && b == 0)) {
            for (int t = 0; t < T; t++) eot[t] = r.uni(0, 1) < p_eot;
            if (T >= 4) {
                int p = r.randint(1, T - 3);
                eot[p] = eot[p + 1] = 1;
            }
            if (T >= 2) eot[T - 1] = 1;
        }
        int last = 0;
        for (int t = 0; t < T; t++) {
            if (eot[t]) last = t;
            ds[(size_t)b * T + t] = last;
        }
    }
    return ds;
}

// naive definitions (double)

// Cm[m, n] = sum_k A(m, k) Bm[k, n], A(m, k) = A[m * sam + k * sak]
vector<double> naive_gemm(const vector<double>& A, long sam, long sak, const vector<double>& Bm, int M,
                          int N, int K) {
    vector<double> Cm((size_t)M * N, 0.0);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = 0;
            for (int k = 0; k < K; k++) s += A[m * sam + k * sak] * Bm[(size_t)k * N + n];
            Cm[(size_t)m * N + n] = s;
        }
    return Cm;
}

// y = x W^T + b, W [OC, C]
vector<double> naive_linear(const vector<double>& x, const vector<double>& W, const double* b, int BT,
                            int C, int OC) {
    vector<double> y((size_t)BT * OC);
    for (int i = 0; i < BT; i++)
        for (int o = 0; o < OC; o++) {
            double s = b ? b[o] : 0.0;
            for (int c = 0; c < C; c++) s += x[(size_t)i * C + c] * W[(size_t)o * C + c];
            y[(size_t)i * OC + o] = s;
        }
    return y;
}

void naive_layernorm(vector<double>& y, vector<double>& mean, vector<double>& rstd, const vector<double>& x,
                     const vector<double>& w, const vector<double>& b, int N, int C) {
    y.assign((size_t)N * C, 0);
    mean.assign(N, 0);
    rstd.assign(N, 0);
    for (int n = 0; n < N; n++) {
        double mu = 0;
        for (int c = 0; c < C; c++) mu += x[(size_t)n * C + c];
        mu /= C;
        double var = 0;
        for (int c = 0; c < C; c++) var += std::pow(x[(size_t)n * C + c] - mu, 2);
        var /= C;  // biased
        const double rs = 1.0 / std::sqrt(var + 1e-5);
        for (int c = 0; c < C; c++) y[(size_t)n * C + c] = (x[(size_t)n * C + c] - mu) * rs * w[c] + b[c];
        mean[n] = mu;
        rstd[n] = rs;
    }
}

// ALiBi slopes, transcribed from the reference code of Press et al. (get_slopes)
vector<double> paper_slopes(int n) {
    auto pow2 = [](int k) {
        const double start = std::pow(2.0, -std::pow(2.0, -(std::log2((double)k) - 3)));
        vector<double> s;
        for (int i = 0; i < k; i++) s.push_back(start * std::pow(start, i));
        return s;
    };
    const double l = std::log2((double)n);
    if (l == std::floor(l)) return pow2(n);
    const int closest = 1 << (int)std::floor(l);
    vector<double> s = pow2(closest), s2 = paper_slopes(2 * closest);
    for (int i = 0; i < n - closest; i++) s.push_back(s2[2 * i]);
    return s;
}

// Full T x T masked score matrix, softmax, times V. out [B, T, n_head, hs], lse [B, n_head, T].
void naive_attention(vector<double>& out, vector<double>& lse, const vector<double>& qkv,
                     const vector<int>& ds, int B, int T, int nh, int nkv, int hs, bool alibi) {
    const int row = (nh + 2 * nkv) * hs;
    const vector<double> slope = paper_slopes(nh);
    out.assign((size_t)B * T * nh * hs, 0);
    lse.assign((size_t)B * nh * T, 0);
    vector<double> S((size_t)T * T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < nh; h++) {
            const int kh = h / (nh / nkv);
            auto q = [&](int t, int d) { return qkv[((size_t)b * T + t) * row + h * hs + d]; };
            auto k = [&](int t, int d) { return qkv[((size_t)b * T + t) * row + (nh + kh) * hs + d]; };
            auto v = [&](int t, int d) { return qkv[((size_t)b * T + t) * row + (nh + nkv + kh) * hs + d]; };
            for (int i = 0; i < T; i++)
                for (int j = 0; j < T; j++) {
                    const bool visible = ds[(size_t)b * T + i] <= j && j <= i;
                    double s = 0;
                    for (int d = 0; d < hs; d++) s += q(i, d) * k(j, d);
                    s = s / std::sqrt((double)hs) - (alibi ? slope[h] * (i - j) : 0.0);
                    S[(size_t)i * T + j] = visible ? s : -INFINITY;
                }
            for (int i = 0; i < T; i++) {
                double mx = -INFINITY;
                for (int j = 0; j < T; j++) mx = std::max(mx, S[(size_t)i * T + j]);
                double z = 0;
                for (int j = 0; j < T; j++) z += std::exp(S[(size_t)i * T + j] - mx);
                lse[((size_t)b * nh + h) * T + i] = mx + std::log(z);
                for (int j = 0; j < T; j++) {
                    const double p = std::exp(S[(size_t)i * T + j] - mx) / z;
                    for (int d = 0; d < hs; d++) out[(((size_t)b * T + i) * nh + h) * hs + d] += p * v(j, d);
                }
            }
        }
}

double naive_silu(double a) { return a / (1.0 + std::exp(-a)); }
double naive_gelu(double x) {
    return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / std::acos(-1.0)) * (x + 0.044715 * x * x * x)));
}

// ------------------------------------------------------------------------------------------------
// matmul.h

struct GemmShape {
    int M, N, K;
};

TEST_CASE_TEMPLATE("gemm: forward vs naive, both A layouts, overwrite and accumulate", T, float, double) {
    // 6x16 register tile, 96-row chunks, 256-deep k blocks: shapes below and above each
    const GemmShape shapes[] = {{7, 5, 19}, {6, 16, 8}, {12, 32, 256}, {13, 37, 300}, {100, 50, 70},
                                {200, 33, 260}, {1, 1, 1}};
    Rng r(1);
    for (const auto& s : shapes) {
        for (int transA = 0; transA < 2; transA++)
            for (int acc = 0; acc < 2; acc++) {
                CAPTURE(s.M);
                CAPTURE(s.N);
                CAPTURE(s.K);
                CAPTURE(transA);
                CAPTURE(acc);
                auto A = rand_vec<T>(r, (size_t)s.M * s.K), Bm = rand_vec<T>(r, (size_t)s.K * s.N);
                // A(m, k): row-major [M, K] (sam = K, sak = 1) or stored transposed [K, M] (sam = 1, sak = M)
                const long sam = transA ? 1 : s.K, sak = transA ? s.M : 1;
                auto prefill = rand_vec<T>(r, (size_t)s.M * s.N);
                auto Cm = acc ? prefill : nan_vec<T>((size_t)s.M * s.N);
                cpu::gemm<T>(Cm.data(), A.data(), sam, sak, Bm.data(), s.M, s.N, s.K, acc != 0);
                auto ref = naive_gemm(to_d(A), sam, sak, to_d(Bm), s.M, s.N, s.K);
                if (acc) ref = add(ref, to_d(prefill));
                check_close(std::string("gemm<") + tname<T>() + "> C" + (acc ? " (prefill + A*B)" : ""),
                            Cm, ref, fwd_rtol<T>() * (s.K > 200 ? 2 : 1));
            }
    }
}

struct MatmulShape {
    int BT, C, OC;
};

TEST_CASE_TEMPLATE("matmul_forward: vs naive x W^T + b, with and without bias", T, float, double) {
    const MatmulShape shapes[] = {{7, 5, 19}, {100, 70, 50}, {1, 1, 1}, {97, 300, 17}, {6, 16, 16}};
    Rng r(2);
    for (const auto& s : shapes)
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            CAPTURE(s.BT);
            CAPTURE(s.C);
            CAPTURE(s.OC);
            CAPTURE(with_bias);
            auto x = rand_vec<T>(r, (size_t)s.BT * s.C), W = rand_vec<T>(r, (size_t)s.OC * s.C),
                 b = rand_vec<T>(r, s.OC);
            auto out = nan_vec<T>((size_t)s.BT * s.OC);
            cpu::matmul_forward<T>(out.data(), x.data(), W.data(), with_bias ? b.data() : nullptr, s.BT, s.C,
                                   s.OC);
            auto bd = to_d(b);
            auto ref = naive_linear(to_d(x), to_d(W), with_bias ? bd.data() : nullptr, s.BT, s.C, s.OC);
            check_close(std::string("matmul_forward<") + tname<T>() + "> out", out, ref,
                        fwd_rtol<T>() * (s.C > 200 ? 2 : 1));
        }
}

TEST_CASE_TEMPLATE("matmul_backward: vs naive (dinp overwritten, dweight/dbias accumulate)", T, float, double) {
    const MatmulShape shapes[] = {{7, 5, 19}, {100, 70, 50}, {260, 20, 24}, {130, 33, 150}};
    Rng r(3);
    for (const auto& s : shapes)
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            CAPTURE(s.BT);
            CAPTURE(s.C);
            CAPTURE(s.OC);
            CAPTURE(with_bias);
            auto x = rand_vec<T>(r, (size_t)s.BT * s.C), W = rand_vec<T>(r, (size_t)s.OC * s.C),
                 dout = rand_vec<T>(r, (size_t)s.BT * s.OC);
            auto dW0 = rand_vec<T>(r, (size_t)s.OC * s.C), db0 = rand_vec<T>(r, s.OC);
            auto dx = nan_vec<T>((size_t)s.BT * s.C);
            auto dW = dW0, db = db0;
            cpu::matmul_backward<T>(dx.data(), dW.data(), with_bias ? db.data() : nullptr, dout.data(), x.data(),
                                    W.data(), s.BT, s.C, s.OC);
            const auto xd = to_d(x), Wd = to_d(W), dd = to_d(dout);
            // dinp = dout W ; dW = dout^T x ; db = column sums of dout
            vector<double> rdx((size_t)s.BT * s.C, 0), rdW((size_t)s.OC * s.C, 0), rdb(s.OC, 0);
            for (int i = 0; i < s.BT; i++)
                for (int o = 0; o < s.OC; o++) {
                    const double g = dd[(size_t)i * s.OC + o];
                    rdb[o] += g;
                    for (int c = 0; c < s.C; c++) {
                        rdx[(size_t)i * s.C + c] += g * Wd[(size_t)o * s.C + c];
                        rdW[(size_t)o * s.C + c] += g * xd[(size_t)i * s.C + c];
                    }
                }
            const double tol = fwd_rtol<T>() * (s.BT > 200 ? 2 : 1);
            const std::string op = std::string("matmul_backward<") + tname<T>() + "> ";
            check_close(op + "dinp", dx, rdx, tol);
            check_close(op + "dweight (prefill + dout^T inp)", dW, add(to_d(dW0), rdW), tol);
            if (with_bias)
                check_close(op + "dbias (prefill + sum dout)", db, add(to_d(db0), rdb), tol);
            else
                check_bitwise(op + "dbias untouched when null", db, db0);
        }
}

TEST_CASE("matmul: backward vs finite differences (double)") {
    struct Case {
        int BT, C, OC;
        size_t max_n;  // FD on a random subset for the large shape (it is also checked fully vs naive)
    };
    const Case cases[] = {{7, 5, 19, SIZE_MAX}, {3, 17, 6, SIZE_MAX}, {100, 70, 50, 300}, {260, 20, 24, 200}};
    Rng r(4);
    for (const auto& cs : cases)
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            const int BT = cs.BT, C = cs.C, OC = cs.OC;
            CAPTURE(BT);
            CAPTURE(C);
            CAPTURE(OC);
            CAPTURE(with_bias);
            auto x = rand_vec<double>(r, (size_t)BT * C), W = rand_vec<double>(r, (size_t)OC * C),
                 b = rand_vec<double>(r, OC), R = rand_vec<double>(r, (size_t)BT * OC);
            auto loss = [&] {
                vector<double> out((size_t)BT * OC);
                cpu::matmul_forward<double>(out.data(), x.data(), W.data(), with_bias ? b.data() : nullptr, BT,
                                            C, OC);
                return dot(out, R);
            };
            auto dx = nan_vec<double>((size_t)BT * C);
            auto dW0 = rand_vec<double>(r, (size_t)OC * C), db0 = rand_vec<double>(r, OC);
            auto dW = dW0, db = db0;
            cpu::matmul_backward<double>(dx.data(), dW.data(), with_bias ? db.data() : nullptr, R.data(),
                                         x.data(), W.data(), BT, C, OC);
            fd_check("matmul_backward<double> dinp", x, dx, loss, cs.max_n);
            fd_check("matmul_backward<double> dweight (minus prefill)", W, sub(dW, dW0), loss, cs.max_n);
            if (with_bias) fd_check("matmul_backward<double> dbias (minus prefill)", b, sub(db, db0), loss);
        }
}

// ------------------------------------------------------------------------------------------------
// layernorm.h

struct LnShape {
    int N, C;
};
const LnShape ln_shapes[] = {{7, 5}, {13, 37}, {3, 70}, {4, 1}, {1, 64}};

TEST_CASE_TEMPLATE("layernorm_forward and fused_residual_layernorm_forward: vs naive", T, float, double) {
    Rng r(5);
    for (const auto& s : ln_shapes) {
        CAPTURE(s.N);
        CAPTURE(s.C);
        const size_t NC = (size_t)s.N * s.C;
        auto x = rand_vec<T>(r, NC, 0.1, 2.0), w = rand_vec<T>(r, s.C), b = rand_vec<T>(r, s.C);
        const std::string op = std::string("layernorm_forward<") + tname<T>() + "> ";
        {
            auto out = nan_vec<T>(NC), mean = nan_vec<T>(s.N), rstd = nan_vec<T>(s.N);
            cpu::layernorm_forward<T>(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), s.N,
                                      s.C);
            vector<double> ry, rm, rr;
            naive_layernorm(ry, rm, rr, to_d(x), to_d(w), to_d(b), s.N, s.C);
            check_close(op + "out", out, ry, fwd_rtol<T>());
            check_close(op + "mean", mean, rm, fwd_rtol<T>());
            check_close(op + "rstd", rstd, rr, fwd_rtol<T>());
        }
        {
            const std::string fop = std::string("fused_residual_layernorm_forward<") + tname<T>() + "> ";
            auto x2 = rand_vec<T>(r, NC);
            auto res = nan_vec<T>(NC), out = nan_vec<T>(NC), mean = nan_vec<T>(s.N), rstd = nan_vec<T>(s.N);
            cpu::fused_residual_layernorm_forward<T>(res.data(), out.data(), mean.data(), rstd.data(), x.data(),
                                                     x2.data(), w.data(), b.data(), s.N, s.C);
            vector<double> rres(NC);
            for (size_t i = 0; i < NC; i++) rres[i] = (double)x[i] + (double)x2[i];
            vector<double> ry, rm, rr;
            naive_layernorm(ry, rm, rr, rres, to_d(w), to_d(b), s.N, s.C);
            check_close(fop + "residual", res, rres, fwd_rtol<T>());
            check_close(fop + "out", out, ry, fwd_rtol<T>());
            check_close(fop + "mean", mean, rm, fwd_rtol<T>());
            check_close(fop + "rstd", rstd, rr, fwd_rtol<T>());
        }
    }
}

TEST_CASE("layernorm_backward: vs finite differences (double), all gradients accumulate") {
    Rng r(6);
    for (const auto& s : ln_shapes) {
        const int N = s.N, C = s.C;
        CAPTURE(N);
        CAPTURE(C);
        const size_t NC = (size_t)N * C;
        auto x = rand_vec<double>(r, NC, 0.1, 2.0), w = rand_vec<double>(r, C), b = rand_vec<double>(r, C),
             R = rand_vec<double>(r, NC);
        auto loss = [&] {
            vector<double> out(NC), mean(N), rstd(N);
            cpu::layernorm_forward<double>(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N,
                                           C);
            return dot(out, R);
        };
        vector<double> out(NC), mean(N), rstd(N);
        cpu::layernorm_forward<double>(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
        auto dx0 = rand_vec<double>(r, NC), dw0 = rand_vec<double>(r, C), db0 = rand_vec<double>(r, C);
        auto dx = dx0, dw = dw0, db = db0;
        cpu::layernorm_backward<double>(dx.data(), dw.data(), db.data(), R.data(), x.data(), w.data(),
                                        mean.data(), rstd.data(), N, C);
        fd_check("layernorm_backward<double> dinp (minus prefill)", x, sub(dx, dx0), loss);
        fd_check("layernorm_backward<double> dweight (minus prefill)", w, sub(dw, dw0), loss);
        fd_check("layernorm_backward<double> dbias (minus prefill)", b, sub(db, db0), loss);
    }
}

TEST_CASE("fused_residual_layernorm_forward: gradients of both outputs vs finite differences (double)") {
    // L = sum(out * R) + sum(residual * R2): dinp1 = dinp2 = R2 + LN backward of R, which is what
    // layernorm_backward gives when dinp is pre-filled with the residual stream's gradient R2.
    Rng r(7);
    for (const auto& s : ln_shapes) {
        const int N = s.N, C = s.C;
        CAPTURE(N);
        CAPTURE(C);
        const size_t NC = (size_t)N * C;
        auto x1 = rand_vec<double>(r, NC), x2 = rand_vec<double>(r, NC), w = rand_vec<double>(r, C),
             b = rand_vec<double>(r, C), R = rand_vec<double>(r, NC), R2 = rand_vec<double>(r, NC);
        auto loss = [&] {
            vector<double> res(NC), out(NC), mean(N), rstd(N);
            cpu::fused_residual_layernorm_forward<double>(res.data(), out.data(), mean.data(), rstd.data(),
                                                          x1.data(), x2.data(), w.data(), b.data(), N, C);
            return dot(out, R) + dot(res, R2);
        };
        vector<double> res(NC), out(NC), mean(N), rstd(N);
        cpu::fused_residual_layernorm_forward<double>(res.data(), out.data(), mean.data(), rstd.data(), x1.data(),
                                                      x2.data(), w.data(), b.data(), N, C);
        auto dres = R2, dw = vector<double>(C, 0.0), db = vector<double>(C, 0.0);
        cpu::layernorm_backward<double>(dres.data(), dw.data(), db.data(), R.data(), res.data(), w.data(),
                                        mean.data(), rstd.data(), N, C);
        fd_check("fused_residual_layernorm (via layernorm_backward) dinp1", x1, dres, loss);
        fd_check("fused_residual_layernorm (via layernorm_backward) dinp2", x2, dres, loss);
        fd_check("fused_residual_layernorm (via layernorm_backward) dweight", w, dw, loss);
        fd_check("fused_residual_layernorm (via layernorm_backward) dbias", b, db, loss);
    }
}

// ------------------------------------------------------------------------------------------------
// rmsnorm.h

void naive_rmsnorm(vector<double>& y, vector<double>& rstd, const vector<double>& x, const vector<double>& w, int N,
                   int C, double eps) {
    y.assign((size_t)N * C, 0);
    rstd.assign(N, 0);
    for (int n = 0; n < N; n++) {
        double ms = 0;
        for (int c = 0; c < C; c++) ms += x[(size_t)n * C + c] * x[(size_t)n * C + c];
        ms /= C;  // the mean square: no mean is subtracted
        const double rs = 1.0 / std::sqrt(ms + eps);
        for (int c = 0; c < C; c++) y[(size_t)n * C + c] = x[(size_t)n * C + c] * rs * w[c];
        rstd[n] = rs;
    }
}

TEST_CASE_TEMPLATE("rmsnorm_forward and fused_residual_rmsnorm_forward: vs naive", T, float, double) {
    Rng r(41);
    for (const float eps : {1e-5f, 1e-6f})
        for (const auto& s : ln_shapes) {
            CAPTURE(s.N);
            CAPTURE(s.C);
            CAPTURE(eps);
            const size_t NC = (size_t)s.N * s.C;
            auto x = rand_vec<T>(r, NC, 0.1, 2.0), w = rand_vec<T>(r, s.C);
            {
                const std::string op = std::string("rmsnorm_forward<") + tname<T>() + "> ";
                auto out = nan_vec<T>(NC), rstd = nan_vec<T>(s.N);
                cpu::rmsnorm_forward<T>(out.data(), rstd.data(), x.data(), w.data(), s.N, s.C, eps);
                vector<double> ry, rr;
                naive_rmsnorm(ry, rr, to_d(x), to_d(w), s.N, s.C, (double)eps);
                check_close(op + "out", out, ry, fwd_rtol<T>());
                check_close(op + "rstd", rstd, rr, fwd_rtol<T>());
            }
            {
                const std::string fop = std::string("fused_residual_rmsnorm_forward<") + tname<T>() + "> ";
                auto x2 = rand_vec<T>(r, NC);
                auto res = nan_vec<T>(NC), out = nan_vec<T>(NC), rstd = nan_vec<T>(s.N);
                cpu::fused_residual_rmsnorm_forward<T>(res.data(), out.data(), rstd.data(), x.data(), x2.data(),
                                                       w.data(), s.N, s.C, eps);
                vector<double> rres(NC);
                for (size_t i = 0; i < NC; i++) rres[i] = (double)x[i] + (double)x2[i];
                vector<double> ry, rr;
                naive_rmsnorm(ry, rr, rres, to_d(w), s.N, s.C, (double)eps);
                check_close(fop + "residual", res, rres, fwd_rtol<T>());
                check_close(fop + "out", out, ry, fwd_rtol<T>());
                check_close(fop + "rstd", rstd, rr, fwd_rtol<T>());
            }
        }
}

TEST_CASE("rmsnorm_backward: vs finite differences (double), dinp and dweight accumulate, the split calls") {
    Rng r(42);
    const float eps = 1e-5f;
    for (const auto& s : ln_shapes) {
        const int N = s.N, C = s.C;
        CAPTURE(N);
        CAPTURE(C);
        const size_t NC = (size_t)N * C;
        auto x = rand_vec<double>(r, NC, 0.1, 2.0), w = rand_vec<double>(r, C), R = rand_vec<double>(r, NC);
        auto loss = [&] {
            vector<double> out(NC), rstd(N);
            cpu::rmsnorm_forward<double>(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
            return dot(out, R);
        };
        vector<double> out(NC), rstd(N);
        cpu::rmsnorm_forward<double>(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
        auto dx0 = rand_vec<double>(r, NC), dw0 = rand_vec<double>(r, C);
        auto dx = dx0, dw = dw0;
        cpu::rmsnorm_backward<double, double>(dx.data(), dw.data(), R.data(), x.data(), w.data(), rstd.data(), N, C);
        fd_check("rmsnorm_backward<double> dinp (minus prefill)", x, sub(dx, dx0), loss);
        fd_check("rmsnorm_backward<double> dweight (minus prefill)", w, sub(dw, dw0), loss);
        // the split calls (the zero-bubble pipeline's B and W): dinp alone leaves dweight alone and
        // vice versa (weight null: not read), and together they give the one call's bits
        auto sx = dx0, sw = dw0;
        cpu::rmsnorm_backward<double, double>(sx.data(), nullptr, R.data(), x.data(), w.data(), rstd.data(), N, C);
        check_bitwise("rmsnorm_backward dinp alone", sx, dx);
        cpu::rmsnorm_backward<double, double>(nullptr, sw.data(), R.data(), x.data(), nullptr, rstd.data(), N, C);
        check_bitwise("rmsnorm_backward dweight alone", sw, dw);
    }
}

TEST_CASE("rmsnorm_backward (float): dweight is acc + the op on zeros, bitwise, independent of the thread count") {
    Rng r(43);
    const int N = 67, C = 70;  // C spans three 32-channel blocks, the last one ragged
    const size_t NC = (size_t)N * C;
    auto x = rand_vec<float>(r, NC, 0.1, 2.0), w = rand_vec<float>(r, C), dout = rand_vec<float>(r, NC);
    vector<float> y(NC), rstd(N);
    cpu::rmsnorm_forward<float>(y.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
    const auto dw0 = rand_vec<float>(r, C), dx0 = rand_vec<float>(r, NC);
    vector<float> zero(C, 0.0f);
    cpu::rmsnorm_backward<float, float>(nullptr, zero.data(), dout.data(), x.data(), nullptr, rstd.data(), N, C);
    vector<float> want(C);
    for (int c = 0; c < C; c++) want[c] = dw0[c] + zero[c];
    const int saved = omp_get_max_threads();
    vector<float> first_dx;
    for (int threads : {1, 2, 3}) {
        CAPTURE(threads);
        omp_set_num_threads(threads);
        auto dw = dw0, dx = dx0;
        cpu::rmsnorm_backward<float, float>(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
        check_bitwise("rmsnorm_backward dweight vs acc + op(0)", dw, want);
        if (first_dx.empty()) first_dx = dx;
        check_bitwise("rmsnorm_backward dinp across thread counts", dx, first_dx);
    }
    omp_set_num_threads(saved);
}

TEST_CASE("fused_residual_rmsnorm_forward: gradients of both outputs vs finite differences (double)") {
    // L = sum(out * R) + sum(residual * R2): dinp1 = dinp2 = R2 + the RMSNorm backward of R, which is what
    // rmsnorm_backward gives when dinp is pre-filled with the residual stream's gradient R2
    Rng r(44);
    const float eps = 1e-5f;
    for (const auto& s : ln_shapes) {
        const int N = s.N, C = s.C;
        CAPTURE(N);
        CAPTURE(C);
        const size_t NC = (size_t)N * C;
        auto x1 = rand_vec<double>(r, NC), x2 = rand_vec<double>(r, NC), w = rand_vec<double>(r, C),
             R = rand_vec<double>(r, NC), R2 = rand_vec<double>(r, NC);
        auto loss = [&] {
            vector<double> res(NC), out(NC), rstd(N);
            cpu::fused_residual_rmsnorm_forward<double>(res.data(), out.data(), rstd.data(), x1.data(), x2.data(),
                                                        w.data(), N, C, eps);
            return dot(out, R) + dot(res, R2);
        };
        vector<double> res(NC), out(NC), rstd(N);
        cpu::fused_residual_rmsnorm_forward<double>(res.data(), out.data(), rstd.data(), x1.data(), x2.data(),
                                                    w.data(), N, C, eps);
        auto dres = R2, dw = vector<double>(C, 0.0);
        cpu::rmsnorm_backward<double, double>(dres.data(), dw.data(), R.data(), res.data(), w.data(), rstd.data(), N,
                                              C);
        fd_check("fused_residual_rmsnorm (via rmsnorm_backward) dinp1", x1, dres, loss);
        fd_check("fused_residual_rmsnorm (via rmsnorm_backward) dinp2", x2, dres, loss);
        fd_check("fused_residual_rmsnorm (via rmsnorm_backward) dweight", w, dw, loss);
    }
}

// ------------------------------------------------------------------------------------------------
// rope.h

vector<float> rope_table_vec(int n_pos, int hs, const cpu::RopeSpec& spec) {
    vector<float> t((size_t)std::max(n_pos, 1) * (hs / 2) * 2);
    cpu::rope_table(t.data(), n_pos, hs, spec);
    return t;
}

// the rotation as a complex multiplication: (x_i + j x_{i+hs/2}) * (cos + j sign sin), the table's
// floats, on the q and k heads; v heads copied
template <class T>
vector<double> naive_rope(const vector<T>& qkv, const vector<int>& ds, const vector<float>& cs, int B, int T_, int nh,
                          int nkv, int hs, double sign) {
    vector<double> out = to_d(qkv);
    const int half = hs / 2;
    const size_t row = (size_t)(nh + 2 * nkv) * hs;
    for (int bt = 0; bt < B * T_; bt++) {
        const int p = bt % T_ - ds[bt];
        for (int h = 0; h < nh + nkv; h++)
            for (int i = 0; i < half; i++) {
                const size_t a = bt * row + (size_t)h * hs + i;
                const std::complex<double> z((double)qkv[a], (double)qkv[a + half]);
                const std::complex<double> e(cs[((size_t)p * half + i) * 2], sign * cs[((size_t)p * half + i) * 2 + 1]);
                const std::complex<double> y = z * e;
                out[a] = y.real();
                out[a + half] = y.imag();
            }
    }
    return out;
}

struct RopeShape {
    int B, T, nh, nkv, hs;
};
// MHA, GQA groups of 2 and 3, multi-query, head sizes 2 (one pair), 6 (odd half), 8, 16
const RopeShape rope_shapes[] = {{2, 13, 4, 4, 8}, {2, 17, 6, 3, 6}, {1, 37, 6, 2, 16}, {3, 7, 3, 1, 2},
                                 {2, 29, 4, 2, 8}};

TEST_CASE_TEMPLATE("rope_forward / rope_backward: vs the naive complex multiplication (packed docs, GQA)", T, float,
                   double) {
    Rng r(45);
    cpu::RopeSpec spec;
    for (const auto& s : rope_shapes)
        for (int llama3 = 0; llama3 < 2; llama3++) {
            CAPTURE(s.B);
            CAPTURE(s.T);
            CAPTURE(s.nh);
            CAPTURE(s.nkv);
            CAPTURE(s.hs);
            CAPTURE(llama3);
            spec.theta = llama3 ? 500000.0 : 10000.0;
            spec.scaling = llama3 ? cpu::ROPE_SCALING_LLAMA3 : cpu::ROPE_SCALING_NONE;
            spec.factor = 32.0;
            spec.original_max_pos = 16;  // (small, so that the tiny head sizes see all three regimes)
            const auto cs = rope_table_vec(s.T, s.hs, spec);
            const auto ds = make_doc_start(s.B, s.T, r);
            const size_t n = (size_t)s.B * s.T * (s.nh + 2 * s.nkv) * s.hs;
            const auto x = rand_vec<T>(r, n, 0.1, 2.0);
            auto y = x;
            cpu::rope_forward<T>(y.data(), ds.data(), cs.data(), s.B, s.T, s.nh, s.nkv, s.hs);
            check_close(std::string("rope_forward<") + tname<T>() + ">", y,
                        naive_rope(x, ds, cs, s.B, s.T, s.nh, s.nkv, s.hs, 1.0), fwd_rtol<T>());
            auto g = x;
            cpu::rope_backward<T>(g.data(), ds.data(), cs.data(), s.B, s.T, s.nh, s.nkv, s.hs);
            check_close(std::string("rope_backward<") + tname<T>() + ">", g,
                        naive_rope(x, ds, cs, s.B, s.T, s.nh, s.nkv, s.hs, -1.0), fwd_rtol<T>());
            // the value heads pass untouched (bitwise), and position 0 (a document's first token) is the identity
            const size_t row = (size_t)(s.nh + 2 * s.nkv) * s.hs, qk = (size_t)(s.nh + s.nkv) * s.hs;
            size_t moved = 0;
            for (int bt = 0; bt < s.B * s.T; bt++)
                for (size_t c = 0; c < row; c++) {
                    const size_t a = bt * row + c;
                    const bool fixed = c >= qk || bt % s.T == ds[bt];
                    moved += fixed && std::memcmp(&y[a], &x[a], sizeof(T)) != 0;
                    moved += fixed && std::memcmp(&g[a], &x[a], sizeof(T)) != 0;
                }
            CHECK_MESSAGE(moved == 0, moved << " value-head or position-0 elements changed");
        }
}

TEST_CASE("rope_table: cos / sin of p * theta^(-2i/hs) within float rounding, any position") {
    cpu::RopeSpec spec;
    for (double theta : {10000.0, 500000.0})
        for (int hs : {2, 8, 64, 128}) {
            CAPTURE(theta);
            CAPTURE(hs);
            spec.theta = theta;
            const int n_pos = 3000, half = hs / 2;
            const auto cs = rope_table_vec(n_pos, hs, spec);
            double worst = 0;
            for (int p = 0; p < n_pos; p += 7)
                for (int i = 0; i < half; i++) {
                    const double inv = std::exp(-(2.0 * i / hs) * std::log(theta));
                    const std::complex<double> e = std::polar(1.0, p * inv);
                    worst = std::max({worst, std::fabs(cs[((size_t)p * half + i) * 2] - e.real()),
                                      std::fabs(cs[((size_t)p * half + i) * 2 + 1] - e.imag())});
                }
            CHECK(worst <= 6e-8);  // one float rounding of a value in [-1, 1] (2^-25 ~ 3e-8) plus the angle's
        }
}

TEST_CASE("rope_backward: vs finite differences (double), the transpose of rope_forward") {
    Rng r(46);
    cpu::RopeSpec spec;
    for (const auto& s : rope_shapes) {
        CAPTURE(s.B);
        CAPTURE(s.T);
        CAPTURE(s.hs);
        const auto cs = rope_table_vec(s.T, s.hs, spec);
        const auto ds = make_doc_start(s.B, s.T, r);
        const size_t n = (size_t)s.B * s.T * (s.nh + 2 * s.nkv) * s.hs;
        auto x = rand_vec<double>(r, n), R = rand_vec<double>(r, n);
        auto loss = [&] {
            auto y = x;
            cpu::rope_forward<double>(y.data(), ds.data(), cs.data(), s.B, s.T, s.nh, s.nkv, s.hs);
            return dot(y, R);
        };
        auto g = R;  // in place: the gradient at the output becomes the gradient at the input
        cpu::rope_backward<double>(g.data(), ds.data(), cs.data(), s.B, s.T, s.nh, s.nkv, s.hs);
        fd_check("rope_backward<double> dqkv", x, g, loss, 400);
        // <rope(x), R> == <x, rope_backward(R)>: the backward is the forward's transpose
        auto y = x;
        cpu::rope_forward<double>(y.data(), ds.data(), cs.data(), s.B, s.T, s.nh, s.nkv, s.hs);
        CHECK(dot(y, R) == doctest::Approx(dot(x, g)).epsilon(1e-13));
        // and its inverse (a rotation): backward(forward(x)) == x, to within the table's floats (cos^2 + sin^2
        // is 1 within ~2^-24: the rotation by float cos / sin scales by that much)
        cpu::rope_backward<double>(y.data(), ds.data(), cs.data(), s.B, s.T, s.nh, s.nkv, s.hs);
        check_close("rope_backward(rope_forward(x))", y, x, 3e-7);
    }
}

TEST_CASE("rope: a packed row equals its documents run alone (positions restart at doc_start), bitwise") {
    Rng r(47);
    const int B = 3, T = 41, nh = 4, nkv = 2, hs = 8;
    const size_t row = (size_t)(nh + 2 * nkv) * hs;
    cpu::RopeSpec spec;
    const auto cs = rope_table_vec(T, hs, spec);
    const auto ds = make_doc_start(B, T, r);
    const auto x = rand_vec<float>(r, (size_t)B * T * row);
    auto y = x, g = x;
    cpu::rope_forward<float>(y.data(), ds.data(), cs.data(), B, T, nh, nkv, hs);
    cpu::rope_backward<float>(g.data(), ds.data(), cs.data(), B, T, nh, nkv, hs);
    int docs = 0;
    for (int b = 0; b < B; b++)
        for (int t0 = 0; t0 < T;) {
            int t1 = t0 + 1;
            while (t1 < T && ds[(size_t)b * T + t1] == ds[(size_t)b * T + t0]) t1++;
            const int L = t1 - t0;  // the document [t0, t1) (row 0's first one began before the row)
            CAPTURE(b);
            CAPTURE(t0);
            vector<float> dx(x.begin() + ((size_t)b * T + t0) * row, x.begin() + ((size_t)b * T + t1) * row);
            auto dg = dx;
            const vector<int> zero(L, 0);
            cpu::rope_forward<float>(dx.data(), zero.data(), cs.data(), 1, L, nh, nkv, hs);
            cpu::rope_backward<float>(dg.data(), zero.data(), cs.data(), 1, L, nh, nkv, hs);
            check_bitwise("document alone, forward", dx,
                          vector<float>(y.begin() + ((size_t)b * T + t0) * row, y.begin() + ((size_t)b * T + t1) * row));
            check_bitwise("document alone, backward", dg,
                          vector<float>(g.begin() + ((size_t)b * T + t0) * row, g.begin() + ((size_t)b * T + t1) * row));
            docs++;
            t0 = t1;
        }
    CHECK(docs > B + 3);  // several documents per row
}

TEST_CASE("rope_inv_freq: theta^(-2i/hs), and llama3 scaling vs its formula written out (theta 500000, factor 32, "
          "low 1, high 4, original 8192, hs 64)") {
    const int hs = 64;
    const double theta = 500000, factor = 32, low = 1, high = 4, orig = 8192, pi = 3.14159265358979323846;
    cpu::RopeSpec plain;
    plain.theta = theta;
    const auto f0 = cpu::rope_inv_freq(hs, plain);
    REQUIRE(f0.size() == (size_t)hs / 2);
    cpu::RopeSpec l3 = plain;
    l3.scaling = cpu::ROPE_SCALING_LLAMA3;
    l3.factor = factor;
    l3.low_freq_factor = low;
    l3.high_freq_factor = high;
    l3.original_max_pos = (int)orig;
    const auto f = cpu::rope_inv_freq(hs, l3);
    REQUIRE(f.size() == (size_t)hs / 2);
    int kept = 0, divided = 0, blended = 0;
    for (int i = 0; i < hs / 2; i++) {
        CAPTURE(i);
        const double base = std::exp(-(2.0 * i / hs) * std::log(theta));
        CHECK(f0[i] == doctest::Approx(base).epsilon(1e-14));
        // the turns a frequency makes over the original context, orig / wavelength, placed between low and
        // high and clamped: 0 (long wavelengths) divides by factor, 1 (short ones) keeps, between blends
        const double turns = orig * base / (2 * pi);
        const double s = std::min(1.0, std::max(0.0, (turns - low) / (high - low)));
        const double want = base * (s + (1 - s) / factor);
        CHECK(f[i] == doctest::Approx(want).epsilon(1e-14));
        kept += s == 1.0;
        divided += s == 0.0;
        blended += s > 0.0 && s < 1.0;
    }
    // i 0..14 have wavelengths below orig / high = 2048 (i 14: ~1957), 15..17 in [2048, 8192] (i 17: ~6685),
    // 18.. above 8192 (i 18: ~10083): all three regimes are exercised
    CHECK(kept == 15);
    CHECK(blended == 3);
    CHECK(divided == hs / 2 - 18);
    CHECK(f[0] == 1.0);
    CHECK(f[14] == f0[14]);
    CHECK(f[18] == doctest::Approx(f0[18] / factor).epsilon(1e-15));
    for (int i = 15; i <= 17; i++) CHECK((f[i] < f0[i] && f[i] > f0[i] / factor));
    // and the table rotates by those frequencies
    const int n_pos = 100;
    const auto cs = rope_table_vec(n_pos, hs, l3);
    double worst = 0;
    for (int p = 0; p < n_pos; p++)
        for (int i = 0; i < hs / 2; i++)
            worst = std::max({worst, std::fabs(cs[((size_t)p * hs / 2 + i) * 2] - std::cos(p * f[i])),
                              std::fabs(cs[((size_t)p * hs / 2 + i) * 2 + 1] - std::sin(p * f[i]))});
    CHECK(worst <= 6e-8);
}

TEST_CASE("rope: head slices (tensor parallel, local head counts) give the full op's bits for those heads") {
    Rng r(48);
    const int B = 2, T = 19, nh = 8, nkv = 4, hs = 16;
    const size_t row = (size_t)(nh + 2 * nkv) * hs;
    cpu::RopeSpec spec;
    const auto cs = rope_table_vec(T, hs, spec);
    const auto ds = make_doc_start(B, T, r);
    const auto x = rand_vec<float>(r, (size_t)B * T * row);
    auto y = x, g = x;
    cpu::rope_forward<float>(y.data(), ds.data(), cs.data(), B, T, nh, nkv, hs);
    cpu::rope_backward<float>(g.data(), ds.data(), cs.data(), B, T, nh, nkv, hs);
    for (int tp : {2, 4}) {
        const int lnh = nh / tp, lnkv = nkv / tp;
        const size_t lrow = (size_t)(lnh + 2 * lnkv) * hs;
        for (int rank = 0; rank < tp; rank++) {
            CAPTURE(tp);
            CAPTURE(rank);
            // the rank's slice of a row: its q heads, its k heads, its v heads (the column-parallel qkv)
            auto slice = [&](const vector<float>& full) {
                vector<float> s((size_t)B * T * lrow);
                for (int bt = 0; bt < B * T; bt++) {
                    const float* src = full.data() + bt * row;
                    float* dst = s.data() + bt * lrow;
                    std::copy_n(src + (size_t)rank * lnh * hs, (size_t)lnh * hs, dst);
                    std::copy_n(src + (size_t)(nh + rank * lnkv) * hs, (size_t)lnkv * hs, dst + (size_t)lnh * hs);
                    std::copy_n(src + (size_t)(nh + nkv + rank * lnkv) * hs, (size_t)lnkv * hs,
                                dst + (size_t)(lnh + lnkv) * hs);
                }
                return s;
            };
            auto ly = slice(x), lg = slice(x);
            cpu::rope_forward<float>(ly.data(), ds.data(), cs.data(), B, T, lnh, lnkv, hs);
            cpu::rope_backward<float>(lg.data(), ds.data(), cs.data(), B, T, lnh, lnkv, hs);
            check_bitwise("rope_forward on the rank's heads", ly, slice(y));
            check_bitwise("rope_backward on the rank's heads", lg, slice(g));
        }
    }
}

// ------------------------------------------------------------------------------------------------
// attention.h

TEST_CASE("alibi_slope: Press et al. slopes, including non power-of-two head counts") {
    for (int h = 0; h < 8; h++) {
        CAPTURE(h);
        CHECK(cpu::alibi_slope(h, 8) == doctest::Approx(std::pow(2.0, -(h + 1))).epsilon(1e-15));
    }
    const double s12[] = {1 / 2.,  1 / 4.,  1 / 8.,  1 / 16.,          1 / 32.,          1 / 64.,
                          1 / 128., 1 / 256., std::pow(2.0, -0.5), std::pow(2.0, -1.5), std::pow(2.0, -2.5),
                          std::pow(2.0, -3.5)};
    for (int h = 0; h < 12; h++) {
        CAPTURE(h);
        CHECK(cpu::alibi_slope(h, 12) == doctest::Approx(s12[h]).epsilon(1e-15));
    }
    const double s6[] = {1 / 4., 1 / 16., 1 / 64., 1 / 256., 1 / 2., 1 / 8.};
    for (int h = 0; h < 6; h++) {
        CAPTURE(h);
        CHECK(cpu::alibi_slope(h, 6) == doctest::Approx(s6[h]).epsilon(1e-15));
    }
    // every head count 1..64 vs the paper's reference code (get_slopes)
    for (int n = 1; n <= 64; n++) {
        const auto ref = paper_slopes(n);
        REQUIRE(ref.size() == (size_t)n);
        vector<double> got(n);
        for (int h = 0; h < n; h++) got[h] = cpu::alibi_slope(h, n);
        check_close("alibi_slope(h, " + std::to_string(n) + ")", got, ref, 1e-14, 0);
    }
}

struct AttnShape {
    int B, T, nh, nkv, hs;
};
// non power-of-two head counts, multi-query (nkv 1), nkv == nh, GQA groups of 2, 3, 4; T off any tile
const AttnShape attn_shapes[] = {{2, 7, 3, 1, 4},  {2, 13, 6, 2, 3}, {2, 13, 6, 1, 4}, {2, 13, 6, 6, 4},
                                 {1, 37, 12, 4, 2}, {2, 13, 12, 12, 2}, {2, 1, 2, 1, 3}, {3, 5, 4, 2, 8}};

TEST_CASE_TEMPLATE("attention_forward: vs naive masked softmax (packed docs, GQA, ALiBi)", T, float, double) {
    Rng r(8);
    vector<AttnShape> shapes(std::begin(attn_shapes), std::end(attn_shapes));
    shapes.push_back({2, 64, 8, 2, 16});
    shapes.push_back({3, 37, 6, 3, 8});
    for (const auto& s : shapes)
        for (int alibi = 0; alibi < 2; alibi++) {
            CAPTURE(s.B);
            CAPTURE(s.T);
            CAPTURE(s.nh);
            CAPTURE(s.nkv);
            CAPTURE(s.hs);
            CAPTURE(alibi);
            const int row = (s.nh + 2 * s.nkv) * s.hs;
            auto ds = make_doc_start(s.B, s.T, r);
            auto qkv = rand_vec<T>(r, (size_t)s.B * s.T * row, 0.1, 1.5);
            auto out = nan_vec<T>((size_t)s.B * s.T * s.nh * s.hs), lse = nan_vec<T>((size_t)s.B * s.nh * s.T);
            cpu::attention_forward<T>(out.data(), lse.data(), qkv.data(), ds.data(), s.B, s.T, s.nh, s.nkv, s.hs,
                                      alibi ? s.nh : 0, 0);
            vector<double> rout, rlse;
            naive_attention(rout, rlse, to_d(qkv), ds, s.B, s.T, s.nh, s.nkv, s.hs, alibi != 0);
            const std::string op = std::string("attention_forward<") + tname<T>() + "> ";
            check_close(op + "out", out, rout, fwd_rtol<T>());
            check_close(op + "lse", lse, rlse, fwd_rtol<T>());
        }
}

TEST_CASE("attention_backward: vs finite differences (double), dqkv overwritten") {
    Rng r(9);
    for (const auto& s : attn_shapes)
        for (int alibi = 0; alibi < 2; alibi++) {
            const int B = s.B, T = s.T, nh = s.nh, nkv = s.nkv, hs = s.hs;
            CAPTURE(B);
            CAPTURE(T);
            CAPTURE(nh);
            CAPTURE(nkv);
            CAPTURE(hs);
            CAPTURE(alibi);
            const int row = (nh + 2 * nkv) * hs;
            auto ds = make_doc_start(B, T, r);
            auto qkv = rand_vec<double>(r, (size_t)B * T * row, 0.1, 1.5);
            auto R = rand_vec<double>(r, (size_t)B * T * nh * hs);
            vector<double> out(R.size()), lse((size_t)B * nh * T);
            auto loss = [&] {
                cpu::attention_forward<double>(out.data(), lse.data(), qkv.data(), ds.data(), B, T, nh, nkv, hs,
                                               alibi ? nh : 0, 0);
                return dot(out, R);
            };
            loss();
            auto dqkv = nan_vec<double>(qkv.size());
            cpu::attention_backward<double>(dqkv.data(), R.data(), qkv.data(), out.data(), lse.data(), ds.data(),
                                            B, T, nh, nkv, hs, alibi ? nh : 0, 0);
            fd_check("attention_backward<double> dqkv", qkv, dqkv, loss);
        }
}

TEST_CASE_TEMPLATE("attention: GQA equals MHA on explicitly repeated K/V heads (forward, dQ, summed dK/dV)", T,
                   float, double) {
    const AttnShape shapes[] = {{2, 13, 6, 2, 4}, {2, 37, 12, 1, 4}, {1, 13, 6, 3, 5}};
    Rng r(10);
    for (const auto& s : shapes)
        for (int alibi = 0; alibi < 2; alibi++) {
            CAPTURE(s.B);
            CAPTURE(s.T);
            CAPTURE(s.nh);
            CAPTURE(s.nkv);
            CAPTURE(s.hs);
            CAPTURE(alibi);
            const int hs = s.hs, nh = s.nh, nkv = s.nkv, group = nh / nkv, BT = s.B * s.T;
            const int row = (nh + 2 * nkv) * hs, row_rep = 3 * nh * hs;
            auto ds = make_doc_start(s.B, s.T, r);
            auto qkv = rand_vec<T>(r, (size_t)BT * row, 0.1, 1.5);
            vector<T> rep((size_t)BT * row_rep);
            for (int t = 0; t < BT; t++)
                for (int h = 0; h < nh; h++)
                    for (int d = 0; d < hs; d++) {
                        const T* src = &qkv[(size_t)t * row];
                        T* dst = &rep[(size_t)t * row_rep];
                        dst[h * hs + d] = src[h * hs + d];
                        dst[(nh + h) * hs + d] = src[(nh + h / group) * hs + d];
                        dst[(2 * nh + h) * hs + d] = src[(nh + nkv + h / group) * hs + d];
                    }
            const size_t no = (size_t)BT * nh * hs, nl = (size_t)s.B * nh * s.T;
            auto out = nan_vec<T>(no), lse = nan_vec<T>(nl), out_r = nan_vec<T>(no), lse_r = nan_vec<T>(nl);
            cpu::attention_forward<T>(out.data(), lse.data(), qkv.data(), ds.data(), s.B, s.T, nh, nkv, hs,
                                      alibi ? nh : 0, 0);
            cpu::attention_forward<T>(out_r.data(), lse_r.data(), rep.data(), ds.data(), s.B, s.T, nh, nh, hs,
                                      alibi ? nh : 0, 0);
            const std::string op = std::string("attention<") + tname<T>() + "> GQA vs repeated-KV ";
            const double tight = std::is_same<T, float>::value ? 1e-6 : 1e-14;
            check_close(op + "out", out, out_r, tight);
            check_close(op + "lse", lse, lse_r, tight);
            auto dout = rand_vec<T>(r, no);
            auto dq = nan_vec<T>(qkv.size()), dq_r = nan_vec<T>(rep.size());
            cpu::attention_backward<T>(dq.data(), dout.data(), qkv.data(), out.data(), lse.data(), ds.data(), s.B,
                                       s.T, nh, nkv, hs, alibi ? nh : 0, 0);
            cpu::attention_backward<T>(dq_r.data(), dout.data(), rep.data(), out_r.data(), lse_r.data(), ds.data(),
                                       s.B, s.T, nh, nh, hs, alibi ? nh : 0, 0);
            vector<double> expect((size_t)BT * row, 0.0);  // dQ copied, dK/dV summed over each group
            for (int t = 0; t < BT; t++)
                for (int h = 0; h < nh; h++)
                    for (int d = 0; d < hs; d++) {
                        const T* src = &dq_r[(size_t)t * row_rep];
                        double* dst = &expect[(size_t)t * row];
                        dst[h * hs + d] = src[h * hs + d];
                        dst[(nh + h / group) * hs + d] += src[(nh + h) * hs + d];
                        dst[(nh + nkv + h / group) * hs + d] += src[(2 * nh + h) * hs + d];
                    }
            check_close(op + "dqkv (dQ equal, dK/dV = sums over the group)", dq, expect,
                        std::is_same<T, float>::value ? 1e-5 : 1e-12);
        }
}

TEST_CASE("attention: a packed row equals its documents run alone") {
    // doc_start masks across documents: the output of a token depends only on its own document
    const int T = 23, nh = 6, nkv = 2, hs = 4, row = (nh + 2 * nkv) * hs;
    Rng r(11);
    for (int alibi = 0; alibi < 2; alibi++) {
        CAPTURE(alibi);
        vector<int> ds = make_doc_start(2, T, r);
        ds.erase(ds.begin(), ds.begin() + T);  // keep the row with EOTs
        auto qkv = rand_vec<double>(r, (size_t)T * row, 0.1, 1.5);
        vector<double> out((size_t)T * nh * hs), lse((size_t)nh * T);
        cpu::attention_forward<double>(out.data(), lse.data(), qkv.data(), ds.data(), 1, T, nh, nkv, hs,
                                       alibi ? nh : 0, 0);
        for (int start = 0; start < T;) {
            int end = start;
            while (end < T && ds[end] == start) end++;
            const int L = end - start;
            CAPTURE(start);
            CAPTURE(L);
            vector<double> sub_qkv(qkv.begin() + (size_t)start * row, qkv.begin() + (size_t)end * row);
            vector<int> sub_ds(L, 0);
            vector<double> so((size_t)L * nh * hs), sl((size_t)nh * L);
            cpu::attention_forward<double>(so.data(), sl.data(), sub_qkv.data(), sub_ds.data(), 1, L, nh, nkv, hs,
                                           alibi ? nh : 0, 0);
            check_close("attention_forward<double> packed document vs alone: out", so.data(),
                        out.data() + (size_t)start * nh * hs, so.size(), 1e-13);
            start = end;
        }
    }
}

// Tensor parallelism: a rank computes a slice of the heads (head0, alibi_n_head = the model's heads).
// qkv rows of a slice: the query heads qh[0..] and the kv heads kvh[0..] (local kv head i = global
// kvh[i]; a kv head may appear twice, a copy for each of two query heads), from full rows of nh / nkv.
template <class T>
vector<T> slice_qkv(const vector<T>& qkv, int BT, int nh, int nkv, int hs, const vector<int>& qh,
                    const vector<int>& kvh) {
    const int row = (nh + 2 * nkv) * hs, nq = (int)qh.size(), nk = (int)kvh.size(), lrow = (nq + 2 * nk) * hs;
    vector<T> s((size_t)BT * lrow);
    for (int t = 0; t < BT; t++) {
        const T* src = &qkv[(size_t)t * row];
        T* dst = &s[(size_t)t * lrow];
        for (int i = 0; i < nq; i++) std::copy_n(src + qh[i] * hs, hs, dst + i * hs);
        for (int i = 0; i < nk; i++) {
            std::copy_n(src + (nh + kvh[i]) * hs, hs, dst + (nq + i) * hs);
            std::copy_n(src + (nh + nkv + kvh[i]) * hs, hs, dst + (nq + nk + i) * hs);
        }
    }
    return s;
}

// x as [outer, nh, len] -> the heads qh of every outer index: [B*T, nh, hs] (out, dout: outer B*T,
// len hs) or [B, nh, T] (lse: outer B, len T)
template <class T>
vector<T> slice_heads(const vector<T>& x, int outer, int nh, int len, const vector<int>& qh) {
    vector<T> s;
    for (int o = 0; o < outer; o++)
        for (int h : qh)
            s.insert(s.end(), x.begin() + ((size_t)o * nh + h) * len, x.begin() + ((size_t)o * nh + h + 1) * len);
    return s;
}

// the full model's attention (forward and backward), the reference of the slices
template <class T>
struct FullAttention {
    int B, T_, nh, nkv, hs, alibi_n_head;
    vector<int> ds;
    vector<T> qkv, dout, out, lse, dqkv;
};

template <class T>
FullAttention<T> full_attention(int B, int T_, int nh, int nkv, int hs, bool alibi, Rng& r) {
    FullAttention<T> f{B, T_, nh, nkv, hs, alibi ? nh : 0, {}, {}, {}, {}, {}, {}};
    const int BT = B * T_, row = (nh + 2 * nkv) * hs;
    f.ds = make_doc_start(B, T_, r, 0.1);
    f.qkv = rand_vec<T>(r, (size_t)BT * row, 0.1, 1.5);
    f.dout = rand_vec<T>(r, (size_t)BT * nh * hs);
    f.out = nan_vec<T>(f.dout.size());
    f.lse = nan_vec<T>((size_t)B * nh * T_);
    f.dqkv = nan_vec<T>(f.qkv.size());
    cpu::attention_forward<T>(f.out.data(), f.lse.data(), f.qkv.data(), f.ds.data(), B, T_, nh, nkv, hs,
                              f.alibi_n_head, 0);
    cpu::attention_backward<T>(f.dqkv.data(), f.dout.data(), f.qkv.data(), f.out.data(), f.lse.data(), f.ds.data(), B,
                               T_, nh, nkv, hs, f.alibi_n_head, 0);
    return f;
}

// Runs the slice of query heads head0 .. head0 + nq - 1 reading kv heads kvh (alibi_n_head, head0) and
// checks that out, lse and dq of each local query head are bitwise the full model's; each local kv
// head's dk / dv (its partial result) come back in dk_part / dv_part [BT, nk, hs].
template <class T>
void check_head_slice(const FullAttention<T>& f, int head0, int nq, const vector<int>& kvh, vector<T>& dk_part,
                      vector<T>& dv_part) {
    CAPTURE(head0);
    CAPTURE(nq);
    const int B = f.B, T_ = f.T_, BT = B * T_, hs = f.hs, nk = (int)kvh.size();
    vector<int> qh(nq);
    std::iota(qh.begin(), qh.end(), head0);
    const auto qkv = slice_qkv(f.qkv, BT, f.nh, f.nkv, hs, qh, kvh);
    const auto dout = slice_heads(f.dout, BT, f.nh, hs, qh);
    auto out = nan_vec<T>((size_t)BT * nq * hs), lse = nan_vec<T>((size_t)B * nq * T_), dqkv = nan_vec<T>(qkv.size());
    cpu::attention_forward<T>(out.data(), lse.data(), qkv.data(), f.ds.data(), B, T_, nq, nk, hs, f.alibi_n_head,
                              head0);
    cpu::attention_backward<T>(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), f.ds.data(), B, T_, nq,
                               nk, hs, f.alibi_n_head, head0);
    const std::string op = std::string("attention<") + tname<T>() + "> head slice ";
    check_bitwise(op + "out", out, slice_heads(f.out, BT, f.nh, hs, qh));
    check_bitwise(op + "lse", lse, slice_heads(f.lse, B, f.nh, T_, qh));
    const int row = (f.nh + 2 * f.nkv) * hs, lrow = (nq + 2 * nk) * hs;
    vector<T> dq, dq_full;
    dk_part.clear();
    dv_part.clear();
    for (int t = 0; t < BT; t++) {
        for (int i = 0; i < nq; i++)
            for (int d = 0; d < hs; d++) {
                dq.push_back(dqkv[(size_t)t * lrow + i * hs + d]);
                dq_full.push_back(f.dqkv[(size_t)t * row + qh[i] * hs + d]);
            }
        for (int i = 0; i < nk; i++)
            for (int d = 0; d < hs; d++) {
                dk_part.push_back(dqkv[(size_t)t * lrow + (nq + i) * hs + d]);
                dv_part.push_back(dqkv[(size_t)t * lrow + (nq + nk + i) * hs + d]);
            }
    }
    check_bitwise(op + "dq", dq, dq_full);
}

// the dk (or dv) of the full model's kv head kh, [BT, hs]
template <class T>
vector<T> full_dkv(const FullAttention<T>& f, int kh, bool v) {
    const int BT = f.B * f.T_, hs = f.hs, row = (f.nh + 2 * f.nkv) * hs;
    vector<T> x;
    for (int t = 0; t < BT; t++)
        for (int d = 0; d < hs; d++) x.push_back(f.dqkv[(size_t)t * row + (f.nh + (v ? f.nkv : 0) + kh) * hs + d]);
    return x;
}
// local kv head i of a [BT, nk, hs] partial
template <class T>
vector<double> part_kv(const vector<T>& p, int BT, int nk, int hs, int i) {
    vector<double> x;
    for (int t = 0; t < BT; t++)
        for (int d = 0; d < hs; d++) x.push_back((double)p[((size_t)t * nk + i) * hs + d]);
    return x;
}

TEST_CASE_TEMPLATE("attention: head slices with head0 / alibi_n_head (tensor parallel) equal the full model's heads", T,
                   float, double) {
    const double tol = std::is_same<T, float>::value ? 1e-6 : 1e-13;
    Rng r(30);
    for (int alibi = 0; alibi < 2; alibi++) {
        CAPTURE(alibi);
        {  // n_head 6 / n_kv_head 2: heads 2..5 alone, heads 3..5 (a whole kv group), heads 0..1
            const int B = 2, T_ = 29, hs = 4, BT = B * T_;
            const auto f = full_attention<T>(B, T_, 6, 2, hs, alibi != 0, r);
            // heads 2..5 read kv heads 0, 1, 1, 1: as one call, each query head gets its own copy of its kv head
            vector<T> dk25, dv25, dk35, dv35, dk01, dv01;
            check_head_slice(f, 2, 4, {0, 1, 1, 1}, dk25, dv25);
            // heads 3..5 with their kv head 1 (the whole group): dk, dv bitwise the full model's too
            check_head_slice(f, 3, 3, {1}, dk35, dv35);
            check_bitwise("attention head slice 3..5: dk of kv head 1", dk35, full_dkv(f, 1, false));
            check_bitwise("attention head slice 3..5: dv of kv head 1", dv35, full_dkv(f, 1, true));
            // heads 0..1 with kv head 0: with head 2's copy, the sum is kv head 0's dk / dv
            check_head_slice(f, 0, 2, {0}, dk01, dv01);
            check_close("attention heads 0..1 + 2: dk of kv head 0",
                        add(part_kv(dk01, BT, 1, hs, 0), part_kv(dk25, BT, 4, hs, 0)), to_d(full_dkv(f, 0, false)),
                        tol);
            check_close("attention heads 0..1 + 2: dv of kv head 0",
                        add(part_kv(dv01, BT, 1, hs, 0), part_kv(dv25, BT, 4, hs, 0)), to_d(full_dkv(f, 0, true)),
                        tol);
            // the copies of kv head 1 (heads 3, 4, 5) sum to its dk / dv
            for (int v = 0; v < 2; v++) {
                const auto& p = v ? dv25 : dk25;
                check_close(std::string("attention heads 3 + 4 + 5 (copies): d") + (v ? "v" : "k") + " of kv head 1",
                            add(add(part_kv(p, BT, 4, hs, 1), part_kv(p, BT, 4, hs, 2)), part_kv(p, BT, 4, hs, 3)),
                            to_d(full_dkv(f, 1, v != 0)), tol);
            }
        }
        {  // n_head 8 / n_kv_head 2 over 4 ranks of 2 query heads (1 kv head each)
            const int B = 2, T_ = 31, hs = 5;
            const auto f = full_attention<T>(B, T_, 8, 2, hs, alibi != 0, r);
            vector<T> dk[4], dv[4];
            for (int rank = 0; rank < 4; rank++) check_head_slice(f, 2 * rank, 2, {rank / 2}, dk[rank], dv[rank]);
            for (int kh = 0; kh < 2; kh++) {
                CAPTURE(kh);
                check_close("attention 4 ranks: dk = sum of the two ranks' partials",
                            add(to_d(dk[2 * kh]), to_d(dk[2 * kh + 1])), to_d(full_dkv(f, kh, false)), tol);
                check_close("attention 4 ranks: dv = sum of the two ranks' partials",
                            add(to_d(dv[2 * kh]), to_d(dv[2 * kh + 1])), to_d(full_dkv(f, kh, true)), tol);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// mlp.h (and vec_math.h, whose exp the nonlinearities and the softmax use)

TEST_CASE("exp_fast (float): within 1 ulp of exp on [-87, 88], finite outside, NaN stays NaN") {
    double worst = 0;
    float worst_x = 0;
    for (uint64_t b = 0; b < 0x100000000ull; b += 4099) {  // ~1 M floats spread over every binade
        const uint32_t u = (uint32_t)b;
        float x;
        std::memcpy(&x, &u, 4);
        if (!(x >= -87.0f && x <= 88.0f)) continue;
        const double want = std::exp((double)x);
        const float w = (float)want;
        const double ulp = std::nextafter(w, INFINITY) - w;
        const double err = std::fabs(cpu::exp_fast(x) - want) / ulp;
        if (err > worst) {
            worst = err;
            worst_x = x;
        }
    }
    CAPTURE(worst_x);
    CHECK(worst <= 1.0);
    // out of range: finite and positive, flat beyond the range (a masked softmax entry selects its 0)
    CHECK(cpu::exp_fast(-1000.0f) > 0.0f);
    CHECK(cpu::exp_fast(-1000.0f) < 1e-37f);
    CHECK(cpu::exp_fast(-1000.0f) == cpu::exp_fast(-200.0f));
    CHECK(cpu::exp_fast(-INFINITY) == cpu::exp_fast(-200.0f));
    CHECK(std::isfinite(cpu::exp_fast(1000.0f)));
    CHECK(std::isfinite(cpu::exp_fast(INFINITY)));
    CHECK(cpu::exp_fast(1000.0f) > 1e38f);
    CHECK(std::isnan(cpu::exp_fast(std::numeric_limits<float>::quiet_NaN())));
    CHECK(cpu::exp_fast(0.0f) == 1.0f);
}

TEST_CASE_TEMPLATE("swiglu_forward and gelu_forward: vs naive", T, float, double) {
    Rng r(12);
    {
        const int N = 7, H = 37;
        auto inp = rand_vec<T>(r, (size_t)N * 2 * H, 0.05, 4.0);
        auto out = nan_vec<T>((size_t)N * H);
        cpu::swiglu_forward<T>(out.data(), inp.data(), N, H);
        vector<double> ref((size_t)N * H);
        for (int n = 0; n < N; n++)
            for (int i = 0; i < H; i++)
                ref[(size_t)n * H + i] =
                    naive_silu((double)inp[(size_t)n * 2 * H + i]) * (double)inp[(size_t)n * 2 * H + H + i];
        check_close(std::string("swiglu_forward<") + tname<T>() + "> out", out, ref, fwd_rtol<T>(), 0);
    }
    {
        const long N = 301;
        auto inp = rand_vec<T>(r, N, 0.01, 5.0);
        auto out = nan_vec<T>(N);
        cpu::gelu_forward<T>(out.data(), inp.data(), N);
        vector<double> ref(N);
        for (long i = 0; i < N; i++) ref[i] = naive_gelu((double)inp[i]);
        // gelu(x) -> 0 for x << 0: relative to the tensor scale there
        check_close(std::string("gelu_forward<") + tname<T>() + "> out", out, ref, fwd_rtol<T>());
    }
}

TEST_CASE("swiglu_backward and gelu_backward: vs finite differences (double), dinp overwritten") {
    Rng r(13);
    {
        const int N = 7, H = 13;
        auto inp = rand_vec<double>(r, (size_t)N * 2 * H, 0.05, 4.0), R = rand_vec<double>(r, (size_t)N * H);
        auto loss = [&] {
            vector<double> out((size_t)N * H);
            cpu::swiglu_forward<double>(out.data(), inp.data(), N, H);
            return dot(out, R);
        };
        auto dinp = nan_vec<double>(inp.size());
        cpu::swiglu_backward<double>(dinp.data(), R.data(), inp.data(), N, H);
        fd_check("swiglu_backward<double> dinp", inp, dinp, loss);
    }
    {
        const long N = 201;
        auto inp = rand_vec<double>(r, N, 0.01, 5.0), R = rand_vec<double>(r, N);
        auto loss = [&] {
            vector<double> out(N);
            cpu::gelu_forward<double>(out.data(), inp.data(), N);
            return dot(out, R);
        };
        auto dinp = nan_vec<double>(N);
        cpu::gelu_backward<double>(dinp.data(), R.data(), inp.data(), N);
        fd_check("gelu_backward<double> dinp", inp, dinp, loss);
    }
}

// ------------------------------------------------------------------------------------------------
// encoder.h

TEST_CASE_TEMPLATE("encoder_forward: vs naive, learned positions indexed inside the document", T, float, double) {
    const int B = 3, T_ = 13, C = 37, V = 11;
    Rng r(14);
    auto ds = make_doc_start(B, T_, r);
    vector<int> tokens(B * T_);
    for (auto& t : tokens) t = r.randint(0, V - 1);
    auto wte = rand_vec<T>(r, (size_t)V * C), wpe = rand_vec<T>(r, (size_t)T_ * C);
    for (int with_wpe = 0; with_wpe < 2; with_wpe++) {
        CAPTURE(with_wpe);
        auto out = nan_vec<T>((size_t)B * T_ * C);
        cpu::encoder_forward<T>(out.data(), tokens.data(), ds.data(), wte.data(), with_wpe ? wpe.data() : nullptr,
                                B, T_, C, 0, V);
        vector<double> ref((size_t)B * T_ * C);
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T_; t++) {
                const int bt = b * T_ + t, pos = t - ds[bt];
                for (int c = 0; c < C; c++)
                    ref[(size_t)bt * C + c] =
                        (double)wte[(size_t)tokens[bt] * C + c] + (with_wpe ? (double)wpe[(size_t)pos * C + c] : 0.0);
            }
        check_close(std::string("encoder_forward<") + tname<T>() + "> out", out, ref, fwd_rtol<T>());
    }
}

TEST_CASE("encoder_backward: vs finite differences (double), dwte/dwpe accumulate") {
    struct S {
        int B, T, C, V;
    };
    const S shapes[] = {{2, 13, 37, 6}, {1, 7, 5, 3}, {3, 5, 70, 20}};
    Rng r(15);
    for (const auto& s : shapes)
        for (int with_wpe = 0; with_wpe < 2; with_wpe++) {
            const int B = s.B, T_ = s.T, C = s.C, V = s.V;
            CAPTURE(B);
            CAPTURE(T_);
            CAPTURE(C);
            CAPTURE(V);
            CAPTURE(with_wpe);
            auto ds = make_doc_start(B, T_, r);
            vector<int> tokens(B * T_);
            for (auto& t : tokens) t = r.randint(0, V - 1);  // repeated tokens
            auto wte = rand_vec<double>(r, (size_t)V * C), wpe = rand_vec<double>(r, (size_t)T_ * C),
                 R = rand_vec<double>(r, (size_t)B * T_ * C);
            auto loss = [&] {
                vector<double> out((size_t)B * T_ * C);
                cpu::encoder_forward<double>(out.data(), tokens.data(), ds.data(), wte.data(),
                                             with_wpe ? wpe.data() : nullptr, B, T_, C, 0, V);
                return dot(out, R);
            };
            auto dwte0 = rand_vec<double>(r, wte.size()), dwpe0 = rand_vec<double>(r, wpe.size());
            auto dwte = dwte0, dwpe = dwpe0;
            cpu::encoder_backward<double>(dwte.data(), with_wpe ? dwpe.data() : nullptr, R.data(), tokens.data(),
                                          ds.data(), B, T_, C, 0, V);
            fd_check("encoder_backward<double> dwte (minus prefill)", wte, sub(dwte, dwte0), loss);
            if (with_wpe)
                fd_check("encoder_backward<double> dwpe (minus prefill)", wpe, sub(dwpe, dwpe0), loss);
            else
                check_bitwise("encoder_backward<double> dwpe untouched when null", dwpe, dwpe0);
        }
}

// Vocab-parallel embedding: ranks holding the wte rows [begin, end) of each range
TEST_CASE_TEMPLATE("encoder_forward / encoder_backward: vocab ranges (tensor parallel) sum to the full embedding, "
                   "their dwte rows are the full rows",
                   T, float, double) {
    const int B = 3, T_ = 17, C = 37, V = 12;
    Rng r(31);
    auto ds = make_doc_start(B, T_, r);
    vector<int> tokens(B * T_);
    for (auto& t : tokens) t = r.randint(0, V - 1);
    tokens[0] = 0, tokens[1] = V - 1;  // the first and last rows
    auto wte = rand_vec<T>(r, (size_t)V * C), wpe = rand_vec<T>(r, (size_t)T_ * C),
         dout = rand_vec<T>(r, (size_t)B * T_ * C);
    const auto dwte0 = rand_vec<T>(r, wte.size()), dwpe0 = rand_vec<T>(r, wpe.size());
    const vector<vector<int>> splits = {{0, 6, 12}, {0, 3, 6, 9, 12}, {0, 5, 12}, {0, 0, 12, 12}};  // range bounds
    for (int with_wpe = 0; with_wpe < 2; with_wpe++) {
        CAPTURE(with_wpe);
        const T* pe = with_wpe ? wpe.data() : nullptr;
        auto full = nan_vec<T>((size_t)B * T_ * C);
        cpu::encoder_forward<T>(full.data(), tokens.data(), ds.data(), wte.data(), pe, B, T_, C, 0, V);
        auto dwte_full = dwte0, dwpe_full = dwpe0;
        cpu::encoder_backward<T>(dwte_full.data(), with_wpe ? dwpe_full.data() : nullptr, dout.data(), tokens.data(),
                                 ds.data(), B, T_, C, 0, V);
        for (const auto& bounds : splits) {
            const int R = (int)bounds.size() - 1;
            CAPTURE(R);
            CAPTURE(bounds[1]);
            vector<T> sum((size_t)B * T_ * C, T(0));
            for (int k = 0; k < R; k++) {
                const int v0 = bounds[k], n = bounds[k + 1] - bounds[k];
                CAPTURE(k);
                // forward: the local rows of wte; the position term on range 0 only
                auto out = nan_vec<T>(sum.size());
                cpu::encoder_forward<T>(out.data(), tokens.data(), ds.data(), wte.data() + (size_t)v0 * C,
                                        k == 0 ? pe : nullptr, B, T_, C, v0, n);
                for (size_t i = 0; i < sum.size(); i++) sum[i] += out[i];
                // backward: the local rows of the prefilled dwte; dwpe gets every token on every range
                vector<T> dwte(dwte0.begin() + (size_t)v0 * C, dwte0.begin() + (size_t)(v0 + n) * C), dwpe = dwpe0;
                cpu::encoder_backward<T>(dwte.data(), with_wpe ? dwpe.data() : nullptr, dout.data(), tokens.data(),
                                         ds.data(), B, T_, C, v0, n);
                check_bitwise(std::string("encoder_backward<") + tname<T>() + "> range dwte rows", dwte,
                              vector<T>(dwte_full.begin() + (size_t)v0 * C, dwte_full.begin() + (size_t)(v0 + n) * C));
                check_bitwise(std::string("encoder_backward<") + tname<T>() + "> range dwpe", dwpe,
                              with_wpe ? dwpe_full : dwpe0);
            }
            check_bitwise(std::string("encoder_forward<") + tname<T>() + "> sum over ranges", sum, full);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// classifier.h

TEST_CASE_TEMPLATE("fused_classifier: losses, dlogits, ignored targets and padded columns vs naive", T, float,
                   double) {
    struct S {
        int N, V, Vp;
    };
    const S shapes[] = {{9, 37, 48}, {5, 50, 128}, {4, 16, 16}};
    Rng r(16);
    for (const auto& s : shapes) {
        const int N = s.N, V = s.V, Vp = s.Vp;
        CAPTURE(N);
        CAPTURE(V);
        CAPTURE(Vp);
        vector<int> tgt(N);
        for (int n = 0; n < N; n++) tgt[n] = (n % 3 == 1) ? -1 : r.randint(0, V - 1);
        tgt[0] = V - 1;  // last real column
        auto logits = rand_vec<T>(r, (size_t)N * Vp, 0.1, 4.0);
        // padded columns hold NaN or huge values: they must not enter the softmax (and get 0 dlogits)
        for (int n = 0; n < N; n++)
            for (int v = V; v < Vp; v++)
                logits[(size_t)n * Vp + v] = n % 2 ? T(1000 + v) : std::numeric_limits<T>::quiet_NaN();
        // naive log-softmax over the first V columns
        vector<double> rloss(N), rd((size_t)N * Vp, 0.0);
        const double dloss = 0.37;
        for (int n = 0; n < N; n++) {
            double mx = -INFINITY, z = 0;
            for (int v = 0; v < V; v++) mx = std::max(mx, (double)logits[(size_t)n * Vp + v]);
            for (int v = 0; v < V; v++) z += std::exp((double)logits[(size_t)n * Vp + v] - mx);
            const double lz = mx + std::log(z);
            rloss[n] = tgt[n] < 0 ? 0.0 : -((double)logits[(size_t)n * Vp + tgt[n]] - lz);
            if (tgt[n] >= 0)
                for (int v = 0; v < V; v++)
                    rd[(size_t)n * Vp + v] =
                        dloss * (std::exp((double)logits[(size_t)n * Vp + v] - lz) - (v == tgt[n] ? 1.0 : 0.0));
        }
        const std::string op = std::string("fused_classifier<") + tname<T>() + "> ";
        // dloss == 0: losses only, logits untouched
        {
            auto lg = logits;
            auto losses = nan_vec<T>(N);
            cpu::fused_classifier<T>(lg.data(), losses.data(), tgt.data(), T(0), N, V, Vp);
            check_close(op + "losses (dloss = 0)", losses, rloss, fwd_rtol<T>());
            check_bitwise(op + "logits untouched when dloss = 0", lg, logits);
        }
        {
            auto lg = logits;
            auto losses = nan_vec<T>(N);
            cpu::fused_classifier<T>(lg.data(), losses.data(), tgt.data(), T(dloss), N, V, Vp);
            check_close(op + "losses", losses, rloss, fwd_rtol<T>());
            check_close(op + "dlogits", lg, rd, fwd_rtol<T>());
            for (int n = 0; n < N; n++) {
                CAPTURE(n);
                CAPTURE(tgt[n]);
                if (tgt[n] < 0) {
                    CHECK_MESSAGE(losses[n] == T(0), op << "ignored target must give loss 0");
                    for (int v = 0; v < Vp; v++)
                        CHECK_MESSAGE(lg[(size_t)n * Vp + v] == T(0),
                                      op << "ignored target must give zero dlogits, column " << v);
                }
                for (int v = V; v < Vp; v++)
                    CHECK_MESSAGE(lg[(size_t)n * Vp + v] == T(0), op << "padded column " << v << " must get 0 dlogits");
            }
        }
    }
}

TEST_CASE("fused_classifier: dlogits vs finite differences of dloss * sum(losses) (double)") {
    struct S {
        int N, V, Vp;
    };
    const S shapes[] = {{5, 13, 16}, {3, 50, 128}, {6, 7, 7}};
    Rng r(17);
    for (const auto& s : shapes) {
        const int N = s.N, V = s.V, Vp = s.Vp;
        CAPTURE(N);
        CAPTURE(V);
        CAPTURE(Vp);
        vector<int> tgt(N);
        for (int n = 0; n < N; n++) tgt[n] = (n == 1) ? -1 : r.randint(0, V - 1);
        auto logits = rand_vec<double>(r, (size_t)N * Vp, 0.1, 3.0);
        for (int n = 0; n < N; n++)  // large padded logits: no effect on the loss, 0 dlogits
            for (int v = V; v < Vp; v++) logits[(size_t)n * Vp + v] = 1000.0 + v;
        const double dloss = 1.0 / 7;
        auto loss = [&] {
            auto lg = logits;
            vector<double> losses(N);
            cpu::fused_classifier<double>(lg.data(), losses.data(), tgt.data(), 0.0, N, V, Vp);
            double sum = 0;
            for (double l : losses) sum += l;
            return dloss * sum;
        };
        auto dlogits = logits;
        vector<double> losses(N);
        cpu::fused_classifier<double>(dlogits.data(), losses.data(), tgt.data(), dloss, N, V, Vp);
        fd_check("fused_classifier<double> dlogits", logits, dlogits, loss);
    }
}

// Vocab-parallel cross-entropy as the model runs it over `slices` ranks: each rank holds Vp / slices
// columns; M = max over the ranks' classifier_max, the sum of exp per chunk of CH global columns
// (classifier_sumexp on the rank holding the chunk) added in a fixed pairwise tree over the chunk
// index, x_t = sum over the ranks' classifier_target (one non-zero), then classifier_backward on every
// rank. Returns the losses (every rank's, checked equal) and the dlogits reassembled as [N, Vp].
struct VocabParallelCE {
    vector<float> losses, dlogits, mx, sum, tgt;
};
inline VocabParallelCE vocab_parallel_ce(const vector<float>& logits, const vector<int>& targets, float dloss, int N,
                                         int V, int Vp, int slices, int CH) {
    REQUIRE(Vp % slices == 0);
    const int ld = Vp / slices, n_chunks = Vp / CH;
    REQUIRE(ld % CH == 0);
    vector<vector<float>> local(slices);
    for (int k = 0; k < slices; k++) {
        local[k].resize((size_t)N * ld);
        for (int n = 0; n < N; n++)
            std::copy_n(&logits[(size_t)n * Vp + k * ld], ld, &local[k][(size_t)n * ld]);
    }
    auto n_real = [&](int k) { return std::max(0, std::min(ld, V - k * ld)); };
    VocabParallelCE r;
    r.mx.assign(N, -INFINITY);
    r.tgt.assign(N, 0.0f);
    for (int k = 0; k < slices; k++) {
        vector<float> m = nan_vec<float>(N), t = nan_vec<float>(N);
        cpu::classifier_max<float>(m.data(), local[k].data(), N, ld, n_real(k));
        cpu::classifier_target<float>(t.data(), local[k].data(), targets.data(), N, ld, k * ld, n_real(k));
        for (int n = 0; n < N; n++) {
            r.mx[n] = std::max(r.mx[n], m[n]);
            r.tgt[n] += t[n];
        }
    }
    vector<vector<float>> chunk(n_chunks, nan_vec<float>(N));
    for (int g = 0; g < n_chunks; g++) {
        const int k = g * CH / ld, c0 = g * CH - k * ld;
        cpu::classifier_sumexp<float>(chunk[g].data(), local[k].data(), r.mx.data(), N, ld, c0,
                                      std::min(c0 + CH, n_real(k)));
    }
    std::function<float(int, int, int)> tree = [&](int n, int lo, int hi) -> float {
        return hi - lo == 1 ? chunk[lo][n] : tree(n, lo, lo + (hi - lo) / 2) + tree(n, lo + (hi - lo) / 2, hi);
    };
    r.sum.resize(N);
    for (int n = 0; n < N; n++) r.sum[n] = tree(n, 0, n_chunks);
    r.dlogits.assign((size_t)N * Vp, NAN);
    for (int k = 0; k < slices; k++) {
        vector<float> losses = nan_vec<float>(N);
        cpu::classifier_backward<float>(local[k].data(), losses.data(), r.mx.data(), r.sum.data(), r.tgt.data(),
                                        targets.data(), dloss, N, ld, k * ld, n_real(k));
        if (k == 0) r.losses = losses;
        else check_bitwise("classifier_backward: losses equal on every rank", losses, r.losses);
        for (int n = 0; n < N; n++)
            std::copy_n(&local[k][(size_t)n * ld], ld, &r.dlogits[(size_t)n * Vp + k * ld]);
    }
    return r;
}

TEST_CASE("vocab-parallel cross-entropy (classifier_max / _sumexp / _target / _backward) over 1, 2, 4, 8 slices "
          "equals fused_classifier") {
    const int N = 13, V = 300, Vp = 384, CH = 16;
    Rng r(32);
    vector<int> tgt(N);
    for (int n = 0; n < N; n++) tgt[n] = (n % 4 == 1) ? -1 : r.randint(0, V - 1);
    tgt[0] = V - 1, tgt[2] = 0, tgt[3] = 100, tgt[4] = 200, tgt[5] = 290;  // in every slice of 4 (96 columns)
    auto logits = rand_vec<float>(r, (size_t)N * Vp, 0.1, 4.0);
    // padded columns hold NaN or huge values: they must not enter the softmax (and get 0 dlogits)
    for (int n = 0; n < N; n++)
        for (int v = V; v < Vp; v++) logits[(size_t)n * Vp + v] = n % 2 ? float(1000 + v) : NAN;
    for (float dloss : {0.37f, 0.0f}) {
        CAPTURE(dloss);
        auto want = logits;
        vector<float> want_losses = nan_vec<float>(N);
        cpu::fused_classifier<float>(want.data(), want_losses.data(), tgt.data(), dloss, N, V, Vp);
        VocabParallelCE first;
        for (int slices : {1, 2, 4, 8}) {  // 8: slice 7 (columns 336..383) holds only padding
            CAPTURE(slices);
            const VocabParallelCE got = vocab_parallel_ce(logits, tgt, dloss, N, V, Vp, slices, CH);
            check_close("vocab-parallel losses vs fused_classifier", got.losses, want_losses, 1e-6);
            if (dloss != 0.0f) {
                check_close("vocab-parallel dlogits vs fused_classifier", got.dlogits, want, 1e-6);
                for (int n = 0; n < N; n++)
                    for (int v = 0; v < Vp; v++)
                        if (v >= V || tgt[n] < 0) REQUIRE(got.dlogits[(size_t)n * Vp + v] == 0.0f);
            } else {
                check_bitwise("vocab-parallel: logits untouched when dloss = 0", got.dlogits, logits);
            }
            // the statistics and the results do not depend on the split (exact max and target, the
            // same chunk sums added in the same tree)
            if (slices == 1) {
                first = got;
                continue;
            }
            check_bitwise("vocab-parallel max, any split", got.mx, first.mx);
            check_bitwise("vocab-parallel sum, any split", got.sum, first.sum);
            check_bitwise("vocab-parallel target logit, any split", got.tgt, first.tgt);
            check_bitwise("vocab-parallel losses, any split", got.losses, first.losses);
            check_bitwise("vocab-parallel dlogits, any split", got.dlogits, first.dlogits);
        }
    }
}

// A trained GPT-2's next-token distribution over its 50257 tokens is peaked: a few tokens hold most
// of the mass and most logits lie 15-25 nats below the maximum, so most terms exp(x - max) fall below
// half an ulp of an fp32 running sum near 1. The loss must still be within 1e-7 relative of the
// float64 sum: fused_classifier, and the vocab-parallel ops with the engine's canonical chunks over
// 1 and 8 slices. A plain fp32 sum is checked to miss by more than 1e-6 here, so the distribution
// does test the accumulator.
// The dlogits d (softmax - onehot) too, against float64, within 1e-7 in two norms per row: the
// relative L2 error over the row's non-target columns (the probabilities, which the target's p - 1
// would otherwise dominate), and the largest error of the row over its largest gradient (every
// column, the target's included). An lse rounded to fp32 before exp(x - lse) (~5e-7 off at lse ~ 10)
// is checked to miss the first by more than 1e-7 here, so the test sees the lse's precision.
struct PeakedErr {
    double l2 = 0, max = 0;  // worst row: relative L2 over non-target columns; max |err| / max |ref|
};
inline PeakedErr peaked_grad_error(const vector<float>& got, const vector<double>& want, const vector<int>& tgt,
                                   int N, int V, int Vp) {
    PeakedErr e;
    for (int n = 0; n < N; n++) {
        double e2 = 0, r2 = 0, emax = 0, rmax = 0;
        for (int v = 0; v < V; v++) {
            const double g = got[(size_t)n * Vp + v], r = want[(size_t)n * Vp + v], err = std::fabs(g - r);
            if (!(err == err)) emax = INFINITY;  // NaN
            emax = std::max(emax, err);
            rmax = std::max(rmax, std::fabs(r));
            if (v != tgt[n]) e2 += err * err, r2 += r * r;
        }
        e.l2 = std::max(e.l2, std::sqrt(e2 / r2));
        e.max = std::max(e.max, emax / rmax);
    }
    return e;
}
TEST_CASE("classifier: loss and dlogits on a peaked 50257-way distribution within 1e-7 relative of float64") {
    const int N = 8, V = 50257, Vp = 50304, CH = Vp / 8;
    const float dloss = 1.0f / N;
    Rng r(50257);
    vector<float> logits((size_t)N * Vp);
    vector<int> tgt(N);
    std::normal_distribution<double> bulk(-19.0, 2.5);
    for (int n = 0; n < N; n++) {
        float* x = &logits[(size_t)n * Vp];
        for (int v = 0; v < Vp; v++) x[v] = v < V ? (float)(bulk(r.g) + 7.0) : NAN;  // (+7: the max is not 0)
        const int top = r.randint(0, V - 1);
        x[top] = 7.0f;
        for (int k = 0; k < 40; k++) x[r.randint(0, V - 1)] = (float)r.uni(1.0, 6.0);  // the plausible few
        tgt[n] = r.randint(0, V - 1);
        x[tgt[n]] = (float)r.uni(3.0, 5.0);  // a loss of about 2-4 nats
    }
    vector<double> want(N), want_d((size_t)N * Vp, 0.0);
    vector<float> fp32_lse_d((size_t)N * Vp, 0.0f);  // the dlogits with an fp32 lse (the old rounding)
    double worst_fp32 = 0;
    for (int n = 0; n < N; n++) {
        const float* x = &logits[(size_t)n * Vp];
        const double mx = *std::max_element(x, x + V);
        double s = 0;
        float s32 = 0;
        for (int v = 0; v < V; v++) {
            s += std::exp((double)x[v] - mx);
            s32 += std::exp(x[v] - (float)mx);
        }
        const double lse = mx + std::log(s);
        want[n] = lse - x[tgt[n]];
        worst_fp32 = std::max(worst_fp32, std::fabs(mx + std::log((double)s32) - x[tgt[n]] - want[n]) / want[n]);
        for (int v = 0; v < V; v++) {
            want_d[(size_t)n * Vp + v] = (double)dloss * (std::exp((double)x[v] - lse) - (v == tgt[n] ? 1.0 : 0.0));
            fp32_lse_d[(size_t)n * Vp + v] = dloss * (std::exp(x[v] - (float)lse) - (v == tgt[n] ? 1.0f : 0.0f));
        }
    }
    MESSAGE("plain fp32 sum: worst loss error " << worst_fp32 << " relative");
    CHECK_MESSAGE(worst_fp32 > 1e-6, "the distribution is not peaked enough to test the accumulator");
    const PeakedErr old = peaked_grad_error(fp32_lse_d, want_d, tgt, N, V, Vp);
    MESSAGE("dlogits with an fp32 lse: relative L2 " << old.l2 << ", max " << old.max);
    CHECK_MESSAGE(old.l2 > 1e-7, "an fp32 lse meets the bound here: the test would not see the lse's precision");
    auto check_grad = [&](const std::string& what, const vector<float>& got) {
        const PeakedErr e = peaked_grad_error(got, want_d, tgt, N, V, Vp);
        MESSAGE(what << " dlogits vs float64: relative L2 " << e.l2 << ", max " << e.max << " (worst row)");
        CHECK_MESSAGE(e.l2 <= 1e-7, what << " dlogits: relative L2 (non-target columns) " << e.l2 << " > 1e-7");
        CHECK_MESSAGE(e.max <= 1e-7, what << " dlogits: max |err| / max |dlogit| " << e.max << " > 1e-7");
        for (int n = 0; n < N; n++)
            for (int v = V; v < Vp; v++) REQUIRE(got[(size_t)n * Vp + v] == 0.0f);  // padding
    };
    {
        auto lg = logits;
        vector<float> losses = nan_vec<float>(N);
        cpu::fused_classifier<float>(lg.data(), losses.data(), tgt.data(), 0.0f, N, V, Vp);
        check_close("fused_classifier<float> losses vs float64", losses, want, 1e-7, 0.0);
        losses = nan_vec<float>(N);
        cpu::fused_classifier<float>(lg.data(), losses.data(), tgt.data(), dloss, N, V, Vp);
        check_close("fused_classifier<float> losses (dloss != 0) vs float64", losses, want, 1e-7, 0.0);
        check_grad("fused_classifier<float>", lg);
    }
    for (int slices : {1, 8}) {
        CAPTURE(slices);
        const VocabParallelCE got = vocab_parallel_ce(logits, tgt, 0.0f, N, V, Vp, slices, CH);
        check_close("vocab-parallel losses vs float64", got.losses, want, 1e-7, 0.0);
        const VocabParallelCE got_d = vocab_parallel_ce(logits, tgt, dloss, N, V, Vp, slices, CH);
        check_close("vocab-parallel losses (dloss != 0) vs float64", got_d.losses, want, 1e-7, 0.0);
        check_grad("vocab-parallel", got_d.dlogits);
    }
}

TEST_CASE("vocab-parallel cross-entropy: all targets ignored, a slice of padding only, empty ranges") {
    const int N = 5, V = 300, Vp = 384, ld = 48;
    Rng r(33);
    auto logits = rand_vec<float>(r, (size_t)N * Vp, 0.1, 3.0);
    {  // all targets -1: zero losses and zero gradients everywhere
        const vector<int> tgt(N, -1);
        for (int slices : {1, 4}) {
            CAPTURE(slices);
            const auto got = vocab_parallel_ce(logits, tgt, 0.25f, N, V, Vp, slices, 16);
            check_bitwise("all ignored: losses", got.losses, vector<float>(N, 0.0f));
            check_bitwise("all ignored: dlogits", got.dlogits, vector<float>((size_t)N * Vp, 0.0f));
            check_bitwise("all ignored: target logits", got.tgt, vector<float>(N, 0.0f));
        }
    }
    {  // the last slice of 8 (columns 336..383, V = 300): n_real = 0
        const int v0 = 7 * ld;
        vector<float> x((size_t)N * ld);
        for (int n = 0; n < N; n++) std::copy_n(&logits[(size_t)n * Vp + v0], ld, &x[(size_t)n * ld]);
        vector<int> tgt = {0, 299, -1, 150, 299};
        vector<float> mx = nan_vec<float>(N), sum = nan_vec<float>(N), t = nan_vec<float>(N);
        cpu::classifier_max<float>(mx.data(), x.data(), N, ld, 0);
        cpu::classifier_sumexp<float>(sum.data(), x.data(), mx.data(), N, ld, 0, 0);
        cpu::classifier_target<float>(t.data(), x.data(), tgt.data(), N, ld, v0, 0);
        for (int n = 0; n < N; n++) {
            CHECK(mx[n] == -INFINITY);
            CHECK(sum[n] == 0.0f);
            CHECK(t[n] == 0.0f);
        }
        // with the global statistics of another slice: losses from them, the padding's dlogits 0
        const vector<float> gmx(N, 3.0f), gsum(N, 40.0f), gtgt(N, 1.5f);
        vector<float> losses = nan_vec<float>(N);
        cpu::classifier_backward<float>(x.data(), losses.data(), gmx.data(), gsum.data(), gtgt.data(), tgt.data(), 0.5f,
                                        N, ld, v0, 0);
        check_bitwise("padding-only slice: dlogits", x, vector<float>(x.size(), 0.0f));
        for (int n = 0; n < N; n++)
            CHECK(losses[n] == (tgt[n] < 0 ? 0.0f : (float)((3.0 - 1.5) + std::log(40.0))));
    }
    {  // sumexp over c1 < c0 is 0; the max of a range is its naive max
        vector<float> sum = nan_vec<float>(N), mx = nan_vec<float>(N), zero(N, 0.0f);
        cpu::classifier_sumexp<float>(sum.data(), logits.data(), zero.data(), N, Vp, 10, 5);
        check_bitwise("sumexp of an empty range", sum, zero);
        cpu::classifier_max<float>(mx.data(), logits.data(), N, Vp, 37);
        for (int n = 0; n < N; n++)
            CHECK(mx[n] == *std::max_element(logits.begin() + (size_t)n * Vp, logits.begin() + (size_t)n * Vp + 37));
    }
}

// ------------------------------------------------------------------------------------------------
// adamw.h

template <class P>
void adamw_case(int t0, int steps, double grad_scale) {
    const size_t n = 1001;
    const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    Rng r(18 + t0);
    auto p = rand_vec<P>(r, n, 0.1, 2.0);
    vector<float> m(n, 0.0f), v(n, 0.0f);
    if (t0 > 1)  // resume from nonzero moments
        for (size_t i = 0; i < n; i++) m[i] = (float)r.nz(0.01, 0.5), v[i] = (float)r.uni(0.01, 0.3);
    vector<double> rp = to_d(p), rm = to_d(m), rv = to_d(v);
    for (int t = t0; t < t0 + steps; t++) {
        CAPTURE(t);
        auto g = rand_vec<float>(r, n, 0.01, 1.0);  // fp32 grads whatever P (the fp32 accumulator)
        const auto p_before = to_d(p);
        cpu::adamw_update<P>(p.data(), nullptr, g.data(), m.data(), v.data(), n, (float)lr, (float)b1, (float)b2,
                             (float)eps, (float)wd, (float)grad_scale, t, 0);
        // PyTorch AdamW: p -= lr*wd*p; m, v update; p -= lr * mhat / (sqrt(vhat) + eps)
        vector<double> delta(n);
        for (size_t i = 0; i < n; i++) {
            const double gi = (double)g[i] * grad_scale;
            const double p0 = rp[i];
            rp[i] -= lr * wd * rp[i];
            rm[i] = b1 * rm[i] + (1 - b1) * gi;
            rv[i] = b2 * rv[i] + (1 - b2) * gi * gi;
            const double mhat = rm[i] / (1 - std::pow(b1, t)), vhat = rv[i] / (1 - std::pow(b2, t));
            rp[i] -= lr * mhat / (std::sqrt(vhat) + eps);
            delta[i] = rp[i] - p0;
        }
        const std::string op = std::string("adamw_update<") + tname<P>() + "> ";
        check_close(op + "params", p, rp, 1e-6);
        check_close(op + "m", m, rm, 1e-5);
        check_close(op + "v", v, rv, 1e-5);
        // the step itself, to better than the parameter's rounding: param delta vs reference delta
        check_close(op + "params - params_before", sub(to_d(p), p_before), delta, 1e-4);
        rp = to_d(p), rm = to_d(m), rv = to_d(v);  // continue from the op's state
    }
}

TEST_CASE("adamw_update: steps vs PyTorch AdamW formula in double (grad_scale, t > 1)") {
    SUBCASE("float, t = 1..4, grad_scale 1") { adamw_case<float>(1, 4, 1.0); }
    SUBCASE("float, t = 1..3, grad_scale 0.5") { adamw_case<float>(1, 3, 0.5); }
    SUBCASE("float, t = 10..12 from nonzero moments, grad_scale 0.25") { adamw_case<float>(10, 3, 0.25); }
    SUBCASE("double params, t = 5..6, grad_scale 0.8") { adamw_case<double>(5, 2, 0.8); }
}

// ------------------------------------------------------------------------------------------------
// global_norm.h

TEST_CASE_TEMPLATE("global_norm_squared: vs naive double sum, independent of the thread count", T, float, double) {
    Rng r(19);
    for (size_t n : {size_t(0), size_t(1), size_t(1000), size_t(16384), size_t(3 * 16384 + 123)}) {
        CAPTURE(n);
        auto x = rand_vec<T>(r, n, 0.001, 3.0);
        double ref = 0;
        for (size_t i = 0; i < n; i++) ref += (double)x[i] * (double)x[i];
        const double got = cpu::global_norm_squared<T>(x.data(), n);
        check_close(std::string("global_norm_squared<") + tname<T>() + ">", &got, &ref, 1, 1e-12);
        same_across_thread_counts<double>(std::string("global_norm_squared<") + tname<T>() + ">",
                                          [&] { return vector<vector<double>>{{cpu::global_norm_squared<T>(x.data(), n)}}; });
    }
}

// ------------------------------------------------------------------------------------------------
// the GPU's split-K weight gradient (llmc/ops/matmul.cuh): its host arithmetic (op_scratch.h) and the
// CPU twin of its sum kernel

TEST_CASE("matmul split-K: P from BT alone, the partials' bytes, the sum's order (chunks first, one add)") {
    // no split below MATMUL_SPLITK_MIN_BT; above, ceil(BT / ROWS) chunks whatever C and OC
    CHECK(matmul_splitk_chunks(1) == 1);
    CHECK(matmul_splitk_chunks(MATMUL_SPLITK_MIN_BT - 1) == 1);
    CHECK(matmul_splitk_chunks(MATMUL_SPLITK_MIN_BT) == MATMUL_SPLITK_MIN_BT / MATMUL_SPLITK_ROWS);
    CHECK(matmul_splitk_chunks(MATMUL_SPLITK_MIN_BT + 1) == MATMUL_SPLITK_MIN_BT / MATMUL_SPLITK_ROWS + 1);
    CHECK(matmul_splitk_chunks(32 * 1024) == 8);  // d12 at B 32 x T 1024
    CHECK(matmul_splitk_chunks(8 * 1024) == 1);   // d30's speed run at B 8 x T 1024
    CHECK(matmul_splitk_scratch_bytes(1024, 768, 50304) == 0);
    CHECK(matmul_splitk_scratch_bytes(32768, 768, 768) == (size_t)8 * 768 * 768 * 4);
    CHECK(matmul_splitk_scratch_bytes(32768, 768, 768) == 8 * matmul_splitk_scratch_bytes(32768, 96, 768));  // tp 8
    CHECK(matmul_backward_scratch_bytes(1024, 768, 2304) == matmul_scratch_bytes(1024, 2304));
    CHECK(matmul_backward_scratch_bytes(32768, 768, 2304) == (size_t)8 * 768 * 2304 * 4);
    // where it splits: the whole weight's 128 x 128 tiles below half the SM count (132 on an H200),
    // from B*T 16384 on; GPT-2 124M at B 32 x T 1024: the attention projection (36 tiles), not qkv
    // (108) nor the FFN (144+); nothing at B*T 8192
    CHECK(matmul_splitk_wanted(32768, 768, 768, 132));
    CHECK(!matmul_splitk_wanted(32768, 768, 2304, 132));
    CHECK(!matmul_splitk_wanted(32768, 2048, 768, 132));
    CHECK(!matmul_splitk_wanted(32768, 768, 3072, 132));
    CHECK(!matmul_splitk_wanted(8192, 768, 768, 132));
    CHECK(!matmul_splitk_wanted(65536, 2048, 2048, 132));
    CHECK(matmul_splitk_wanted(32768, 768, 768, 108));  // an A100's 108 SMs
    CHECK(!matmul_splitk_wanted(32768, 768, 768, 72));

    // the twin: S = ((p0 + p1) + p2), then dweight + S. With dweight = 2^24 and p = 1, 1, 0.5: S = 2.5
    // and 2^24 + 2.5 rounds to 2^24 + 2, while adding each chunk into dweight in turn would lose all
    // of them (2^24 + 1 is a tie that rounds to even, 2^24; so is every later step)
    const size_t n = 3;
    const float big = 16777216.0f;
    std::vector<float> dw = {big, 1.0f, -2.0f};
    const std::vector<float> partials = {1.0f, 0.25f, 3.0f, 1.0f, 0.5f, -1.0f, 0.5f, -0.125f, 0.0f};
    cpu::matmul_dweight_reduce(dw.data(), partials.data(), 3, n);
    CHECK(dw[0] == big + 2.0f);
    CHECK(dw[1] == 1.0f + 0.625f);
    CHECK(dw[2] == 0.0f);
    std::vector<float> one = {1.0f, 2.0f, 3.0f};
    cpu::matmul_dweight_reduce(one.data(), partials.data(), 1, n);  // P = 1: one add of the one partial
    CHECK(one == std::vector<float>({2.0f, 2.25f, 6.0f}));
}

// ------------------------------------------------------------------------------------------------
// accumulate.h

// acc[i] += (float)x[i]: one fp32 addition per element, so exactly the naive loop's bits; the leaf
// type T is float (CPU build) or double (converted to float first)
TEST_CASE_TEMPLATE("grad_accumulate: acc += (float)x bitwise, three micro-steps, independent of the thread count", T,
                   float, double) {
    Rng r(21);
    for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(1003)}) {
        CAPTURE(n);
        vector<float> acc = rand_vec<float>(r, n, 0.01, 1.0), want = acc;
        for (int micro = 0; micro < 3; micro++) {
            const auto x = rand_vec<T>(r, n, 0.001, 0.1);
            for (size_t i = 0; i < n; i++) want[i] = want[i] + (float)x[i];
            cpu::grad_accumulate<T>(acc.data(), x.data(), n);
        }
        CHECK(std::memcmp(acc.data(), want.data(), n * sizeof(float)) == 0);
        const auto x = rand_vec<T>(r, n, 0.001, 0.1);
        same_across_thread_counts<float>(std::string("grad_accumulate<") + tname<T>() + ">", [&] {
            vector<float> a = acc;
            cpu::grad_accumulate<T>(a.data(), x.data(), n);
            return vector<vector<float>>{a};
        });
    }
}

// ------------------------------------------------------------------------------------------------
// thread-count independence (bitwise) of the float ops that reduce across rows/tokens

TEST_CASE("thread-count independence: gemm, matmul_forward/backward, layernorm_backward, encoder_backward, "
          "attention_forward/backward (float, bitwise)") {
    Rng r(20);
    SUBCASE("gemm") {
        const int M = 200, N = 40, K = 300;
        auto A = rand_vec<float>(r, (size_t)M * K), Bm = rand_vec<float>(r, (size_t)K * N),
             C0 = rand_vec<float>(r, (size_t)M * N);
        for (int transA = 0; transA < 2; transA++) {
            CAPTURE(transA);
            const long sam = transA ? 1 : K, sak = transA ? M : 1;
            same_across_thread_counts<float>("gemm", [&] {
                auto c1 = C0, c2 = C0;
                cpu::gemm<float>(c1.data(), A.data(), sam, sak, Bm.data(), M, N, K, false);
                cpu::gemm<float>(c2.data(), A.data(), sam, sak, Bm.data(), M, N, K, true);
                return vector<vector<float>>{c1, c2};
            });
        }
    }
    SUBCASE("matmul_forward / matmul_backward") {
        const int BT = 130, C = 70, OC = 150;
        auto x = rand_vec<float>(r, (size_t)BT * C), W = rand_vec<float>(r, (size_t)OC * C),
             b = rand_vec<float>(r, OC), dout = rand_vec<float>(r, (size_t)BT * OC),
             dW0 = rand_vec<float>(r, W.size()), db0 = rand_vec<float>(r, OC);
        same_across_thread_counts<float>("matmul_forward", [&] {
            vector<float> out((size_t)BT * OC);
            cpu::matmul_forward<float>(out.data(), x.data(), W.data(), b.data(), BT, C, OC);
            return vector<vector<float>>{out};
        });
        same_across_thread_counts<float>("matmul_backward (dinp, dweight, dbias)", [&] {
            vector<float> dx((size_t)BT * C);
            auto dW = dW0, db = db0;
            cpu::matmul_backward<float>(dx.data(), dW.data(), db.data(), dout.data(), x.data(), W.data(), BT, C,
                                        OC);
            return vector<vector<float>>{dx, dW, db};
        });
    }
    SUBCASE("layernorm_backward") {
        const int N = 67, C = 100;
        auto x = rand_vec<float>(r, (size_t)N * C), w = rand_vec<float>(r, C), b = rand_vec<float>(r, C),
             dout = rand_vec<float>(r, (size_t)N * C), dx0 = rand_vec<float>(r, (size_t)N * C),
             dw0 = rand_vec<float>(r, C), db0 = rand_vec<float>(r, C);
        vector<float> out((size_t)N * C), mean(N), rstd(N);
        cpu::layernorm_forward<float>(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
        same_across_thread_counts<float>("layernorm_backward (dinp, dweight, dbias)", [&] {
            auto dx = dx0, dw = dw0, db = db0;
            cpu::layernorm_backward<float>(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                                           mean.data(), rstd.data(), N, C);
            return vector<vector<float>>{dx, dw, db};
        });
    }
    SUBCASE("encoder_backward") {
        const int B = 4, T_ = 37, C = 100, V = 9;
        auto ds = make_doc_start(B, T_, r);
        vector<int> tokens(B * T_);
        for (auto& t : tokens) t = r.randint(0, V - 1);
        auto dout = rand_vec<float>(r, (size_t)B * T_ * C), dwte0 = rand_vec<float>(r, (size_t)V * C),
             dwpe0 = rand_vec<float>(r, (size_t)T_ * C);
        same_across_thread_counts<float>("encoder_backward (dwte, dwpe)", [&] {
            auto dwte = dwte0, dwpe = dwpe0;
            cpu::encoder_backward<float>(dwte.data(), dwpe.data(), dout.data(), tokens.data(), ds.data(), B, T_, C, 0,
                                         V);
            return vector<vector<float>>{dwte, dwpe};
        });
    }
    SUBCASE("attention_forward / attention_backward") {
        for (int alibi = 0; alibi < 2; alibi++) {
            CAPTURE(alibi);
            const int B = 2, T_ = 37, nh = 6, nkv = 3, hs = 8, row = (nh + 2 * nkv) * hs;
            auto ds = make_doc_start(B, T_, r);
            auto qkv = rand_vec<float>(r, (size_t)B * T_ * row), dout = rand_vec<float>(r, (size_t)B * T_ * nh * hs);
            vector<float> out(dout.size()), lse((size_t)B * nh * T_);
            cpu::attention_forward<float>(out.data(), lse.data(), qkv.data(), ds.data(), B, T_, nh, nkv, hs,
                                          alibi ? nh : 0, 0);
            same_across_thread_counts<float>("attention_forward (out, lse)", [&] {
                vector<float> o(out.size()), l(lse.size());
                cpu::attention_forward<float>(o.data(), l.data(), qkv.data(), ds.data(), B, T_, nh, nkv, hs,
                                              alibi ? nh : 0, 0);
                return vector<vector<float>>{o, l};
            });
            same_across_thread_counts<float>("attention_backward (dqkv)", [&] {
                vector<float> dqkv(qkv.size());
                cpu::attention_backward<float>(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(),
                                               ds.data(), B, T_, nh, nkv, hs, alibi ? nh : 0, 0);
                return vector<vector<float>>{dqkv};
            });
        }
    }
}

// ------------------------------------------------------------------------------------------------
// The gradient-path contract: every weight-gradient output gets one fp32 addition per element of a
// sum computed without its prior content, so op(acc) == acc + op(zeros) bitwise. (A repeated +=
// into the destination, per token or per k block, rounds at every step and fails this.)

// run(dst) applies the op to the destinations; acc0 the random non-zero accumulators
void check_adds_once(const std::string& what, const vector<vector<float>>& acc0,
                     const std::function<void(vector<vector<float>>&)>& run) {
    auto acc = acc0;
    run(acc);
    vector<vector<float>> zero;
    for (const auto& a : acc0) zero.emplace_back(a.size(), 0.0f);
    run(zero);
    for (size_t k = 0; k < acc0.size(); k++) {
        vector<float> want(acc0[k].size());
        for (size_t i = 0; i < want.size(); i++) want[i] = acc0[k][i] + zero[k][i];
        check_bitwise(what + " output " + std::to_string(k) + ": op(acc) vs acc + op(0)", acc[k], want);
    }
}

TEST_CASE("gradient-path contract: op(acc) == acc + op(zeros) bitwise for every weight gradient (float)") {
    Rng r(40);
    // accumulators of the sums' magnitude, so that the rounding of a running += shows
    auto accs = [&](std::initializer_list<size_t> sizes) {
        vector<vector<float>> v;
        for (size_t n : sizes) v.push_back(rand_vec<float>(r, n, 1.0, 10.0));
        return v;
    };
    SUBCASE("gemm (accumulate)") {
        const GemmShape shapes[] = {{50, 40, 200}, {200, 33, 600}, {13, 37, 300}};
        for (const auto& s : shapes)
            for (int transA = 0; transA < 2; transA++) {
                CAPTURE(s.K);
                CAPTURE(transA);
                auto A = rand_vec<float>(r, (size_t)s.M * s.K), Bm = rand_vec<float>(r, (size_t)s.K * s.N);
                const long sam = transA ? 1 : s.K, sak = transA ? s.M : 1;
                check_adds_once("gemm", accs({(size_t)s.M * s.N}), [&](vector<vector<float>>& d) {
                    cpu::gemm<float>(d[0].data(), A.data(), sam, sak, Bm.data(), s.M, s.N, s.K, true);
                });
                // and overwriting gives the sum itself
                vector<float> over((size_t)s.M * s.N, NAN), zero((size_t)s.M * s.N, 0.0f);
                cpu::gemm<float>(over.data(), A.data(), sam, sak, Bm.data(), s.M, s.N, s.K, false);
                cpu::gemm<float>(zero.data(), A.data(), sam, sak, Bm.data(), s.M, s.N, s.K, true);
                check_bitwise("gemm: overwrite vs accumulate onto zeros", over, zero);
            }
    }
    SUBCASE("matmul_backward dweight, dbias (one k block, several, several row groups)") {
        // {260, 1100, 1000}: dweight is 1000 x 1100 over 260 tokens, more than one scratch row group
        const MatmulShape shapes[] = {{7, 5, 19}, {100, 70, 50}, {600, 33, 150}, {260, 1100, 1000}};
        for (const auto& s : shapes) {
            CAPTURE(s.BT);
            CAPTURE(s.C);
            CAPTURE(s.OC);
            auto x = rand_vec<float>(r, (size_t)s.BT * s.C), W = rand_vec<float>(r, (size_t)s.OC * s.C),
                 dout = rand_vec<float>(r, (size_t)s.BT * s.OC);
            auto run = [&](vector<vector<float>>& d) {
                cpu::matmul_backward<float>((float*)nullptr, d[0].data(), d[1].data(), dout.data(), x.data(),
                                            W.data(), s.BT, s.C, s.OC);
            };
            check_adds_once("matmul_backward", accs({(size_t)s.OC * s.C, (size_t)s.OC}), run);
            // the row groups' sums are the whole product's
            vector<vector<float>> z{vector<float>((size_t)s.OC * s.C, 0.0f), vector<float>(s.OC, 0.0f)};
            run(z);
            vector<double> rdW((size_t)s.OC * s.C, 0.0);
            for (int i = 0; i < s.BT; i++)
                for (int o = 0; o < s.OC; o++) {
                    const double g = dout[(size_t)i * s.OC + o];
                    for (int c = 0; c < s.C; c++) rdW[(size_t)o * s.C + c] += g * x[(size_t)i * s.C + c];
                }
            check_close("matmul_backward<float> dweight on zeros", z[0], rdW, fwd_rtol<float>() * 2);
        }
    }
    SUBCASE("matmul_backward_batched dweight, dbias") {
        const int n_batch = 3, BT = 300, C = 20, OC = 24;
        auto x = rand_vec<float>(r, (size_t)n_batch * BT * C), W = rand_vec<float>(r, (size_t)n_batch * OC * C),
             dout = rand_vec<float>(r, (size_t)n_batch * BT * OC);
        check_adds_once("matmul_backward_batched", accs({(size_t)n_batch * OC * C, (size_t)n_batch * OC}),
                        [&](vector<vector<float>>& d) {
                            cpu::matmul_backward_batched<float>((float*)nullptr, d[0].data(), d[1].data(),
                                                                dout.data(), x.data(), W.data(), n_batch, BT, C, OC);
                        });
    }
    SUBCASE("layernorm_backward dweight, dbias") {
        const int N = 300, C = 70;
        auto x = rand_vec<float>(r, (size_t)N * C), w = rand_vec<float>(r, C), b = rand_vec<float>(r, C),
             dout = rand_vec<float>(r, (size_t)N * C);
        vector<float> out((size_t)N * C), mean(N), rstd(N);
        cpu::layernorm_forward<float>(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
        check_adds_once("layernorm_backward", accs({(size_t)C, (size_t)C}), [&](vector<vector<float>>& d) {
            cpu::layernorm_backward<float>((float*)nullptr, d[0].data(), d[1].data(), dout.data(), x.data(),
                                           (const float*)nullptr, mean.data(), rstd.data(), N, C);
        });
    }
    SUBCASE("encoder_backward dwte, dwpe (repeated tokens, a vocab range)") {
        const int B = 4, T_ = 64, C = 40, V = 9;
        auto ds = make_doc_start(B, T_, r);
        vector<int> tokens(B * T_);
        for (auto& t : tokens) t = r.randint(0, V - 1);
        auto dout = rand_vec<float>(r, (size_t)B * T_ * C);
        for (int v0 : {0, 3}) {
            const int n = v0 == 0 ? V : 4;
            CAPTURE(v0);
            check_adds_once("encoder_backward", accs({(size_t)n * C, (size_t)T_ * C}), [&](vector<vector<float>>& d) {
                cpu::encoder_backward<float>(d[0].data(), d[1].data(), dout.data(), tokens.data(), ds.data(), B, T_,
                                             C, v0, n);
            });
        }
    }
    SUBCASE("moe_router_backward drouter_w") {
        const int n = 200, C = 30, E = 4;
        auto x = rand_vec<float>(r, (size_t)n * C), w = rand_vec<float>(r, (size_t)E * C, 0.01, 0.1),
             ds = rand_vec<float>(r, (size_t)n * E);
        vector<float> scores((size_t)n * E);
        cpu::moe_router_forward(scores.data(), x.data(), w.data(), n, C, E);
        check_adds_once("moe_router_backward", accs({(size_t)E * C}), [&](vector<vector<float>>& d) {
            cpu::moe_router_backward<float, float>((float*)nullptr, d[0].data(), ds.data(), scores.data(), x.data(),
                                                   w.data(), n, C, E);
        });
    }
}

}  // namespace
