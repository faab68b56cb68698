// Host utilities shared by every build: errors that name what went wrong, checked file I/O,
// and an atomic file writer for checkpoints.
#pragma once
#include <cerrno>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>
#include <fcntl.h>
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

inline FILE* fopen_or_fail(const std::string& path, const char* mode) {
    FILE* f = fopen(path.c_str(), mode);
    LLMC_CHECK(f != nullptr, "%s: cannot open (%s)", path.c_str(), strerror(errno));
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

inline long long file_size_bytes(const std::string& path) {
    FILE* f = fopen_or_fail(path, "rb");
    fseek(f, 0, SEEK_END);
    long long n = ftell(f);
    fclose(f);
    return n;
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
