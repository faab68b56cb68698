// Machine-readable training log: one JSON object per line in <out_dir>/log.jsonl
// ({"step":..,"loss":..,...} per training step, {"step":..,"val_loss":..} per evaluation).
#pragma once
#include <cstdio>
#include <string>
#include <utility>
#include <vector>
#include "utils.h"

struct JsonlLogger {
    FILE* f = nullptr;
    void open(const std::string& path, bool append) {
        f = fopen_or_fail(path, append ? "ab" : "wb");
    }
    void write(const std::vector<std::pair<const char*, double>>& fields) {
        if (!f) return;
        fputc('{', f);
        for (size_t i = 0; i < fields.size(); i++)
            fprintf(f, "%s\"%s\":%.9g", i ? "," : "", fields[i].first, fields[i].second);
        fputs("}\n", f);
        fflush(f);
    }
    ~JsonlLogger() { if (f) fclose(f); }
};
