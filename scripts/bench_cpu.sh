#!/usr/bin/env bash
# CPU build benchmark (not a test): per-op throughput against this machine's own rooflines, and
# the whole training step, on three GPT-2-shaped models (GELU, learned positions) and the quick
# start's model (SwiGLU, ALiBi), all on the fortunes byte stream. Optionally llm.c's CPU trainer
# (train_gpt2.c) on the same models and tokens, as the peer. Results go to a markdown file with
# the date, the commit and the machine's load.
#
#   scripts/bench_cpu.sh [--threads N] [--steps N] [--trainer PATH] [--llmc DIR] [--out FILE]
#     --threads  OpenMP threads of every run (default 2)
#     --steps    training steps per run; the step time is the median of steps >= 3 (default 8)
#     --trainer  a train_gpt_cpu to time instead of building this checkout's (e.g. another commit's)
#     --llmc     a checkout of github.com/karpathy/llm.c: build its train_gpt2.c (in a temporary
#                folder, B, T, the model file and the step count substituted) and time it too
#     --out      the results file (default docs/CPU_BENCH.md)
# Needs g++ and the fortunes corpus (data/fortunes, made from /usr/share/games/fortunes as the quick
# start does). Other jobs on the machine make the figures noisy: the load average is recorded.
set -euo pipefail
cd "$(dirname "$0")/.."

threads=2 steps=8 trainer="" llmc="" out=docs/CPU_BENCH.md
while [ $# -gt 0 ]; do
    case "$1" in
        --threads) threads="$2"; shift 2 ;;
        --steps) steps="$2"; shift 2 ;;
        --trainer) trainer="$2"; shift 2 ;;
        --llmc) llmc="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        *) echo "bench_cpu.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
[ "$steps" -ge 4 ] || { echo "bench_cpu.sh: --steps $steps: need at least 4 (steps >= 3 are timed)" >&2; exit 2; }
if [ -n "$llmc" ] && [ ! -f "$llmc/train_gpt2.c" ]; then
    echo "bench_cpu.sh: --llmc $llmc: no train_gpt2.c there" >&2; exit 2
fi
export OMP_NUM_THREADS="$threads"

if [ -z "$trainer" ]; then
    make -s train_gpt_cpu >/dev/null
    trainer=./train_gpt_cpu
fi
[ -x "$trainer" ] || { echo "bench_cpu.sh: --trainer $trainer: not an executable" >&2; exit 2; }
mkdir -p dev/bin
g++ -O3 -march=native -std=c++17 -fopenmp -I. dev/bench_cpu_ops.cpp -o dev/bin/bench_cpu_ops
shard=data/fortunes/fortunes_train_000.bin
if [ ! -f "$shard" ]; then
    [ -d /usr/share/games/fortunes ] || { echo "bench_cpu.sh: no $shard and no /usr/share/games/fortunes (apt-get install fortunes)" >&2; exit 1; }
    python3 dev/data/prepare_text.py /usr/share/games/fortunes --sep percent --out_dir data/fortunes >/dev/null
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# median of the step times (ms) of steps >= 3 in a log: ours print "| 31.2 ms |", llm.c "(took 31.2 ms)"
median_ms() {
    grep -oE '^step +[0-9]+[/:].*' "$1" | awk -v first="$2" '
        { n = $2; sub(/[\/:].*/, "", n); ms = ""
          for (i = 1; i < NF; i++) if ($(i + 1) == "ms" || $(i + 1) == "ms)") ms = $i
          if (ms != "" && n + 0 >= first) print ms + 0 }' | sort -g |
        awk '{ v[++k] = $1 } END { if (k == 0) print "n/a"; else printf "%.1f", (k % 2) ? v[(k + 1) / 2] : (v[k / 2] + v[k / 2 + 1]) / 2 }'
}

commit=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- llmc train_gpt.cu 2>/dev/null || echo "+changes")
{
    echo "# CPU benchmark (scripts/bench_cpu.sh)"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $commit, trainer $trainer, $threads threads,"
    echo "$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) cores; load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)."
    echo
    echo "## Rooflines and accuracy"
    echo
    echo '```'
    ./dev/bin/bench_cpu_ops --roofline
    echo '```'
} >"$out.tmp"

