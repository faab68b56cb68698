// A chapter of train_gpt.cu (included once, there): the model's state and its files. The state in
// the parameter table's layout (init, checkpoints, llm.c files, tests) <-> wherever this rank keeps
// it (ZeRO shards, pipeline stages, tensor- and expert-parallel slices), streamed through host
// staging of one chunk per array; the checkpoint files of a run directory; llm.c's GPT-2 model files.

// where the element at a table offset lives in the padded space (the full buffers at stages 0-2)
[[maybe_unused]] static size_t gpt_padded_index(const GPT& m, size_t table_offset) {
    const ZeroLayout& z = m.zero;
    for (int s = 0; s < (int)z.segs.size(); s++)
        if (table_offset >= z.segs[s].begin && table_offset < z.segs[s].begin + z.segs[s].len)
            return z.padded_index(s, table_offset - z.segs[s].begin);
    LLMC_FAIL("table offset %zu is not in this stage's parameters", table_offset);
}

// Model state, in the table's layout (init, checkpoints, llm.c files, tests) <-> wherever this rank
// keeps it. With master weights the fp32 values live in the master and params hold their rounding.
// Segment padding stays zero. Both directions stream: the state passes through host staging of at
// most staging_elems() elements per array (llmc/io/checkpoint.h), never the whole table.

// The optimizer state's buffers (master, moments) are device buffers, or host arenas with
// --offload optimizer: copies between them and the caller's host memory.
static void state_copy_in(bool on_host, void* dst, const void* src, size_t bytes) {
    if (on_host) memcpy(dst, src, bytes);
    else copy_to_buffer(dst, src, bytes);
}
static void state_copy_out(bool on_host, void* dst, const void* src, size_t bytes) {
    if (on_host) memcpy(dst, src, bytes);
    else copy_from_buffer(dst, src, bytes);
}

// A source of model state: fills table elements [begin, begin + n) of the params, Adam m and Adam v
// (arrays of n floats; m and v are null where the caller keeps no moments). The init, a checkpoint
// file and whole-table arrays are sources.
using StateSource = std::function<void(size_t begin, size_t n, float* params, float* adam_m, float* adam_v)>;

// where segment-relative element rel of segment s lives in the params and the master/moment buffers
static size_t params_index(const ZeroLayout& z, int s, size_t rel) {
    return z.params_sharded() ? z.shard_index(s, rel) : z.padded_index(s, rel);
}
static size_t state_index(const ZeroLayout& z, int s, size_t rel) {
    return z.state_sharded() ? z.shard_index(s, rel) : z.padded_index(s, rel);
}

