#!/usr/bin/env bash
# The whole GPU check in ONE call on a bare H200 machine (nvcc 13, PyTorch, compute-sanitizer; no
# MPI, no NCCL package, no doctest, no internet), most valuable steps first.
#
#   on the CPU machine:  scripts/device_check.sh --prepare     (builds and prints the carry list)
#                        DRY_RUN=1 scripts/device_check.sh     (the plan: every step, its budget, the sums)
#   on the GPU machine:  scripts/device_check.sh               (carrying what --prepare printed;
#                        run timeout_s 330; ESSENTIAL_ONLY=1 for a second try: timeout_s 270;
#                        ONLY="step step ..." runs just the named steps: a second call for what the
#                        first one did not reach)
#
# Steps in order of value. Each step's budget is its hard timeout (`timeout`), so the essential part
# (1-6) ends within the sum of its budgets, <= 255 s with the carried binaries (DRY_RUN=1 checks it).
# The 15-minute window holds two calls with their cold starts (1-2 minutes each): the first call
# runs BUDGET=315 s (timeout_s 330), ESSENTIAL_ONLY=1 a second one in 255 s (timeout_s 270), so a
# failed or cut first call (<= 330 + 120 s) leaves the 4 minutes a second machine needs and more.
#   1. binaries: the single-GPU build --prepare made (no MPI, no NCCL: neither exists there), probed
#      for loading only (dynamic libraries resolve, `--help` / `--list-test-cases` exit 0); rebuilt
#      with make -j16 only when one does not load, never because of a test result
#   2. test_gpu: every kernel vs its CPU twin, the CUDA trainer vs the CPU trainer
#   3. compute-sanitizer memcheck and racecheck on test_gpu -tc='sanitizer*' (small shapes of every
#      kernel family: attention incl. tensor-parallel head slices, layernorm, MoE, the classifier and
#      its vocab-parallel ops, the encoder's vocab ranges, grad_accumulate, global norms, AdamW)
#   4. a short d12 run (20 steps of 32 x 1024 tokens, one evaluation, a sample, a checkpoint under
#      /tmp) and a short MoE run
#   5. the layouts one GPU can run: -z 0 / 1 / 3, -r 2 and --offload optimizer on a d4 (6 steps
#      each: the losses must agree), and -z 3 with its collectives looped back on the comm stream
#   6. the dev/cuda attention forward / backward and matmul benchmarks (validation, then timings)
#   then, optional, while the budget lasts (BUDGET, default 315 s): the compute_80 PTX build through
#      the driver's JIT with the attention held to 99 KB of shared memory (an RTX 3090 / 4090 / L4),
#      the fp16 build for sm_75 (T4, RTX 20xx) through the JIT of its compute_75 PTX (test_gpu's
#      kernels, then 20 steps with dynamic loss scaling, the attention held to a T4's 64 KB),
#      GPT-2 124M before / after the dweight split and the lm head's chunk, the d30 speed runs, and:
#   7. the memory plan next to the device memory a d24 run takes; bench_attention.py --quick
#      (FlexAttention and SDPA, torch.compile per shape)
#   8. the memory-limit run: the largest dN model --max_fit finds at -r 2 (~7e9 parameters
#      initialised and uploaded: the riskiest and slowest step), then the other dev/cuda benchmarks
#      (the matmul / attention / layernorm ladders first: each kernel version checked and timed)
#   9. the summary table, printed last
# $OUT (default out/device_check) gets ONE combined log (device_check.log, every step's output,
# head and tail of each, at most LOG_TOTAL_CAP in all), summary.txt and the training runs'
# log.jsonl files: at most 5 files, each under 16 MiB. Full step logs stay in /tmp/device_check.
# Results go to dev/cuda/RESULTS.md (date, commit, the summary).
#
# Device-time estimates (EST below, from the H200 runs of 2026-12-04; the cold start (~35 s) and the
# transfers come on top): the binaries' probe ~1 s; make -j16 instead ~90 s; test_gpu ~60 s (GPU
# work is milliseconds: the time is the CPU references, OpenMP on 16 cores); memcheck ~6 s,
# racecheck ~30 s; d12 ~5 s; MoE ~1 s; the five d4 runs ~1 s each; the three benchmarks 3-9 s; the
# PTX-only compute_80 binaries add their JIT compile at start-up: the trainer ~9 s, test_gpu's
# attention / matmul / layernorm / one-step cases 25 s in all. The fp16 sm_75 build (compute_75 PTX):
# not yet run on a device; its estimates are the compute_80 build's (jit75_*).
set -uo pipefail
cd "$(dirname "$0")/.."