# name | model flags | B | T | mlp for the op table
shapes=(
    "L4 C128 H4, B4 T64 (gelu, learned)|--n_layer 4 --n_embd 128 --n_head 4 --mlp gelu --pos learned|4|64|gelu|4 128 4"
    "L4 C128 H4, B16 T256 (gelu, learned)|--n_layer 4 --n_embd 128 --n_head 4 --mlp gelu --pos learned|16|256|gelu|4 128 4"
    "L8 C256 H8, B8 T256 (gelu, learned)|--n_layer 8 --n_embd 256 --n_head 8 --mlp gelu --pos learned|8|256|gelu|8 256 8"
    "quick start: L4 C128 H4, B16 T256 (swiglu, alibi)|--n_layer 4 --n_embd 128 --n_head 4 --mlp swiglu --pos alibi|16|256|swiglu|4 128 4"
)
summary="| model | ours ms/step | tokens/s |$( [ -n "$llmc" ] && echo " llm.c ms/step | ratio |")"$'\n'"|---|---|---|$( [ -n "$llmc" ] && echo "---|---|")"
for s in "${shapes[@]}"; do
    IFS='|' read -r name flags B T mlp lch <<<"$s"
    echo "== $name" >&2
    read -r L C H <<<"$lch"
    ours_log="$work/ours.log"
    export_flag=()
    [ -n "$llmc" ] && [ "$mlp" = gelu ] && export_flag=(--export_llmc "$work/model.bin")
    # shellcheck disable=SC2086
    "$trainer" $flags -b "$B" -t "$T" -x "$steps" -v 0 -m 1 -g 0 -n -1 -o "$work/out" --overwrite 1 \
        "${export_flag[@]}" >"$ours_log" 2>&1 || { cat "$ours_log" >&2; exit 1; }
    ours=$(median_ms "$ours_log" 3)
    line="| $name | $ours | $(awk -v ms="$ours" -v n=$((B * T)) 'BEGIN { printf "%.0f", n / ms * 1000 }') |"
    if [ -n "$llmc" ]; then
        peer="n/a" ratio="n/a"
        if [ "$mlp" = gelu ]; then
            # llm.c's loader reads its own shard format: the same tokens under its 1024-byte header
            mkdir -p "$work/dev/data/tinyshakespeare"
            python3 - "$shard" "$work/dev/data/tinyshakespeare" <<'EOF'
import struct, sys
b = open(sys.argv[1], "rb").read()
n = struct.unpack_from("<Q", b, 16)[0]
assert struct.unpack_from("<I", b, 12)[0] == 2, "2-byte tokens expected"
data = struct.pack("<3i", 20240520, 1, n) + bytes(1024 - 12) + b[64:64 + 2 * n]
for split in ("train", "val"):
    open(f"{sys.argv[2]}/tiny_shakespeare_{split}.bin", "wb").write(data)
EOF
            sed -e "s|\"gpt2_124M.bin\"|\"$work/model.bin\"|" -e "s|int B = 4;|int B = $B;|" -e "s|int T = 64;|int T = $T;|" \
                -e "s|step <= 40|step <= $steps|" "$llmc/train_gpt2.c" >"$work/train_gpt2.c"
            gcc -Ofast -march=native -fopenmp -DOMP -Wno-unused-result -I"$llmc" "$work/train_gpt2.c" -lm -o "$work/peer"
            (cd "$work" && ./peer >"$work/peer.log" 2>&1) || { cat "$work/peer.log" >&2; exit 1; }
            peer=$(median_ms "$work/peer.log" 3)
            ratio=$(awk -v a="$ours" -v b="$peer" 'BEGIN { printf "%.2f", a / b }')
        fi
        line="$line $peer | $ratio |"
    fi
    summary="$summary"$'\n'"$line"
    {
        echo
        echo "## $name"
        echo
        ./dev/bin/bench_cpu_ops "$L" "$C" "$H" "$B" "$T" "$mlp" "$shard"
    } >>"$out.tmp"
done
{
    echo
    echo "## Whole training step (median of steps >= 3 of $steps)"
    echo
    echo "$summary"
    echo
    echo "Load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)."
} >>"$out.tmp"
mv "$out.tmp" "$out"
cat "$out"
