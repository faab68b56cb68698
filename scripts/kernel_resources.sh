#!/usr/bin/env bash
# Registers and spills of the CUDA kernels, from ptxas' report (nvcc --resource-usage), against the
# checked-in table dev/cuda/kernel_resources.txt. Fails when a kernel of the table uses more registers
# or spills more than the table allows, or when any kernel not in the table spills at all. Prints the
# hot kernels (attention, layernorm, the classifier, SwiGLU/GELU: most of a step's non-GEMM time) and
# every kernel over its limit: the build shows what each costs.
#   scripts/kernel_resources.sh PTXAS_LOG            check (what `make train_gpt` runs)
#   scripts/kernel_resources.sh PTXAS_LOG --table    print a table for every kernel in the log
# Registers matter on a GPU: an SM has 64K; a 256-thread block at 64 registers leaves room for 4
# blocks, at 80 for 3. A spill is a local-memory round trip inside the loop that spilled.
set -euo pipefail
log=$1
table=$(dirname "$0")/../dev/cuda/kernel_resources.txt
command -v c++filt > /dev/null || { echo "kernel_resources.sh: c++filt (binutils) not found" >&2; exit 1; }

# one line per kernel: name (demangled, without the argument list) <TAB> registers <TAB> spill bytes
# (stores + loads)
measured=$(awk '/Compiling entry function/ { match($0, /_Z[A-Za-z0-9_]+/); fn = substr($0, RSTART, RLENGTH) }
                /bytes spill stores/ { spill = $5 + $9 }
                /Used [0-9]+ registers/ { print fn, $5, spill }' "$log" |
           while read -r fn regs spill; do
               printf '%s\t%s\t%s\n' "$(echo "$fn" | c++filt | sed -E 's/\(.*$//; s/^void //')" "$regs" "$spill"
           done | sort -u)
[ -n "$measured" ] || { echo "kernel_resources.sh: no ptxas report in $log (nvcc --resource-usage)" >&2; exit 1; }

if [ "${2:-}" = --table ]; then
    printf '%s\n' "$measured" | awk -F'\t' '{ printf "%-72s %4d %5d\n", $1, $2, $3 }'
    exit 0
fi

HOT='flash_|layernorm_backward_kernel<8'
fail=0 checked=0
echo "kernel resources (ptxas, $(basename "$log" .ptxas)): registers / spill bytes, limits from dev/cuda/kernel_resources.txt"
while IFS=$'\t' read -r name regs spill; do
    limit=$(awk -v n="$name" 'substr($0, 1, 1) != "#" && NF >= 3 {
                                  k = $0; sub(/[ \t]+[0-9]+[ \t]+[0-9]+[ \t]*$/, "", k)
                                  if (k == n) { print $(NF - 1), $NF; exit } }' "$table")
    if [ -n "$limit" ]; then
        read -r max_regs max_spill <<< "$limit"
        status=ok
        [ "$regs" -le "$max_regs" ] && [ "$spill" -le "$max_spill" ] || { status="OVER (table: $max_regs / $max_spill)"; fail=1; }
        if [ "$status" != ok ] || [[ "$name" =~ $HOT ]]; then
            printf '  %-64s %4d / %-4d %s\n' "$name" "$regs" "$spill" "$status"
        fi
        [ "$status" = ok ] && checked=$((checked + 1))
    elif [ "$spill" -gt 0 ]; then
        printf '  %-64s %4d / %-4d NEW SPILL (not in the table)\n' "$name" "$regs" "$spill"
        fail=1
    fi
done <<< "$measured"
echo "  ($checked kernels within their lines of the table)"
if [ "$fail" != 0 ]; then
    echo "kernel_resources.sh: a kernel exceeds dev/cuda/kernel_resources.txt (fix the kernel, or raise its line there" \
         "and say why in the commit)" >&2
    exit 1
fi