PREBUILT=.prebuilt
DATA_DIR=data/fortunes
CARRY='[".deps", "data/fortunes", ".prebuilt"]'
ESSENTIAL_LIMIT=255                   # seconds: the sum of the essential steps' budgets may not exceed it
LOG_CAP=$((512 * 1024))               # bytes of one step's output in the combined log (head + tail)
LOG_TOTAL_CAP=$((15 * 1024 * 1024))   # bytes of the combined log in all (what comes back: < 16 MiB a file)

# the carried binaries: name in $PREBUILT <- what make builds (the trainer is the single-GPU build)
# (jit80/: the compute_80 PTX builds, the sm_80 code path the H200's driver JIT-compiles)
PREBUILT_FROM=("train_gpt:dev/cuda/bin/train_gpt_single" "test_gpu:test/test_gpu"
               "libllmc_attention.so:dev/cuda/bin/libllmc_attention.so"
               "jit80/test_gpu:dev/cuda/bin/jit80/test_gpu" "jit80/train_gpt:dev/cuda/bin/jit80/train_gpt"
               "jit75/test_gpu:dev/cuda/bin/jit75/test_gpu" "jit75/train_gpt:dev/cuda/bin/jit75/train_gpt")
# (jit75/: the fp16 build's compute_75 PTX: on the H200 the driver JIT-compiles it, the sm_75 code path)
# the kernel benchmarks the check runs (bench below), the only ones carried: the 64 MiB carry holds no more
BENCHES="attention_forward attention_backward matmul rope"
MAKE_TARGETS="dev/cuda/bin/train_gpt_single test/test_gpu dev/cuda/bin/jit80/test_gpu
              dev/cuda/bin/jit80/train_gpt dev/cuda/bin/jit75/test_gpu dev/cuda/bin/jit75/train_gpt dev_cuda
              dev/cuda/bin/libllmc_attention.so"

# the carried binaries' dynamic dependencies that the GPU machine cannot satisfy (it has no MPI and
# no NCCL library of its own): prints the offending NEEDED entries, fails if there is one
check_no_mpi_nccl() {  # files...
    local f bad=0
    for f in "$@"; do
        if readelf -d "$f" 2>/dev/null | grep -E 'NEEDED.*(libmpi|libnccl|libopen-)'; then
            echo "$f: needs MPI or NCCL, which the GPU machine does not have"
            bad=1
        fi
    done
    return $bad
}

# ------------------------------------------------------------------------------------------------
# --prepare (CPU machine): everything the device needs, in ignored folders

