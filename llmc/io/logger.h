// Machine-readable training log: one JSON object per line in <out_dir>/log.jsonl
// ({"step":..,"loss":..,...} per training step, {"step":..,"val_loss":..} per evaluation,
// {"step":..,"resume":1} where a resumed run continues).
//
// The log is valid JSON lines at all times: a number that is not finite (a diverged loss) is
// written as null, and every record is one fprintf + fflush whose failure (disk full, I/O error)
// is fatal, because a run that keeps training while its log silently loses steps is worse than a
// run that stops and says why.
//
// Resuming. A run resumed from a checkpoint at step S rewrites the log (atomically: temp file,
// fsync, rename) keeping only the records with step <= S, then appends a {"step":S,"resume":1}
// record and continues. We chose truncation over "append and let readers deduplicate": the steps
// after S that the interrupted run logged belong to a timeline that was abandoned (its state was
// never checkpointed), so keeping them would make every reader (plots, the tests' loss maps,
// anything that sums or averages per step) count those steps twice or mix two different runs.
// After truncation the log reads exactly like an uninterrupted run's, plus the resume markers.
#pragma once
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>
#include "llmc/utils.h"

// One JSON number, or null when not finite (JSON has no NaN/Inf). Integral values are written
// exactly (steps, counters); others with 9 significant digits (enough to round-trip a float).
inline std::string json_number(double v) {
    if (!std::isfinite(v)) return "null";
    char buf[40];
    if (v == std::floor(v) && std::fabs(v) < 9007199254740992.0) snprintf(buf, sizeof(buf), "%lld", (long long)v);
    else snprintf(buf, sizeof(buf), "%.9g", v);
    return buf;
}

// The "step" of a log line that is a complete JSON object ({...}), or -1 when the line has no
// step or is torn (a crash mid-write leaves a partial last line).
inline long long jsonl_record_step(const std::string& line) {
    if (line.size() < 2 || line.front() != '{' || line.back() != '}') return -1;
    size_t p = line.find("\"step\":");
    if (p == std::string::npos) return -1;
    const char* s = line.c_str() + p + 7;
    char* end = nullptr;
    long long v = strtoll(s, &end, 10);
    if (end == s || (*end != ',' && *end != '}')) return -1;
    return v;
}

// Rewrites the log at `path` keeping only the complete records with step <= keep_through_step
// (see the comment at the top). Returns the number of records dropped. No file: nothing to do.
inline size_t truncate_log_after_step(const std::string& path, long long keep_through_step) {
    if (!file_exists(path)) return 0;
    FILE* in = fopen_or_fail(path, "rb");
    std::string kept, line;
    size_t dropped = 0;
    int c;
    bool eof = false;
    while (!eof) {
        line.clear();
        while ((c = fgetc(in)) != EOF && c != '\n') line.push_back((char)c);
        eof = c == EOF;
        if (eof && line.empty()) break;
        long long step = jsonl_record_step(line);
        if (step >= 0 && step <= keep_through_step) kept += line + "\n";
        else dropped++;
    }
    const bool read_error = ferror(in);
    fclose(in);
    LLMC_CHECK(!read_error, "%s: read error while trimming the log for the resume", path.c_str());
    AtomicFile out(path);
    out.write(kept.data(), kept.size());
    out.commit();
    return dropped;
}

struct JsonlLogger {
    FILE* f = nullptr;
    std::string path;
    void open(const std::string& p, bool append) {
        path = p;
        f = fopen_or_fail(path, append ? "ab" : "wb");
    }
    // A fresh run (resume_step < 0) starts an empty log; a resumed one trims the log back to
    // resume_step and marks the resume.
    void open_for_run(const std::string& p, long long resume_step) {
        if (resume_step < 0) { open(p, false); return; }
        size_t dropped = truncate_log_after_step(p, resume_step);
        if (dropped) printf("log: dropped %zu record(s) after step %lld from %s (the resumed run redoes them)\n",
                            dropped, resume_step, p.c_str());
        open(p, true);
        write({{"step", (double)resume_step}, {"resume", 1}});
    }
    void write(const std::vector<std::pair<const char*, double>>& fields) {
        if (!f) return;
        std::string line = "{";
        for (size_t i = 0; i < fields.size(); i++)
            line += std::string(i ? "," : "") + "\"" + fields[i].first + "\":" + json_number(fields[i].second);
        line += "}\n";
        const bool ok = fputs(line.c_str(), f) >= 0 && fflush(f) == 0 && !ferror(f);
        LLMC_CHECK(ok, "%s: writing the training log failed (%s); stopping rather than training on without a log "
                       "(free disk space, then resume from the last checkpoint)",
                   path.c_str(), strerror(errno));
    }
    ~JsonlLogger() { if (f) fclose(f); }
};
