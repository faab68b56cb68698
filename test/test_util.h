// Helpers shared by the CPU test files (test_ops.cpp, test_moe.cpp, test_model.cpp).
//  - numeric helpers (random vectors, tolerant and bitwise comparison, central finite differences):
//    need only doctest and OpenMP;
//  - trainer helpers (token shards, temp dirs, running train_main in-process): need train_gpt.cu,
//    so they are declared only when it was included first (LLMC_NO_MAIN defined).
// Everything lives in namespace test_util (train_gpt.cu has its own Rng).
#pragma once

#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
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

namespace test_util {

using std::vector;

struct Rng {
    std::mt19937_64 g;
    explicit Rng(uint64_t seed) : g(seed) {}
    double uni(double a, double b) { return std::uniform_real_distribution<double>(a, b)(g); }
    // never zero: magnitude uniform in [lo, hi], random sign
    double nz(double lo = 0.1, double hi = 1.0) {
        double m = uni(lo, hi);
        return (g() & 1) ? m : -m;
    }
    int randint(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g); }  // inclusive
};

template <class T>
vector<T> rand_vec(Rng& r, size_t n, double lo = 0.1, double hi = 1.0) {
    vector<T> v(n);
    for (auto& x : v) x = (T)r.nz(lo, hi);
    return v;
}

template <class T>
vector<T> nan_vec(size_t n) {
    return vector<T>(n, std::numeric_limits<T>::quiet_NaN());
}

template <class T>
vector<double> to_d(const vector<T>& v) {
    return vector<double>(v.begin(), v.end());
}

inline double dot(const vector<double>& a, const vector<double>& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); i++) s += a[i] * b[i];
    return s;
}

inline vector<double> sub(const vector<double>& a, const vector<double>& b) {
    vector<double> c(a.size());
    for (size_t i = 0; i < a.size(); i++) c[i] = a[i] - b[i];
    return c;
}

template <class T>
const char* tname() {
    return std::is_same<T, float>::value ? "float" : "double";
}

// forward tolerance vs a double-precision naive definition
template <class T>
double fwd_rtol() {
    return std::is_same<T, float>::value ? 1e-5 : 1e-12;
}

// |got - ref| <= rtol * (|ref| + scale) for every element, scale = max |ref| unless given: a relative
// error with a floor relative to the tensor's magnitude. NaN anywhere fails. One CHECK per tensor,
// whose message names the tensor, the number of bad elements and the worst one.
template <class G, class R>
bool check_close(const std::string& what, const G* got, const R* ref, size_t n, double rtol,
                 double scale = -1, const vector<size_t>* index = nullptr) {
    if (scale < 0) {
        scale = 0;
        for (size_t i = 0; i < n; i++)
            if (std::isfinite((double)ref[i])) scale = std::max(scale, std::fabs((double)ref[i]));
    }
    size_t nfail = 0, worst = 0;
    double worst_ratio = -1;
    for (size_t i = 0; i < n; i++) {
        double g = (double)got[i], r = (double)ref[i];
        double err = std::fabs(g - r), tol = rtol * (std::fabs(r) + scale);
        if (!(err <= tol)) {
            nfail++;
            double ratio = std::isnan(err) ? INFINITY : err / std::max(tol, 1e-300);
            if (ratio > worst_ratio) worst_ratio = ratio, worst = i;
        }
    }
    std::string msg;
    if (nfail) {
        std::ostringstream os;
        os << std::setprecision(12) << what << ": " << nfail << "/" << n
           << " elements out of tolerance; worst at index " << (index ? (*index)[worst] : worst)
           << ": got " << (double)got[worst] << ", expected " << (double)ref[worst] << ", |err| "
           << std::fabs((double)got[worst] - (double)ref[worst]) << " > tol "
           << rtol * (std::fabs((double)ref[worst]) + scale) << " (rtol " << rtol << ", scale " << scale
           << ")";
        msg = os.str();
    }
    CHECK_MESSAGE(nfail == 0, msg);
    return nfail == 0;
}

template <class G, class R>
bool check_close(const std::string& what, const vector<G>& got, const vector<R>& ref, double rtol,
                 double scale = -1) {
    REQUIRE_MESSAGE(got.size() == ref.size(), what << ": size mismatch");
    return check_close(what, got.data(), ref.data(), got.size(), rtol, scale);
}

template <class T>
void check_bitwise(const std::string& what, const vector<T>& got, const vector<T>& ref) {
    REQUIRE_MESSAGE(got.size() == ref.size(), what << ": size mismatch");
    size_t first = got.size();
    for (size_t i = 0; i < got.size(); i++)
        if (std::memcmp(&got[i], &ref[i], sizeof(T)) != 0) {
            first = i;
            break;
        }
    std::string msg;
    if (first < got.size()) {
        std::ostringstream os;
        os << std::setprecision(12) << what << ": first bitwise difference at index " << first << ": "
           << (double)got[first] << " vs " << (double)ref[first];
        msg = os.str();
    }
    CHECK_MESSAGE(first == got.size(), msg);
}