if [ "${1:-}" = "--prepare" ]; then
    set -e
    mkdir -p .deps/doctest
    cp /usr/include/doctest/doctest.h .deps/doctest/
    if [ ! -f "$DATA_DIR/fortunes_val_000.bin" ]; then
        if [ -d /usr/share/games/fortunes ]; then
            python3 dev/data/prepare_text.py /usr/share/games/fortunes --sep percent --out_dir "$DATA_DIR"
        else
            echo "no /usr/share/games/fortunes (apt-get install fortunes): the device makes shards from Python's sources"
        fi
    fi
    if [ "${PREPARE_NO_BUILD:-0}" != 1 ]; then
        # test_gpu as the default build on a machine without a GPU makes it (sm_80 sm_86 sm_89 sm_90a:
        # compressed, no larger than sm_90a alone), the trainer and benchmarks for sm_90a, and the
        # compute_80 PTX ones: the same flags as `make test` here, so nothing it built is rebuilt
        echo "building the sm_90a and compute_80 (PTX) binaries..."
        # shellcheck disable=SC2086
        make -j"$(nproc)" GPU_ARCH="sm_80 sm_86 sm_89 sm_90a" BENCH_ARCH=sm_90a $MAKE_TARGETS
        rm -rf "$PREBUILT"
        mkdir -p "$PREBUILT/bin" "$PREBUILT/jit80" "$PREBUILT/jit75"
        for pair in "${PREBUILT_FROM[@]}"; do cp "${pair#*:}" "$PREBUILT/${pair%%:*}"; done
        for b in $BENCHES; do cp "dev/cuda/bin/$b" "$PREBUILT/bin/"; done
        # strip the host symbols (the device code is untouched): the carry limit is 64 MiB
        strip "$PREBUILT/train_gpt" "$PREBUILT/test_gpu" "$PREBUILT"/bin/* "$PREBUILT"/jit80/* "$PREBUILT"/jit75/*
        check_no_mpi_nccl "$PREBUILT/train_gpt" "$PREBUILT/test_gpu" "$PREBUILT/libllmc_attention.so" "$PREBUILT"/bin/* \
            "$PREBUILT"/jit80/* "$PREBUILT"/jit75/*
        git rev-parse --short HEAD > "$PREBUILT/COMMIT" 2>/dev/null || true
    fi
    echo
    carried=()
    for d in .deps "$DATA_DIR" "$PREBUILT"; do [ -e "$d" ] && carried+=("$d"); done
    du -sh "${carried[@]}"
    total=$(du -scb "${carried[@]}" | tail -1 | cut -f1)
    echo "carry total: $((total / 1024 / 1024)) MiB (limit 64 MiB)"
    [ "$total" -lt $((64 * 1024 * 1024)) ] || { echo "too large to carry"; exit 1; }
    echo
    echo "carry: $CARRY"
    echo "call:  scripts/device_check.sh   (timeout_s 330; the script keeps itself within BUDGET=315 s;"
    echo "       a second try: ESSENTIAL_ONLY=1 scripts/device_check.sh, timeout_s 270)"
    exit 0
fi

# ------------------------------------------------------------------------------------------------
# the run (DRY_RUN=1: on the CPU machine, print the plan; GPU steps are not executed)

DRY_RUN=${DRY_RUN:-0}
ESSENTIAL_ONLY=${ESSENTIAL_ONLY:-0}
OUT=${OUT:-out/device_check}
BUDGET=${BUDGET:-315}
[ "$ESSENTIAL_ONLY" = 1 ] && BUDGET=$ESSENTIAL_LIMIT
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
# budget where none is given), so the plan shows which steps the budget would reach
declare -A EST=([probe]=2 [build]=90 [test_gpu]=65 [memcheck]=8 [racecheck]=32 [train_d12]=6 [train_moe]=3
                [train_z0]=2 [train_z1]=2 [train_z3]=2 [train_r2]=2 [train_offload]=2 [train_z3_loopback]=2
                [bench_attention_forward]=4 [bench_attention_backward]=10 [bench_matmul]=5
                [jit80_test_gpu]=25 [jit80_train_hs128]=10 [jit75_test_gpu]=35 [jit75_train]=15 [train_hs128]=4 [train_hs128_99kb]=4 [speed_d12_before]=3 [speed_d12_after]=3 [bench_matmul_splitk]=8
                [train_llama]=6 [train_qwen]=6 [bench_rope]=5 [speed_d30_r0]=14 [speed_d30_r2]=14 [mem_d24]=8 [bench_attention_torch]=100 [maxfit_query]=2 [mem_maxfit_r2]=90)
DRY_CLOCK=0
PHASE=essential
ESSENTIAL_BUDGET_SUM=0
now() { echo $(($(date +%s) + DRY_CLOCK)); }
declare -a TABLE
say() { echo "$*" | tee -a "$LOG"; }
[ "$DRY_RUN" = 1 ] && say "=== DRY RUN: commands are printed, not executed (GPU steps stubbed) ==="

# the step's output into the combined log: whole if small, else its head and tail; never past
# LOG_TOTAL_CAP in all, however many steps there are
append_capped() {  # file
    local size used cap
    size=$(stat -c %s "$1")
    used=$(stat -c %s "$LOG")
    cap=$((LOG_TOTAL_CAP - used - 4096))
    [ "$cap" -gt "$LOG_CAP" ] && cap=$LOG_CAP
    if [ "$cap" -le 0 ]; then
        printf '[... step log not copied: the combined log is full; full log in %s on the device ...]\n' "$1" >> "$LOG"
    elif [ "$size" -le "$cap" ]; then
        cat "$1" >> "$LOG"
    else
        head -c $((cap / 2)) "$1" >> "$LOG"
        printf '\n[... %d bytes cut: full log in %s on the device ...]\n' $((size - cap)) "$1" >> "$LOG"
        tail -c $((cap / 2)) "$1" >> "$LOG"
    fi
}

# run_step NAME BUDGET_S NOTE_FN COMMAND...: runs COMMAND under timeout (its budget, clipped to what
# is left of BUDGET), its output to $WORK/NAME.log and, capped, the combined log; one row of the
# table. NOTE_FN (or -) extracts the numbers for the table from the step's log. Every command's
# stdout and stderr go to the step's log: nothing is hidden.
run_step() {
    local name=$1 limit=$2 note_fn=$3
    shift 3
    local step_log="$WORK/$name.log" t0 left rc dt note=""
    [ "$PHASE" = essential ] && ESSENTIAL_BUDGET_SUM=$((ESSENTIAL_BUDGET_SUM + limit))
    if [ -n "${ONLY:-}" ] && [[ " $ONLY probe " != *" $name "* ]]; then
        TABLE+=("$(printf '%-26s %-10s %5s %5ss  %s' "$name" skipped - "$limit" "not in ONLY")")
        return 1
    fi
    t0=$(now)
    left=$((BUDGET - (t0 - START)))
    if [ "$left" -lt 10 ] || { [ "$PHASE" != essential ] && [ "$ESSENTIAL_ONLY" = 1 ]; }; then
        TABLE+=("$(printf '%-26s %-10s %5s %5ss  %s' "$name" skipped - "$limit" "$PHASE; ${left}s of the budget left")")
        say "=== $name: skipped ($PHASE, ${left}s of the budget left)"
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say ""
    say "=== $name ($PHASE, budget ${limit}s, starts at $((t0 - START))s; output: $LOG section '$name', full: $step_log)"
    say "\$ $*"
    if [ "$DRY_RUN" = 1 ]; then
        local est=${EST[$name]:-$limit}
        [ "$est" -gt "$limit" ] && est=$limit
        echo "DRY RUN: not executed (estimate ${est} s of its ${limit} s)" > "$step_log"
        DRY_CLOCK=$((DRY_CLOCK + est))
        rc=0
    else
        if declare -F "$1" > /dev/null; then  # a shell function (the probe): timeout runs programs only
            "$@" > "$step_log" 2>&1
        else
            timeout --kill-after=5 "$limit" "$@" > "$step_log" 2>&1
        fi
        rc=$?
    fi
    dt=$(($(now) - t0))
    append_capped "$step_log"
    tail -n 4 "$step_log"
    [ "$note_fn" != - ] && [ "$DRY_RUN" != 1 ] && note=$($note_fn "$step_log" 2>&1 | head -c 150)
    local status=ok
    [ "$rc" -ne 0 ] && status="FAIL:$rc"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="TIMEOUT"
    [ "$DRY_RUN" = 1 ] && status="dry-run"
    say "=== $name: $status in ${dt}s"
    TABLE+=("$(printf '%-26s %-10s %4ss %5ss  %s' "$name" "$status" "$dt" "$limit" "$note")")
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
note_probe() { grep -E "^probe:" "$1" | tail -1; }

# ------------------------------------------------------------------------------------------------
# 0. the machine

# the carried binaries' commit first: the device's copy of the tree may carry an older git HEAD
say "commit $(cat "$PREBUILT/COMMIT" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%FT%TZ)"
if [ "$DRY_RUN" = 1 ]; then
    say "DRY RUN: nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader"
else
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
    nvcc --version 2>&1 | tail -1 | tee -a "$LOG"
fi

# ------------------------------------------------------------------------------------------------
# 1. binaries: the carried ones if they load, else built here

# every carried binary loads: its libraries resolve (if only the CUDA libraries' folder is missing
# from the loader's path, it is added), the trainer answers --help, test_gpu lists its test cases
probe_binaries() {  # dir
    local dir=$1 f missing
    [ -f "$dir/train_gpt" ] && [ -f "$dir/test_gpu" ] || { echo "probe: no binaries in $dir"; return 1; }
    for f in "$dir/train_gpt" "$dir/test_gpu" "$dir/libllmc_attention.so" "$dir"/bin/*; do
        [ -e "$f" ] || continue
        missing=$(ldd "$f" 2>&1 | grep -E "not found|not a dynamic" || true)
        if [ -n "$missing" ]; then echo "probe: $f: $missing"; return 1; fi
    done
    check_no_mpi_nccl "$dir/train_gpt" "$dir/test_gpu" || return 1
    "$dir/train_gpt" --help > /dev/null || { echo "probe: $dir/train_gpt --help failed"; return 1; }
    "$dir/test_gpu" --list-test-cases > /dev/null || { echo "probe: $dir/test_gpu --list-test-cases failed"; return 1; }
    echo "probe: every binary in $dir loads"
}
cuda_lib_path() {
    local d
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
             $(python3 -c 'import nvidia, glob; print(*[d for p in nvidia.__path__ for d in glob.glob(p + "/*/lib")])' 2>/dev/null); do
        [ -d "$d" ] && printf '%s:' "$d"
    done
}

