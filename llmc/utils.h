// Host utilities shared by every build: errors that name what went wrong, checked file I/O,
// and an atomic file writer for checkpoints.
#pragma once
#include <cctype>
#include <cerrno>
#include <cmath>
#include <initializer_list>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

// Every user-facing failure (bad file, bad flag, impossible layout) is an LlmcError whose message
// says what was expected and what was found. main() prints it and exits 1; tests can catch it.
struct LlmcError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

inline std::string strfmt(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[2048];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return std::string(buf);
}

#define LLMC_FAIL(...) throw LlmcError(strfmt(__VA_ARGS__))
#define LLMC_CHECK(cond, ...) do { if (!(cond)) LLMC_FAIL(__VA_ARGS__); } while (0)

// Opens a file. For reading, the path must be a regular file: a directory, FIFO, socket or device
// is refused with a message saying what it is. The check is made on the opened descriptor (opened
// non-blocking, so opening a FIFO that has no writer cannot block), so there is no window between
// checking and opening.
inline const char* file_kind_name(mode_t m) {
    return S_ISDIR(m) ? "a directory" : S_ISFIFO(m) ? "a FIFO (named pipe)" : S_ISSOCK(m) ? "a socket"
           : S_ISCHR(m) ? "a character device" : S_ISBLK(m) ? "a block device" : "not a regular file";
}
inline FILE* fopen_or_fail(const std::string& path, const char* mode) {
    if (mode[0] != 'r') {
        FILE* f = fopen(path.c_str(), mode);
        LLMC_CHECK(f != nullptr, "%s: cannot open (%s)", path.c_str(), strerror(errno));
        return f;
    }
    int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    LLMC_CHECK(fd >= 0, "%s: cannot open (%s)", path.c_str(), strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        const char* kind = fstat(fd, &st) == 0 ? file_kind_name(st.st_mode) : strerror(errno);
        close(fd);
        LLMC_FAIL("%s: cannot read: it is %s, expected a regular file", path.c_str(), kind);
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // regular files never block anyway
    FILE* f = fdopen(fd, "rb");
    if (!f) { close(fd); LLMC_FAIL("%s: cannot open (%s)", path.c_str(), strerror(errno)); }
    return f;
}

inline void fread_or_fail(void* dst, size_t bytes, FILE* f, const std::string& path, const char* what) {
    size_t got = fread(dst, 1, bytes, f);
    LLMC_CHECK(got == bytes, "%s: truncated while reading %s (expected %zu bytes, got %zu)",
               path.c_str(), what, bytes, got);
}

inline void fwrite_or_fail(const void* src, size_t bytes, FILE* f, const std::string& path) {
    size_t put = fwrite(src, 1, bytes, f);
    LLMC_CHECK(put == bytes, "%s: write failed (%s)", path.c_str(), strerror(errno));
}

// Size of a regular file (refusing anything else, like fopen_or_fail), from stat: no open, so a
// FIFO cannot block here either.
inline long long file_size_bytes(const std::string& path) {
    struct stat st;
    LLMC_CHECK(stat(path.c_str(), &st) == 0, "%s: cannot stat (%s)", path.c_str(), strerror(errno));
    LLMC_CHECK(S_ISREG(st.st_mode), "%s: it is %s, expected a regular file", path.c_str(), file_kind_name(st.st_mode));
    return (long long)st.st_size;
}

inline bool file_exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// Writes `path` so that a crash at any moment leaves either the old file or the complete new one:
// write to path.tmp, fsync it, rename over path, fsync the directory.
struct AtomicFile {
    std::string path, tmp_path;
    FILE* f = nullptr;
    explicit AtomicFile(const std::string& p) : path(p), tmp_path(p + ".tmp") {
        f = fopen_or_fail(tmp_path, "wb");
    }
    void write(const void* src, size_t bytes) { fwrite_or_fail(src, bytes, f, tmp_path); }
    void commit() {
        LLMC_CHECK(fflush(f) == 0 && fsync(fileno(f)) == 0, "%s: flush failed (%s)", tmp_path.c_str(), strerror(errno));
        fclose(f);
        f = nullptr;
        LLMC_CHECK(rename(tmp_path.c_str(), path.c_str()) == 0, "%s: rename failed (%s)", path.c_str(), strerror(errno));
        std::string dir = path.find('/') == std::string::npos ? "." : path.substr(0, path.rfind('/'));
        int dfd = open(dir.empty() ? "/" : dir.c_str(), O_RDONLY);
        if (dfd >= 0) { fsync(dfd); close(dfd); }
    }
    ~AtomicFile() { if (f) { fclose(f); remove(tmp_path.c_str()); } }
};

// A duration for people: "42s", "3m07s", "2h05m".
inline std::string format_duration(double seconds) {
    if (!std::isfinite(seconds) || seconds < 0) return "?";
    const long long t = (long long)(seconds + 0.5);
    char buf[48];
    if (t < 60) snprintf(buf, sizeof(buf), "%llds", t);
    else if (t < 3600) snprintf(buf, sizeof(buf), "%lldm%02llds", t / 60, t % 60);
    else snprintf(buf, sizeof(buf), "%lldh%02lldm", t / 3600, (t % 3600) / 60);
    return buf;
}

// Sorted list of files matching a glob pattern (shard lists like "data/train_*.bin").
#include <glob.h>
inline std::vector<std::string> glob_files(const std::string& pattern) {
    glob_t g;
    std::vector<std::string> out;
    if (glob(pattern.c_str(), 0, nullptr, &g) == 0) {
        for (size_t i = 0; i < g.gl_pathc; i++) out.push_back(g.gl_pathv[i]);
    }
    globfree(&g);
    return out;
}

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }
inline long ceil_div(long a, long b) { return (a + b - 1) / b; }

