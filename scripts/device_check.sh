#!/usr/bin/env bash
# The whole GPU check in ONE call on a bare H200 machine (nvcc 13, PyTorch, compute-sanitizer; no
# MPI, no doctest, no internet), essential steps first, in under 7 minutes of device time.
#
#   on the CPU machine:  scripts/device_check.sh --prepare     (prints the carry list)
#                        DRY_RUN=1 scripts/device_check.sh     (every step's command, budget, output)
#   on the GPU machine:  scripts/device_check.sh               (carrying what --prepare printed)
#
# Steps, in priority order (a step that cannot start inside the budget is reported as skipped):
#   1. binaries: the ones --prepare built for sm_90 (.prebuilt/, checked against a hash of the
#      sources and probed on a few small kernels); if they are stale or fail to start, make -j16
#   2. test_gpu: every kernel vs its CPU twin, the CUDA trainer vs the CPU trainer
#   3. compute-sanitizer memcheck and racecheck on test_gpu -tc='sanitizer*' (small shapes of the
#      attention, MoE and layernorm kernels)
#   4. a short training run (d12, 32 x 1024 tokens per step, 30 steps; --val_batches computed from
#      the val shard's size) and a short MoE run; checkpoints under /tmp, never under $OUT; then the
#      memory plan vs the device memory a run takes, for d12, d24 and the largest --max_fit model at -r 2
#   5. benchmarks, each under its own timeout: dev/cuda attention forward / backward, then
#      scripts/bench_attention.py --quick (FlexAttention and SDPA, trimmed grid), then matmul and the
#      other dev/cuda benchmarks
#   6. the summary table, printed last
# $OUT (default out/device_check) gets ONE combined log (device_check.log, every step's output,
# each capped at 640 KiB: head and tail), summary.txt and the training runs' log.jsonl files:
# at most 5 files, each well under 16 MiB. Full step logs stay in /tmp/device_check.
#
# Device-time estimate (script only; the machine's cold start and the transfers come on top):
#   prebuilt binaries: info + hash + probe ~15 s (the probe is 2 small test cases). make -j16
#     instead: measured on the 2-core CPU machine, test/test_gpu alone takes 88 s of nvcc (one TU:
#     two copies of the trainer and every test) and train_gpt + all of dev/cuda + the attention
#     library 85 s with -j2; with -j16 the targets build side by side, so ~90 s (the longest TU),
#     i.e. carrying .prebuilt saves ~75 s
#   test_gpu ~90 s: GPU work is milliseconds; the time is the CPU references, the largest being
#     attention backward at T = 4096 (one thread per (row, kv head): 2-4 threads) ~20-40 s, the
#     model tests' CPU trainer steps ~10 s, and host-side random data ~10 s
#   memcheck ~30 s, racecheck ~45 s (small shapes; sanitizer start-up ~10 s each on a large binary)
#   training ~45 s (start-up ~10 s, 30 steps at ~0.1-0.3 s, 2 evaluations, 64-token sample, a
#     1.5 GB checkpoint written to /tmp) + MoE run ~25 s
#   dev/cuda attention forward, backward: 25 + 25 s (cut by their timeouts if longer: they print as
#     they go); bench_attention.py --quick gets the rest, ~45 s by these estimates, which reaches its
#     first problems only (~15 s of torch.compile per shape; it prints each problem as it finishes);
#     matmul and the other benchmarks only if the earlier steps were faster than estimated
#   memory plan runs: d24 ~30 s, the largest --max_fit model at -r 2 ~90 s (init and upload of ~7 B
#     parameters, two steps)
#   total: essential part (1-4) ~370 s with .prebuilt (~450 s rebuilding), everything <= BUDGET = 400 s
#   < 7 minutes.
# Budgets are hard: every step runs under `timeout` clipped to what is left of BUDGET.
set -uo pipefail
cd "$(dirname "$0")/.."

PREBUILT=.prebuilt
DATA_DIR=data/fortunes
CARRY='[".deps", "data/fortunes", ".prebuilt"]'
LOG_CAP=$((640 * 1024))  # bytes of one step's output in the combined log (head + tail)
MAX_STEPS_IN_LOG=20      # steps this script can run (with every bench): 20 x 640 KiB = 12.5 MiB < 16 MiB