TRAIN=dev/cuda/bin/train_gpt_single TEST=./test/test_gpu BENCH_DIR=dev/cuda/bin LIB=dev/cuda/bin/libllmc_attention.so
JIT80=dev/cuda/bin/jit80 JIT75=dev/cuda/bin/jit75
if [ -d "$PREBUILT" ] || [ "$DRY_RUN" = 1 ]; then
    if [ "$DRY_RUN" != 1 ] && ! probe_binaries "$PREBUILT" > /dev/null 2>&1; then
        export LD_LIBRARY_PATH="$(cuda_lib_path)${LD_LIBRARY_PATH:-}"
        say "the carried binaries do not all load as they are: retrying with LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    fi
    if run_step probe 10 note_probe probe_binaries "$PREBUILT"; then
        TRAIN=$PREBUILT/train_gpt TEST=$PREBUILT/test_gpu BENCH_DIR=$PREBUILT/bin LIB=$PREBUILT/libllmc_attention.so
        JIT80=$PREBUILT/jit80 JIT75=$PREBUILT/jit75
        PREBUILT_OK=1
    fi
fi
if [ "${PREBUILT_OK:-0}" != 1 ]; then
    say "no carried binaries that load: building them here (not part of the essential budget)"
    # without the doctest header test_gpu cannot build: say so instead of failing obscurely
    [ -f .deps/doctest/doctest.h ] || [ -f /usr/include/doctest/doctest.h ] ||
        say "WARNING: no doctest header (.deps/doctest/doctest.h): carry .deps (scripts/device_check.sh --prepare)"
    PHASE=build
    # shellcheck disable=SC2086
    run_step build 150 - make -j16 GPU_ARCH=sm_90a BENCH_ARCH=sm_90a NVCC=nvcc USE_MPI=0 $MAKE_TARGETS
    PHASE=essential
