#!/usr/bin/env bash
# Registers, spills and static shared memory of the CUDA kernels, per architecture, from ptxas' report
# (nvcc --resource-usage), against the checked-in tables dev/cuda/kernel_resources/<arch>.txt (sm_90
# reads sm_90a's: the same code). The tables are the bf16 build's; the fp16 build (make PRECISION=fp16,
# told apart by its kernels' __half arguments) reads <arch>_fp16.txt, and sm_75.txt, the precision sm_75
# has (no bf16): an fp16 build for sm_80+ has no table (so far: nothing in CI builds it). Per
# architecture of the build:
#   - with a table: fails when a kernel of the table uses more registers or spills more than its line
#     allows, or when a kernel not in the table spills at all;
#   - without one (a card we have no table for): never fails on registers (a table made on another
#     card says nothing about this one), only on a spill in a hot kernel.
# Prints the hot kernels (attention, layernorm's backward at the widths models use: most of a step's non-GEMM time) and every
# kernel over its limit, so the build shows what each costs.
#   scripts/kernel_resources.sh PTXAS_LOG                 check (what `make train_gpt` runs)
#   scripts/kernel_resources.sh PTXAS_LOG --table [ARCH]  print the table lines of every kernel (of ARCH)
# Registers matter on a GPU: an SM has 64K; a 256-thread block at 64 registers leaves room for 4
# blocks, at 80 for 3. A spill is a local-memory round trip inside the loop that spilled.
set -euo pipefail
log=$1
tables=$(dirname "$0")/../dev/cuda/kernel_resources
command -v c++filt > /dev/null || { echo "kernel_resources.sh: c++filt (binutils) not found" >&2; exit 1; }

# one line per kernel and architecture: arch <TAB> name (demangled, without the argument list) <TAB>
# registers <TAB> spill bytes (stores + loads) <TAB> static shared memory bytes
measured=$(awk '/Compiling entry function/ { match($0, /_Z[A-Za-z0-9_]+/); fn = substr($0, RSTART, RLENGTH)
                                             match($0, /for .sm_[0-9]+a?.$/); arch = substr($0, RSTART + 5, RLENGTH - 6) }
                /bytes spill stores/ { spill = $5 + $9 }
                /Used [0-9]+ registers/ { smem = 0; if (match($0, /[0-9]+ bytes smem/)) smem = substr($0, RSTART, RLENGTH) + 0
                                          print arch, fn, $5, spill, smem }' "$log" |
           while read -r arch fn regs spill smem; do
               printf '%s\t%s\t%s\t%s\t%s\n' "$arch" "$(echo "$fn" | c++filt | sed -E 's/\(.*$//; s/^void //')" "$regs" "$spill" "$smem"
           done | sort -u)
if [ -z "$measured" ]; then
    # a PTX-only build (GPU_ARCH=compute_XX) runs no ptxas: nothing to check until the driver compiles it
    grep -q 'Compiling entry function' "$log" 2>/dev/null ||
        { echo "kernel resources: no ptxas report in $(basename "$log") (a PTX-only build: checked when a card JIT-compiles it)"; exit 0; }
    echo "kernel_resources.sh: could not read the ptxas report in $log" >&2
    exit 1
fi

if [ "${2:-}" = --table ]; then
    printf '%s\n' "$measured" | awk -F'\t' -v a="${3:-}" 'a == "" || $1 == a { printf "%s%-72s %4d %5d\n", (a == "" ? $1 " " : ""), $2, $3, $4 }'
    exit 0
fi

HOT='flash_|attention_|layernorm_backward_kernel<8, [12],'
# the build's precision: the fp16 build's kernels take __half (mangled 6__half), the bf16 one's __nv_bfloat16
precision=bf16
grep -qE 'Compiling entry function.*6__half' "$log" && precision=fp16
fail=0
for arch in $(printf '%s\n' "$measured" | cut -f1 | sort -u); do
    if [ "$precision" = fp16 ]; then
        table=$tables/${arch}_fp16.txt
        [ "$arch" = sm_75 ] && table=$tables/sm_75.txt
        [ -f "$table" ] || table=$tables/${arch}a_fp16.txt
    else
        table=$tables/$arch.txt
        [ -f "$table" ] || table=$tables/${arch}a.txt
    fi
    [ -f "$table" ] || table=
    checked=0
    source="no table for $arch ($precision): hot kernels must not spill"
    [ -n "$table" ] && source="limits from dev/cuda/kernel_resources/$(basename "$table")"
    echo "kernel resources (ptxas, $(basename "$log" .ptxas), $arch, $precision): registers / spill bytes / static smem bytes, $source"
    while IFS=$'\t' read -r _ name regs spill smem; do
        limit=
        [ -n "$table" ] && limit=$(awk -v n="$name" 'substr($0, 1, 1) != "#" && NF >= 3 {
                                      k = $0; sub(/[ \t]+[0-9]+[ \t]+[0-9]+[ \t]*$/, "", k)
                                      if (k == n) { print $(NF - 1), $NF; exit } }' "$table")
        if [ -n "$limit" ]; then
            read -r max_regs max_spill <<< "$limit"
            status=ok
            [ "$regs" -le "$max_regs" ] && [ "$spill" -le "$max_spill" ] || { status="OVER (table: $max_regs / $max_spill)"; fail=1; }
            if [ "$status" != ok ] || [[ "$name" =~ $HOT ]]; then
                printf '  %-60s %4d / %-4d / %-6d %s\n' "$name" "$regs" "$spill" "$smem" "$status"
            fi
            [ "$status" = ok ] && checked=$((checked + 1))
        elif [ "$spill" -gt 0 ] && { [ -n "$table" ] || [[ "$name" =~ $HOT ]]; }; then
            printf '  %-60s %4d / %-4d / %-6d SPILL (%s)\n' "$name" "$regs" "$spill" "$smem" "$([ -n "$table" ] && echo "not in the table" || echo "a hot kernel")"
            fail=1
        elif [ -z "$table" ] && { [[ "$name" =~ $HOT ]] || [ "$spill" -gt 0 ]; }; then
            printf '  %-60s %4d / %-4d / %-6d\n' "$name" "$regs" "$spill" "$smem"
        fi
    done < <(printf '%s\n' "$measured" | awk -F'\t' -v a="$arch" '$1 == a')
    [ -n "$table" ] && echo "  ($checked kernels within their lines of the table)"