# the sources the binaries are built from: a stale prebuilt binary is never used
sources_hash() {
    cat Makefile train_gpt.cu llmc/*.h llmc/*.cuh llmc/cpu/*.h test/test_gpu.cu test/gpu/*.cuh \
        dev/cuda/*.cu dev/cuda/*.cuh | sha1sum | cut -d' ' -f1
}

# ------------------------------------------------------------------------------------------------
# --prepare (CPU machine): everything the device needs, in ignored folders

if [ "${1:-}" = "--prepare" ]; then
    set -e
    mkdir -p .deps/doctest
    cp /usr/include/doctest/doctest.h .deps/doctest/
    [ -f "$DATA_DIR/fortunes_val_000.bin" ] ||
        python3 dev/data/prepare_text.py /usr/share/games/fortunes --sep percent --out_dir "$DATA_DIR"
    if [ "${PREPARE_NO_BUILD:-0}" != 1 ]; then
        echo "building the sm_90 binaries (make, as many jobs as cores)..."
        make -j"$(nproc)" GPU_ARCH=sm_90 train_gpt test/test_gpu dev_cuda dev/cuda/bin/libllmc_attention.so
        rm -rf "$PREBUILT"
        mkdir -p "$PREBUILT/bin"
        cp train_gpt test/test_gpu "$PREBUILT/"
        cp dev/cuda/bin/libllmc_attention.so "$PREBUILT/"
        for b in dev/cuda/bin/*; do [ "$(basename "$b")" = libllmc_attention.so ] || cp "$b" "$PREBUILT/bin/"; done
        # strip the host symbols (the device code is untouched): the carry limit is 64 MiB
        strip "$PREBUILT/train_gpt" "$PREBUILT/test_gpu" "$PREBUILT"/bin/* 2>/dev/null || true
        sources_hash > "$PREBUILT/SOURCES.sha1"
        git rev-parse --short HEAD > "$PREBUILT/COMMIT" 2>/dev/null || true
    fi
    echo
    du -sh .deps "$DATA_DIR" "$PREBUILT" 2>/dev/null
    total=$(du -scb .deps "$DATA_DIR" "$PREBUILT" 2>/dev/null | tail -1 | cut -f1)
    echo "carry total: $((total / 1024 / 1024)) MiB (limit 64 MiB)"
    [ "$total" -lt $((64 * 1024 * 1024)) ] || { echo "too large to carry"; exit 1; }
    echo
    echo "carry: $CARRY"
    echo "call:  scripts/device_check.sh   (timeout_s 460; the script keeps itself within BUDGET=400 s)"
    exit 0
fi

# ------------------------------------------------------------------------------------------------
# the run (DRY_RUN=1: on the CPU machine, print the plan; GPU steps are not executed)

DRY_RUN=${DRY_RUN:-0}
OUT=${OUT:-out/device_check}
BUDGET=${BUDGET:-400}
WORK=/tmp/device_check  # full step logs and the training runs' out_dir: outside $OUT
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK"
LOG="$OUT/device_check.log"
SUMMARY="$OUT/summary.txt"
: > "$LOG"
export PATH=/usr/local/cuda/bin:$PATH
export LLMC_REQUIRE_GPU=1  # test_gpu fails (instead of skipping) when it sees no GPU
START=$(date +%s)
# the dry run has no real durations: its clock advances by each step's estimate (EST, seconds; the
# limit where none is given), so the plan shows which steps the budget would reach
declare -A EST=([probe_prebuilt]=10 [build]=90 [test_gpu]=90 [memcheck]=30 [racecheck]=45 [train_d12]=45
                [train_moe]=25 [bench_attention_torch]=110 [bench_attention_forward]=25
                [bench_attention_backward]=25 [bench_matmul]=20 [train_z0]=8 [train_z1]=8 [train_z3]=8
                [train_offload]=8 [mem_d24]=30 [mem_maxfit_r2]=90)
DRY_CLOCK=0
now() { echo $(($(date +%s) + DRY_CLOCK)); }
declare -a TABLE
say() { echo "$*" | tee -a "$LOG"; }
[ "$DRY_RUN" = 1 ] && say "=== DRY RUN: commands are printed, not executed (GPU steps stubbed) ==="

# the step's output into the combined log: whole if small, else its head and tail
append_capped() {  # file
    local size
    size=$(stat -c %s "$1")
    if [ "$size" -le "$LOG_CAP" ]; then
        cat "$1" >> "$LOG"
    else
        head -c $((LOG_CAP / 2)) "$1" >> "$LOG"
        printf '\n[... %d bytes cut: full log in %s on the device ...]\n' $((size - LOG_CAP)) "$1" >> "$LOG"
        tail -c $((LOG_CAP / 2)) "$1" >> "$LOG"
    fi
}

# run_step NAME BUDGET_S NOTE_FN COMMAND...: runs COMMAND under timeout (clipped to what is left of
# BUDGET), its output to $WORK/NAME.log and, capped, the combined log; one row of the table.
# NOTE_FN (or -) extracts the numbers for the table from the step's log.
run_step() {
    local name=$1 limit=$2 note_fn=$3
    shift 3
    local step_log="$WORK/$name.log" t0 left rc dt note=""
    t0=$(now)
    left=$((BUDGET - (t0 - START)))
    if [ "$left" -lt 15 ]; then
        TABLE+=("$(printf '%-24s %-10s %5s %5ss  %s' "$name" skipped - "$limit" "out of time budget")")
        say "=== $name: skipped (${left}s of the budget left)"
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say ""
    say "=== $name (timeout ${limit}s; output: $LOG section '$name', full: $step_log)"
    say "\$ $*"
    if [ "$DRY_RUN" = 1 ]; then
        local est=${EST[$name]:-15}
        [ "$est" -gt "$limit" ] && est=$limit
        echo "DRY RUN: not executed (starts at ~$((t0 - START)) s, estimate ${est} s)" > "$step_log"
        DRY_CLOCK=$((DRY_CLOCK + est))
        rc=0
    else
        timeout --kill-after=5 "$limit" "$@" > "$step_log" 2>&1
        rc=$?
    fi
    dt=$(($(now) - t0))
    append_capped "$step_log"
    tail -n 4 "$step_log"
    [ "$note_fn" != - ] && [ "$DRY_RUN" != 1 ] && note=$($note_fn "$step_log" 2>/dev/null | head -c 150)
    local status=ok
    [ "$rc" -ne 0 ] && status="FAIL:$rc"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="TIMEOUT"
    [ "$DRY_RUN" = 1 ] && status="dry-run"
    say "=== $name: $status in ${dt}s"
    TABLE+=("$(printf '%-24s %-10s %4ss %5ss  %s' "$name" "$status" "$dt" "$limit" "$note")")
    return "$rc"
}

# table notes, read from a step's log
note_doctest() { grep -E "^\[doctest\] (test cases|assertions)" "$1" | sed 's/\[doctest\] //' | tr -s ' ' | paste -sd';'; }
note_sanitizer() { grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$1" | tail -1; note_doctest "$1"; }
note_train() {
    grep -E "^step +[0-9]+/[0-9]+ \| loss" "$1" | tail -1 | sed -E 's/ +/ /g'
    grep -E "val loss" "$1" | tail -1 | sed -E 's/.*(val loss [0-9.]+).*/\1/'
}
note_bench_attention() { grep -E "PASS|MISS|VALIDATION|all validations" "$1" | sed -E 's/ +/ /g' | paste -sd';'; }
note_mem() { grep -E "^memory after step 1" "$1" | sed -E 's/.*grown by ([0-9.]+) MiB.*plan: ([0-9.]+) MiB.*/grown \1 MiB, plan \2 MiB/'; }
note_bench() { grep -ciE "mismatch|fail" "$1" | sed 's/^/mismatch lines: /'; }

