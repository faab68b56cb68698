// The comm's loopback (llmc/parallel/comm.h, "The loopback"; LLMC_COMM_LOOPBACK=DELAY_US): on one GPU
// the buffer collectives of one-rank groups go through the comm stream as NCCL's do, so the stream
// order of the overlap machinery runs here.
//  - The collectives themselves: a one-rank all_to_all is a copy on the comm stream that the consumer
//    sees once comm_finish has made the compute stream wait; leaving out that wait (a test switch)
//    the consumer reads the receive buffer before the copy lands, and the device check counts a stale
//    finish; leaving out the comm stream's wait for the compute stream, the copy reads the send buffer
//    before the producer has written it. An in-place collective's bytes land after the spin (a write
//    to its buffer while it is in flight is overwritten, as a real gather's may be).
//  - The model: -z 0, 1, 2, 3 on one GPU, three ways (no loopback; loopback with no delay; with a
//    200 us spin before each collective): the hooks take the multi-rank paths (ZeRO's gathers in
//    flight, -z 0's deferred update, -z 3's prefetches), every collective is counted, none is stale,
//    and the losses, params and moments are bitwise those without the loopback. The negative control:
//    with the compute stream's wait on the done event left out and a 10 ms spin, the device check
//    counts every finish stale, at every stage. (The model's gathers are in place: on one rank their
//    bytes are the ones already there, so a consumer that runs ahead reads right values and the
//    params come out equal; the wrong data a missing wait gives is the all_to_all case above.)
// About 2.5 s on an H200 (most of it the 10 ms spins of the negative control).
#pragma once
#include <cstring>
#include <memory>

