// Ownership of an output directory (log.jsonl, checkpoints) by one run.
//
//  - RunDirLock: an exclusive, non-blocking flock on <out_dir>/.lock, held for the life of the
//    trainer. A second trainer on the same out_dir is refused at start-up instead of interleaving
//    its log and checkpoints with the first. flock locks belong to the open file description, so
//    the kernel drops the lock when the process dies, however it dies (no stale lock files).
//    The lock is taken on the out_dir itself too (a directory descriptor): deleting .lock makes a
//    new file a second trainer could lock, but it cannot unlock the directory. Where directories
//    cannot be flocked (NFS emulates flock with byte-range locks, which need a file open for
//    writing) the .lock file's lock is the only one, as before.
//    In a multi-process run only one process (rank 0, the one that writes the log) should take
//    it: the caller decides, this header knows nothing about ranks.
//  - claim_out_dir: a fresh run (no --resume) into an out_dir that already holds checkpoints is
//    refused unless --overwrite is given, in which case the old checkpoints and log are removed.
//    Otherwise a later `--resume latest` would pick up the OTHER run's newest checkpoint.
//    First, with the lock held (so no other trainer is writing one), it removes every
//    ckpt_*.tmp: a checkpoint write that a crash or a kill interrupted. A .tmp is never a
//    checkpoint of a run: it neither blocks a fresh start nor is offered to --resume.
#pragma once
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include <fcntl.h>
#include <ftw.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include "llmc/utils.h"

struct RunDirLock {
    int fd = -1, dir_fd = -1;
    std::string path;

    RunDirLock() = default;
    RunDirLock(const RunDirLock&) = delete;
    RunDirLock& operator=(const RunDirLock&) = delete;
    ~RunDirLock() { release(); }

    void acquire(const std::string& out_dir) {
        release();
        path = out_dir + "/.lock";
        dir_fd = open(out_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        LLMC_CHECK(dir_fd >= 0, "--out_dir %s: cannot open (%s)", out_dir.c_str(), strerror(errno));
        const bool dir_busy = flock(dir_fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
        if (dir_busy) {  // (the holder's pid, when its .lock file still exists)
            char owner[32] = {0};
            const int pid_fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
            const ssize_t n = pid_fd >= 0 ? pread(pid_fd, owner, sizeof(owner) - 1, 0) : 0;
            if (pid_fd >= 0) close(pid_fd);
            owner[n > 0 ? n : 0] = 0;
            for (char* c = owner; *c; c++) if (*c == '\n') *c = 0;
            close(dir_fd);
            dir_fd = -1;
            LLMC_FAIL("--out_dir %s is in use by another trainer (pid %s holds a lock on the directory); wait for it to "
                      "finish, or choose another --out_dir", out_dir.c_str(), owner[0] ? owner : "?");
        }
        fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        LLMC_CHECK(fd >= 0, "%s: cannot create the out_dir lock file (%s)", path.c_str(), strerror(errno));
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            const int err = errno;
            char owner[32] = {0};  // the holder wrote its pid there
            ssize_t n = pread(fd, owner, sizeof(owner) - 1, 0);
            if (n > 0) owner[n] = 0; else owner[0] = 0;
            for (char* c = owner; *c; c++) if (*c == '\n') *c = 0;
            close(fd);
            fd = -1;
            if (err == EWOULDBLOCK)
                LLMC_FAIL("--out_dir %s is in use by another trainer (pid %s holds %s); wait for it to finish, or "
                          "choose another --out_dir", out_dir.c_str(), owner[0] ? owner : "?", path.c_str());
            LLMC_FAIL("%s: cannot lock (%s)", path.c_str(), strerror(err));
        }
        // the pid, for the message a second trainer prints (informational only: the lock is the flock)
        char pid[32];
        int len = snprintf(pid, sizeof(pid), "%ld\n", (long)getpid());
        if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, len, 0) != len) { /* the lock still holds */ }
    }
    void release() {
        if (fd >= 0) close(fd);  // closing the descriptor drops the flock
        if (dir_fd >= 0) close(dir_fd);
        fd = dir_fd = -1;
    }
    bool held() const { return fd >= 0; }
};

inline bool is_checkpoint_tmp(const std::string& path) {
    return path.size() >= 4 && path.compare(path.size() - 4, 4, ".tmp") == 0;
}
// Everything a previous run left that a fresh run must not mix with its own: checkpoints (files or,
// for sharded formats, directories named ckpt_*; not the .tmp of an interrupted write), and the log.
inline std::vector<std::string> previous_run_checkpoints(const std::string& out_dir) {
    std::vector<std::string> out;
    for (const std::string& p : glob_files(out_dir + "/ckpt_*")) if (!is_checkpoint_tmp(p)) out.push_back(p);
    return out;
}

inline void remove_tree(const std::string& path) {
    auto rm = [](const char* p, const struct stat*, int, struct FTW*) -> int { return remove(p); };
    struct stat st;
    if (lstat(path.c_str(), &st) != 0) return;
    int rc = S_ISDIR(st.st_mode) ? nftw(path.c_str(), rm, 16, FTW_DEPTH | FTW_PHYS) : remove(path.c_str());
    LLMC_CHECK(rc == 0, "%s: cannot remove (%s)", path.c_str(), strerror(errno));
}

// Stale temp files first (the caller holds the lock: see the top). Then, resuming: the run
// continues what is there, nothing to check. A fresh run: refused when the directory holds
// checkpoints, unless overwrite (then they and the log are deleted first).
// Returns the number of checkpoints removed.
inline size_t claim_out_dir(const std::string& out_dir, bool resuming, bool overwrite) {
    for (const std::string& p : glob_files(out_dir + "/ckpt_*")) {
        if (!is_checkpoint_tmp(p)) continue;
        remove_tree(p);
        printf("removed %s: a checkpoint write that did not finish (the trainer was killed while writing it)\n",
               p.c_str());
    }
    if (resuming) return 0;
    std::vector<std::string> old = previous_run_checkpoints(out_dir);
    if (old.empty()) return 0;
    LLMC_CHECK(overwrite,
               "--out_dir %s already holds %zu checkpoint(s) of another run (newest by name: %s); starting a fresh run "
               "there would mix the two. Pass --resume latest to continue that run, --overwrite to delete its "
               "checkpoints and log and start over, or choose another --out_dir",
               out_dir.c_str(), old.size(), old.back().c_str());
    for (const std::string& p : old) remove_tree(p);
    const std::string log = out_dir + "/log.jsonl";
    if (file_exists(log)) remove_tree(log);
    return old.size();
}