# ------------------------------------------------------------------------------------------------
# 0. the machine

say "commit $(git rev-parse --short HEAD 2>/dev/null || cat "$PREBUILT/COMMIT" 2>/dev/null || echo unknown), $(date -u +%FT%TZ)"
if [ "$DRY_RUN" = 1 ]; then
    say "DRY RUN: nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader"
else
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
    nvcc --version 2>&1 | tail -1 | tee -a "$LOG"
fi

# ------------------------------------------------------------------------------------------------
# 1. binaries: prebuilt (if fresh and they start) or built here

TRAIN=./train_gpt TEST=./test/test_gpu BENCH_DIR=dev/cuda/bin LIB=dev/cuda/bin/libllmc_attention.so
PROBE_TC='sanitizer: layernorm*,sanitizer: attention*'  # a few small kernels, flash ones included
use_prebuilt=0
if [ -f "$PREBUILT/SOURCES.sha1" ] && [ "$(cat "$PREBUILT/SOURCES.sha1")" = "$(sources_hash)" ]; then
    use_prebuilt=1
    say "prebuilt binaries in $PREBUILT match the sources"
else
    say "no prebuilt binaries for these sources: building"
fi
if [ "$use_prebuilt" = 1 ]; then
    if run_step probe_prebuilt 60 note_doctest "$PREBUILT/test_gpu" -tc="$PROBE_TC"; then
        TRAIN=$PREBUILT/train_gpt TEST=$PREBUILT/test_gpu BENCH_DIR=$PREBUILT/bin LIB=$PREBUILT/libllmc_attention.so
    else
        say "the prebuilt test_gpu did not start or failed its probe: rebuilding"
        use_prebuilt=0
    fi