// Fills this rank's buffers from a source (not collective): per segment, the part its params
// hold (-z 3: the rank's slice; else the whole segment) and inside it the part its master and
// moments hold (-z 1..3: the slice), then the last stage's copy of the tied embedding (pp > 1). A
// chunk of local elements maps to table runs (tensor parallel: the rank's rows and columns; the
// local alignment padding between tensors is no one's and stays zero, as the segment padding).
static void gpt_set_state(GPT& m, const StateSource& src) {
    params_drop_all(m);  // -z 3: what the slots hold is the params before
    const size_t cap = staging_cap(m);
    std::vector<float> p(cap), mm(cap), v(cap);
    std::vector<floatX> px(cap);
    const bool host = m.offload == OFFLOAD_OPTIMIZER;  // the state in host arenas
    // one layout's segments: params of rel [lo, hi) into `params`; with_state: master and moments too
    auto load = [&](const ZeroLayout& z, floatX* params, bool params_sharded, bool with_state) {
        for (int s = 0; s < (int)z.segs.size(); s++) {
            const Segment& seg = z.segs[s];
            const size_t lo = params_sharded ? z.own_begin(s) : 0, hi = params_sharded ? lo + z.shard_len(s) : seg.padded;
            const size_t st_lo = z.state_sharded() ? z.own_begin(s) : 0;
            const size_t st_hi = !with_state ? st_lo : z.state_sharded() ? st_lo + z.shard_len(s) : seg.padded;
            for (size_t a = lo; a < hi; a += cap) {
                const size_t n = std::min(cap, hi - a), real = a < seg.len ? std::min(n, seg.len - a) : 0;
                std::fill(p.begin(), p.begin() + n, 0.0f);
                std::fill(mm.begin(), mm.begin() + n, 0.0f);
                std::fill(v.begin(), v.begin() + n, 0.0f);
                // the chunk's table runs, cut where the moments' part begins and ends
                if (real > 0)
                    for_each_table_run(m.pieces, seg.begin + a, real, [&](size_t local, size_t global, size_t len, bool) {
                        for (size_t rel = local - seg.begin, end = rel + len; rel < end;) {
                            const bool state = rel >= st_lo && rel < st_hi;
                            const size_t stop = std::min(end, state ? st_hi : rel < st_lo ? st_lo : end);
                            const size_t at = rel - a;
                            src(global + (rel - (local - seg.begin)), stop - rel, p.data() + at,
                                state ? mm.data() + at : nullptr, state ? v.data() + at : nullptr);
                            rel = stop;
                        }
                    });
#pragma omp parallel for schedule(static)
                for (size_t k = 0; k < n; k++) px[k] = (floatX)p[k];
                copy_to_buffer(params + (params_sharded ? z.shard_index(s, a) : z.padded_index(s, a)), px.data(),
                               n * sizeof(floatX));
                const size_t c0 = std::max(a, st_lo), c1 = std::min(a + n, st_hi);  // the moments' part of the chunk
                if (c0 >= c1) continue;
                const size_t at = state_index(z, s, c0), bytes = (c1 - c0) * sizeof(float);
                if (m.master) state_copy_in(host, m.master + at, p.data() + (c0 - a), bytes);
                state_copy_in(host, m.adam_m + at, mm.data() + (c0 - a), bytes);
                state_copy_in(host, m.adam_v + at, v.data() + (c0 - a), bytes);
            }
        }
    };
    load(m.zero, m.params, m.zero.params_sharded(), true);
    if (m.head_params) load(m.head, m.head_params, false, false);  // the last stage's copy of the tied embedding
}

// The whole state in the table's layout, the same arrays on every rank (tests, llm.c files).
static void gpt_set_state(GPT& m, const float* table_params, const float* table_m, const float* table_v) {
    gpt_set_state(m, [&](size_t begin, size_t n, float* p, float* mm, float* v) {
        std::copy(table_params + begin, table_params + begin + n, p);
        if (mm) std::copy(table_m + begin, table_m + begin + n, mm);
        if (v) std::copy(table_v + begin, table_v + begin + n, v);
    });
}

// This rank's own slice of every segment (the shard space, z.shard_total elements each): fp32
// params, adam m, adam v. At stage 0 every rank holds everything and reports its slice.
static void gpt_own_state(const GPT& m, float* params, float* adam_m, float* adam_v) {
    const ZeroLayout& z = m.zero;
    std::vector<float> st_m(z.state_elems()), st_v(z.state_elems()), st_p;
    const bool host = m.offload == OFFLOAD_OPTIMIZER;  // the state in host arenas
    state_copy_out(host, st_m.data(), m.adam_m, st_m.size() * 4);
    state_copy_out(host, st_v.data(), m.adam_v, st_v.size() * 4);
    if (m.master) {
        st_p.resize(z.state_elems());
        state_copy_out(host, st_p.data(), m.master, st_p.size() * 4);
    } else {
        std::vector<floatX> raw(z.params_elems());
        copy_from_buffer(raw.data(), m.params, raw.size() * sizeof(floatX));
        st_p.assign(raw.begin(), raw.end());
    }
    for (int s = 0; s < (int)z.segs.size(); s++)
        for (size_t rel = z.own_begin(s); rel < z.own_begin(s) + z.shard_len(s); rel++) {
            const size_t out = z.shard_index(s, rel);
            const size_t st = z.state_sharded() ? out : z.padded_index(s, rel);
            params[out] = st_p[m.master ? st : (z.params_sharded() ? out : z.padded_index(s, rel))];
            adam_m[out] = st_m[st];
            adam_v[out] = st_v[st];
        }
}