fi

# ------------------------------------------------------------------------------------------------
# 2. all GPU tests, 3. sanitizers on small shapes

# racecheck instruments only our kernels: cuBLASLt's and cub's are not ours to fix, and their
# instrumentation is most of racecheck's cost (its slowdown grows with each kernel's shared-memory
# accesses: 10-100x against memcheck's 2-10x, compute-sanitizer's documentation)
LIBRARY_KERNELS=(--kernel-name-exclude kns=gemm --kernel-name-exclude kns=xmma --kernel-name-exclude kns=cutlass
                 --kernel-name-exclude kns=cub:: --kernel-name-exclude kns=cublas)
# cuBLASLt's generated Hopper GEMMs (nvjet_sm90_*) cannot be excluded that way: on the H200
# (2026-12-04) racecheck reported hazards inside one (the split-K partials' batched fp32 GEMM), and
# with kns=nvjet excluded the sanitizer itself failed ("failed to handle a hardware exception",
# then illegal accesses). So they run instrumented and their reports are read and set aside: the
# step fails on a hazard in any other kernel, or when the tests themselves fail.
racecheck_ours() {  # budget_s test-binary test-args...
    local budget=$1 raw="$WORK/racecheck_raw.log" rc ours lib
    shift
    timeout --kill-after=5 "$budget" compute-sanitizer --tool racecheck --print-limit 100 "${LIBRARY_KERNELS[@]}" "$@" \
        > "$raw" 2>&1
    rc=$?
    cat "$raw"
    ours=$(grep -E "Race reported between" "$raw" | grep -cvE "nvjet_|gemm|xmma|cutlass|cublas|cub::")
    lib=$(grep -E "Race reported between" "$raw" | grep -cE "nvjet_|gemm|xmma|cutlass|cublas|cub::")
    echo "racecheck: $ours hazard reports in our kernels, $lib in cuBLASLt's (set aside); the tests' exit $rc"
    [ "$ours" -eq 0 ] || return 9
    return "$rc"
}
note_racecheck() { grep -E "^racecheck: " "$1" | tail -1; note_doctest "$1"; }
run_step test_gpu 85 note_doctest "$TEST"
# memcheck also over the one-step model test (every op of the model at small shapes; 6 s on the
# H200, 2026-12-04: it named the kernel the first run's illegal access came from)
run_step memcheck 20 note_sanitizer compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
    "$TEST" -tc='sanitizer*,model: one training step*'
run_step racecheck 45 note_racecheck racecheck_ours 45 "$TEST" -tc='sanitizer*'

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
    n=$(od -An -t u8 -j 16 -N 8 "$1" 2>/dev/null | tr -d ' ')
    [ -n "$n" ] || n=1
    echo $((((n - 1) / $3) / $2))
}
avail=$(val_batches_of "${DATA}_val_000.bin" $B $T)
VALB=$((avail < 2 ? avail : 2))
say "val shard ${DATA}_val_000.bin: $avail batches of ${B}x${T}: --val_batches $VALB"
VAL_ARGS=(--val "${DATA}_val_*.bin" --val_batches "$VALB")
[ "$VALB" -ge 1 ] || VAL_ARGS=(--val '')
run_step train_d12 15 note_train "$TRAIN" --train "${DATA}_train_*.bin" "${VAL_ARGS[@]}" --out_dir "$WORK/train_d12" \
    -e d12 -b $B -t $T --max_steps 20 --warmup 5 --val_every 20 --sample_len 32