// Central differences (L(x+h) - L(x-h)) / 2h of loss() w.r.t. x[i], compared with grad[i], for every
// element of x (or a random subset of max_n of them when x is larger).
inline void fd_check(const std::string& what, vector<double>& x, const vector<double>& grad,
                     const std::function<double()>& loss, size_t max_n = SIZE_MAX, double h = 1e-5,
                     double rtol = 1e-6) {
    REQUIRE_MESSAGE(grad.size() == x.size(), what << ": gradient size mismatch");
    vector<size_t> idx(x.size());
    std::iota(idx.begin(), idx.end(), 0);
    if (x.size() > max_n) {
        Rng r(1234 + x.size());
        std::shuffle(idx.begin(), idx.end(), r.g);
        idx.resize(max_n);
        std::sort(idx.begin(), idx.end());
    }
    vector<double> fd, an;
    // thousands of tiny forwards: one thread avoids the fork/join cost (the backward under test ran
    // with the default thread count; thread-count independence is tested separately)
    const int saved_threads = omp_get_max_threads();
    omp_set_num_threads(1);
    for (size_t i : idx) {
        const double x0 = x[i];
        x[i] = x0 + h;
        const double lp = loss();
        x[i] = x0 - h;
        const double lm = loss();
        x[i] = x0;
        fd.push_back((lp - lm) / (2 * h));
        an.push_back(grad[i]);
    }
    omp_set_num_threads(saved_threads);
    // relative to the gradient's magnitude, with an absolute floor of 1e-4 * rtol for gradients that
    // are exactly zero (FD roundoff, and the prefill subtraction of accumulated gradients, ~1e-14)
    double scale = 1e-4;
    for (double g : grad) scale = std::max(scale, std::fabs(g));
    if (!std::isfinite(scale)) scale = 1;
    check_close(what + " vs central finite differences", an.data(), fd.data(), idx.size(), rtol, scale,
                &idx);
}

// Runs f (returning a list of output buffers) with 1, 2 and 3 OpenMP threads; all must be bitwise equal.
template <class T>
inline void same_across_thread_counts(const std::string& what, const std::function<vector<vector<T>>()>& f) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    const auto ref = f();
    vector<vector<vector<T>>> got;
    for (int nt : {2, 3}) {
        omp_set_num_threads(nt);
        got.push_back(f());
    }
    omp_set_num_threads(saved);
    for (size_t k = 0; k < got.size(); k++) {
        REQUIRE(got[k].size() == ref.size());
        for (size_t o = 0; o < ref.size(); o++) {
            REQUIRE(got[k][o].size() == ref[o].size());
            const bool same = std::memcmp(got[k][o].data(), ref[o].data(), ref[o].size() * sizeof(T)) == 0;
            size_t first = 0;
            while (!same && first < ref[o].size() && std::memcmp(&got[k][o][first], &ref[o][first], sizeof(T)) == 0)
                first++;
            CHECK_MESSAGE(same, what << ": output #" << o << " differs between 1 and " << (k + 2)
                                     << " threads (first difference at index " << first << ")");
        }
    }
}

}  // namespace test_util

#ifdef LLMC_NO_MAIN  // train_gpt.cu was included: trainer helpers
#include <fcntl.h>
#include <unistd.h>

#include <fstream>

namespace test_util {

// Writes a token shard with an explicit header, so tests can also write broken ones.
inline void write_shard(const std::string& path, const std::vector<int>& tokens, uint32_t vocab_size = 257,
                        uint32_t eot = 256, uint32_t token_bytes = 2, const char* magic = "LLMCSHRD",
                        long long num_tokens_in_header = -1) {
    FILE* f = fopen(path.c_str(), "wb");
    REQUIRE(f);
    unsigned char h[SHARD_HEADER_BYTES] = {0};
    memcpy(h, magic, 8);
    uint32_t version = SHARD_VERSION;
    uint64_t n = num_tokens_in_header >= 0 ? (uint64_t)num_tokens_in_header : tokens.size();
    memcpy(h + 8, &version, 4);
    memcpy(h + 12, &token_bytes, 4);
    memcpy(h + 16, &n, 8);
    memcpy(h + 24, &vocab_size, 4);
    memcpy(h + 28, &eot, 4);
    fwrite(h, 1, sizeof(h), f);
    for (int t : tokens) fwrite(&t, 1, token_bytes, f);  // little-endian host
    fclose(f);
}

// Byte-like text with documents opened by EOT (256), lengths 1..40 (train_gpt.cu's Rng).
inline std::vector<int> synthetic_tokens(int n, uint64_t seed) {
    ::Rng rng(seed);
    std::vector<int> t;
    while ((int)t.size() < n) {
        t.push_back(256);
        int len = 1 + (int)rng.below(40);
        for (int i = 0; i < len && (int)t.size() < n; i++) t.push_back('a' + (int)rng.below(8) + (i % 3 == 0 ? 0 : 8));
    }
    return t;
}

// A fresh directory /tmp/<prefix>XXXXXX.
inline std::string make_temp_dir(const std::string& prefix = "llmc_test_") {
    std::string tmpl = "/tmp/" + prefix + "XXXXXX";
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    return tmpl;
}

inline std::string read_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// Runs the trainer in-process with its stdout silenced (errors still propagate as LlmcError).
// train_main with its stdout sent to stdout_path (restored afterwards, also on an exception)
inline int run_train_to(std::vector<std::string> args, const std::string& stdout_path) {
    args.insert(args.begin(), "train_gpt_cpu");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    fflush(stdout);
    int saved = dup(1), fd = open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    close(fd);
    struct Restore {
        int fd;
        ~Restore() {
            fflush(stdout);
            dup2(fd, 1);
            close(fd);
        }
    } restore{saved};
    return train_main((int)argv.size(), argv.data());
}
inline int run_train(std::vector<std::string> args) { return run_train_to(std::move(args), "/dev/null"); }
// run_train with its stdout captured (into a temporary file, read back)
inline int run_train_output(std::vector<std::string> args, std::string& out) {
    const std::string path = make_temp_dir("llmc_out_") + "/stdout.txt";
    const int rc = run_train_to(std::move(args), path);
    out = read_file(path);
    return rc;
}

}  // namespace test_util
#endif  // LLMC_NO_MAIN
