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
//
// Changed from outside (logrotate, a user). The log is opened with O_APPEND and every record is one
// write(): a record lands at the file's end as it is then, never at a remembered offset. So after
// logrotate's copytruncate (copy, then truncate in place) the next record starts the emptied file,
// where a plain offset would leave the gap before it as NUL bytes, an unparseable line. Before each
// record the logger compares its file with the path: a truncated file is said once on stderr; a
// file deleted, or moved away with a new one in its place (logrotate's default rename + create), is
// said once and the path is reopened (created when missing), so the run keeps logging where a
// reader looks, never into a file that no longer has a name. LLMC_FAULT_LOG injects these changes
// for the tests (JsonlLogger::inject_fault).
#pragma once
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
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
    int fd = -1;
    std::string path;
    long long size = 0;  // the file's size after our last record (a smaller one was truncated)
    bool fault_done = false;  // LLMC_FAULT_LOG (once)
    void open(const std::string& p, bool append) {
        path = p;
        reopen(append ? 0 : O_TRUNC);
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
        if (fd < 0) return;
        std::string line = "{";
        for (size_t i = 0; i < fields.size(); i++)
            line += std::string(i ? "," : "") + "\"" + fields[i].first + "\":" + json_number(fields[i].second);
        line += "}\n";
        if (!fields.empty() && !strcmp(fields[0].first, "step")) inject_fault((long long)fields[0].second);
        follow_path();
        size_t done = 0;  // one write() (O_APPEND: at the end of the file); a short one is continued
        while (done < line.size()) {
            const ssize_t w = ::write(fd, line.data() + done, line.size() - done);
            if (w < 0 && errno == EINTR) continue;
            LLMC_CHECK(w > 0, "%s: writing the training log failed (%s); stopping rather than training on without a "
                              "log (free disk space, then resume from the last checkpoint)",
                       path.c_str(), w < 0 ? strerror(errno) : "nothing written");
            done += (size_t)w;
        }
        struct stat st;
        size = fstat(fd, &st) == 0 ? (long long)st.st_size : size + (long long)line.size();
    }
    ~JsonlLogger() { if (fd >= 0) close(fd); }

  private:
    void reopen(int extra_flags) {
        if (fd >= 0) close(fd);
        fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | extra_flags, 0644);
        LLMC_CHECK(fd >= 0, "%s: cannot open the training log (%s)", path.c_str(), strerror(errno));
        struct stat st;
        size = fstat(fd, &st) == 0 ? (long long)st.st_size : 0;
    }
    // the file we write vs the one the path names now (see the top of the file)
    void follow_path() {
        struct stat mine, named;
        if (fstat(fd, &mine) != 0) return;
        const bool exists = stat(path.c_str(), &named) == 0;
        if (!exists || named.st_dev != mine.st_dev || named.st_ino != mine.st_ino) {
            fprintf(stderr, exists ? "warning: %s was replaced during the run (moved away, as logrotate does): "
                                     "logging into the new file\n"
                                   : "warning: %s was deleted during the run: logging into a new one\n",
                    path.c_str());
            reopen(0);
        } else if ((long long)mine.st_size < size) {
            fprintf(stderr, "warning: %s was truncated during the run (to %lld of its %lld bytes, as logrotate's "
                            "copytruncate does): logging on from its new end\n",
                    path.c_str(), (long long)mine.st_size, size);
            size = (long long)mine.st_size;
        }
    }
    // LLMC_FAULT_LOG=<copytruncate|create|remove>:<step>, fault injection for the tests: before the
    // first record of that step, the log is changed as logrotate or a user would: copied to <log>.1
    // and truncated in place (copytruncate), renamed to <log>.1 and a new empty <log> created
    // (logrotate's default, create), or deleted (remove)
    void inject_fault(long long step) {
        const char* spec = getenv("LLMC_FAULT_LOG");
        char action[16];
        long long at_step = -1;
        if (fault_done || !spec || sscanf(spec, "%15[a-z]:%lld", action, &at_step) != 2 || at_step != step) return;
        fault_done = true;
        const std::string old = path + ".1";
        bool ok = false;
        if (!strcmp(action, "copytruncate")) {
            std::string bytes;
            if (FILE* in = fopen(path.c_str(), "rb")) {
                char buf[4096];
                for (size_t n; (n = fread(buf, 1, sizeof(buf), in)) > 0;) bytes.append(buf, n);
                fclose(in);
            }
            FILE* out = fopen(old.c_str(), "wb");
            ok = out && fwrite(bytes.data(), 1, bytes.size(), out) == bytes.size();
            ok = (out && fclose(out) == 0) && ok && truncate(path.c_str(), 0) == 0;
        } else if (!strcmp(action, "create")) {
            const int made =
                rename(path.c_str(), old.c_str()) == 0 ? ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644) : -1;
            ok = made >= 0 && close(made) == 0;
        } else if (!strcmp(action, "remove")) {
            ok = unlink(path.c_str()) == 0;
        } else LLMC_FAIL("LLMC_FAULT_LOG=%s: the action is copytruncate, create or remove", spec);
        fprintf(stderr, "fault injected: %s %s before the record of step %lld%s\n", action, path.c_str(), step,
                ok ? "" : " (failed)");
    }
};