avail_moe=$(val_batches_of "${DATA}_val_000.bin" 16 $T)
run_step train_moe 8 note_train "$TRAIN" --train "${DATA}_train_*.bin" --val '' --out_dir "$WORK/train_moe" \
    -e d8 --n_expert 8 --moe_every 2 --capacity_factor 1.25 -b 16 -t $T --max_steps 10 --warmup 3 --sample_len 0 \
    --ckpt_every -1

# ------------------------------------------------------------------------------------------------
# 5. the layouts of one GPU (no MPI on the device machine: one rank, so -z only changes buffer
# layouts and the update pieces): 6 steps each; -z 0 / 1 / 3 and -r 2 must give the same losses
# (bitwise: the same kernels on the same inputs); --offload optimizer too (the host step reproduces
# the kernel's bits but for denormals), and it is the only device test of the side-stream copies

small_run() {  # name flags...
    local name=$1
    shift
    run_step "$name" 4 note_train "$TRAIN" --train "${DATA}_train_*.bin" --val '' --out_dir "$WORK/$name" \
        -e d4 -b 8 -t 256 -d 4096 --max_steps 6 --warmup 2 --sample_len 0 --ckpt_every -1 "$@"
}
for zs in 0 1 3; do small_run "train_z$zs" -z $zs; done
small_run train_r2 -r 2
small_run train_offload --offload optimizer
# the comm-stream path on one GPU (LLMC_COMM_LOOPBACK, llmc/parallel/comm.h): -z 3's gathers as
# collectives on the comm stream, each 200 us late: the same losses as train_z3, no stale finish
run_step train_z3_loopback 6 note_train env LLMC_COMM_LOOPBACK=200 "$TRAIN" --train "${DATA}_train_*.bin" --val '' \
    --out_dir "$WORK/train_z3_loopback" -e d4 -b 8 -t 256 -d 4096 --max_steps 6 --warmup 2 --sample_len 0 --ckpt_every -1 -z 3
for run in train_d12 train_moe; do
    [ -f "$WORK/$run/log.jsonl" ] && cp "$WORK/$run/log.jsonl" "$OUT/${run}_log.jsonl"
done

# ------------------------------------------------------------------------------------------------
# 6. benchmarks of our own kernels (validation first, numbers printed as they come: a timeout keeps them)

bench() {  # name budget
    [ -x "$BENCH_DIR/$1" ] || [ "$DRY_RUN" = 1 ] || { TABLE+=("$(printf '%-26s %-10s' "bench_$1" missing)"); return; }
    run_step "bench_$1" "$2" note_bench "$BENCH_DIR/$1"
}
bench attention_forward 10
bench attention_backward 15
bench matmul 15

# ------------------------------------------------------------------------------------------------
# 7. optional: the memory plan vs the device at d24, attention vs PyTorch

[ "$DRY_RUN" = 1 ] && say "" && say "=== essential steps: budgets sum to ${ESSENTIAL_BUDGET_SUM} s (limit ${ESSENTIAL_LIMIT} s)"
PHASE=optional
# the cards our users have, through the H200: the PTX-only compute_80 build (the driver JIT-compiles
# it at start-up), with the attention kernels held to the 99 KB of shared memory per block an RTX
# 3090 / 4090 or an L4 allows (LLMC_ATTENTION_SMEM_LIMIT): the kernels' tests, then a short run at
# head size 128 (the variant that differs) whose losses should match the sm_90a trainer's
SMEM_99KB=101376
run_step jit80_test_gpu 60 note_doctest env LLMC_ATTENTION_SMEM_LIMIT=$SMEM_99KB "$JIT80/test_gpu" \
    -tc='attention*,flash*,matmul*,layernorm*,model: one training step*'
hs128_run() {  # name trainer [env...]
    local name=$1 trainer=$2
    shift 2
    run_step "$name" 30 note_train env "$@" "$trainer" --train "${DATA}_train_*.bin" --val '' --out_dir "$WORK/$name" \
        --n_layer 4 --n_embd 512 --n_head 4 -b 8 -t 512 -d 4096 --max_steps 6 --warmup 2 --sample_len 0 --ckpt_every -1
}
hs128_run jit80_train_hs128 "$JIT80/train_gpt" LLMC_ATTENTION_SMEM_LIMIT=$SMEM_99KB
# the fp16 build's sm_75 code path (T4, RTX 20xx), JIT-compiled from its compute_75 PTX: two m16n8k8 fp16
# mma.sync per product and plain loads for cp.async, fp16 cuBLASLt, fp16 stochastic rounding; the kernels'
# tests (fp16 tolerances), then 20 steps of a d4 with dynamic loss scaling (the default of the fp16
# build) and the attention held to a T4's 64 KB of shared memory per block (hs 64: the T4's variants)
SMEM_64KB=65536
run_step jit75_test_gpu 60 note_doctest "$JIT75/test_gpu" \
    -tc='attention*,flash*,matmul*,layernorm*,adamw*,classifier*,model: one training step*'