// mkdir -p: creates every missing directory of path
#include <sys/stat.h>
inline void make_dirs(const std::string& path) {
    for (size_t i = 1; i <= path.size(); i++) {
        if (i < path.size() && path[i] != '/') continue;
        std::string prefix = path.substr(0, i);
        if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST)
            LLMC_FAIL("%s: cannot create directory (%s)", prefix.c_str(), strerror(errno));
    }
}

// ----------------------------------------------------------------------------------------------
// Checked arithmetic and strict number parsing. Sizes that come from files or flags are multiplied
// in 64 bits with an overflow check, so a hostile header or flag gives an error, never a wrapped
// (and therefore passing) size check.

// a * b, or an LlmcError naming `what` when the product does not fit in uint64
inline uint64_t mul_u64_or_fail(uint64_t a, uint64_t b, const char* what) {
    uint64_t r;
    LLMC_CHECK(!__builtin_mul_overflow(a, b, &r), "%s: %llu * %llu overflows 64 bits", what,
               (unsigned long long)a, (unsigned long long)b);
    return r;
}
inline uint64_t add_u64_or_fail(uint64_t a, uint64_t b, const char* what) {
    uint64_t r;
    LLMC_CHECK(!__builtin_add_overflow(a, b, &r), "%s: %llu + %llu overflows 64 bits", what,
               (unsigned long long)a, (unsigned long long)b);
    return r;
}
// product of signed factors (each >= 0), or an error when it exceeds `limit`
inline int64_t checked_product(std::initializer_list<int64_t> factors, int64_t limit, const char* what) {
    int64_t r = 1;
    for (int64_t f : factors) {
        LLMC_CHECK(f >= 0, "%s: negative factor %lld", what, (long long)f);
        LLMC_CHECK(!__builtin_mul_overflow(r, f, &r) && r <= limit, "%s is too large (more than %lld)", what,
                   (long long)limit);
    }
    return r;
}

// Parses all of `text` as a decimal integer in [lo, hi]: no trailing junk ("12abc"), no empty
// string, no leading blanks, no silent wrap-around ("4294967300" for an int flag).
// `name` is the flag, for the message.
inline int64_t parse_int64(const std::string& text, const char* name, int64_t lo, int64_t hi) {
    const char* s = text.c_str();
    char* end = nullptr;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    const bool ok = !text.empty() && !isspace((unsigned char)s[0]) && *end == 0;
    LLMC_CHECK(ok, "--%s: expected an integer, got '%s'", name, s);
    LLMC_CHECK(errno != ERANGE && v >= lo && v <= hi, "--%s: %s is out of range, expected an integer in [%lld, %lld]",
               name, s, (long long)lo, (long long)hi);
    return (int64_t)v;
}
// An unsigned 64-bit integer (a seed): all of [0, 2^64 - 1], and nothing else (strtoull would
// accept "-1" as 2^64 - 1).
inline uint64_t parse_uint64(const std::string& text, const char* name) {
    const char* s = text.c_str();
    char* end = nullptr;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    const bool ok = !text.empty() && isdigit((unsigned char)s[0]) && *end == 0;
    LLMC_CHECK(ok, "--%s: expected a non-negative integer, got '%s'", name, s);
    LLMC_CHECK(errno != ERANGE, "--%s: %s is out of range, expected an integer in [0, 18446744073709551615]", name, s);
    return (uint64_t)v;
}
// A finite floating-point number (nan, inf and overflowing values like 1e999 are refused).
inline double parse_double(const std::string& text, const char* name) {
    const char* s = text.c_str();
    char* end = nullptr;
    errno = 0;
    double v = strtod(s, &end);
    const bool ok = !text.empty() && !isspace((unsigned char)s[0]) && *end == 0;
    LLMC_CHECK(ok, "--%s: expected a number, got '%s'", name, s);
    LLMC_CHECK(std::isfinite(v) && errno != ERANGE, "--%s: expected a finite number, got '%s'", name, s);
    return v;
}

// Index of the first non-finite value, or n when all are finite. Used before writing a
// checkpoint: a diverged state must never be saved (a later --resume would continue from NaN).
inline size_t first_non_finite(const float* v, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!std::isfinite(v[i])) return i;
    return n;
}