// calls f(rel, table, n) for this rank's own runs among the segment-relative elements [a, b) of its
// slice of segment s: the table's elements (not padding) that this rank reports, a tensor-parallel
// replica by its owner only
template <typename F>
static void for_each_own_run(const GPT& m, int s, size_t a, size_t b, const F& f) {
    const Segment& seg = m.zero.segs[s];
    b = std::min(b, seg.len);
    if (a >= b) return;
    for_each_table_run(m.pieces, seg.begin + a, b - a, [&](size_t local, size_t global, size_t n, bool owner) {
        if (owner) f(local - seg.begin, global, n);
    });
}
// the segment-relative range of this rank's own slice of segment s
static std::pair<size_t, size_t> own_slice(const ZeroLayout& z, int s) {
    return {z.own_begin(s), z.own_begin(s) + z.shard_len(s)};
}

// This rank's own slices (what it writes to a checkpoint, what a gather collects): the table ranges
// they cover and their values, from a shard-space array. A tensor-parallel replica is reported by
// its owner only; tp_table_padding's zeros are reported too, so every table element is someone's.
static void own_table_slices(const GPT& m, const float* shard_values, std::vector<CheckpointRange>& ranges,
                             std::vector<float>& values) {
    const ZeroLayout& z = m.zero;
    ranges.clear();
    values.clear();
    for (int s = 0; s < (int)z.segs.size(); s++) {
        const auto [lo, hi] = own_slice(z, s);
        for_each_own_run(m, s, lo, hi, [&](size_t rel, size_t global, size_t n) {
            if (!ranges.empty() && ranges.back().begin + ranges.back().n == global) ranges.back().n += n;
            else ranges.push_back({global, n});
            const float* v = shard_values + z.shard_index(s, rel);
            values.insert(values.end(), v, v + n);
        });
    }
    for (const CheckpointRange& pad : m.table_padding) {
        ranges.push_back(pad);
        values.insert(values.end(), pad.n, 0.0f);
    }
}

// This rank's part of a checkpoint being written (out, llmc/io/checkpoint.h), streamed: its own slices
// chunk by chunk, copied out of the buffers (fp32 params from the master, or the params themselves;
// the moments) into host staging, checked finite (a diverged state is never written: a later
// --resume would continue from it), each owned table run written at its place in the file. Host
// memory: one chunk per array.
static void gpt_write_state(const GPT& m, CheckpointWriter& out, int step) {
    const ZeroLayout& z = m.zero;
    const size_t cap = staging_cap(m);
    std::vector<float> st[3];
    for (auto& a : st) a.resize(cap);
    std::vector<floatX> raw(m.master ? 0 : cap);
    const bool host = m.offload == OFFLOAD_OPTIMIZER;  // the state in host arenas
    for (int s = 0; s < (int)z.segs.size(); s++) {
        const auto [lo, hi] = own_slice(z, s);
        for (size_t a = lo; a < std::min(hi, z.segs[s].len); a += cap) {
            const size_t n = std::min(cap, hi - a), at = state_index(z, s, a), bytes = n * sizeof(float);
            if (m.master) {
                state_copy_out(host, st[0].data(), m.master + at, bytes);
            } else {
                copy_from_buffer(raw.data(), m.params + params_index(z, s, a), n * sizeof(floatX));
                std::copy(raw.begin(), raw.begin() + n, st[0].begin());
            }
            state_copy_out(host, st[1].data(), m.adam_m + at, bytes);
            state_copy_out(host, st[2].data(), m.adam_v + at, bytes);
            for (int k = 0; k < 3; k++) {
                const size_t bad = first_non_finite(st[k].data(), n);
                if (bad == n) continue;
                LLMC_FAIL("step %d: refusing to write %s: a %s is %g (the model state is not finite: the run diverged); "
                          "resume from an earlier checkpoint with a lower --lr", step, out.path.c_str(),
                          k == 0 ? "parameter" : k == 1 ? "Adam m" : "Adam v", st[k][bad]);
            }
            for_each_own_run(m, s, a, a + n, [&](size_t rel, size_t global, size_t len) {
                for (int k = 0; k < 3; k++) out.write_range(k, global, len, st[k].data() + (rel - a));
            });
        }
    }
    const float zeros[8] = {};  // tp_table_padding: a tensor's alignment gap, under 8 elements
    for (const CheckpointRange& pad : m.table_padding)
        for (int k = 0; k < 3; k++) out.write_range(k, pad.begin, pad.n, zeros);
}