namespace comm_loopback_test {

// The loopback on for a scope (delay_us, and a wait left out for a negative control), then off again
// whatever happens in it: the comm stream's copies drained first (a negative control leaves them
// behind the compute stream), no wait left out.
struct LoopbackScope {
    explicit LoopbackScope(int delay_us, int skip = COMM_SKIP_NONE) {
        Comm& c = comm_world();
        comm_set_loopback(c, delay_us);
        c.loop.skip_wait = skip;
    }
    ~LoopbackScope() {
        Comm& c = comm_world();
        c.loop.skip_wait = COMM_SKIP_NONE;
        const cudaError_t err = cudaDeviceSynchronize();
        if (err != cudaSuccess) fprintf(stderr, "comm loopback test: %s\n", cudaGetErrorString(err));
        try {
            comm_set_loopback(c, -1);
        } catch (const std::exception& e) {
            fprintf(stderr, "comm loopback test: %s\n", e.what());
        }
    }
    LoopbackScope(const LoopbackScope&) = delete;
    LoopbackScope& operator=(const LoopbackScope&) = delete;
};

// device bytes
struct DeviceBytes {
    unsigned char* p = nullptr;
    size_t n = 0;
    explicit DeviceBytes(size_t bytes) : n(bytes) { cudaCheck(cudaMalloc(&p, bytes)); }
    ~DeviceBytes() {
        const cudaError_t err = cudaFree(p);
        if (err != cudaSuccess) fprintf(stderr, "comm loopback test: %s\n", cudaGetErrorString(err));
    }
    void fill(int v) { cudaCheck(cudaMemsetAsync(p, v, n, llmc_stream())); }  // on the compute stream
    // how many bytes are not v (waits for the compute stream)
    size_t count_not(int v) const {
        std::vector<unsigned char> h(n);
        cudaCheck(cudaMemcpyAsync(h.data(), p, n, cudaMemcpyDeviceToHost, llmc_stream()));
        cudaCheck(cudaStreamSynchronize(llmc_stream()));
        size_t bad = 0;
        for (unsigned char b : h) bad += b != (unsigned char)v;
        return bad;
    }
    DeviceBytes(const DeviceBytes&) = delete;
    DeviceBytes& operator=(const DeviceBytes&) = delete;
};

// One training run of the GPU build on one process at ZeRO stage `zero`, as train_gpt's step runs it
// (gpt_pipeline_step, the norm, the losses, the update; no settle between steps, so -z 0's deferred
// update and -z 1/2's gathers stay in flight into the next step), with the loopback at delay_us (-1:
// off) and skip (a wait left out).
struct LoopbackRun {
    std::vector<double> losses;
    std::vector<float> params, m, v;
    uint64_t collectives = 0, stale = 0;  // loopback collectives queued; finishes that ran ahead of theirs
    size_t segments = 0;
};
inline LoopbackRun loopback_run(const ref::GPTConfig& rc, const std::vector<float>& p0, int zero, int delay_us, int skip,
                                int steps, int B, int T) {
    using namespace gpu_test;
    Comm& c = comm_world();
    LoopbackRun out;
    gpu::Layout layout;
    layout.zero_stage = zero;
    gpu::GPT g;
    gpu::gpt_allocate(g, convert_config<gpu::GPTConfig>(rc), B, T, layout);
    const std::vector<float> zeros(p0.size(), 0.0f);
    gpu::gpt_set_state(g, p0.data(), zeros.data(), zeros.data());
    out.segments = g.zero.segs.size();
    {
        std::unique_ptr<LoopbackScope> scope(delay_us >= 0 ? new LoopbackScope(delay_us, skip) : nullptr);
        const uint64_t issued0 = c.loop.issued, stale0 = comm_loopback_stale(c);
        const gpu::OptimizerConfig opt;
        std::vector<int> in, tgt, ds;
        for (int step = 0; step < steps; step++) {
            model_test_batch(B, T, 300 + step, in, tgt, ds);
            const std::vector<gpu::MicroBatch> batches = {{in.data(), tgt.data(), ds.data()}};
            gpu::gpt_zero_grad(g);
            gpu::gpt_pipeline_step(g, batches, B, T, 1.0f, false, nullptr);
            const float norm = gpu::gpt_grad_norm(g);
            const std::vector<double> l = gpu::take_losses(g);
            out.losses.insert(out.losses.end(), l.begin(), l.end());
            gpu::gpt_apply_update(g, opt, 3e-3f, step, norm);
        }
        gpu::zero_settle(g);  // (what is still in flight: -z 0's deferred updates, -z 1/2's gathers)
        cudaCheck(cudaDeviceSynchronize());
        out.collectives = c.loop.issued - issued0;
        out.stale = comm_loopback_stale(c) - stale0;
    }
    for (auto* x : {&out.params, &out.m, &out.v}) x->resize(g.n_params);
    gpu::gpt_get_state(g, out.params.data(), out.m.data(), out.v.data());
    gpu::gpt_free(g);
    return out;
}
template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace comm_loopback_test

TEST_CASE("comm loopback: one-rank collectives run on the comm stream, and leaving out either event wait reads stale data") {
    using namespace comm_loopback_test;
    Comm& c = comm_world();
    REQUIRE(c.world_size == 1);
    CommGroup one;  // a group of this rank alone
    one.id = CG_DP;
    const size_t bytes = 4u << 20;
    DeviceBytes send(bytes), recv(bytes), out(bytes);
    const uint64_t stale0 = comm_loopback_stale(c);

    {  // without the loopback a one-rank group has no collective
        CHECK(!comm_moves(one));
        CommRequest r = all_gather_start(one, recv.p, recv.p, bytes);
        CHECK(!r.active());
        CHECK_THROWS(all_to_all_start(one, send.p, recv.p, bytes));
    }
    // all_to_all of one rank: send's bytes to recv on the comm stream, 20 ms after the comm stream
    // reaches it; the consumer (a copy of recv on the compute stream) follows comm_finish at once
    for (int skip : {(int)COMM_SKIP_NONE, (int)COMM_SKIP_FINISH_WAIT}) {
        CAPTURE(skip);
        {
            LoopbackScope lb(20000, skip);
            CHECK(comm_moves(one));
            recv.fill(0);
            send.fill(0xA1);
            CommRequest r = all_to_all_start(one, send.p, recv.p, bytes);
            REQUIRE(r.active());
            CHECK(r.on_stream());
            CHECK(!comm_done_early(r));  // (the comm stream's order, as NCCL's)
            comm_finish(r);
            cudaCheck(cudaMemcpyAsync(out.p, recv.p, bytes, cudaMemcpyDeviceToDevice, llmc_stream()));
            if (skip == COMM_SKIP_NONE) {
                CHECK(out.count_not(0xA1) == 0);
                CHECK(comm_loopback_stale(c) == stale0);
            } else {  // the consumer read recv before the copy: the zeros it held
                CHECK(out.count_not(0) == 0);
                CHECK(comm_loopback_stale(c) == stale0 + 1);
            }
        }
        CHECK(recv.count_not(0xA1) == 0);  // (the copy has landed by now, either way)
    }
    // the comm stream's wait for the compute stream: the producer of send runs 50 ms late on the
    // compute stream (a spin before it); the collective must copy what it wrote
    for (int skip : {(int)COMM_SKIP_NONE, (int)COMM_SKIP_ENTER_WAIT}) {
        CAPTURE(skip);
        send.fill(0xA1);
        recv.fill(0);
        cudaCheck(cudaStreamSynchronize(llmc_stream()));
        {
            LoopbackScope lb(0, skip);
            comm_gpu_spin(llmc_stream(), 50000);
            send.fill(0xB2);
            CommRequest r = all_to_all_start(one, send.p, recv.p, bytes);
            comm_finish(r);
        }
        // skipped: the comm stream copied send before the producer wrote it
        CHECK(recv.count_not(skip == COMM_SKIP_NONE ? 0xB2 : 0xA1) == 0);
    }
    {  // an in-place collective's output lands after the spin
        LoopbackScope lb(20000);
        recv.fill(0xC3);
        CommRequest r = all_gather_start(one, recv.p, recv.p, bytes);
        recv.fill(0xD4);  // a write to a buffer in flight (no caller may do this): the gather's bytes win
        comm_finish(r);
        CHECK(recv.count_not(0xC3) == 0);
        CHECK(comm_loopback_stale(c) == stale0 + 1);  // (the one of the skipped finish wait above)
    }
}

TEST_CASE("comm loopback: -z 0..3 on one GPU through the comm stream train bitwise as without it; a missing wait is caught") {
    using namespace gpu_test;
    using namespace comm_loopback_test;
    const ref::GPTConfig rc = model_test_config();  // L 2: 2L + 2 = 6 segments
    const int B = 4, T = 64, steps = 3;
    const std::vector<float> p0 = initial_params(rc, B, T, 17);
    for (int zero = 0; zero <= 3; zero++) {
        CAPTURE(zero);
        const LoopbackRun base = loopback_run(rc, p0, zero, -1, COMM_SKIP_NONE, steps, B, T);
        CHECK(base.collectives == 0);
        REQUIRE(base.losses.size() == (size_t)steps);
        for (int delay_us : {0, 200}) {
            CAPTURE(delay_us);
            const LoopbackRun lb = loopback_run(rc, p0, zero, delay_us, COMM_SKIP_NONE, steps, B, T);
            MESSAGE("-z " << zero << ", delay " << delay_us << " us: " << lb.collectives << " loopback collectives in "
                          << steps << " steps");
            // -z 0: each segment's gradient gather per step; -z 1/2: each segment's param gather per
            // step; -z 3: the slots' gathers, at least each segment's once per step (the forward's;
            // the backward gathers those its slots no longer hold: 29 in 3 steps at L 2 on an H200)
            if (zero <= 2) CHECK(lb.collectives == (uint64_t)steps * lb.segments);
            else CHECK(lb.collectives > (uint64_t)steps * lb.segments);
            CHECK(lb.stale == 0);
            CHECK(same_bits(lb.losses, base.losses));
            CHECK(same_bits(lb.params, base.params));
            CHECK(same_bits(lb.m, base.m));
            CHECK(same_bits(lb.v, base.v));
        }
        // the negative control: the compute stream's wait on the done event left out, 10 ms before
        // each collective's bytes land: the consumers run ahead, and the check counts them
        const LoopbackRun bad = loopback_run(rc, p0, zero, 10000, COMM_SKIP_FINISH_WAIT, steps, B, T);
        MESSAGE("-z " << zero << ", finish wait left out: " << bad.stale << " of " << bad.collectives
                      << " finishes stale; params " << std::string(same_bits(bad.params, base.params) ? "equal" : "differ"));
        CHECK(bad.collectives > 0);
        CHECK(bad.stale > 0);
    }
}