fi
if [ "$use_prebuilt" = 0 ]; then
    # without the doctest header test_gpu cannot build: say so instead of failing obscurely
    [ -f .deps/doctest/doctest.h ] || [ -f /usr/include/doctest/doctest.h ] ||
        say "WARNING: no doctest header (.deps/doctest/doctest.h): carry .deps (scripts/device_check.sh --prepare)"
    run_step build 240 - make -j16 GPU_ARCH=sm_90 NVCC=nvcc train_gpt test/test_gpu dev_cuda \
        dev/cuda/bin/libllmc_attention.so
fi

# ------------------------------------------------------------------------------------------------
# 2. all GPU tests, 3. sanitizers on small shapes

run_step test_gpu 180 note_doctest "$TEST"
run_step memcheck 60 note_sanitizer compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
    "$TEST" -tc='sanitizer*'
run_step racecheck 75 note_sanitizer compute-sanitizer --tool racecheck --error-exitcode 9 --print-limit 20 \
    "$TEST" -tc='sanitizer*'

# ------------------------------------------------------------------------------------------------
# 4. short training runs (checkpoints under $WORK, outside $OUT)

B=32 T=1024
DATA=$DATA_DIR/fortunes
if [ ! -f "${DATA}_val_000.bin" ]; then  # not carried: any text on the machine (Python's sources)
    src=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    say "no $DATA_DIR: making shards from $src"
    python3 dev/data/prepare_text.py "$src/email" "$src/json" "$src/asyncio" --sep file --out_dir "$WORK/pysrc" >> "$LOG" 2>&1
    DATA=$WORK/pysrc/pysrc
fi
# batches of B x T in the first val shard, as the trainer counts them: ((num_tokens - 1) / T) / B
# (num_tokens: uint64 at byte 16 of the 64-byte header)
val_batches_of() {  # shard B T
    local n
    n=$(od -An -t u8 -j 16 -N 8 "$1" | tr -d ' ')
    echo $((((n - 1) / $3) / $2))
}
avail=$(val_batches_of "${DATA}_val_000.bin" $B $T)
VALB=$((avail < 4 ? avail : 4))
say "val shard ${DATA}_val_000.bin: $avail batches of ${B}x${T}: --val_batches $VALB"
VAL_ARGS=(--val "${DATA}_val_*.bin" --val_batches "$VALB")
[ "$VALB" -ge 1 ] || VAL_ARGS=(--val '')
run_step train_d12 90 note_train "$TRAIN" --train "${DATA}_train_*.bin" "${VAL_ARGS[@]}" --out_dir "$WORK/train_d12" \
    -e d12 -b $B -t $T --max_steps 30 --warmup 10 --val_every 15 --sample_len 64
avail_moe=$(val_batches_of "${DATA}_val_000.bin" 16 $T)
run_step train_moe 60 note_train "$TRAIN" --train "${DATA}_train_*.bin" --val "${DATA}_val_*.bin" \
    --val_batches $((avail_moe < 2 ? avail_moe : 2)) --out_dir "$WORK/train_moe" -e d8 --n_expert 8 --moe_every 2 \
    --capacity_factor 1.25 -b 16 -t $T --max_steps 20 --warmup 5 --val_every 10 --sample_len 0
# the memory plan next to what the device gave out ("memory after step 1": grown by X MiB since before
# the model, plan Y MiB): d12 from train_d12 above, d24, and the largest dN model that --max_fit finds
# at -r 2 in this GPU's free memory (-b 8 -t 1024; no checkpoint: the largest is ~80 GB of fp32 state)
run_step mem_d24 45 note_mem "$TRAIN" --train "${DATA}_train_*.bin" --val '' --out_dir "$WORK/mem_d24" \
    -e d24 -b 8 -t $T --max_steps 2 --warmup 1 --sample_len 0 --ckpt_every -1
MAXFIT_N=12
if [ "$DRY_RUN" != 1 ]; then
    MAXFIT_N=$("$TRAIN" --plan --max_fit -e d12 -b 8 -t $T 2>/dev/null |
               sed -nE 's/.*-r 2: .*largest dN model at -b 8 is d([0-9]+).*/\1/p' | head -1)
    say "--max_fit at -r 2 on this GPU: d${MAXFIT_N:-?}"
fi
[ -n "$MAXFIT_N" ] && run_step mem_maxfit_r2 120 note_mem "$TRAIN" --train "${DATA}_train_*.bin" --val '' \
    --out_dir "$WORK/mem_maxfit_r2" -e "d$MAXFIT_N" -b 8 -t $T -r 2 --max_steps 2 --warmup 1 --sample_len 0 --ckpt_every -1
