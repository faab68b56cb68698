#!/usr/bin/env bash
# The whole GPU check in one call, for a bare H200 machine (nvcc and PyTorch, no MPI, no
# internet), in under 8 minutes: build for sm_90 without MPI, run test_gpu, train 50 steps on the
# quick-start data (tok/s, MFU), run every dev/cuda benchmark, print a short table last. Full
# logs go to $OUT (default out/device_check).
#
# The device has no doctest and no fortunes package: first run, on a machine that has them,
#   scripts/device_check.sh --prepare      (copies doctest.h to .deps/, builds data/fortunes/)
# and carry ".deps" and "data/fortunes" with the call.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
    mkdir -p .deps/doctest
    cp /usr/include/doctest/doctest.h .deps/doctest/
    [ -f data/fortunes/fortunes_val_000.bin ] ||
        python3 dev/data/prepare_text.py /usr/share/games/fortunes --sep percent --out_dir data/fortunes
    exit 0
fi

OUT=${OUT:-out/device_check}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" | tee -a "$OUT/gpu.txt"

# the device tool runs one command for at most 600 s: steps that would start after BUDGET seconds
# are reported as skipped instead of being cut off mid-way
BUDGET=${BUDGET:-540}
START=$(date +%s)
declare -a TABLE
run_step() {  # name, timeout seconds, command...
    local name=$1 limit=$2; shift 2
    local log="$OUT/$name.log" t0=$(date +%s)
    if [ $(( t0 - START + 10 )) -gt "$BUDGET" ]; then
        TABLE+=("$(printf '%-28s %-6s' "$name" "skipped (time budget)")")
        return 1
    fi
    [ $(( t0 - START + limit )) -gt "$BUDGET" ] && limit=$(( BUDGET - (t0 - START) ))
    echo "=== $name: $*"
    timeout "$limit" "$@" > "$log" 2>&1
    local rc=$? dt=$(( $(date +%s) - t0 ))
    tail -n 5 "$log"
    TABLE+=("$(printf '%-28s %-6s %4ss' "$name" "$([ $rc -eq 0 ] && echo ok || echo FAIL:$rc)" "$dt")")
    return $rc
}

# corpus: the carried fortunes shards, else any text on the machine (Python's own sources)
DATA=data/fortunes/fortunes
if [ ! -f ${DATA}_val_000.bin ]; then
    src=$(python3 -c 'import os, sysconfig; print(sysconfig.get_paths()["stdlib"])')
    python3 dev/data/prepare_text.py "$src/email" "$src/json" "$src/asyncio" --sep file --out_dir data/pysrc > "$OUT/data.log" 2>&1
    DATA=data/pysrc/pysrc
fi

run_step build 300 make -j16 train_gpt test/test_gpu dev_cuda GPU_ARCH=sm_90 NVCC=nvcc
run_step test_gpu 240 ./test/test_gpu
run_step train_50_steps 180 ./train_gpt --train "${DATA}_train_*.bin" --val "${DATA}_val_*.bin" --out_dir "$OUT/train" \
    -e d12 -b 32 -t 1024 --max_steps 50 --warmup 10 --val_every 25 --val_batches 4 --sample_len 128
for b in dev/cuda/bin/*; do
    run_step "bench_$(basename "$b")" 45 "$b"
done
run_step bench_attention_vs_torch 120 python3 scripts/bench_attention.py

echo
echo "== training (last steps)"
grep -E "^step +(1|10|25|50)/" "$OUT/train_50_steps.log" | head -8
echo "== benchmarks (% of measured ceilings)"
grep -hE "GB/s|TFLOP/s|ratio|PASS|MISS" "$OUT"/bench_*.log | head -80
echo "== summary"
printf '%s\n' "${TABLE[@]}"