// Every rank's own slices (shard space) -> the whole table, on every rank of the world (collective):
// each rank sends its table ranges and their values (pipeline stages and tensor-parallel ranks hold
// different parts).
static void gather_to_table(const GPT& m, const float* own_shard, float* table_out) {
    const CommGroup& world = comm_world().world;
    std::vector<CheckpointRange> own;
    std::vector<float> vals;
    own_table_slices(m, own_shard, own, vals);
    std::vector<uint64_t> ranges;
    for (const CheckpointRange& rg : own) ranges.insert(ranges.end(), {rg.begin, rg.n});
    size_t max_vals = 0, max_ranges = 0;
    for (uint64_t n : host_gather_all<uint64_t>(world, vals.size())) max_vals = std::max(max_vals, (size_t)n);
    for (uint64_t n : host_gather_all<uint64_t>(world, ranges.size())) max_ranges = std::max(max_ranges, (size_t)n);
    std::vector<float> v(max_vals, 0.0f), all_v(max_vals * world.size);
    std::vector<uint64_t> r(max_ranges, 0), all_r(max_ranges * world.size);
    std::copy(vals.begin(), vals.end(), v.begin());
    std::copy(ranges.begin(), ranges.end(), r.begin());
    host_all_gather(world, v.data(), all_v.data(), max_vals * sizeof(float));
    host_all_gather(world, r.data(), all_r.data(), max_ranges * sizeof(uint64_t));
    for (int k = 0; k < world.size; k++) {
        size_t at = 0;
        for (size_t j = 0; j + 1 < max_ranges; j += 2) {
            const uint64_t begin = all_r[k * max_ranges + j], n = all_r[k * max_ranges + j + 1];
            for (uint64_t e = 0; e < n; e++) table_out[begin + e] = all_v[k * max_vals + at++];
        }
    }
}

// The whole state in table layout on every rank (collective): tests, exports.
[[maybe_unused]] static void gpt_get_state(const GPT& m, float* params, float* adam_m, float* adam_v) {
    std::vector<float> own[3];
    for (auto& v : own) v.resize(m.zero.shard_total);
    gpt_own_state(m, own[0].data(), own[1].data(), own[2].data());
    float* outs[3] = {params, adam_m, adam_v};
    for (int a = 0; a < 3; a++)
        if (outs[a]) gather_to_table(m, own[a].data(), outs[a]);
}

// The accumulated gradient of the step so far, in table layout, on every rank (collective; tests).
// In one stage the lm head's part of the tied embedding still in head_acc (before the embedding's
// reduction, or per step at -z 2/3) is added here as it will be (with pp > 1, call it after
// tied_embedding_sum). ZeRO stages 0-1 with dp > 1: after the step's reductions (zero_reduce_finish).
[[maybe_unused]] static std::vector<float> gpt_grads(const GPT& m) {
    const ZeroLayout& z = m.zero;
    std::vector<float> acc(z.acc_elems()), own(z.shard_total), out(m.n_params, 0.0f), head;
    copy_from_buffer(acc.data(), m.grad_acc, acc.size() * 4);
    if (m.pipe.P == 1 && m.head_acc) {
        head.resize(m.head.shard_len(0));
        const size_t at = m.head.grads_in_acc() ? m.head.own_begin(0) : 0;  // the rank's slice of the head
        copy_from_buffer(head.data(), m.head_acc + at, head.size() * 4);
    }
    for (int s = 0; s < (int)z.segs.size(); s++)
        for (size_t rel = z.own_begin(s); rel < z.own_begin(s) + z.shard_len(s); rel++) {
            float v = acc[z.acc_sharded() ? z.shard_index(s, rel) : z.padded_index(s, rel)];
            if (z.segs[s].id == 0 && !head.empty()) v += head[rel - z.own_begin(s)];
            own[z.shard_index(s, rel)] = v;
        }
    gather_to_table(m, own.data(), out.data());
    return out;
}