# ZeRO code paths on one GPU (no MPI on the device machine: one rank, so -z only changes buffer
# layouts and the update pieces): 6 steps each with -z 0, 1 and 3; the losses must be the same
for zs in 0 1 3; do
    run_step "train_z$zs" 20 note_train "$TRAIN" --train "${DATA}_train_*.bin" --val '' --out_dir "$WORK/train_z$zs" \
        -e d4 -b 8 -t 256 -d 4096 --max_steps 6 --warmup 2 --sample_len 0 -z $zs
done
# full activation recomputation: the same losses as -z 0 above (bitwise: the same kernels on the
# same inputs), and the plan next to the measured device memory ("memory after step 1")
run_step train_r2 15 note_train "$TRAIN" --train "${DATA}_train_*.bin" --val '' --out_dir "$WORK/train_r2" \
    -e d4 -b 8 -t 256 -d 4096 --max_steps 6 --warmup 2 --sample_len 0 -r 2
# optimizer offload (AdamW on the host, llmc/offload.h): the same losses as -z 0 above (the host step
# reproduces the kernel's bits but for denormals), the host arenas next to their plan
run_step train_offload 15 note_train "$TRAIN" --train "${DATA}_train_*.bin" --val '' --out_dir "$WORK/train_offload" \
    -e d4 -b 8 -t 256 -d 4096 --max_steps 6 --warmup 2 --sample_len 0 --offload optimizer
for run in train_d12 train_moe; do
    [ -f "$WORK/$run/log.jsonl" ] && cp "$WORK/$run/log.jsonl" "$OUT/${run}_log.jsonl"
done

# ------------------------------------------------------------------------------------------------
# 5. benchmarks, most wanted first

# our attention kernels alone first (no compile step, numbers printed as they come: a timeout
# keeps them), then the comparison with PyTorch (torch.compile per shape), then the other kernels
bench() {  # name limit
    [ -x "$BENCH_DIR/$1" ] || [ "$DRY_RUN" = 1 ] || { TABLE+=("$(printf '%-24s %-10s' "bench_$1" missing)"); return; }
    run_step "bench_$1" "$2" note_bench "$BENCH_DIR/$1"
}
bench attention_forward 25
bench attention_backward 25
run_step bench_attention_torch 130 note_bench_attention python3 scripts/bench_attention.py --quick --no-build --lib "$LIB"
for name in matmul moe layernorm classifier adamw encoder swiglu gelu global_norm attention_lib; do bench "$name" 25; done

# ------------------------------------------------------------------------------------------------
# 6. summary, last

{
    echo
    echo "== training (step lines)"
    grep -hE "^step +(1|10|15|20|30)/|val loss|tok/s \| MFU" "$WORK"/train_d12.log "$WORK"/train_moe.log 2>/dev/null | head -20
    echo "== memory: plan vs device memory grown since before the model (dev/cuda/RESULTS.md)"
    for run in train_d12 mem_d24 mem_maxfit_r2; do
        printf '%-16s %s\n' "$run" "$(grep -hE '^memory after step 1' "$WORK/$run.log" 2>/dev/null | head -1)"
    done
    echo "== attention vs PyTorch"
    grep -hE "TFLOP/s|PASS|MISS|MISMATCH" "$WORK/bench_attention_torch.log" 2>/dev/null | head -40
    echo "== summary ($(($(now) - START)) s of $BUDGET s$([ "$DRY_RUN" = 1 ] && echo ', DRY RUN: estimated'))"
    printf '%-24s %-10s %5s %6s  %s\n' step status time limit notes
    printf '%s\n' "${TABLE[@]}"
} > "$SUMMARY"
cat "$SUMMARY" >> "$LOG"

# what comes back from $OUT: at most 8 files, each under 16 MiB
n_files=$(find "$OUT" -type f | wc -l)
big=$(find "$OUT" -type f -size +16M | wc -l)
{
    echo "== \$OUT ($OUT): $n_files files (limit 8), $big over 16 MiB; the log's worst case:" \
        "$MAX_STEPS_IN_LOG steps x $((LOG_CAP / 1024)) KiB = $((MAX_STEPS_IN_LOG * LOG_CAP / 1024 / 1024)) MiB + summary"
    find "$OUT" -type f -printf '  %s bytes  %p\n'
} | tee -a "$LOG" >> "$SUMMARY"
cat "$SUMMARY"
[ "$n_files" -le 8 ] && [ "$big" -eq 0 ] || { echo "OUT CHECK FAILED"; exit 1; }
[ "$DRY_RUN" = 1 ] && echo "DRY RUN done: nothing was run on a GPU"
exit 0