run_step jit75_train 30 note_train env LLMC_ATTENTION_SMEM_LIMIT=$SMEM_64KB "$JIT75/train_gpt" --train "${DATA}_train_*.bin" \
    --val '' --out_dir "$WORK/jit75_train" -e d4 -b 8 -t 256 -d 4096 --max_steps 20 --warmup 2 --sample_len 0 \
    --ckpt_every -1 --loss_scale dynamic
hs128_run train_hs128 "$TRAIN"
# the open models' shape (Llama / Qwen2: rope, RMSNorm, their biases, Llama's untied head) at d12's
# size, 20 steps each: the losses should fall as train_d12's; then the rope kernel's time beside the
# attention forward's on the same shapes (a separate in-place kernel vs fusing it: dev/cuda/rope.cu)
open_run() {  # name flags...
    local name=$1
    shift
    run_step "$name" 15 note_train "$TRAIN" --train "${DATA}_train_*.bin" --val '' --out_dir "$WORK/$name" \
        -e d12 -b $B -t $T --max_steps 20 --warmup 5 --sample_len 0 --ckpt_every -1 --pos rope --norm rmsnorm "$@"
}
open_run train_llama --rope_theta 500000 --rope_scaling llama3 --bias none --tie_embeddings 0
open_run train_qwen --rope_theta 1000000 --norm_eps 1e-6 --bias qkv
[ -x "$BENCH_DIR/rope" ] || [ "$DRY_RUN" = 1 ] && run_step bench_rope 10 note_bench "$BENCH_DIR/rope"
hs128_run train_hs128_99kb "$TRAIN" LLMC_ATTENTION_SMEM_LIMIT=$SMEM_99KB
# GPT-2 124M before / after the weight-gradient split and the lm head's chunk from the memory plan
# (the same binary: LLMC_DWEIGHT_SPLIT=0 and --logits_chunk 1024 are the previous behaviour)
speed_d12() {  # name env-assignment... -- trainer flags...
    local name=$1 envs=()
    shift
    while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    run_step "$name" 20 note_train env "${envs[@]}" "$TRAIN" --train "${DATA}_train_*.bin" --val '' --out_dir "$WORK/$name" \
        -e d12 -b $B -t $T --max_steps 12 --warmup 2 --sample_len 0 --ckpt_every -1 "$@"
}
speed_d12 speed_d12_before LLMC_DWEIGHT_SPLIT=0 -- --logits_chunk 1024
speed_d12 speed_d12_after --
# the split itself: each dense dweight of d12 / d30 unsplit vs chunks of 8192 / 4096 / 2048 rows
[ -x "$BENCH_DIR/matmul" ] || [ "$DRY_RUN" = 1 ] && run_step bench_matmul_splitk 20 note_bench "$BENCH_DIR/matmul" splitk
# a ~1.3B model's speed (d30: 30 layers of 1920, 1.4e9 parameters with the embedding) at -r 0 and
# -r 2, B 8 x T 1024, 6 steps: tok/s and MFU on the last, memory after step 1 next to the plan
for level in 0 2; do
    run_step "speed_d30_r$level" 30 note_train "$TRAIN" --train "${DATA}_train_*.bin" --val '' --out_dir "$WORK/speed_d30_r$level" \
        -e d30 -b 8 -t $T -r $level --max_steps 6 --warmup 2 --sample_len 0 --ckpt_every -1
done
# the memory plan next to the device memory a run takes ("memory after step 1": grown by X MiB
# since before the model, plan Y MiB): d12 from train_d12 above, d24 here
run_step mem_d24 40 note_mem "$TRAIN" --train "${DATA}_train_*.bin" --val '' --out_dir "$WORK/mem_d24" \
    -e d24 -b 8 -t $T --max_steps 2 --warmup 1 --sample_len 0 --ckpt_every -1
run_step bench_attention_torch 100 note_bench_attention python3 scripts/bench_attention.py --quick --no-build --lib "$LIB"

# ------------------------------------------------------------------------------------------------
# 8. the largest dN model --max_fit finds at -r 2 in this GPU's free memory (-b 8 -t 1024;
# no checkpoint: ~80 GB of fp32 state)

MAXFIT_N=12
if run_step maxfit_query 10 - "$TRAIN" --plan --max_fit -e d12 -b 8 -t $T && [ "$DRY_RUN" != 1 ]; then
    MAXFIT_N=$(sed -nE 's/.*-r 2: .*largest dN model at -b 8 is d([0-9]+).*/\1/p' "$WORK/maxfit_query.log" | head -1)
    say "--max_fit at -r 2 on this GPU: d${MAXFIT_N:-?}"
