// Stopping a run early on SIGINT / SIGTERM (ctrl-C; how SLURM and cloud spot instances preempt).
//
// The first signal only sets a flag: the step in progress finishes. At every step boundary all
// ranks agree on whether to stop (stop_agreed: one host all-gather of a flag, since under a
// launcher the signal reaches the ranks at different moments, or only some of them, and they
// must still stop after the same step); then the trainer writes a checkpoint of that step
// (collectively), prints "stopped by signal at step N; continue with --resume latest" and exits
// with STOP_EXIT_CODE. A second signal exits at once with 128 + its number (the shell's code for a
// process killed by that signal); the checkpoint being written, if any, stays a .tmp that the next
// start removes (llmc/io/run_dir.h).
//
// SIGXFSZ is ignored for the same life: a file size limit (ulimit -f) then fails the write with
// EFBIG, which is reported naming the file (and a checkpoint write cleans up its .tmp), instead of
// killing the trainer without a word.
//
// Under mpirun the signal must reach the ranks: SLURM (scancel, preemption) signals every task;
// Open MPI's mpirun, when it is signalled itself, kills its ranks one second later
// (odls_base_sigkill_timeout), so send the signal to the rank processes, or raise that limit.
#pragma once
#include <csignal>
#include <cstdint>
#include <cstring>
#include <unistd.h>
#include "llmc/parallel/comm.h"

constexpr int STOP_EXIT_CODE = 75;  // sysexits' EX_TEMPFAIL: stopped early, resumable

// the first signal's number, 0 while none came (written by the handler only)
inline volatile sig_atomic_t& stop_signal() {
    static volatile sig_atomic_t sig = 0;
    return sig;
}

extern "C" inline void stop_signal_handler(int sig) {
    if (stop_signal() == 0) {
        stop_signal() = sig;
        return;
    }
    static const char msg[] = "second signal: exiting at once (no checkpoint)\n";
    if (write(STDERR_FILENO, msg, sizeof(msg) - 1) < 0) { /* nothing else is async-signal-safe to do */ }
    _exit(128 + sig);
}

// Installs the handlers for the life of the object (the trainer's main()); restores the previous ones.
struct StopSignals {
    struct sigaction old_int, old_term, old_xfsz;
    StopSignals() {
        stop_signal() = 0;
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = stop_signal_handler;
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = SA_RESTART;  // the first signal must not fail a read or a write in progress
        sigaction(SIGINT, &sa, &old_int);
        sigaction(SIGTERM, &sa, &old_term);
        sa.sa_handler = SIG_IGN;
        sigaction(SIGXFSZ, &sa, &old_xfsz);
    }
    ~StopSignals() {
        sigaction(SIGINT, &old_int, nullptr);
        sigaction(SIGTERM, &old_term, nullptr);
        sigaction(SIGXFSZ, &old_xfsz, nullptr);
    }
    StopSignals(const StopSignals&) = delete;
    StopSignals& operator=(const StopSignals&) = delete;
};

// Collective over the world, at a step boundary: whether any rank has received a signal (the
// same answer on every rank). sig_out: the signal and the lowest rank that received it.
inline bool stop_agreed(const CommGroup& world, int& sig_out, int& rank_out) {
    const int32_t mine = (int32_t)stop_signal();
    const std::vector<int32_t> all = host_gather_all<int32_t>(world, mine);
    for (int r = 0; r < (int)all.size(); r++)
        if (all[r] != 0) {
            sig_out = all[r];
            rank_out = r;
            return true;
        }
    return false;
}