// The init (normal(0, init_std), ones, zeros by tensor; docs/ARCHITECTURE.md): table element i of a
// normal tensor is normal_at(seed, i) (llmc/rand.h), a value that depends only on (seed, i), so each
// rank computes just the parts it holds, in parallel, and every layout starts from the same bits.
// The wte (and untied lm_head) rows past vocab_size (padding to a multiple of 128) start at zero: no
// token uses them and the softmax leaves them out, so their gradient is zero and AdamW (zero update,
// decay of zero) keeps them at zero. Moments: zero.
static void gpt_init_params(GPT& m, uint64_t seed) {
    const std::vector<ParamTensor>& table = m.table;
    const size_t vocab_used = (size_t)m.config.vocab_size * m.config.n_embd;
    gpt_set_state(m, [&](size_t begin, size_t n, float* p, float* mm, float* v) {
        std::fill(p, p + n, 0.0f);  // the alignment gaps between tensors, the unused wte rows
        if (mm) std::fill(mm, mm + n, 0.0f);
        if (v) std::fill(v, v + n, 0.0f);
        // the tensors that overlap [begin, begin + n): from the first one ending after begin
        size_t k = std::upper_bound(table.begin(), table.end(), begin,
                                    [](size_t b, const ParamTensor& t) { return b < t.offset + t.numel; }) - table.begin();
        for (; k < table.size() && table[k].offset < begin + n; k++) {
            const ParamTensor& t = table[k];
            const bool vocab_rows = t.name == "wte" || t.name == "lm_head";
            const size_t lo = std::max(begin, t.offset), hi = std::min(begin + n, t.offset + (vocab_rows ? vocab_used : t.numel));
            if (t.init == ParamTensor::ONES) std::fill(p + (lo - begin), p + std::max(lo, hi) - begin, 1.0f);
            if (t.init != ParamTensor::NORMAL) continue;
            const float std = t.init_std;
#pragma omp parallel for schedule(static) if (hi > lo + 16384)
            for (size_t i = lo; i < hi; i++) p[i - begin] = normal_at(seed, i, 0.0f, std);
        }
    });
}

static std::string checkpoint_path(const std::string& out_dir, int step) {
    return out_dir + "/ckpt_" + std::to_string(1000000000 + step).substr(1) + ".bin";
}

// The newest checkpoint in out_dir that verifies, by the step stored inside; the ones that do not
// are skipped with a warning, and none that loads is an error. "" when out_dir holds no checkpoint
// yet (a run stopped before its first one): the caller starts afresh, so one command line serves
// every (re)start of a preemptible job. Collective: verify_checkpoint's verdict is the same on every rank.
static std::string latest_checkpoint(const std::string& out_dir, Checkpoint& ck) {
    std::vector<std::pair<int64_t, std::string>> found;
    const std::vector<std::string> files = glob_files(out_dir + "/ckpt_*.bin");
    if (files.empty()) {
        if (comm_world().world_rank == 0)
            printf("--resume latest: %s holds no checkpoint yet; starting from step 0\n", out_dir.c_str());
        return "";
    }
    for (const std::string& f : files) {
        int64_t step = checkpoint_step(f);
        if (step >= 0) found.push_back({step, f});
        else if (comm_world().world_rank == 0) fprintf(stderr, "warning: %s is not a readable checkpoint, skipped\n", f.c_str());
    }
    std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.first > b.first; });
    for (auto& [step, path] : found) {
        try {
            ck = verify_checkpoint(comm_world().world, path);
            return path;
        } catch (const LlmcError& e) {
            if (comm_world().world_rank == 0) fprintf(stderr, "warning: skipping %s\n", e.what());
        }
    }
    LLMC_FAIL("--resume latest: no checkpoint in %s loads (looked for ckpt_*.bin)", out_dir.c_str());
}