fi
[ -n "$MAXFIT_N" ] && run_step mem_maxfit_r2 120 note_mem "$TRAIN" --train "${DATA}_train_*.bin" --val '' \
    --out_dir "$WORK/mem_maxfit_r2" -e "d$MAXFIT_N" -b 8 -t $T -r 2 --max_steps 2 --warmup 1 --sample_len 0 --ckpt_every -1

# then the other benchmarks, while the budget lasts
for name in ladder_matmul ladder_attention ladder_layernorm layernorm classifier moe adamw encoder swiglu gelu global_norm \
            accumulate attention_lib; do bench "$name" 15; done

# ------------------------------------------------------------------------------------------------
# 9. summary, last

{
    echo
    echo "== training (step lines)"
    grep -hE "^step +(1|10|20)/|val loss|tok/s \| MFU" "$WORK"/train_d12.log "$WORK"/train_moe.log 2>/dev/null | head -20
    for run in speed_d12_before speed_d12_after speed_d30_r0 speed_d30_r2; do
        printf '%-14s %s\n' "$run" "$(grep -hE "^step +[0-9]+/[0-9]+ \| loss" "$WORK/$run.log" 2>/dev/null | tail -1)"
    done
    echo "== the layouts of one GPU: last step of each (the losses must agree)"
    for run in train_z0 train_z1 train_z3 train_r2 train_offload train_z3_loopback; do
        printf '%-14s %s\n' "$run" "$(grep -hE "^step +[0-9]+/[0-9]+ \| loss" "$WORK/$run.log" 2>/dev/null | tail -1)"
    done
    echo "== head size 128: sm_90a, sm_90a with 99 KB attention, compute_80 PTX with 99 KB (the losses should agree)"
    for run in train_hs128 train_hs128_99kb jit80_train_hs128; do
        printf '%-18s %s\n' "$run" "$(grep -hE "^step +[0-9]+/[0-9]+ \| loss" "$WORK/$run.log" 2>/dev/null | tail -1)"
    done
    grep -hE "^attention hs" "$WORK"/train_hs128*.log "$WORK"/jit80_train_hs128.log 2>/dev/null | sort -u | head -4
    echo "== the fp16 build's sm_75 code path (compute_75 PTX, JIT), 64 KB attention, dynamic loss scaling"
    grep -hE "^attention hs|^step +(1|10|20)/" "$WORK/jit75_train.log" 2>/dev/null | head -5
    echo "== memory: plan vs device memory grown since before the model"
    for run in train_d12 speed_d30_r0 speed_d30_r2 mem_d24 mem_maxfit_r2; do
        printf '%-16s %s\n' "$run" "$(grep -hE '^memory after step 1' "$WORK/$run.log" 2>/dev/null | head -1)"
    done
    echo "== attention vs PyTorch"
    grep -hE "TFLOP/s|PASS|MISS|MISMATCH" "$WORK/bench_attention_torch.log" 2>/dev/null | head -40
    echo "== summary ($(($(now) - START)) s of $BUDGET s$([ "$DRY_RUN" = 1 ] && echo ', DRY RUN: estimated');" \
         "essential budgets ${ESSENTIAL_BUDGET_SUM} s of ${ESSENTIAL_LIMIT} s)"
    printf '%-26s %-10s %5s %6s  %s\n' step status time budget notes
    printf '%s\n' "${TABLE[@]}"
    echo "(copy this table with the date and commit into dev/cuda/RESULTS.md)"
} > "$SUMMARY"
cat "$SUMMARY" >> "$LOG"

# what comes back from $OUT: at most 8 files, each under 16 MiB
n_files=$(find "$OUT" -type f | wc -l)
big=$(find "$OUT" -type f -size +16M | wc -l)
{
    echo "== \$OUT ($OUT): $n_files files (limit 8), $big over 16 MiB (the combined log is capped at" \
        "$((LOG_TOTAL_CAP / 1024 / 1024)) MiB)"
    find "$OUT" -type f -printf '  %s bytes  %p\n'
} | tee -a "$LOG" >> "$SUMMARY"
cat "$SUMMARY"
[ "$n_files" -le 8 ] && [ "$big" -eq 0 ] || { echo "OUT CHECK FAILED"; exit 1; }
if [ "$ESSENTIAL_BUDGET_SUM" -gt "$ESSENTIAL_LIMIT" ]; then
    echo "PLAN CHECK FAILED: the essential steps' budgets sum to $ESSENTIAL_BUDGET_SUM s > $ESSENTIAL_LIMIT s"
    exit 1
fi
[ "$DRY_RUN" = 1 ] && echo "DRY RUN done: nothing was run on a GPU"
exit 0
