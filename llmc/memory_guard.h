// How much memory the machine can give the run right now, for the memory guard in train_gpt.cu
// (which compares it with what the run will allocate and refuses an impossible run up front,
// instead of growing until the OOM killer ends it).
//
// Host: MemAvailable from /proc/meminfo (the kernel's estimate of what can be allocated without
// swapping, page cache included). LLMC_MEMORY_LIMIT=<bytes> (optionally with a K/M/G suffix)
// replaces the measurement: to cap a run below what the machine has, and for tests.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include "utils.h"

// LLMC_MEMORY_LIMIT in bytes, or -1 when not set
inline double memory_limit_override() {
    const char* env = getenv("LLMC_MEMORY_LIMIT");
    if (!env || !*env) return -1;
    std::string s = env;
    double mult = 1;
    const char last = s.back();
    if (last == 'K' || last == 'k') mult = 1024.0;
    if (last == 'M' || last == 'm') mult = 1048576.0;
    if (last == 'G' || last == 'g') mult = 1073741824.0;
    if (mult != 1) s.pop_back();
    return (double)parse_int64(s, "LLMC_MEMORY_LIMIT (environment)", 0, INT64_MAX / 1073741824) * mult;
}

// MemAvailable in bytes from a meminfo-format file, or -1 when it cannot be read (then the guard
// has nothing to compare with and lets the run start).
inline double meminfo_available_bytes(const char* path = "/proc/meminfo") {
    FILE* f = fopen(path, "r");
    if (!f) return -1;
    char line[256];
    double kib = -1;
    while (fgets(line, sizeof(line), f)) {
        unsigned long long v;
        if (sscanf(line, "MemAvailable: %llu kB", &v) == 1) { kib = (double)v; break; }
    }
    fclose(f);
    return kib < 0 ? -1 : kib * 1024.0;
}

inline double available_host_memory(std::string& source) {
    double limit = memory_limit_override();
    if (limit >= 0) { source = "LLMC_MEMORY_LIMIT"; return limit; }
    source = "available host memory (MemAvailable in /proc/meminfo)";
    return meminfo_available_bytes();
}