// llm.c's GPT-2 model files (llmc/io/llmc_format.h) and our model: the config a file describes, our
// config in llm.c's terms (refused, naming the field, when it is not GPT-2's shape), and the
// conversions between the two parameter orders.
static TableIndex table_index(const std::vector<ParamTensor>& table) {
    TableIndex index;
    for (const ParamTensor& t : table) index[t.name] = {t.offset, t.numel};
    return index;
}
static GPTConfig config_from_llmc(const LlmcModelShape& s, const std::string& path) {
    GPTConfig c;
    c.vocab_size = s.vocab_size;
    c.n_layer = s.n_layer;
    c.n_embd = s.n_embd;
    c.n_head = c.n_kv_head = s.n_head;
    c.ffn_hidden = 4 * s.n_embd;
    c.max_seq_len = s.max_seq_len;
    c.mlp = MLP_GELU;
    c.pos = POS_LEARNED;
    c.n_expert = 0;
    c.finalize();
    LLMC_CHECK(c.padded_vocab_size == s.padded_vocab_size,
               "%s: the llm.c model pads vocab_size %d to %d rows, this engine pads it to %d (the next multiple of 128); "
               "the wte tables would not line up", path.c_str(), s.vocab_size, s.padded_vocab_size, c.padded_vocab_size);
    return c;
}
static LlmcModelShape llmc_shape_of(const GPTConfig& c) {
    const char* why = c.mlp != MLP_GELU ? "--mlp gelu (this model has swiglu)"
                      : c.pos != POS_LEARNED ? (c.pos == POS_ROPE ? "--pos learned (this model has rope)"
                                                                  : "--pos learned (this model has alibi)")
                      : c.norm != NORM_LAYERNORM ? "--norm layernorm (this model has rmsnorm)"
                      : c.bias != BIAS_ALL ? "--bias all (this model has fewer biases)"
                      : !c.tie_embeddings ? "--tie_embeddings 1 (this model has an lm head of its own)"
                      : c.n_kv_head != c.n_head ? "--n_kv_head equal to --n_head (this model has grouped-query attention)"
                      : c.ffn_hidden != 4 * c.n_embd ? "--ffn_hidden 4 * n_embd (this model's differs)"
                      : c.n_expert != 0 ? "a dense model (this one has experts)" : nullptr;
    LLMC_CHECK(!why, "--export_llmc: llm.c's GPT-2 format holds only GPT-2-shaped models: it needs %s; "
                     "scripts/export_hf.py exports any shape", why);
    LlmcModelShape s;
    s.max_seq_len = c.max_seq_len;
    s.vocab_size = c.vocab_size;
    s.n_layer = c.n_layer;
    s.n_head = c.n_head;
    s.n_embd = c.n_embd;
    s.padded_vocab_size = c.padded_vocab_size;
    return s;
}
// The weights of an llm.c file into the model (fresh optimizer state). The wte rows past
// vocab_size are zeroed: no token uses them (both engines skip them in the softmax) and our
// invariant keeps them zero.
static void gpt_load_llmc(GPT& m, const LlmcModelFile& f, const std::string& path) {
    std::vector<float> p = llmc_to_table(f.shape, f.params, table_index(m.table), m.n_params, path);
    const ParamTensor& wte = m.table[0];
    std::fill(p.begin() + wte.offset + (size_t)m.config.vocab_size * m.config.n_embd, p.begin() + wte.offset + wte.numel,
              0.0f);
    std::vector<float> zeros(m.n_params, 0.0f);
    gpt_set_state(m, p.data(), zeros.data(), zeros.data());
}
// Collective (every rank gathers the whole table), rank 0 writes.
static void gpt_export_llmc(const GPT& m, const std::string& path, bool bf16) {
    const LlmcModelShape shape = llmc_shape_of(m.config);
    std::vector<float> p(m.n_params);
    gpt_get_state(m, p.data(), nullptr, nullptr);
    const CommLongWork long_work;  // the others wait for rank 0's write
    if (comm_world().world_rank == 0) write_llmc_model(path, shape, table_to_llmc(shape, p.data(), table_index(m.table)), bf16);
    barrier(comm_world().dp);
}
