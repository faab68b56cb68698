#!/usr/bin/env bash
# The device check as CI can test it without a GPU (make test): scripts/device_check.sh --prepare
# builds the binaries it carries to the GPU machine, which has no MPI and no NCCL, so none of them
# may need libmpi or libnccl (readelf); and the dry run's plan keeps the essential steps within
# their budget (<= 255 s in all), so that a second try fits in one device window.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)}
if [ -z "$NVCC" ]; then
    echo "test_device_check: nvcc not found; skipped"
    exit 0
fi
fail() { echo "test_device_check: FAILED: $*"; exit 1; }

log=$(mktemp /tmp/llmc_device_check_XXXXXX)
trap 'rm -rf "$log" /tmp/llmc_device_check_out' EXIT
bash scripts/device_check.sh --prepare > "$log" 2>&1 || { cat "$log"; fail "--prepare"; }
grep -q "carry total" "$log" || { cat "$log"; fail "--prepare printed no carry total"; }
carried=(.prebuilt/train_gpt .prebuilt/test_gpu .prebuilt/libllmc_attention.so .prebuilt/bin/* .prebuilt/jit80/train_gpt .prebuilt/jit80/test_gpu
         .prebuilt/jit75/train_gpt .prebuilt/jit75/test_gpu)
for f in "${carried[@]}"; do
    [ -f "$f" ] || fail "$f was not prepared"
    readelf -d "$f" > /dev/null || fail "$f is not an ELF file"
    if readelf -d "$f" | grep -qE 'NEEDED.*(libmpi|libnccl)'; then fail "$f needs MPI or NCCL"; fi
done
echo "test_device_check: ${#carried[@]} carried binaries, none needs libmpi or libnccl"
# the readelf test can fail: a multi-GPU trainer (MPI + NCCL found here) does need them
if [ -f train_gpt ] && grep -q "LLMC_NCCL" dev/cuda/bin/.build_flags 2>/dev/null; then
    readelf -d train_gpt | grep -qE 'NEEDED.*libnccl' || fail "the multi-GPU train_gpt does not show libnccl (the check would be blind)"
fi

DRY_RUN=1 OUT=/tmp/llmc_device_check_out bash scripts/device_check.sh > "$log" 2>&1 || { cat "$log"; fail "the dry run"; }
sum=$(sed -nE 's/.*essential budgets ([0-9]+) s of 255 s.*/\1/p' "$log" | head -1)
[ -n "$sum" ] || { cat "$log"; fail "the dry run printed no essential budget"; }
[ "$sum" -le 255 ] || fail "the essential steps' budgets sum to $sum s > 255 s"
for step in probe test_gpu memcheck racecheck train_d12 train_moe train_z0 train_z1 train_z3 train_r2 train_offload train_z3_loopback \
            bench_attention_forward bench_attention_backward bench_matmul; do
    grep -qE "^$step +dry-run" "$log" || { cat "$log"; fail "the dry run does not reach the essential step $step"; }
done
echo "test_device_check: the dry run reaches every essential step; their budgets sum to $sum s (<= 255 s)"