done
# Shared memory per block, static (ptxas) + dynamic (the launch's), of the attention kernels against each
# architecture's opt-in limit per block. The dynamic bytes are attention.cuh's formulas (a static_assert
# there keeps FA_TILE 64 and FA_PAD 8, which these use): flash forward (1 + 2 STAGES) and backward
# (2 + 2 STAGES) tiles of 64 x (hs + 8) 2-byte elements; the fp32 fallback kernels' for head sizes 64 and
# 128. The run-time rule (attention.cuh, flash_pick) takes a 2-stage kernel only where it fits and
# needs the 1-stage one to: that must fit every card a build is for, at head size 64 (every GPT-2
# shape) and, on sm_80 and newer, 128; sm_75's 64 KB hold the flash kernels at head size 64 only (the
# run refuses hs 128 there, naming it).
smem_limit() { case $1 in sm_75) echo 65536 ;; sm_80) echo 166912 ;; sm_86|sm_89) echo 101376 ;; sm_90*) echo 232448 ;; *) echo 0 ;; esac; }
for arch in $(printf '%s\n' "$measured" | cut -f1 | sort -u); do
    limit=$(smem_limit "$arch")
    [ "$limit" -gt 0 ] || { echo "shared memory ($arch): no per-block limit known for this architecture: not checked"; continue; }
    echo "shared memory per block ($arch, limit $limit B): static + dynamic = total"
    while IFS=$'\t' read -r _ name regs spill smem; do
        kernel=${name##*::}
        if [[ $kernel =~ ^flash_(forward|dq|dkdv)_kernel\<([0-9]+),\ ([12])\>$ ]]; then
            kind=${BASH_REMATCH[1]} hs=${BASH_REMATCH[2]} stages=${BASH_REMATCH[3]}
            [ "$kind" = forward ] && tiles=$((1 + 2 * stages)) || tiles=$((2 + 2 * stages))
            dyn=$((tiles * 64 * (hs + 8) * 2))
        elif [[ $kernel =~ ^attention_(forward|dq|dkdv)_kernel ]]; then
            kind=${BASH_REMATCH[1]}
            for hs in 64 128; do
                case $kind in
                    forward) dyn=$((4 * (32 * (hs + 4) + 32 * hs + 16 * hs))) ;;
                    *)       dyn=$((4 * (2 * 32 * (hs + 4) + 2 * 16 * hs))) ;;
                esac
                total=$((smem + dyn)); status=ok
                [ "$total" -le "$limit" ] || { status="DOES NOT FIT"; fail=1; }
                printf '  %-60s %6d + %6d = %6d %s\n' "$kernel (hs $hs)" "$smem" "$dyn" "$total" "$status"
            done
            continue
        else
            continue
        fi
        total=$((smem + dyn)); status=ok
        if [ "$total" -gt "$limit" ]; then
            # a 2-stage kernel that does not fit is never chosen; a 1-stage one must fit (hs 128 on sm_75 aside)
            if [ "$arch" = sm_75 ] && [ "$hs" -gt 64 ]; then status="does not fit: sm_75 runs head size 64 (the run refuses $hs)"
            elif [ "$stages" = 2 ]; then status="does not fit: never chosen here"
            else status="DOES NOT FIT: no variant of this kernel can launch"; fail=1; fi
        fi
        printf '  %-60s %6d + %6d = %6d %s\n' "$kernel" "$smem" "$dyn" "$total" "$status"
    done < <(printf '%s\n' "$measured" | awk -F'\t' -v a="$arch" '$1 == a' | sort -t$'\t' -k2,2V)
done
if [ "$fail" != 0 ]; then
    echo "kernel_resources.sh: a kernel exceeds dev/cuda/kernel_resources/<arch>.txt, a hot kernel spills, or an attention" \
         "kernel's shared memory does not fit an architecture of the build (fix the kernel, or raise its line there and" \
         "say why in the commit)" >&2
    exit 1
fi
