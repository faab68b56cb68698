// The comm layer's simulated link and non-blocking requests, under mpirun (test/test_dist.sh section 12):
//   mpirun -np 2 ./test/test_comm      (and -np 3)
// Checked on every rank, against the link's recorded model times and counters (never a ratio of
// wall-clock times):
//   - --sim_link's parser: bad values refused with a message naming the flag; "" is off;
//   - a collective (all_to_all, all_gather) and a transfer with the link never finish before their
//     model end, which is at least the model cost after the start; the data arrive intact; the
//     bytes counted are the real ones;
//   - two operations started back to back queue on the rank's link (the second ends a cost after
//     the first);
//   - compute between start and finish hides the link: a finish entered after the model end does not
//     wait for it (the link's `held` counter does not move), one entered at once does;
//   - without the link nothing is simulated;
//   - the NCCL build's start-up decision on peer access (peer_access_plan, pure host logic): which
//     GPU pairs lack it, NCCL_P2P_DISABLE=1 set only where a pair lacks it and the user set neither
//     NCCL_P2P_DISABLE nor NCCL_P2P_LEVEL, and the line it prints in each case.
// One line per failed check; the exit status is the number of failed checks (capped), on every rank.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/parallel/comm.h"

namespace {
int n_checks = 0, n_failed = 0;
void check(bool ok, const std::string& what) {
    n_checks++;
    if (!ok) {
        n_failed++;
        printf("FAIL (rank %d): %s\n", comm_world().world_rank, what.c_str());
        fflush(stdout);
    }
}
// the recorded interval of the latest finished operation
const CommInterval& latest(const std::vector<CommInterval>& t) { return t.back(); }
// busy work until the clock passes t (the "compute" between a start and its finish)
void compute_until(double t) {
    volatile double x = 0;
    while (comm_now_s() < t)
        for (int k = 0; k < 1000; k++) x = x + k;
}

void parser_checks() {
    for (const char* bad : {"0", "-1", "abc", "1,-5", "1,x", ",3", "1e9", "nan"}) {
        bool refused = false;
        try {
            parse_sim_link(bad);
        } catch (const LlmcError& e) {
            refused = strstr(e.what(), "--sim_link") != nullptr;
        }
        check(refused, strfmt("--sim_link %s refused naming the flag", bad));
    }
    const SimLink l = parse_sim_link("8,20");
    check(std::abs(l.bytes_per_s - 1e9) < 1 && std::abs(l.latency_s - 20e-6) < 1e-12, "--sim_link 8,20 is 1e9 bytes/s and 20 us");
    check(!parse_sim_link("").on(), "--sim_link '' is off");
    check(parse_sim_link("2").latency_s == 0, "--sim_link 2: no latency");
}

bool has(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }
// n GPUs named name, access everywhere (or nowhere) but for the listed exceptions (i, j: i -> j flipped)
PeerAccessPlan plan_for(int n, bool all, std::vector<std::pair<int, int>> flipped, const char* env_disable = nullptr,
                        const char* env_level = nullptr, int ranks = -1, const char* name = "NVIDIA GeForce RTX 4090",
                        const std::string& where = "") {
    std::vector<int> dev(n);
    std::vector<std::string> names(n, name);
    std::vector<char> can((size_t)n * n, all ? 1 : 0);
    for (int i = 0; i < n; i++) dev[i] = i;
    for (auto [i, j] : flipped) can[(size_t)i * n + j] = !can[(size_t)i * n + j];
    return peer_access_plan(dev, names, can, ranks < 0 ? n : ranks, env_disable, env_level, where);
}
void peer_checks() {
    // two RTX 4090s: no access, nothing set by the user -> NCCL_P2P_DISABLE=1, said on one line
    PeerAccessPlan p = plan_for(2, false, {});
    check(p.set_p2p_disable && has(p.message, "peer access: GPUs 0-1 have none (NVIDIA GeForce RTX 4090)") &&
              has(p.message, "NCCL_P2P_DISABLE=1 set") && has(p.message, "host memory") && !has(p.message, "\n"),
          "two GPUs without peer access: NCCL_P2P_DISABLE=1 set: " + p.message);
    // access both ways: nothing set, the line says so
    p = plan_for(2, true, {});
    check(!p.set_p2p_disable && p.message == "peer access: all 2 local GPUs pairwise", "two GPUs with peer access: " + p.message);
    p = plan_for(8, true, {}, nullptr, nullptr, 8, "NVIDIA H100 80GB HBM3");
    check(!p.set_p2p_disable && p.message == "peer access: all 8 local GPUs pairwise", "eight GPUs with peer access: " + p.message);
    // one direction missing is a pair without access (NCCL's P2P uses both)
    p = plan_for(2, true, {{1, 0}});
    check(p.set_p2p_disable && has(p.message, "GPUs 0-1 have none"), "access one way only counts as none: " + p.message);
    // pairs 0-1 and 2-3 bridged (access), the rest not: the four pairs without it, by number
    p = plan_for(4, false, {{0, 1}, {1, 0}, {2, 3}, {3, 2}});
    check(p.set_p2p_disable && has(p.message, "GPUs 0-2, 0-3, 1-2, 1-3 have none"),
          "bridged pairs: the others listed: " + p.message);
    // no pair of eight: said in a word, not 28 pairs
    p = plan_for(8, false, {});
    check(p.set_p2p_disable && has(p.message, "no pair of the 8 local GPUs (0-7) has it") && p.message.size() < 200,
          "eight GPUs without peer access: one short line: " + p.message);
    // one GPU cut off from seven others with access: 7 pairs, 6 shown and a count
    std::vector<std::pair<int, int>> cut;
    for (int j = 1; j < 8; j++) cut.push_back({0, j});
    p = plan_for(8, true, cut);
    check(p.set_p2p_disable && has(p.message, "GPUs 0-1, 0-2, 0-3, 0-4, 0-5, 0-6 and 1 more pairs have none"),
          "seven pairs without access: six shown and a count: " + p.message);
    // the user's choice stands: no setenv, the line says it is kept
    p = plan_for(2, false, {}, "1");
    check(!p.set_p2p_disable && has(p.message, "GPUs 0-1 have none") &&
              has(p.message, "NCCL_P2P_DISABLE=1 from the environment kept") && !has(p.message, "set ("),
          "NCCL_P2P_DISABLE=1 from the user: kept: " + p.message);
    p = plan_for(2, false, {}, "0");
    check(!p.set_p2p_disable && has(p.message, "NCCL_P2P_DISABLE=0 from the environment kept") && has(p.message, "hangs"),
          "NCCL_P2P_DISABLE=0 where there is no access: kept, with a warning: " + p.message);
    p = plan_for(2, false, {}, nullptr, "LOC");
    check(!p.set_p2p_disable && has(p.message, "NCCL_P2P_LEVEL=LOC from the environment kept"),
          "NCCL_P2P_LEVEL from the user: kept: " + p.message);
    p = plan_for(2, true, {}, "1");
    check(!p.set_p2p_disable && has(p.message, "all 2 local GPUs pairwise; NCCL_P2P_DISABLE=1 from the environment kept"),
          "peer access and the user's NCCL_P2P_DISABLE: " + p.message);
    // set to the empty string is unset (NCCL ignores it too)
    p = plan_for(2, false, {}, "", "");
    check(p.set_p2p_disable, "NCCL_P2P_DISABLE='' counts as unset: " + p.message);
    // one GPU, one rank: nothing to check or say; ranks that each see one GPU: not checked, said
    p = plan_for(1, false, {}, nullptr, nullptr, 1);
    check(!p.set_p2p_disable && p.message.empty(), "one GPU: nothing said: " + p.message);
    p = plan_for(1, false, {}, nullptr, nullptr, 4);
    check(!p.set_p2p_disable && has(p.message, "not checked") && has(p.message, "NCCL_P2P_DISABLE=1"),
          "four ranks that see one GPU each: not checked, the remedy named: " + p.message);
    // several nodes: each line names its node; mixed kinds named once each
    std::vector<std::string> names = {"NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 4090"};
    p = peer_access_plan({0, 1, 2}, names, std::vector<char>(9, 0), 3, nullptr, nullptr, "box2 (rank 2's node)");
    check(p.set_p2p_disable && has(p.message, "peer access on box2 (rank 2's node): no pair of the 3 local GPUs") &&
              has(p.message, "(NVIDIA GeForce RTX 4090, NVIDIA GeForce RTX 3090)"),
          "a node of a multi-node job names itself and each kind once: " + p.message);
    // a malformed matrix is refused (internal)
    bool refused = false;
    try {
        peer_access_plan({0, 1}, {"a", "b"}, std::vector<char>(3, 0), 2, nullptr, nullptr);
    } catch (const LlmcError&) {
        refused = true;
    }
    check(refused, "peer_access_plan refuses an answer matrix of the wrong size");
}

void link_checks(Comm& c) {
    const CommGroup& g = c.world;
    const int n = g.size, me = g.rank;
    const size_t block = 64 * 1024;  // bytes per rank block
    std::vector<unsigned char> send(block * n), recv(block * n);
    auto fill = [&] {
        for (int r = 0; r < n; r++)
            for (size_t i = 0; i < block; i++) send[r * block + i] = (unsigned char)(me * 31 + r * 7 + i);
        std::fill(recv.begin(), recv.end(), 0);
    };
    auto all_to_all_ok = [&] {
        for (int r = 0; r < n; r++)
            for (size_t i = 0; i < block; i++)
                if (recv[r * block + i] != (unsigned char)(r * 31 + me * 7 + i)) return false;
        return true;
    };
    std::vector<CommInterval> trace;
    c.trace = &trace;

    // without the link: nothing simulated
    fill();
    all_to_all(g, send.data(), recv.data(), block);
    check(all_to_all_ok() && c.sim.finished == 0, "all_to_all without the link: data, nothing simulated");

    // 0.01 Gbit/s = 1.25 MB/s, 100 us: a 64 KiB block costs 52.5 ms per step, far above what MPI
    // itself takes on one machine (even a busy one)
    comm_set_sim_link(c, parse_sim_link("0.01,100"));
    const double step_s = 100e-6 + block / 1.25e6, cost_s = (n - 1) * step_s;
    const uint64_t sent0 = c.sent_bytes[COMM_ALL_TO_ALL];

    // finished at once: it waits for the model end
    barrier(g);
    fill();
    uint64_t held = c.sim.held;
    CommRequest r = all_to_all_start(g, send.data(), recv.data(), block);
    const double cost = r.cost_s, start = r.start_s;
    comm_finish(r);
    check(all_to_all_ok(), "all_to_all with the link: data");
    check(std::abs(cost - cost_s) < 1e-12, strfmt("all_to_all model cost %.6f s, expected (N-1)(a + b/BW) = %.6f s", cost, cost_s));
    check(latest(trace).done_s >= start + cost && latest(trace).end_s >= latest(trace).done_s,
          strfmt("all_to_all finished at +%.6f s, model end +%.6f s, cost %.6f s", latest(trace).end_s - start,
                 latest(trace).done_s - start, cost));
    check(c.sim.held == held + 1, "a finish right after the start waits for the link");
    check(c.sent_bytes[COMM_ALL_TO_ALL] - sent0 == block * (n - 1), "the bytes counted are the real ones");

    // compute past the model end between start and finish: the finish does not wait for the link
    barrier(g);
    fill();
    held = c.sim.held;
    r = all_to_all_start(g, send.data(), recv.data(), block);
    compute_until(r.start_s + r.cost_s + 0.3);  // every member has started well before (barrier above)
    comm_finish(r);
    check(all_to_all_ok(), "all_to_all behind compute: data");
    check(c.sim.held == held, strfmt("a finish after the model end does not wait for it (model end +%.6f s, finish "
                                     "entered +%.6f s)", latest(trace).done_s - latest(trace).start_s,
                                     latest(trace).wait_s - latest(trace).start_s));

    // two started back to back queue on the link: the second ends at least a cost after the first
    barrier(g);
    std::vector<unsigned char> gathered(block * n), gathered2(block * n);
    for (size_t i = 0; i < block; i++) gathered[me * block + i] = gathered2[me * block + i] = (unsigned char)(me + i);
    CommRequest a = all_gather_start(g, gathered.data() + me * block, gathered.data(), block);
    CommRequest b = all_gather_start(g, gathered2.data() + me * block, gathered2.data(), block);
    const double b_cost = b.cost_s;
    comm_finish(a);
    const double a_done = latest(trace).done_s;
    comm_finish(b);
    const double b_done = latest(trace).done_s;
    bool data = true;
    for (int q = 0; q < n; q++)
        for (size_t i = 0; i < block; i++)
            data = data && gathered[q * block + i] == (unsigned char)(q + i) && gathered2[q * block + i] == (unsigned char)(q + i);
    check(data, "two all_gathers in flight: data");
    check(std::abs(b_cost - cost_s) < 1e-12 && b_done >= a_done + b_cost - 1e-9,
          strfmt("the second all_gather ends %.6f s after the first, its cost %.6f s: the link serialises them",
                 b_done - a_done, b_cost));

    // a transfer: the receiver's finish waits for the sender's model end
    if (n >= 2 && me < 2) {
        const int peer = 1 - me;
        std::vector<unsigned char> buf(block, (unsigned char)(me == 0 ? 0x5a : 0));
        CommRequest t = p2p_start(g, {{me == 0, buf.data(), block, peer, 7}});
        const double t_start = t.start_s;
        comm_finish(t);
        const CommInterval& iv = latest(trace);
        if (me == 1) {
            bool same = true;
            for (unsigned char v : buf) same = same && v == 0x5a;
            check(same, "send/recv with the link: data");
            check(iv.end_s >= iv.done_s, strfmt("the receive returned at +%.6f s, before the sender's model end +%.6f s",
                                                iv.end_s - t_start, iv.done_s - t_start));
        } else {
            check(iv.done_s >= t_start + step_s - 1e-9 && iv.end_s >= iv.done_s,
                  strfmt("the send's model end +%.6f s, its cost a + bytes/BW = %.6f s", iv.done_s - t_start, step_s));
        }
    }
    c.trace = nullptr;
}
}  // namespace

int main(int argc, char** argv) {
    Comm& c = comm_init(&argc, &argv);
    int rc = 0;
    try {
        comm_make_grid(c, c.world_size, 1);
        parser_checks();
        peer_checks();
        link_checks(c);
        const std::vector<int> failed = host_gather_all<int>(c.world, n_failed);
        int total = 0;
        for (int f : failed) total += f;
        if (c.world_rank == 0) printf("test_comm: np %d: %d checks, %d failed\n", c.world_size, n_checks, total);
        rc = total > 100 ? 100 : total;
    } catch (const LlmcError& e) {
        fprintf(stderr, "error (rank %d): %s\n", c.world_rank, e.what());
        comm_abort(1);
        rc = 1;
    }
    comm_finalize();
    return rc;
}
