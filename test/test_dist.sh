#!/usr/bin/env bash
# Distributed tests of the CPU build under mpirun (make test runs this). A layout moves bytes, not
# math: every run below is compared with one process on the same global batch, bitwise (same_run:
# the final checkpoints (params, Adam moments, data position, RNG) byte-identical and the logged
# losses and gradient norms equal). The order of the step's gradient sum is the layout's gradient
# blocks (llmc/gpt/layout.h: -z 0/1 a block per dp rank, -z 2/3 a block per micro-batch, with pp
# -z 2/3 one block), printed at start-up; the one process is given the same --grad_blocks
# (ref_for). Not bitwise: resumes that change the blocks, held to 1e-6 relative on every logged
# loss and gradient norm over 8 steps (close_run, test/compare_runs.py).
#   1. matrix: np 1..4 x --zero 0..3, a dense and an MoE model (parameter counts not divisible
#      by 3 or 4), 8 steps of 2 micro-batches per rank, vs one process with np x 2 micro-batches;
#      -z 0/1 with one micro-batch per rank (bitwise); the bytes per step of every collective ==
#      the theory, and the data-parallel bytes <= the anchors' (DDP, Megatron's distributed
#      optimizer, ZeRO-2, ZeRO-3) at 1, 2 and 8 micro-batches per rank
#   2. resume with the same layout, and resharded resumes 4 -> 2, 2 -> 4, 3 -> 1, -z 3 -> 0; the
#      same with a tiny host staging chunk (streamed init, verify, load, save); a corrupt newest
#      checkpoint refused on every rank, skipped by --resume latest
#   3. faults: one rank SIGKILLed while writing a checkpoint (no loadable checkpoint appears;
#      --resume latest takes the previous one), one rank killed mid-run, one rank's error
#   4. bad layouts refused with one clear message
#   5. pipeline schedules x ZeRO x recompute, reshards across pp, the trace, bad pipeline layouts
#   6. llm.c model files: export and import under np 2 -z 3, np 4 -z 1 and pp 2 = one process's bytes
#   7. tensor parallel (+ sequence parallel) in the full dp x tp x pp grid (B 2 and 4: a block in
#      2 and 4 parts of the micro-batch), reshards across tp,
#      bad tensor-parallel layouts; the lm head over token chunks (--logits_chunk) in dp, tp + sp, pp
#   8. --offload optimizer: np 2 -z 1/3 (dense, MoE), pp 2 and a resume that turns it on, bitwise
#   9. tensor parallelism op by op (test/test_tp) under np 2, 3, 4 and 6: row- and column-parallel
#      linears, vocab-parallel loss, attention activations and gradients vs the unsplit model
#  10. expert parallel: --ep 2/4, both routing groups, -z 0/1/3, pp 2, tp 2, reshards, bad layouts
#  11. what clusters do to a run: a stopped rank (SIGSTOP, np 4 dp and pp) ends the job within
#      --comm_timeout + 10 s naming it, a slow checkpoint write does not; SIGTERM / SIGINT at a
#      random step (one process, np 2, np 4) stop with a checkpoint of the stopping step and resume
#      bitwise, a second signal exits at once; SIGKILL during the first checkpoint write (10
#      trials): the same command with --resume latest works; a failed write leaves no .tmp;
#      oversized checkpoint fields refused by name
#  12. the simulated link: its model times (test/test_comm), same bits with --sim_link, where the
#      transfers complete (-z 1's parameter and -z 0's gradient gathers, 1f1b's gradient sends), bad values
#  13. loss scaling (llmc/loss_scaler.h): a dynamic power-of-two scale changes no bit of an fp32 run; an
#      inf injected into one rank's gradient (LLMC_FAULT_INF_GRAD) makes every rank skip that step and
#      halve the scale, under np 2 -z 0..3, pp 2 and np 4 pp 2 x dp 2, bitwise as one process; the
#      scale doubles after --loss_scale_window finite steps; a resume continues the scale bitwise; a
#      fixed scale counts an overflow as a bad step; bad values refused
#  14. a shard truncated, rewritten at the same size or removed under a running trainer (LLMC_FAULT_SHARD,
#      one process and np 2): an error naming it, not a signal; the last checkpoint intact; restored, a
#      resume continues bitwise
#  15. log.jsonl changed under a running trainer as logrotate does (LLMC_FAULT_LOG: copytruncate, rename
#      + create) or deleted: one warning, every line of every log file valid JSON, no record lost
#  16. multiple choice and --eval_only in one process, dp 2, pp 2, tp 2, dp 2 -z 3
#  17. the open models' shape: a Llama-shaped model (rope with llama3 scaling, rmsnorm, no biases,
#      untied head, one kv head: shared by the tp ranks) and a Qwen2-shaped one (rope, rmsnorm eps 1e-6, q/k/v biases, tied) under
#      dp 2 -z 0..3, tp 2 (+sp), pp 2 (1f1b, zb1 -r 1), np 4 pp 2 x dp 2 and tp 2 x dp 2 -z 3, each
#      bitwise as one process with the bytes of the theory; resumes (same layout, tp 2 -> pp 2)
#      bitwise; --init_from a checkpoint (its weights, fresh moments, step 0); flags that contradict
#      the file refused
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=$PWD/train_gpt_cpu
W=$(mktemp -d /tmp/llmc_dist.XXXXXX)
trap 'rm -rf "$W"' EXIT
export OMP_NUM_THREADS=1
MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none"
fails=0; checks=0
pass() { checks=$((checks + 1)); }
fail() { checks=$((checks + 1)); fails=$((fails + 1)); echo "FAIL: $*"; }

if ! command -v mpirun >/dev/null || ! $BIN -h >/dev/null 2>&1 || ! grep -q "MPI" <(strings "$BIN" | grep -m1 "OMPI\|MPI_Init"); then
    echo "test_dist: train_gpt_cpu was built without MPI (or mpirun is missing): distributed tests FAILED to run"
    exit 1
fi

# data: this repository's sources as documents
python3 dev/data/prepare_text.py llmc test/test_ops.cpp --sep blank --out_dir "$W/data" --val_frac 0.1 >/dev/null || exit 1
B=2; T=16
COMMON="-i $W/data/data_train_*.bin -j $W/data/data_val_*.bin -b $B -t $T -m 3 -v 4 -g 0 -u 2 -l 3e-3 --n_layer 2 --n_embd 27 --n_head 3 --n_kv_head 1 --ffn_hidden 53"
DENSE="$COMMON"
MOE="$COMMON --n_expert 3 --moe_every 2 --expert_hidden 41 --capacity_factor 1.5"
STEPS=8

# run NP OUT ARGS...: trains, keeps stdout+stderr in OUT.log
run() {
    local np=$1 out=$2; shift 2
    if [ "$np" = 1 ]; then "$BIN" "$@" -o "$out" >"$out.log" 2>&1
    else timeout 300 $MPIRUN -np "$np" "$BIN" "$@" -o "$out" >"$out.log" 2>&1; fi
}
# the step records without timings
losses() { grep -o '"step":[0-9]*,"\(loss\|val_loss\)":[^,}]*\(,"grad_norm":[^,}]*\)\?' "$1/log.jsonl"; }
same_run() {  # same_run REF OUT STEP what [N: compare only the last N log records]
    local n=${5:-100000}
    if cmp -s "$1/ckpt_$(printf %09d "$3").bin" "$2/ckpt_$(printf %09d "$3").bin" &&
        [ "$(losses "$1" | tail -n $n)" = "$(losses "$2" | tail -n $n)" ]; then pass
    else fail "$4: checkpoint or losses differ ($1 vs $2)"; fi
}
close_run() {  # close_run REF OUT what [MIN_STEPS [RTOL]]: every logged loss and grad norm within RTOL (1e-6) relative
    local r; r=$(python3 test/compare_runs.py "$1" "$2" --rtol ${5:-1e-6} --min_steps ${4:-8}) && pass || fail "$3: $r ($1 vs $2)"
}
# The one process a layout's run OUT is bitwise equal to: the same model and batch flags given the
# layout's gradient blocks (its start-up line "gradient sum: G blocks"). ref_for OUT FLAGS...: sets
# REF to that one-process run (run once per FLAGS and G).
ref_for() {
    local out=$1; shift
    local G; G=$(grep -o "^gradient sum: [0-9]*" "$out.log" | grep -o "[0-9]*$")
    REF=$W/ref.$(echo "$* G ${G:-none}" | cksum | cut -d' ' -f1)
    [ -d "$REF" ] || run 1 "$REF" "$@" --grad_blocks "${G:-0}" || fail "one-process reference of $out ($* --grad_blocks $G): rc $?"
}
# the measured bytes of every collective == the theory on rank 0; with dp > 1 the data-parallel
# gradient and parameter bytes <= the anchor of the ZeRO stage (with pp at -z 2/3, less the tied
# head's own reduction, which Megatron's embedding group pays too; without pp it must be 0); the
# line gives a later step's bytes (at -z 3 the first one gathers its own first segments too) and
# their sum with the first step's extra is the measured first step's
comm_theory() {  # comm_theory OUT WHAT
    local line; line=$(grep "^communication per step" "$1.log")
    echo "$line" | python3 -c "
import re,sys; l=sys.stdin.read(); m=re.findall(r'(\S+) (\d+) \(theory (\d+)\)', l)
sys.exit(0 if m and all(a==b for _,a,b in m) else 1)" && pass || fail "$2: communication bytes differ from theory: $line"
    line=$(grep "^data-parallel gradients and params per step" "$1.log") || return 0
    echo "$line" | python3 -c "
import re,sys; l=sys.stdin.read()
z, sent, head, extra = re.search(r'-z (\d) sends (\d+) \(tied head (\d+) of it; the first step (\d+) more', l).groups()
anchors = [float(x) for x in re.search(r'DDP all-reduce (\d+), Megatron distributed optimizer (\d+), ZeRO-2 (\d+), ZeRO-3/FSDP (\d+)', l).groups()]
log = open('$1.log').read()
pp = int(re.search(r'pp (\d+) x dp', log).group(1))
first = re.search(r'^communication per step, rank 0.*', log, re.M).group(0)
dp_first = sum(int(b) for _, b in re.findall(r'(all_gather|all_to_all) (\d+) \(theory', first))
only_dp = re.search(r'\(pp 1 x dp \d+ x tp 1, ep 1\)', log)  # (then every buffer collective is the dp group's)
ok = float(sent) - float(head) <= anchors[int(z)] and (pp > 1 or float(head) == 0) and (int(z) == 3 or float(extra) == 0)
sys.exit(0 if ok and (not only_dp or dp_first == float(sent) + float(extra)) else 1)" && pass || fail "$2: data-parallel bytes above the anchor: $line"
}

# ---- 1. the matrix
t0=$(date +%s)
for model in dense moe; do
    [ $model = dense ] && ARGS=$DENSE || ARGS=$MOE
    for np in 1 2 3 4; do
        tokens=$((B * T * np * 2))
        if [ $np = 1 ]; then
            run 1 "$W/$model.np1" $ARGS -d $tokens -x $STEPS || fail "$model one process: rc $?"
            n=$(grep -o "^parameters: [0-9]*" "$W/$model.np1.log" | grep -o "[0-9]*$")
            if [ $((n % 3)) -ne 0 ] && [ $((n % 4)) -ne 0 ]; then pass; else fail "$model: $n parameters divide by 3 or 4"; fi
        fi
        for z in 0 1 2 3; do
            out=$W/$model.np$np.z$z
            if run $np "$out" $ARGS -d $tokens -x $STEPS -z $z; then
                ref_for "$out" $ARGS -d $tokens -x $STEPS
                same_run "$REF" "$out" $STEPS "$model np $np -z $z vs one process"
                # -z 0/1 sum per rank: the plain one process (one block) is another sum, within rounding
                if [ $np = 2 ] && [ $z = 0 ] && [ $model = dense ]; then
                    run 1 "$W/dense.one_block" $ARGS -d $tokens -x $STEPS || fail "one process, one block: rc $?"
                    if cmp -s "$W/dense.one_block/ckpt_$(printf %09d $STEPS).bin" "$out/ckpt_$(printf %09d $STEPS).bin"; then
                        fail "np 2 -z 0: the same bits as one block (the blocks would not be what the test compares)"
                    else close_run "$W/dense.one_block" "$out" "np 2 -z 0 vs one process in one block"; fi
                fi
                if [ $np -gt 1 ] && [ $z -le 2 ]; then grep -q "params identical on all $np ranks" "$out.log" && pass || fail "$model np $np z$z: no rank-agreement line"; fi
                [ $np -gt 1 ] && comm_theory "$out" "$model np $np z$z"
            else
                fail "$model np $np -z $z: rc $?"; tail -5 "$out.log"
            fi
        done
        [ $np = 1 ] && continue
        # one micro-batch per rank
        for z in 0 1; do
            out=$W/$model.np$np.z$z.acc1
            if run $np "$out" $ARGS -d $((B * T * np)) -x $STEPS -z $z; then
                ref_for "$out" $ARGS -d $((B * T * np)) -x $STEPS
                same_run "$REF" "$out" $STEPS "$model np $np -z $z, 1 micro-batch per rank, vs one process"
                comm_theory "$out" "$model np $np z$z acc 1"
            else fail "$model np $np -z $z, 1 micro-batch per rank: rc $?"; tail -5 "$out.log"; fi
        done
    done
done
# the bytes at 8 micro-batches per rank (one step): -z 0/1 send what they send at 1, -z 2/3 per micro-batch
for np in 2 4; do
    for z in 0 1 2 3; do
        out=$W/dense.np$np.z$z.acc8
        run $np "$out" $DENSE -d $((B * T * np * 8)) -x 1 -z $z && comm_theory "$out" "dense np $np z$z acc 8" ||
            { fail "dense np $np -z $z, 8 micro-batches per rank: rc $?"; tail -5 "$out.log"; }
    done
done
echo "test_dist: matrix (2 models x np 1-4 x zero 0-3, 1 / 2 / 8 micro-batches per rank) done in $(( $(date +%s) - t0 )) s"

# ---- 2. resume and reshard: 8 steps with a checkpoint at 4, drop the final checkpoint, continue
# from step 4 under another layout; the final checkpoint and the resumed steps' records must be
# the uninterrupted run's, bitwise where both layouts sum the gradient in the same blocks (a
# resume on one process keeps the checkpoint's blocks), else within 1e-6 and said in a note
full_run() {  # full_run TOKENS: $W/full.TOKENS, the one-process uninterrupted run of that global batch
    [ -d "$W/full.$1" ] || run 1 "$W/full.$1" $DENSE -d $1 -x $STEPS || fail "uninterrupted run of $1 tokens"
}
blocks_of() { grep -o "^gradient sum: [0-9]*" "$1.log" | grep -o "[0-9]*$"; }
TOK=$((B * T * 4 * 2))
for case in "2 0 2 0 2" "4 1 2 2 4" "2 2 4 0 4" "3 0 1 0 3" "2 3 2 0 2" "1 0 1 0 8" "4 1 2 0 8" \
            "2 3 4 1 8" "2 1 1 0 4" "2 1 1 0 4 --grad_blocks 1"; do
    set -- $case  # np_a z_a np_b z_b micro-batches per step [the second run's flags]
    tok=$((B * T * $5))
    out=$W/resume.$1.$2.$3.$4$(echo "${*:6}" | tr -d ' -')
    if run $1 "$out" $DENSE -d $tok -x $STEPS -n 4 -z $2 && blocks_a=$(blocks_of "$out") && rm "$out/ckpt_$(printf %09d $STEPS).bin" &&
        run $3 "$out" $DENSE -d $tok -x $STEPS -z $4 "${@:6}" -y latest && grep -q "resumed from .*ckpt_000000004.bin" "$out.log"; then
        if [ "$blocks_a" = "$(blocks_of "$out")" ]; then
            ref_for "$out" $DENSE -d $tok -x $STEPS
            same_run "$REF" "$out" $STEPS "resume np $1 z$2 -> np $3 z$4 ${*:6}" 5
        else
            full_run $tok; close_run "$W/full.$tok" "$out" "resume np $1 z$2 -> np $3 z$4 ${*:6} ($5 micro-batches)"
            grep -q "^resume: the step's gradient sum was $blocks_a blocks, now $(blocks_of "$out") (--grad_blocks)" "$out.log" &&
                pass || fail "resume np $1 z$2 -> np $3 z$4 ${*:6}: no note of the other gradient blocks"
        fi
    else fail "resume np $1 z$2 -> np $3 z$4 ${*:6}"; tail -3 "$out.log"; fi
done

# streamed state: LLMC_STAGING_ELEMS=300 cuts every segment into many chunks for the init, the
# checkpoint verify pass, loads and saves; the bytes are those of the default chunk, across reshards
for case in "4 1 2 3" "2 0 3 2"; do
    set -- $case
    tok=$((B * T * 12))
    for chunk in 300 default; do
        out=$W/chunked.$chunk.$1.$2.$3.$4
        staged() { if [ $chunk = 300 ]; then LLMC_STAGING_ELEMS=300 run "$@"; else run "$@"; fi; }
        staged $1 "$out" $DENSE -d $tok -x $STEPS -n 4 -z $2 && rm "$out/ckpt_$(printf %09d $STEPS).bin" &&
            staged $3 "$out" $DENSE -d $tok -x $STEPS -z $4 -y latest && grep -q "resumed from .*ckpt_000000004.bin" "$out.log" ||
            { fail "chunked ($chunk) resume np $1 z$2 -> np $3 z$4"; tail -3 "$out.log"; }
    done
    same_run "$W/chunked.default.$1.$2.$3.$4" "$W/chunked.300.$1.$2.$3.$4" $STEPS "chunked resume np $1 z$2 -> np $3 z$4 vs the default chunk"
    full_run $tok; close_run "$W/full.$tok" "$W/chunked.300.$1.$2.$3.$4" "chunked resume np $1 z$2 -> np $3 z$4 vs one process"
done
# a corrupt newest checkpoint: every rank refuses an explicit --resume of it (one message naming
# the file), and --resume latest on 3 ranks (each verifying a third) skips it and takes the previous
out=$W/corrupt; cp -r "$W/resume.2.0.2.0" "$out"
python3 -c "import sys; b=bytearray(open(sys.argv[1],'rb').read()); b[-9]^=16; open(sys.argv[1],'wb').write(b)" "$out/ckpt_000000008.bin"
TOK2=$((B * T * 2))  # resume.2.0.2.0's batch
run 2 "$out" $DENSE -d $TOK2 -x $STEPS -y "$out/ckpt_000000008.bin"; rc=$?
if [ $rc -ne 0 ] && grep -q "ckpt_000000008.bin: checksum mismatch" "$out.log"; then pass; else fail "corrupt checkpoint resumed: rc $rc"; tail -3 "$out.log"; fi
tok=$((B * T * 12)); run 3 "$out" $DENSE -d $tok -x $STEPS -y latest; rc=$?
if [ $rc -ne 0 ] && grep -q "skipping .*ckpt_000000008.bin: checksum mismatch" "$out.log" && grep -q "ckpt_000000004.bin: checkpoint was trained with --total_batch_tokens" "$out.log"; then pass
else fail "latest with a corrupt newest checkpoint: rc $rc"; tail -3 "$out.log"; fi
run 2 "$out" $DENSE -d $TOK2 -x $STEPS -z 3 -y latest && grep -q "resumed from .*ckpt_000000004.bin" "$out.log" &&
    { ref_for "$out" $DENSE -d $TOK2 -x $STEPS; same_run "$REF" "$out" $STEPS "resume past a corrupt checkpoint" 5; } || { fail "resume past a corrupt checkpoint"; tail -3 "$out.log"; }

# ---- 3. faults
# a rank dies while writing a checkpoint: the job fails, no checkpoint of that step loads, and
# --resume latest continues from the previous one
out=$W/kill_ckpt
LLMC_FAULT_KILL_IN_CHECKPOINT=1 run 2 "$out.2" $DENSE -d $TOK -x 6 -n 3; rc=$?
if [ $rc -ne 0 ] && [ ! -e "$out.2/ckpt_000000003.bin" ]; then pass; else fail "rank killed in checkpoint write: rc $rc, ckpt exists: $(ls "$out.2")"; fi
run 2 "$out.2" $DENSE -d $TOK -x 3 -y latest && grep -q "holds no checkpoint yet; starting from step 0" "$out.2.log" && pass ||
    fail "half-written checkpoint was loadable, or its .tmp blocked --resume latest: $(tail -2 "$out.2.log")"
# a rank is SIGKILLed mid-run: the job ends non-zero within 60 s, naming the rank
out=$W/kill_run
( timeout 120 $MPIRUN -np 2 "$BIN" $DENSE -d $TOK -x 100000 -v 0 -o "$out" >"$out.log" 2>&1; echo $? >"$out.rc" ) &
job=$!
for i in $(seq 1 100); do grep -q "^step     2" "$out.log" 2>/dev/null && break; sleep 0.2; done
victim=$(pgrep -f "$BIN.*$out" | sort -n | tail -1)
t_kill=$(date +%s); kill -9 "$victim"; wait $job; took=$(( $(date +%s) - t_kill ))
rc=$(cat "$out.rc")
if [ "$rc" -ne 0 ] && [ $took -le 60 ] && grep -qi "rank" "$out.log"; then pass; else fail "killed rank: rc $rc after $took s"; tail -5 "$out.log"; fi
echo "test_dist: killed rank -> job exit $rc after $took s"
# an error on one rank stops all of them, with the rank named
out=$W/fail_rank
LLMC_FAULT_FAIL_RANK=1 run 3 "$out" $DENSE -d $((B * T * 3)) -x 5; rc=$?
if [ $rc -ne 0 ] && grep -q "error (rank 1 of 3): fault injected on rank 1" "$out.log"; then pass; else fail "error on rank 1: rc $rc"; tail -5 "$out.log"; fi

# ---- 4. bad layouts: refused before allocating, one message
out=$W/bad1; run 2 "$out" $DENSE -d $((B * T * 3)) -x 2; rc=$?
n=$(grep -c "^error" "$out.log")
if [ $rc -ne 0 ] && [ "$n" = 1 ] && grep -q "is not a multiple of B\*T\*ranks = 2\*16\*2" "$out.log"; then pass; else fail "bad total batch: rc $rc, $n error lines"; cat "$out.log"; fi
out=$W/bad2; run 2 "$out" $DENSE -x 2 -z 4; rc=$?
if [ $rc -ne 0 ] && [ "$(grep -c '^error' "$out.log")" = 1 ] && grep -q "\-\-zero: 4 is out of range" "$out.log"; then pass; else fail "bad -z: rc $rc"; cat "$out.log"; fi
out=$W/bad3; run 2 "$out" $DENSE -d $((B * T * 4)) -x 2 -z 1 --grad_blocks 4; rc=$?
if [ $rc -ne 0 ] && [ "$(grep -c '^error' "$out.log")" = 1 ] && grep -q "\-\-grad_blocks 4: this layout (dp 2, --pp 1, -z 1) sums the step's gradient in 2 blocks" "$out.log"; then pass
else fail "bad --grad_blocks on 2 ranks: rc $rc"; cat "$out.log"; fi
out=$W/bad4; run 1 "$out" $DENSE -d $((B * T * 4)) -x 2 --grad_blocks 3; rc=$?
if [ $rc -ne 0 ] && grep -q "\-\-grad_blocks 3 must divide the step's 4 micro-batches" "$out.log"; then pass; else fail "bad --grad_blocks on one process: rc $rc"; cat "$out.log"; fi

# ---- 5. pipeline: every schedule, pp 2 and 4, dp x pp = 2 x 2, ZeRO inside the stages, dense and
# MoE (4 blocks: ALiBi, GQA, packed documents), 4 micro-batches per dp rank per step, vs one process
# with the same global batch and the layout's gradient blocks: bitwise (each stage folds its
# micro-batches in order; the tied embedding's head part joins it once per block)
t0=$(date +%s)
PPDENSE="$DENSE --n_layer 4"
PPMOE="$MOE --n_layer 4"
for model in dense moe; do
    [ $model = dense ] && ARGS=$PPDENSE || ARGS=$PPMOE
    # np pp schedule virtual zero recompute (-r: activation recomputation, the same gradients)
    for case in "2 2 gpipe 1 0 0" "2 2 1f1b 1 0 0" "2 2 interleaved 2 0 0" "2 2 zb1 1 0 0" "4 4 1f1b 1 0 0" \
                "4 4 zb1 1 2 0" "4 4 gpipe 1 1 0" "4 2 1f1b 1 1 0" "4 2 zb1 1 3 0" "4 2 interleaved 2 2 0" \
                "1 1 1f1b 1 0 1" "1 1 1f1b 1 0 2" "2 2 zb1 1 0 1" "2 2 1f1b 1 0 2" "4 2 zb1 1 3 2" "4 2 1f1b 1 0 0"; do
        set -- $case
        dp=$(($1 / $2)); out=$W/pp.$model.np$1.pp$2.$3.z$5.r$6
        if run $1 "$out" $ARGS -d $((B * T * dp * 4)) -x 6 --pp $2 --pp_schedule $3 --pp_virtual $4 -z $5 -r $6; then
            ref_for "$out" $ARGS -d $((B * T * dp * 4)) -x 6
            same_run "$REF" "$out" 6 "$model pp $2 x dp $dp $3 -z $5 -r $6 vs one process"
            [ $1 = 1 ] || comm_theory "$out" "$model pp $2 $3 -z $5"
        else
            fail "$model np $1 pp $2 $3 -z $5: rc $?"; tail -5 "$out.log"
        fi
    done
done
echo "test_dist: pipeline and recompute matrix (2 models x 16 layouts) done in $(( $(date +%s) - t0 )) s"
# reshard resumes across pipeline layouts: pp 2 -> 1 and 1 -> 4 (checkpoints are in the table's layout)
TOK4=$((B * T * 4))
run 1 "$W/pp.full" $PPDENSE -d $TOK4 -x $STEPS || fail "pp uninterrupted run"
for case in "2 2 1 1" "1 1 4 4"; do
    set -- $case  # np_a pp_a np_b pp_b
    out=$W/pp.resume.$1.$2.$3.$4
    run $1 "$out" $PPDENSE -d $TOK4 -x $STEPS -n 4 --pp $2 && rm "$out/ckpt_$(printf %09d $STEPS).bin" &&
        run $3 "$out" $PPDENSE -d $TOK4 -x $STEPS --pp $4 -y latest &&
        grep -q "resumed from .*ckpt_000000004.bin" "$out.log" && same_run "$W/pp.full" "$out" $STEPS "resume pp $2 -> pp $4" 5 ||
        { fail "resume pp $2 -> pp $4"; tail -3 "$out.log"; }
done
# the timeline of one step (--pp_trace): every stage's F and B of every micro-batch; in ZB-H1 with
# two stages, stage 1 runs its W's apart (stage 0 runs each W inside its B)
out=$W/pp.trace
if run 2 "$out" $PPDENSE -d $TOK4 -x 2 --pp 2 --pp_schedule zb1 --pp_trace "$out.jsonl"; then
    for want in "0 F 4" "0 B 4" "0 W 0" "1 F 4" "1 B 4" "1 W 4"; do
        set -- $want
        n=$(grep -c "\"stage\": $1, .*\"op\": \"$2\"" "$out.jsonl")
        [ "$n" = $3 ] && pass || fail "pp trace: stage $1 has $n $2 events, expected $3"
    done
    if python3 -c "import matplotlib" 2>/dev/null; then
        python3 scripts/plot_pipeline.py "$out.jsonl" "$out.png" >/dev/null && [ -s "$out.png" ] && pass || fail "plot_pipeline.py"
    fi
else fail "pp trace run: rc $?"; fi
# bad pipeline layouts: one clear message each
bad_pp() {  # bad_pp NP NEEDLE ARGS...
    local np=$1 needle=$2; shift 2
    out=$W/pp.bad; run $np "$out" $PPDENSE -x 1 "$@"; rc=$?
    if [ $rc -ne 0 ] && [ "$(grep -c '^error' "$out.log")" = 1 ] && grep -q -- "$needle" "$out.log"; then pass
    else fail "bad pipeline layout ($*): rc $rc"; cat "$out.log"; fi
}
bad_pp 2 "every stage needs at least one layer" --pp 2 --n_layer 1
bad_pp 3 "not a multiple of pp \* tp" --pp 2
bad_pp 2 "micro-batches per step (gradient accumulation steps)" --pp 2 -d $((B * T))
bad_pp 2 "equal chunks" --pp 2 --pp_schedule interleaved --pp_virtual 2 --n_layer 6 -d $TOK4
bad_pp 2 "pp_layers 1,2: the counts add up to 3" --pp 2 --pp_layers 1,2 -d $TOK4

# ---- 6. llm.c model files under any layout: an export gathers the whole model (rank 0 writes),
# an import gives every rank its part; both byte-identical to one process
GPT2="$COMMON --n_kv_head 3 --ffn_hidden 108 --mlp gelu --pos learned --max_seq_len 16"
run 2 "$W/llmc2" $GPT2 -d $TOK -x 3 -z 3 --export_llmc "$W/llmc2.bin" || fail "llm.c export, np 2 -z 3"
run 1 "$W/llmc1" $GPT2 -d $TOK -x 3 --grad_blocks "$(blocks_of "$W/llmc2")" --export_llmc "$W/llmc1.bin" || fail "llm.c export, one process"
cmp -s "$W/llmc1.bin" "$W/llmc2.bin" && pass || fail "llm.c export differs between one process and np 2 -z 3"
run 4 "$W/llmc3" $GPT2 -d $TOK -x 0 -z 1 --init_from "$W/llmc1.bin" --export_llmc "$W/llmc3.bin" || fail "llm.c import, np 4 -z 1"
cmp -s "$W/llmc1.bin" "$W/llmc3.bin" && pass || fail "llm.c import + export under np 4 -z 1 changed the file"
run 2 "$W/llmc4" $GPT2 -d $TOK -x 0 --pp 2 --init_from "$W/llmc1.bin" --export_llmc "$W/llmc4.bin" || fail "llm.c import, pp 2"
cmp -s "$W/llmc1.bin" "$W/llmc4.bin" && pass || fail "llm.c import + export under pp 2 changed the file"

# ---- 7. tensor parallel: --tp 2 and 4, with and without --sp, dp x tp, tp x pp, dp x tp x pp
# (np 8), dense and MoE, vs one process with the same global batch, all bitwise: every tp the model
# admits splits the canonical chunks of every summed dimension evenly (llmc/parallel/tensor_parallel.h), a kv
# head shared by ranks (--tp 4 with n_kv_head 2, --tp 6 with 3) runs its group's attention backward on
# each of them; tp 3 and 6 (chunks of 6, not a power of two) 8 steps. Communication = theory.
t0=$(date +%s)
TPA="$COMMON --n_layer 4 --n_embd 48 --n_head 6 --n_kv_head 2 --ffn_hidden 64"  # tp 2: 3 heads, 1 kv head per rank
TPMOE="$TPA --n_expert 3 --moe_every 2 --expert_hidden 32 --capacity_factor 1.5"
TPC="$COMMON --n_layer 2 --n_embd 64 --n_head 8 --n_kv_head 4 --ffn_hidden 96"   # tp 4: 2 heads, 1 kv head per rank
TPB="$COMMON --n_layer 2 --n_embd 64 --n_head 8 --n_kv_head 2 --ffn_hidden 96"   # tp 4: a kv head on 2 ranks
for model in dense moe; do
    [ $model = dense ] && ARGS=$TPA || ARGS=$TPMOE
    # np tp pp flags
    for case in "2 2 1 -z 0" "2 2 1 --sp" "4 2 1 -z 1 --sp" "4 2 2 --pp_schedule 1f1b" "4 2 2 --sp --pp_schedule zb1 -r 1" \
                "8 2 2 -z 3 --sp -r 2"; do
        set -- $case; np=$1 tp=$2 pp=$3; shift 3
        dp=$((np / tp / pp)); out=$W/tp.$model.np$np.tp$tp.pp$pp.$(echo "$*" | tr -d ' -')
        if run $np "$out" $ARGS -d $((B * T * dp * 2)) -x 4 --tp $tp --pp $pp "$@"; then
            ref_for "$out" $ARGS -d $((B * T * dp * 2)) -x 4
            same_run "$REF" "$out" 4 "$model tp $tp x pp $pp x dp $dp $* vs one process"
            comm_theory "$out" "$model tp $tp pp $pp $*"
        else fail "$model np $np tp $tp pp $pp $*: rc $?"; tail -5 "$out.log"; fi
    done
    # B 4: a block's forward in 4 parts of the micro-batch's sequences (B 2 above: 2), -r 2 too
    for flags in "" "-r 2"; do
        out=$W/tp.$model.b4$(echo "$flags" | tr -d ' -')
        if run 2 "$out" $ARGS -b 4 -d $((4 * T * 2)) -x 4 --tp 2 $flags; then
            ref_for "$out" $ARGS -b 4 -d $((4 * T * 2)) -x 4
            same_run "$REF" "$out" 4 "$model tp 2 -b 4 $flags vs one process"
            comm_theory "$out" "$model tp 2 -b 4 $flags"
        else fail "$model tp 2 -b 4 $flags: rc $?"; tail -5 "$out.log"; fi
    done
done
run 1 "$W/tp.c.ref" $TPC -d $TOK -x 4 || fail "tp reference (n_kv_head 4)"
for flags in "" "--sp -r 2"; do
    out=$W/tp.c.tp4$(echo "$flags" | tr -d ' -')
    run 4 "$out" $TPC -d $TOK -x 4 --tp 4 $flags && same_run "$W/tp.c.ref" "$out" 4 "tp 4 $flags vs one process" &&
        comm_theory "$out" "tp 4 $flags" || { fail "tp 4 $flags"; tail -3 "$out.log"; }
done
# a kv head shared by two ranks
run 1 "$W/tp.b.ref" $TPB -d $TOK -x 4 || fail "tp reference (n_kv_head 2)"
out=$W/tp.b.tp4
run 4 "$out" $TPB -d $TOK -x 4 --tp 4 --sp && same_run "$W/tp.b.ref" "$out" 4 "tp 4 shared kv heads vs one process" &&
    comm_theory "$out" "tp 4 shared kv heads" || { fail "tp 4 shared kv heads"; tail -3 "$out.log"; }
# tp 3 and 6 (6 heads, 3 kv heads, FFN 54: canonical chunks of 6; tp 6 shares each kv head), 8 steps
T6=12  # B*T6 = 24 tokens: --sp splits them over 3 and 6 ranks
TP6="$COMMON -t $T6 --n_embd 36 --n_head 6 --n_kv_head 3 --ffn_hidden 54 --mlp gelu --pos learned --max_seq_len 16"
for case in "3 3 1" "6 6 1 --sp" "6 3 1 -z 1 --sp" "6 3 2 -r 2"; do
    set -- $case; np=$1 tp=$2 pp=$3; shift 3
    dp=$((np / tp / pp)); out=$W/tp6.np$np.tp$tp.pp$pp.$(echo "$*" | tr -d ' -')
    if run $np "$out" $TP6 -d $((B * T6 * dp * 2)) -x 8 --tp $tp --pp $pp "$@"; then
        ref_for "$out" $TP6 -d $((B * T6 * dp * 2)) -x 8
        same_run "$REF" "$out" 8 "tp $tp x pp $pp x dp $dp $* (6 heads) vs one process"
        comm_theory "$out" "tp $tp pp $pp $* (6 heads)"
    else fail "6 heads: np $np tp $tp pp $pp $*: rc $?"; tail -5 "$out.log"; fi
done
# the lm head over token chunks of 13 (B*T = 32 tokens: not a divisor, nor aligned with --sp's rows):
# every layout cuts the same chunks and folds them in the same order: bitwise one process
for case in "2 1 1 -z 2" "4 2 1 -z 2 --sp" "4 1 2 -z 3 --pp_schedule zb1"; do
    set -- $case; np=$1 tp=$2 pp=$3; shift 3
    out=$W/chunk.np$np.tp$tp.pp$pp.$(echo "$*" | tr -d ' -')
    if run $np "$out" $TPA -d $((B * T * 2 * 2)) -x 4 --logits_chunk 13 --tp $tp --pp $pp "$@"; then
        ref_for "$out" $TPA -d $((B * T * 2 * 2)) -x 4 --logits_chunk 13
        same_run "$REF" "$out" 4 "lm-head chunks of 13: tp $tp x pp $pp x dp 2 $* vs one process"
        comm_theory "$out" "lm-head chunks of 13: tp $tp pp $pp $*"
    else fail "lm-head chunks of 13: np $np tp $tp pp $pp $*: rc $?"; tail -5 "$out.log"; fi
done
echo "test_dist: tensor-parallel matrix done in $(( $(date +%s) - t0 )) s"
# reshard resumes across tp: 2 -> 1 and 1 -> 4 continue bitwise the uninterrupted run
run 1 "$W/tp.full" $TPC -d $TOK -x 6 || fail "tp uninterrupted run"
for case in "2 2 1 1" "1 1 4 4"; do
    set -- $case  # np_a tp_a np_b tp_b
    out=$W/tp.resume.$1.$3
    run $1 "$out" $TPC -d $TOK -x 6 -n 3 --tp $2 && rm "$out/ckpt_$(printf %09d 6).bin" &&
        run $3 "$out" $TPC -d $TOK -x 6 --tp $4 -y latest &&
        grep -q "resumed from .*ckpt_000000003.bin" "$out.log" && same_run "$W/tp.full" "$out" 6 "resume tp $2 -> tp $4" 4 ||
        { fail "resume tp $2 -> tp $4"; tail -3 "$out.log"; }
done
# bad tensor-parallel layouts: one clear message each
bad_tp() {  # bad_tp NP NEEDLE ARGS...
    local np=$1 needle=$2; shift 2
    out=$W/tp.bad; run $np "$out" -x 1 "$@"; rc=$?
    if [ $rc -ne 0 ] && [ "$(grep -c '^error' "$out.log")" = 1 ] && grep -q -- "$needle" "$out.log"; then pass
    else fail "bad tensor-parallel layout ($*): rc $rc"; cat "$out.log"; fi
}
bad_tp 4 "tp 4 must divide --n_head 6" $TPA --tp 4
bad_tp 2 "tp 2 must divide the FFN width --ffn_hidden 53" $DENSE --n_head 2 --n_embd 28 --tp 2
bad_tp 2 "give --tp > 1" $TPA --sp
bad_tp 3 "not a multiple of pp \* tp" $TPA --tp 2
bad_tp 4 "kv heads (--n_kv_head 3) must split evenly" $COMMON --n_embd 48 --n_head 12 --n_kv_head 3 --ffn_hidden 64 --tp 4

# ---- 8. --offload optimizer (ZeRO-Offload): each rank's slice of the master weights and Adam
# moments in host memory, AdamW on the CPU (the CPU build runs the same copies between its two
# arenas): bitwise the runs above with the optimizer on the "device", np 2 -z 1 and -z 3 (dense,
# MoE) and pp 2; a resume that switches the offload on; the host arenas as planned
t0=$(date +%s)
for case in "dense 1" "dense 3" "moe 3"; do
    set -- $case; model=$1; z=$2
    [ $model = dense ] && ARGS=$DENSE || ARGS=$MOE
    out=$W/offload.$model.z$z
    if run 2 "$out" $ARGS -d $((B * T * 2 * 2)) -x $STEPS -z $z --offload optimizer; then
        same_run "$W/$model.np2.z$z" "$out" $STEPS "$model np 2 -z $z --offload optimizer vs without"
        grep -q "host arenas \([0-9.]*\) MiB (plan: \1 MiB)" "$out.log" && pass || fail "$model -z $z offload: host arenas differ from the plan: $(grep 'host arenas' "$out.log")"
    else
        fail "$model np 2 -z $z --offload optimizer: rc $?"; tail -5 "$out.log"
    fi
done
out=$W/offload.pp2
run 2 "$out" $PPDENSE -d $((B * T * 4)) -x 6 --pp 2 --offload optimizer && ref_for "$out" $PPDENSE -d $((B * T * 4)) -x 6 &&
    same_run "$REF" "$out" 6 "pp 2 --offload optimizer vs one process" ||
    { fail "pp 2 --offload optimizer: rc $?"; tail -5 "$out.log"; }
out=$W/offload.resume
run 2 "$out" $DENSE -d $TOK2 -x $STEPS -n 4 -z 1 && rm "$out/ckpt_$(printf %09d $STEPS).bin" &&
    run 2 "$out" $DENSE -d $TOK2 -x $STEPS -z 3 --offload optimizer -y latest &&
    grep -q "resumed from .*ckpt_000000004.bin" "$out.log" && ref_for "$out" $DENSE -d $TOK2 -x $STEPS &&
    same_run "$REF" "$out" $STEPS "resume np 2 -z 1 -> np 2 -z 3 --offload optimizer" 5 ||
    { fail "resume np 2 -z 1 -> -z 3 --offload optimizer"; tail -3 "$out.log"; }
echo "test_dist: offload (np 2 -z 1/3, MoE, pp 2, resume) done in $(( $(date +%s) - t0 )) s"

# ---- 9. tensor parallelism op by op (test/test_tp.cpp): in each process the tensor-parallel model and
# the unsplit one on the same random parameters: row_parallel_forward / column_parallel_dinp (with and
# without --sp's scatter), the vocab-parallel loss (padded vocabulary), each rank's qkv / atty columns,
# the gathered gradients. All bitwise: kv heads split (np 2, 3, 4) or shared (np 4 with 2 kv heads,
# np 6 with 3), canonical chunks of 6 (np 3, 6). One line per check in $W/test_tp.np*.log
TPBIN=$PWD/test/test_tp
if [ -x "$TPBIN" ]; then
    for np in 2 3 4 6; do
        log=$W/test_tp.np$np.log
        if timeout 120 $MPIRUN -np $np "$TPBIN" >"$log" 2>&1 && grep -q "^test_tp: np $np: [0-9]* checks, 0 failed" "$log"; then pass
        else fail "test_tp np $np: $(grep -m 5 '^FAIL\|error' "$log")"; tail -3 "$log"; fi
        grep "^test_tp: np" "$log"
    done
else fail "test/test_tp is not built (make test/test_tp)"; fi

# ---- 10. expert parallel: --ep 2 and 4 with dp 4, both routing groups, MoE every 1 and 2 blocks,
# -z 0, 1 and 3, with pp 2 and with tp, 8 steps at capacity factor 1.5, each bitwise one process
# with the layout's blocks: the experts' owner keeps one leaf gradient per source rank (-z 2/3: per
# micro-batch, -z 0/1: per step, a source's sum being that rank's block) and folds them in the dp
# ranks' order. The all-to-alls are sized at start-up: the host bytes (the only way a size could be
# asked for at run time) equal the run without --ep, and the measured bytes the theory.
t0=$(date +%s)
EPMOE="$COMMON --n_layer 4 --n_embd 32 --n_head 4 --n_kv_head 2 --ffn_hidden 64 --n_expert 4 --expert_hidden 32"
TOKEP=$((B * T * 4 * 2))
for grouping in batch position; do
    for every in 1 2; do
        ARGS="$EPMOE --moe_every $every --moe_group $grouping --capacity_factor 1.5"
        np4=$W/ep.np4.$grouping.$every
        run 4 "$np4" $ARGS -d $TOKEP -x 8 -z 1 || fail "ep 1 np 4 $grouping"
        for case in "4 2 -z 1" "4 2 -z 0" "4 4 -z 0" "4 4 -z 3" "4 2 -z 1 --pp 2" "4 2 -z 3 --pp 2" "8 2 -z 1 --tp 2 --sp"; do
            set -- $case; np=$1 ep=$2; shift 2
            [ $every = 1 ] && [ $np = 8 ] && continue  # keep the np 8 case to one model
            out=$W/ep.$grouping.$every.np$np.ep$ep.$(echo "$*" | tr -d ' -')
            if run $np "$out" $ARGS -d $TOKEP -x 8 --ep $ep "$@"; then
                ref_for "$out" $ARGS -d $TOKEP -x 8
                same_run "$REF" "$out" 8 "ep $ep $grouping every $every $* vs one process"
                comm_theory "$out" "ep $ep $grouping $*"
                if [ "$np $*" = "4 -z 1" ]; then  # the same layout without --ep: the same host bytes
                    h_ep=$(grep -o "host (scalars) [0-9]*" "$out.log"); h1=$(grep -o "host (scalars) [0-9]*" "$np4.log")
                    [ -n "$h_ep" ] && [ "$h_ep" = "$h1" ] && pass || fail "ep $ep: host bytes $h_ep vs $h1 without --ep"
                fi
            else fail "ep $ep $grouping every $every $*: rc $?"; tail -5 "$out.log"; fi
        done
    done
done
# reshard resumes across ep: 2 -> 1 and 1 -> 4 (np 4, dp 4; -z 2 folds every micro-batch in order)
ARGS="$EPMOE --moe_every 2 --capacity_factor 1.5"
run 4 "$W/ep.full" $ARGS -d $TOKEP -x 6 -z 2 || fail "ep uninterrupted run"
for case in "2 1" "1 4"; do
    set -- $case
    out=$W/ep.resume.$1.$2
    run 4 "$out" $ARGS -d $TOKEP -x 6 -n 3 -z 2 --ep $1 && rm "$out/ckpt_$(printf %09d 6).bin" &&
        run 4 "$out" $ARGS -d $TOKEP -x 6 -z 2 --ep $2 -y latest &&
        grep -q "resumed from .*ckpt_000000003.bin" "$out.log" && same_run "$W/ep.full" "$out" 6 "resume ep $1 -> ep $2" 4 ||
        { fail "resume ep $1 -> ep $2"; tail -3 "$out.log"; }
done
bad_tp 4 "ep 3 must divide the 4 data-parallel ranks" $ARGS --ep 3
bad_tp 2 "ep 2 must divide --n_expert 3" $MOE --ep 2
bad_tp 2 "the model has no experts" $DENSE --ep 2
echo "test_dist: expert-parallel matrix done in $(( $(date +%s) - t0 )) s"

# ---- 11. faults a cluster meets
t0=$(date +%s)
rank_pid() {  # rank_pid OUT RANK: the pid of that rank of the job writing to OUT
    local p
    for p in $(pgrep -f "^$BIN .*-o $1\$"); do
        tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" && { echo $p; return; }
    done
}
wait_step() {  # wait_step LOG N: until the log shows step N (at most 30 s)
    local i
    for i in $(seq 1 600); do grep -q "^step *$2/" "$1" 2>/dev/null && return 0; sleep 0.05; done
    return 1
}
# a stopped rank: the others' wait passes --comm_timeout 3, the job ends naming the rank, one message
for case in "dp 2" "pp 3"; do
    set -- $case; layout=$1 victim=$2
    out=$W/stall.$layout; extra=""; [ $layout = pp ] && extra="--pp 2"
    ( timeout 120 $MPIRUN -np 4 "$BIN" $DENSE --n_layer 4 -d $TOK -x 100000 -v 0 $extra --comm_timeout 3 -o "$out" >"$out.log" 2>&1; echo $? >"$out.rc" ) &
    job=$!
    wait_step "$out.log" 3; pid=$(rank_pid "$out" $victim)
    t_stop=$(date +%s); kill -STOP "$pid"; wait $job; took=$(( $(date +%s) - t_stop )); kill -CONT "$pid" 2>/dev/null
    rc=$(cat "$out.rc"); n=$(grep -c "comm timeout" "$out.log")
    if [ "$rc" -ne 0 ] && [ $took -le 13 ] && [ "$n" = 1 ] &&
        grep -q "comm timeout at step [0-9]*: .*\(rank $victim (not responding\|not responding within [0-9]* s: rank $victim (\)" "$out.log"; then pass
    else fail "stopped rank $victim ($layout): rc $rc after $took s, $n messages"; grep "error" "$out.log"; fi
    echo "test_dist: rank $victim stopped ($layout, --comm_timeout 3): job exit $rc after $took s: $(grep -o 'comm timeout.*' "$out.log")"
done
# a checkpoint write 5 s slow on one rank, --comm_timeout 2: its waits get 10x, the run completes
out=$W/slow_ckpt
LLMC_FAULT_CHECKPOINT_DELAY=1:5000 run 2 "$out" $DENSE -d $TOK -x 4 -n 2 --comm_timeout 2 && [ -e "$out/ckpt_000000004.bin" ] && pass ||
    { fail "a slow checkpoint write tripped --comm_timeout"; tail -3 "$out.log"; }

# SIGTERM / SIGINT at a random step: every rank stops after the same step N with a checkpoint of
# it; --resume latest continues to the bytes of the uninterrupted run of the same layout
# (300 steps: a step takes a few ms, so the signal lands well before the end even when the log
# shows step k late)
SIGTOK=$((B * T * 16)); SIGSTEPS=300
for np in 1 2 4; do run $np "$W/sig.ref.np$np" $DENSE -d $SIGTOK -x $SIGSTEPS || fail "signal reference run np $np"; done
for case in "1 TERM 0" "1 INT 0" "2 TERM 1" "4 INT all" "4 TERM 3"; do
    set -- $case; np=$1 sig=$2 who=$3
    out=$W/sig.np$np.$sig.$who; k=$((3 + RANDOM % 20))
    if [ $np = 1 ]; then ( "$BIN" $DENSE -d $SIGTOK -x $SIGSTEPS -o "$out" >"$out.log" 2>&1; echo $? >"$out.rc" ) &
    else ( timeout 120 $MPIRUN -np $np "$BIN" $DENSE -d $SIGTOK -x $SIGSTEPS -o "$out" >"$out.log" 2>&1; echo $? >"$out.rc" ) & fi
    job=$!
    wait_step "$out.log" $k
    if [ $np = 1 ]; then kill -$sig $(pgrep -f "^$BIN .*-o $out\$")
    elif [ $who = all ]; then for r in 3 1 0 2; do p=$(rank_pid "$out" $r); [ -n "$p" ] && kill -$sig $p; sleep 0.00$((RANDOM % 10)); done
    else kill -$sig $(rank_pid "$out" $who); fi
    wait $job; rc=$(cat "$out.rc")
    n=$(grep -o "stopped by signal at step [0-9]*; continue with --resume latest" "$out.log" | grep -o "[0-9]*" | head -1)
    if [ "$rc" = 75 ] && [ -n "$n" ] && [ "$n" -ge $k ] && [ "$n" -lt $SIGSTEPS ] && [ -e "$out/ckpt_$(printf %09d $n).bin" ]; then
        run $np "$out" $DENSE -d $SIGTOK -x $SIGSTEPS -y latest && grep -q "resumed from .*ckpt_$(printf %09d $n).bin" "$out.log" &&
            same_run "$W/sig.ref.np$np" "$out" $SIGSTEPS "SIG$sig at step $k (np $np, rank $who): stopped at $n, resumed" ||
            { fail "SIG$sig np $np: resume from step $n"; tail -3 "$out.log"; }
    else fail "SIG$sig at step $k (np $np, rank $who): rc $rc, stopped at '$n'"; tail -5 "$out.log"; fi
    echo "test_dist: SIG$sig after step $k (np $np, rank $who): stopped at step $n, rc $rc"
done
# a second signal exits at once (128 + its number), without waiting for the stop's checkpoint
# (made 5 s slow on rank 0: without the second signal the run would end after it, printing the stop)
for np in 1 2; do
    out=$W/sig2.np$np
    if [ $np = 1 ]; then ( LLMC_FAULT_CHECKPOINT_DELAY=0:5000 "$BIN" $DENSE -d $SIGTOK -x 100000 -v 0 -o "$out" >"$out.log" 2>&1; echo $? >"$out.rc" ) &
    else ( LLMC_FAULT_CHECKPOINT_DELAY=0:5000 timeout 120 $MPIRUN -np 2 "$BIN" $DENSE -d $SIGTOK -x 100000 -v 0 -o "$out" >"$out.log" 2>&1; echo $? >"$out.rc" ) & fi
    job=$!
    wait_step "$out.log" 3; pid=$( [ $np = 1 ] && pgrep -f "^$BIN .*-o $out\$" || rank_pid "$out" 1 )
    t_sig=$(date +%s%N); kill -INT $pid; sleep 0.3; kill -INT $pid; wait $job; ms=$(( ($(date +%s%N) - t_sig) / 1000000 )); rc=$(cat "$out.rc")
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 75 ] && [ $ms -lt 4000 ] && grep -q "second signal: exiting at once" "$out.log" &&
        ! grep -q "stopped by signal" "$out.log"; then pass
    else fail "second SIGINT (np $np): rc $rc after $ms ms"; tail -3 "$out.log"; fi
    [ $np = 1 ] && { [ "$rc" = 130 ] && pass || fail "second SIGINT: exit code $rc, expected 130"; }
done

# SIGKILL while the first checkpoint is written (a write made 300 ms slow on rank 0, the kill at
# a random moment after its .tmp appears): the same command, with --resume latest, completes with
# the uninterrupted run's bytes every time (from the checkpoint if it was published, else afresh:
# the .tmp removed, never taken for a checkpoint)
for np in 1 2; do run $np "$W/kill1.ref.np$np" $DENSE -d $TOK -x 6 || fail "kill trials reference np $np"; done
for trial in $(seq 1 10); do
    np=$(( trial % 2 + 1 )); out=$W/kill1.$trial
    if [ $np = 1 ]; then ( LLMC_FAULT_CHECKPOINT_DELAY=0:300 "$BIN" $DENSE -d $TOK -x 6 -n 3 -y latest -o "$out" >"$out.log" 2>&1 ) &
    else ( LLMC_FAULT_CHECKPOINT_DELAY=0:300 timeout 120 $MPIRUN -np 2 "$BIN" $DENSE -d $TOK -x 6 -n 3 -y latest -o "$out" >"$out.log" 2>&1 ) & fi
    job=$!
    for i in $(seq 1 600); do [ -e "$out/ckpt_000000003.bin.tmp" ] && break; sleep 0.01; done
    sleep 0.$(printf %03d $((RANDOM % 400)))
    state=$( [ -e "$out/ckpt_000000003.bin" ] && echo published || echo tmp )
    pid=$( [ $np = 1 ] && pgrep -f "^$BIN .*-o $out\$" || rank_pid "$out" $((RANDOM % 2)) )
    [ -n "$pid" ] && kill -9 $pid; wait $job 2>/dev/null
    if run $np "$out" $DENSE -d $TOK -x 6 -n 3 -y latest && same_run "$W/kill1.ref.np$np" "$out" 6 "SIGKILL in the first checkpoint (trial $trial, np $np, $state)" &&
        [ -z "$(ls "$out" | grep '\.tmp$')" ]; then :
    else fail "SIGKILL in the first checkpoint write, trial $trial (np $np, $state): the rerun failed"; tail -3 "$out.log"; fi
    echo "test_dist: SIGKILL in the first checkpoint write, trial $trial (np $np, killed at: $state): $(grep -o 'removed .*tmp\|resumed from [^ ]*\|holds no checkpoint yet' "$out.log" | tr '\n' ' ')"
done
# a fresh start (no --resume) after a kill that left only the .tmp: the .tmp goes, the run starts
out=$W/kill2
LLMC_FAULT_KILL_IN_CHECKPOINT=1 run 2 "$out" $DENSE -d $TOK -x 6 -n 3; [ -e "$out/ckpt_000000003.bin.tmp" ] && pass || fail "no .tmp left by the killed write"
run 2 "$out" $DENSE -d $TOK -x 6 -n 3 && grep -q "removed .*ckpt_000000003.bin.tmp" "$out.log" && same_run "$W/kill1.ref.np2" "$out" 6 "fresh start after a killed first checkpoint" ||
    { fail "fresh start after a killed first checkpoint"; tail -3 "$out.log"; }
# a write that fails (a file size limit set on the running ranks: the .tmp cannot be sized) leaves
# no .tmp, on one or two ranks. The limit is set once step 2 is logged (MPI's start-up needs larger
# files); the first checkpoint comes 150 steps later (~0.3 s at ~2 ms a step; the log stays under the limit).
for np in 1 2; do
    out=$W/efbig.np$np
    if [ $np = 1 ]; then ( "$BIN" $DENSE -d $SIGTOK -x 1000 -v 0 -n 150 -o "$out" >"$out.log" 2>&1; echo $? >"$out.rc" ) &
    else ( timeout 120 $MPIRUN -np 2 "$BIN" $DENSE -d $SIGTOK -x 1000 -v 0 -n 150 -o "$out" >"$out.log" 2>&1; echo $? >"$out.rc" ) & fi
    job=$!
    wait_step "$out.log" 2
    for p in $(pgrep -f "^$BIN .*-o $out\$"); do prlimit --pid $p --fsize=65536; done
    wait $job; rc=$(cat "$out.rc")
    if [ $rc -ne 0 ] && grep -q "ckpt_000000150.bin.tmp: cannot size the file (File too large)" "$out.log" && [ -z "$(ls "$out" | grep '\.tmp$')" ]; then pass
    else fail "failed checkpoint write (np $np): rc $rc, left: $(ls "$out")"; tail -3 "$out.log"; fi
done

# oversized checkpoint fields (valid checksum): refused by the field's name, enums by name
setfield() {  # setfield SRC DST FIELD VALUE: the header field set, the checksum recomputed
    python3 - "$@" <<'PY'
import struct, sys
M = (1 << 64) - 1
def mix(x):
    x = (x + 0x9E3779B97F4A7C15) & M
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
    return x ^ (x >> 31)
def hash_bytes(p):
    h = 0x243F6A8885A308D3
    for c in p: h = mix(h ^ c)
    return h
src, dst, field, value = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
b = bytearray(open(src, 'rb').read())
n = struct.unpack_from('<I', b, 12)[0]
hlen = 16 + 48 * n + 8
old = hash_bytes(b[:hlen])
found = False
for k in range(n):
    if bytes(b[16 + 48 * k:16 + 48 * k + 32]).rstrip(b'\0').decode() == field:
        struct.pack_into('<q', b, 16 + 48 * k + 40, value); found = True
assert found, field
s = struct.unpack_from('<Q', b, hlen)[0]
struct.pack_into('<Q', b, hlen, (s - old + hash_bytes(b[:hlen])) & M)
open(dst, 'wb').write(b)
PY
}
src=$W/kill1.ref.np1/ckpt_000000006.bin
# (np 2 for the config; the loader's position and the gradient blocks, range-checked before use: an
# epoch near 2^63 overflowed, on one process)
for case in "2 config.n_embd 4294967328 checkpoint field config.n_embd = 4294967328 is outside" \
            "2 config.vocab_size 2147483648 checkpoint field config.vocab_size = 2147483648 is outside" \
            "2 config.mlp 7 checkpoint field config.mlp = 7 is not one of swiglu (0), gelu (1)" \
            "1 loader.epoch 9223372036854775807 checkpoint field loader.epoch = 9223372036854775807 is outside" \
            "1 train.grad_blocks -5 checkpoint field train.grad_blocks = -5 is outside"; do
    set -- $case; np=$1 field=$2 value=$3; shift 3
    setfield "$src" "$W/bad_field.bin" $field $value
    out=$W/bad_field; run $np "$out" $DENSE -d $TOK -x 8 -y "$W/bad_field.bin"; rc=$?
    if [ $rc -ne 0 ] && grep -qF "$*" "$out.log"; then pass; else fail "$field $value: rc $rc"; tail -3 "$out.log"; fi
done
setfield "$src" "$W/gelu.bin" config.mlp 1
out=$W/bad_field; run 1 "$out" $DENSE -d $TOK -x 8 --mlp swiglu -y "$W/gelu.bin"; rc=$?
[ $rc -ne 0 ] && grep -qF "checkpoint has mlp = gelu but the flags ask for swiglu" "$out.log" && pass || { fail "enum named in a mismatch: rc $rc"; tail -2 "$out.log"; }
# a resume with another --lr, --schedule, --logits_chunk and train set says so, once
out=$W/changes; cp -r "$W/kill1.ref.np1" "$out"
run 2 "$out" ${DENSE/-l 3e-3/-l 1e-3} -i "$W/data/data_val_*.bin" -d $TOK -x 8 --schedule linear --logits_chunk 8 -y latest
grep -qx "resume: --lr was 0.003, now 0.001" "$out.log" && grep -q "^resume: --train was data [0-9a-f]*, now data" "$out.log" &&
    grep -qx "resume: --max_steps was 6, now 8" "$out.log" &&
    grep -q "^resume: --schedule was cosine, now linear (the learning rate follows the new schedule" "$out.log" &&
    grep -q "^resume: --logits_chunk was 32, now 8 tokens" "$out.log" && [ "$(grep -c '^resume: --' "$out.log")" = 5 ] &&
    pass || { fail "a resume's changes not printed (once each)"; grep "^resume" "$out.log"; }
# a rank stalled before MPI_Init completes: every rank's start-up watchdog ends the job at 10 x --comm_timeout
out=$W/startup.stall
t_start=$(date +%s)
LLMC_FAULT_STARTUP_STALL=1 timeout 60 $MPIRUN -np 2 "$BIN" $DENSE -x 2 --comm_timeout 1 -o "$out" >"$out.log" 2>&1; rc=$?
took=$(( $(date +%s) - t_start ))
[ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $took -lt 30 ] &&
    grep -q "^error (rank 0): the start-up (MPI_Init, the communicators, NCCL's id exchange) did not finish within 10 s" "$out.log" &&
    pass || { fail "a rank stalled in MPI_Init: rc $rc after $took s"; tail -5 "$out.log"; }
# the out_dir lock holds when .lock is deleted (the directory itself is locked)
out=$W/lockdel
( "$BIN" $DENSE -d $TOK -x 100000 -v 0 -o "$out" >"$out.log" 2>&1 ) &
job=$!
wait_step "$out.log" 2 && rm -f "$out/.lock"
"$BIN" $DENSE -x 2 -y latest -o "$out" >"$out.second.log" 2>&1; rc=$?
kill $job 2>/dev/null; wait $job 2>/dev/null
[ $rc -ne 0 ] && grep -q "is in use by another trainer (pid [0-9?]* holds a lock on the directory)" "$out.second.log" &&
    pass || { fail "a deleted .lock let a second trainer in: rc $rc"; tail -2 "$out.second.log"; }
# flags that mean something only with --plan are refused without it
for flag in "--device h200" "--plan_ranks 4"; do
    out=$W/planonly; run 1 "$out" $DENSE -x 2 $flag; rc=$?
    [ $rc -ne 0 ] && grep -q "^error: ${flag% *} ${flag#* }: means something only with --plan or --max_fit" "$out.log" && pass ||
        { fail "$flag without --plan: rc $rc"; tail -2 "$out.log"; }
done
echo "test_dist: faults (stopped ranks, signals, killed checkpoint writes, bad fields) done in $(( $(date +%s) - t0 )) s"

# ---- 12. the simulated link (--sim_link): its timing under test/test_comm (np 2, 3: model times and
# counters); runs with a slow link give the same bits as the same layout without it (only waits
# move: -z 0-3 with gathers and reductions in flight, -z 1/2's parameter gathers into the next
# forward, the pipeline's sends in flight); where the transfers complete (and -z 3's kept slots
# spare); bad values refused by name
t0=$(date +%s)
COMMBIN=$PWD/test/test_comm
if [ -x "$COMMBIN" ]; then
    for np in 2 3; do
        log=$W/test_comm.np$np.log
        if timeout 120 $MPIRUN -np $np "$COMMBIN" >"$log" 2>&1 && grep -q "^test_comm: np $np: [0-9]* checks, 0 failed" "$log"; then pass
        else fail "test_comm np $np: $(grep -m 5 '^FAIL\|error' "$log")"; tail -3 "$log"; fi
    done
else fail "test/test_comm is not built (make test/test_comm)"; fi
tokens=$((B * T * 2 * 2))
for layout in "2 -z 0" "2 -z 1" "2 -z 2" "2 -z 3" "2 -z 1 --ckpt_every 3" "2 --pp 2 --pp_schedule 1f1b" \
              "2 --pp 2 --pp_schedule zb1 -z 3" "4 --pp 2 -z 1" "4 --pp 2 -z 3"; do
    set -- $layout; np=$1; shift
    out=$W/link.np$np$(echo "$@" | tr -d ' -')
    if run $np "$out.off" $DENSE -d $tokens -x $STEPS "$@" && run $np "$out" $DENSE -d $tokens -x $STEPS "$@" --sim_link 0.05,20; then
        same_run "$out.off" "$out" $STEPS "np $np $* with --sim_link vs without"
    else fail "np $np $* --sim_link: rc $?"; tail -3 "$out.log"; fi
done
# where the transfers complete (the traced last step; the order of events, not their durations):
# -z 1's parameter all-gathers start after the previous step's update, -z 0's of the gradients
# after the previous step's reductions (so no gather runs in the backward), and each completes in the
# forward (-z 0: the segment's update follows it there); 1f1b's last stage completes a gradient send
# only after the next micro-batch's forward has run (the spare d_stream), never right before it
# gather_trace TRACE ASSERTIONS: the python ASSERTIONS for each rank r of a traced np 2 step, given
# mine (its events), b0 (its first backward's start), gathers (its all-gathers on the link), early
# (those started before the step) and waits (its waits for all-gathers)
gather_trace() {
    python3 - "$1" "$2" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
for r in (0, 1):
    mine = [e for e in ev if e["rank"] == r]
    b0 = min(e["t0_ms"] for e in mine if e["op"] == "B")
    gathers = [e for e in mine if e["op"] == "link" and e["comm"] == "all_gather"]
    early = [e for e in gathers if e["t0_ms"] < 0]
    waits = [e for e in mine if e["op"] == "wait" and e["comm"] == "all_gather"]
    exec(sys.argv[2])
PY
}
for z in 0 1; do
    out=$W/link.trace.z$z
    if run 2 "$out" $DENSE -d $((B * T * 2)) -x 3 -z $z --sim_link 0.05,20 --pp_trace "$out.jsonl"; then
        gather_trace "$out.jsonl" '
assert len(early) >= 4 and len(gathers) == len(early) and len(waits) == len(early), (r, gathers, waits)
assert all(w["t1_ms"] <= b0 for w in waits), (r, early, waits)' &&
            pass || fail "-z $z: the all-gathers do not run from the last step into the forward"
    else fail "-z $z trace run: rc $?"; fi
done
# -z 3 (2 blocks, 2 micro-batches per rank: F B F B; a block is two segments, its attention and FFN
# halves): the next forward's first segments (embedding, blocks 0 and 1: 5 gathers) are gathered
# after the previous step's update and complete in the first forward; in the step only 7 gathers:
# the final LN in each forward (the tied head reads the embedding's slot), block 0's two halves in
# each backward (each starts with the forward's last block, kept), the embedding in the first
# backward for the second forward (which starts with blocks 0 and 1, kept from that backward);
# before the kept slots, 14 at one segment per block (every segment per forward, the embedding
# twice, every block per backward)
out=$W/link.trace.z3
if run 2 "$out" $DENSE -d $((B * T * 4)) -x 3 -z 3 --sim_link 0.05,20 --pp_trace "$out.jsonl"; then
    gather_trace "$out.jsonl" '
early_waits = [w for w in waits if w["t0_ms"] < b0][:len(early)]
assert len(early) == 5 and len(gathers) - len(early) == 7, (r, gathers)
assert all(w["t1_ms"] <= b0 for w in early_waits), (r, early_waits)' &&
        pass || fail "-z 3: the parameter gathers are not those of the kept slots and the update"
else fail "-z 3 trace run: rc $?"; fi
out=$W/link.trace.pp
if run 2 "$out" $DENSE -d $((B * T * 6)) -x 2 --pp 2 --pp_schedule 1f1b --sim_link 0.05,20 --pp_trace "$out.jsonl"; then
    python3 - "$out.jsonl" <<'PY' && pass || fail "1f1b: the last stage waits for its gradient send before the next forward"
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1]) if '"stage": 1' in l]
f_end = {e["mb"]: e["t1_ms"] for e in ev if e["op"] == "F"}
sends = [e for e in ev if e["op"] == "send"]
assert len(sends) == 6 and all(e["t0_ms"] >= f_end[e["mb"] + 1] for e in sends if e["mb"] + 1 in f_end), sends
PY
else fail "1f1b trace run: rc $?"; fi
for bad in "0" "abc" "1,-3" "1e-6" "1e-300"; do
    out=$W/link.bad; run 2 "$out" $DENSE -x 2 --sim_link "$bad"; rc=$?
    if [ $rc -ne 0 ] && [ "$(grep -c '^error' "$out.log")" = 1 ] && grep -q "\-\-sim_link" "$out.log"; then pass
    else fail "--sim_link $bad: rc $rc"; cat "$out.log"; fi
done
echo "test_dist: simulated link (test_comm, same bits, bad values) done in $(( $(date +%s) - t0 )) s"

# ---- 13. loss scaling
t0=$(date +%s)
# the arrays of two checkpoints (params, Adam moments) byte-identical: everything after the header
# (16 bytes, 48 per field, n_params) and the checksum; the headers may differ in their fields
same_arrays() {
    python3 - "$1" "$2" <<'PY'
import struct, sys
def arrays(path):
    b = open(path, "rb").read()
    n_fields = struct.unpack_from("<I", b, 12)[0]
    return b[16 + 48 * n_fields + 8 + 8:]
sys.exit(0 if arrays(sys.argv[1]) == arrays(sys.argv[2]) else 1)
PY
}
scales() { grep -o '"step":[0-9]*,.*"loss_scale":[0-9.e+]*' "$1/log.jsonl" | sed -E 's/"step":([0-9]*),.*"loss_scale":/\1:/'; }
LS="$DENSE -d $((B * T * 4)) -x $STEPS --loss_scale dynamic --loss_scale_window 3"
out=$W/scale.off; run 1 "$out" $DENSE -d $((B * T * 4)) -x $STEPS || fail "loss scale off: rc $?"
out=$W/scale.dyn; run 1 "$out" $DENSE -d $((B * T * 4)) -x $STEPS --loss_scale dynamic --loss_scale_window 2 || fail "dynamic: rc $?"
if same_arrays "$W/scale.off/ckpt_$(printf %09d $STEPS).bin" "$out/ckpt_$(printf %09d $STEPS).bin" &&
    [ "$(losses "$W/scale.off")" = "$(losses "$out")" ]; then pass
else fail "a dynamic power-of-two loss scale changed the bits of an fp32 run"; fi
[ "$(scales "$out" | tr '\n' ' ')" = "1:65536 2:65536 3:131072 4:131072 5:262144 6:262144 7:524288 8:524288 " ] && pass ||
    fail "loss scale window 2: the scale did not double every 2 steps: $(scales "$out" | tr '\n' ' ')"
# the one-process reference with the inf at step 5: 3 finite steps double 65536 at step 4, step 5 overflows
# (skipped, 65536 again), steps 6-8 finite (the scale doubles after step 8: the final checkpoint's)
ref=$W/scale.ref
LLMC_FAULT_INF_GRAD=0:5 run 1 "$ref" $LS -n 3 || fail "loss scale reference: rc $?"
[ "$(scales "$ref" | tr '\n' ' ')" = "1:65536 2:65536 3:65536 4:131072 5:131072 6:65536 7:65536 8:65536 " ] &&
    grep -q '"step":5,.*"skipped":1,"overflow":1' "$ref/log.jsonl" && ! grep -q '"bad_steps"' "$ref/log.jsonl" &&
    grep -q "^step     5/8 .*OVERFLOW" "$ref.log" && pass || fail "the injected overflow: scales $(scales "$ref" | tr '\n' ' ')"
for case in "2 1 -z 0" "2 1 -z 1" "2 0 -z 2" "2 1 -z 3" "2 0 --pp 2" "2 1 --pp 2 -z 1" "4 3 --pp 2 -z 1" "4 2 -z 3"; do
    set -- $case  # np, the rank with the inf, the layout's flags
    out=$W/scale.np$1.r$2$(echo "${*:3}" | tr -d ' -')
    if LLMC_FAULT_INF_GRAD=$2:5 run $1 "$out" $LS -n 3 "${@:3}"; then
        G=$(blocks_of "$out")
        gref=$W/scale.ref.G$G
        [ -d "$gref" ] || LLMC_FAULT_INF_GRAD=0:5 run 1 "$gref" $LS -n 3 --grad_blocks "$G" || fail "reference G $G: rc $?"
        same_run "$gref" "$out" $STEPS "loss scale, inf on rank $2 of np $1 ${*:3} vs one process"
        [ "$(scales "$gref")" = "$(scales "$out")" ] && grep -q '"step":5,.*"overflow":1' "$out/log.jsonl" && pass ||
            fail "loss scale np $1 ${*:3}: the scales differ from one process's"
    else fail "loss scale np $1 ${*:3}: rc $?"; tail -3 "$out.log"; fi
done
# resume after the overflow (checkpoint 6: one finite step counted) continues to the same final bytes
for case in "1 $ref" "2 $W/scale.np2.r1z1 -z 1"; do
    set -- $case
    out=$W/scale.resume.$1
    cp -r "$2" "$out" && rm "$out/ckpt_$(printf %09d $STEPS).bin" && run $1 "$out" $LS "${@:3}" -y latest &&
        grep -q "resumed from .*ckpt_000000006.bin" "$out.log" &&
        cmp -s "$2/ckpt_$(printf %09d $STEPS).bin" "$out/ckpt_$(printf %09d $STEPS).bin" && pass ||
        fail "loss scale: a resume at step 6 (np $1 ${*:3}) did not continue the scaler bitwise"
done
# a resume that changes --loss_scale says so
out=$W/scale.change
cp -r "$ref" "$out" && rm "$out/ckpt_$(printf %09d $STEPS).bin" && run 1 "$out" $DENSE -d $((B * T * 4)) -x $STEPS -y latest &&
    grep -qx "resume: --loss_scale was dynamic at 65536, now 1" "$out.log" && pass ||
    fail "a resume that turns loss scaling off gave no note"
# a fixed scale cannot absorb an overflow: a bad step, counted
out=$W/scale.fixed
LLMC_FAULT_INF_GRAD=0:3 run 1 "$out" $DENSE -d $((B * T * 4)) -x 4 --loss_scale 1024 &&
    grep -q '"step":3,.*"skipped":1,"bad_steps":1' "$out/log.jsonl" && grep -q "^step     3/4 .*SKIPPED" "$out.log" && pass ||
    fail "a fixed loss scale's overflow is not a counted bad step"
for bad in "--loss_scale dynamc" "--loss_scale 0" "--loss_scale -2" "--loss_scale_window 0"; do
    out=$W/scale.bad; run 1 "$out" $DENSE -x 2 $bad; rc=$?
    if [ $rc -ne 0 ] && [ "$(grep -c '^error' "$out.log")" = 1 ] && grep -q "\-\-loss_scale" "$out.log"; then pass
    else fail "$bad: rc $rc"; cat "$out.log"; fi
done
echo "test_dist: loss scaling (bits, an overflow on one rank in 8 layouts, resume, bad values) done in $(( $(date +%s) - t0 )) s"

# ---- 14. a shard changed under a running trainer (LLMC_FAULT_SHARD: dp rank 0 truncates, rewrites
# at the same size or removes the shard being read, or the next one, at the start of step k): the run
# ends with an error naming the shard (rc < 128: not a signal), its last checkpoint the uninterrupted
# run's bytes, and once the shard is restored --resume latest continues to the uninterrupted run's bytes
t0=$(date +%s)
SH=$W/shards; mkdir -p "$SH" "$W/shards.orig"
python3 - "$W/data/data_train_000.bin" "$W/shards.orig" <<'PY'
import struct, sys
b = open(sys.argv[1], "rb").read()
for k in range(3):  # 3 shards of 257 tokens (8 micro-batches of 2 x 16): the header with num_tokens 257
    open(f"{sys.argv[2]}/s_{k:03d}.bin", "wb").write(b[:16] + struct.pack("<Q", 257) + b[24:64] + b[64 + 514 * k:64 + 514 * (k + 1)])
PY
cp "$W"/shards.orig/* "$SH"/
shard_run() {  # shard_run NP OUT ARGS...: 10 steps of one micro-batch per rank on $SH, a checkpoint every 2
    local np=$1 out=$2; shift 2
    run $np "$out" $DENSE -i "$SH/s_*.bin" -d $((B * T * np)) -x 10 -n 2 "$@"
}
for np in 1 2; do shard_run $np "$W/shard.ref.np$np" || fail "shard reference run np $np"; done
# np, action, step, shard, the last checkpoint (np 1 reads shard 1 from step 9, np 2 from step 5)
for case in "1 truncate 5 s_000 4" "1 rewrite 3 s_001 8" "1 remove 5 s_000 4" \
            "2 truncate 2 s_001 4" "2 rewrite 3 s_000 2" "2 remove 2 s_001 4"; do
    set -- $case; np=$1 shard=$SH/$4.bin ckpt=ckpt_$(printf %09d $5).bin
    out=$W/shard.np$np.$2.$4
    LLMC_FAULT_SHARD=$2:$3:$shard shard_run $np "$out"; rc=$?
    if [ $rc -gt 0 ] && [ $rc -lt 128 ] && grep -q "^error.*: $shard: " "$out.log" && [ "$(ls "$out" | grep '^ckpt' | tail -1)" = $ckpt ] &&
        cmp -s "$W/shard.ref.np$np/$ckpt" "$out/$ckpt"; then pass
    else fail "shard $2 at step $3 (np $np, $4): rc $rc, checkpoints $(ls "$out" | grep '^ckpt' | tr '\n' ' ')"; tail -3 "$out.log"; fi
    echo "test_dist: shard $2 at step $3 (np $np, $4): rc $rc: $(grep -o "$shard: .*" "$out.log" | head -1)"
    cp "$W"/shards.orig/* "$SH"/
    shard_run $np "$out" -y latest && grep -q "resumed from .*$ckpt" "$out.log" &&
        same_run "$W/shard.ref.np$np" "$out" 10 "shard $2 (np $np, $4): restored, resumed from $ckpt" ||
        { fail "shard $2 (np $np, $4): the resume after the restore"; tail -3 "$out.log"; }
done
echo "test_dist: shards changed under the trainer (truncate, rewrite, remove; np 1, 2) done in $(( $(date +%s) - t0 )) s"

# ---- 15. log.jsonl changed under a running trainer (LLMC_FAULT_LOG=<action>:3: the logger itself, just
# before its record of step 3, copies the log to log.jsonl.1 and truncates it in place (logrotate's
# copytruncate), renames it to log.jsonl.1 and creates an empty one (logrotate's default), or deletes
# it): the run completes (rc 0) with one warning naming the change; every line of log.jsonl (and
# log.jsonl.1) parses as JSON; the two files hold the uninterrupted run's records, and after a delete
# the new log holds those from step 3 on
t0=$(date +%s)
jsonl_ok() {  # jsonl_ok FILE...: each file non-empty, every line a JSON object, the last one ended
    python3 - "$@" <<'PY'
import json, sys
for f in sys.argv[1:]:
    try: b = open(f, "rb").read()
    except OSError as e: sys.exit(f"{f}: {e.strerror}")
    if not b.endswith(b"\n"): sys.exit(f"{f}: empty or no final newline")
    for i, l in enumerate(b.decode("utf-8").split("\n")[:-1]):
        try: assert isinstance(json.loads(l), dict)
        except Exception: sys.exit(f"{f} line {i + 1} is not a JSON object: {l[:80]!r}")
PY
}
ref=$W/logfault.ref
run 1 "$ref" $DENSE -x 6 || fail "log fault reference run: rc $?"
for action in copytruncate create remove; do
    out=$W/logfault.$action
    LLMC_FAULT_LOG=$action:3 run 1 "$out" $DENSE -x 6; rc=$?
    case $action in copytruncate) said="was truncated during the run";; create) said="was replaced during the run";;
                    remove) said="was deleted during the run";; esac
    files="$out/log.jsonl"; [ $action = remove ] || files="$out/log.jsonl.1 $files"
    if [ $action = remove ]; then want=$(losses "$ref" | sed -n '/^"step":3,/,$p'); else want=$(losses "$ref"); fi
    mkdir -p "$out.cat" && cat $files > "$out.cat/log.jsonl" 2>/dev/null
    json=$(jsonl_ok $files 2>&1) && json=ok
    if [ $rc = 0 ] && [ "$(grep -c "^warning: $out/log.jsonl $said" "$out.log")" = 1 ] && [ "$(grep -c '^warning' "$out.log")" = 1 ] &&
        [ "$json" = ok ] && [ "$(losses "$out.cat")" = "$want" ] && [ -n "$want" ]; then pass
    else fail "log.jsonl $action at step 3: rc $rc, JSON: $json"; grep -i "warning\|fault\|error" "$out.log"; fi
    echo "test_dist: log.jsonl $action at step 3: $(grep "^warning: .*log.jsonl" "$out.log")"
done
echo "test_dist: log.jsonl truncated, rotated and deleted under the trainer done in $(( $(date +%s) - t0 )) s"

# ---- 16. multiple choice and --eval_only (scripts/prepare_mc.py --format continuation, --eval_mc): a
# model that has learned 24 documents picks their own continuations (acc well above the 0.25 of
# chance; about chance after one step), and a checkpoint's evaluation gives the same val loss, bits
# per byte and accuracies in one process, dp 2, pp 2, tp 2 and dp 2 -z 3
t0=$(date +%s)
MC=$W/mc; mkdir -p "$MC"
python3 - "$MC" <<'PY'
import json, random, sys
r = random.Random(3)
words = "the quick brown fox jumps over lazy dog river mountain song light rain city road book".split()
docs = [" ".join(r.choice(words) for _ in range(14)) for _ in range(24)]
open(sys.argv[1] + "/docs.txt", "w").write("\n\n".join(docs) + "\n")
with open(sys.argv[1] + "/docs.jsonl", "w") as f:
    for d in docs: f.write(json.dumps({"text": d}) + "\n")
PY
python3 dev/data/prepare_text.py "$MC/docs.txt" --sep blank --out_dir "$MC/data" --val_frac 0.2 >/dev/null &&
    python3 scripts/prepare_mc.py "$MC/docs.jsonl" "$MC/mc.bin" --context_chars 30 --ending_chars 16 >/dev/null ||
    fail "prepare_mc.py --format continuation"
MCRUN="-i $MC/data/*_train_*.bin -j $MC/data/*_val_*.bin --n_layer 2 --n_embd 32 --n_head 4 -l 1e-2 -g 0 --eval_mc $MC/mc.bin"
mc_acc() { grep -o "mc acc [0-9.]*" "$1" | tail -1 | cut -d' ' -f3; }
run 1 "$MC/first" $MCRUN -b 4 -t 32 -m 1 -x 1 -n 0 && run 1 "$MC/trained" $MCRUN -b 4 -t 32 -m 1 -x 120 -v 120 ||
    fail "multiple-choice training runs"
first=$(mc_acc "$MC/first.log"); trained=$(mc_acc "$MC/trained.log")
if python3 -c "import sys; a, b = map(float, sys.argv[1:]); sys.exit(not (a <= 0.5 and b >= 0.7))" "$first" "$trained"; then pass
else fail "multiple choice: acc after 1 step $first (expected about 0.25), after 120 steps $trained (expected >= 0.7)"; fi
grep -q '"mc_acc":' "$MC/trained/log.jsonl" && grep -q '"mc_acc_norm":' "$MC/trained/log.jsonl" || fail "mc_acc not in log.jsonl"
echo "test_dist: multiple choice: acc $first after 1 step, $trained after 120 steps (24 items, chance 0.25)"
ck=$MC/trained/ckpt_000000120.bin
for layout in "1" "2" "2 --pp 2" "2 --tp 2" "2 -z 3"; do
    name=eval.$(echo $layout | tr ' ' _); set -- $layout; np=$1; shift
    run $np "$MC/$name" --eval_only -y "$ck" -i "$MC/data/*_train_*.bin" -j "$MC/data/*_val_*.bin" -m 2 \
        --eval_mc "$MC/mc.bin" "$@" || fail "--eval_only np $layout"
    grep "^eval of step 120" "$MC/$name.log" > "$MC/$name.line"
    [ "$np" = 1 ] || { [ -s "$MC/eval.1.line" ] && cmp -s "$MC/eval.1.line" "$MC/$name.line" && pass ||
        fail "--eval_only np $layout: '$(cat "$MC/$name.line")' vs one process '$(cat "$MC/eval.1.line")'"; }
done
grep -qE "^eval of step 120 \| val loss [0-9.]+ \| [0-9.]+ bits per byte \| mc acc [0-9.]+ acc_norm [0-9.]+ \(24 items\)$" \
    "$MC/eval.1.line" && [ ! -e "$MC/eval.1/log.jsonl" ] && pass || fail "--eval_only's line: $(cat "$MC/eval.1.line")"
echo "test_dist: eval: $(cat "$MC/eval.1.line")"
run 1 "$MC/noeval" --eval_only -i "$MC/data/*_train_*.bin" --n_layer 2 --n_embd 32 --n_head 4
grep -q "eval_only: give the model to evaluate with --resume" "$MC/noeval.log" && pass || fail "--eval_only without a model"
printf 'LLMCMCQA\1\0\0\0' > "$MC/bad.bin"; head -c 60 /dev/zero >> "$MC/bad.bin"
run 1 "$MC/badmc" --eval_only -y "$ck" -i "$MC/data/*_train_*.bin" -j "$MC/data/*_val_*.bin" -m 1 --eval_mc "$MC/bad.bin"
grep -q "eval_mc $MC/bad.bin: holds no items" "$MC/badmc.log" && pass || { fail "a bad --eval_mc file"; tail -2 "$MC/badmc.log"; }
echo "test_dist: multiple choice and --eval_only done in $(( $(date +%s) - t0 )) s"

# ---- 17. the open models' shape (Llama, Qwen2) in every layout
t0=$(date +%s)
OPEN="$COMMON -x $STEPS -d $((B * T * 4)) --n_embd 32 --n_head 4 --ffn_hidden 48"  # (head size 8: rope pairs; tp 2 splits 4 heads)
LLAMA="$OPEN --n_kv_head 1 --pos rope --rope_theta 500000 --rope_scaling llama3 --rope_original_max_pos 8 --norm rmsnorm --bias none --tie_embeddings 0"
QWEN="$OPEN --n_kv_head 2 --pos rope --rope_theta 1000000 --norm rmsnorm --norm_eps 1e-6 --bias qkv"
for shape in llama qwen; do
    [ $shape = llama ] && ARGS=$LLAMA || ARGS=$QWEN
    run 1 "$W/$shape.np1" $ARGS || fail "$shape one process: rc $?"
    for layout in "2 -z 0" "2 -z 1" "2 -z 2" "2 -z 3" "2 --tp 2" "2 --tp 2 --sp" "2 --pp 2" "2 --pp 2 --pp_schedule zb1 -r 1" \
                  "4 --pp 2 -z 1" "4 --tp 2 -z 3"; do
        set -- $layout; np=$1; shift
        out=$W/$shape.$(echo $layout | tr ' ' _)
        if run $np "$out" $ARGS "$@"; then
            ref_for "$out" $ARGS
            same_run "$REF" "$out" $STEPS "$shape np $layout vs one process"
            comm_theory "$out" "$shape np $layout"
        else fail "$shape np $layout: rc $?"; tail -3 "$out.log"; fi
    done
    # resumes: the same layout, and tp 2 -> pp 2 (checkpoints are in the table's layout)
    run 2 "$W/$shape.part" $ARGS --tp 2 -n 4 && run 2 "$W/$shape.resumed" $ARGS --tp 2 -y "$W/$shape.part/ckpt_000000004.bin" &&
        run 2 "$W/$shape.repp" $ARGS --pp 2 -y "$W/$shape.part/ckpt_000000004.bin" || fail "$shape resumes: rc $?"
    same_run "$W/$shape.2_--tp_2" "$W/$shape.resumed" $STEPS "$shape tp 2 resumed at step 4" 4
    same_run "$W/$shape.2_--pp_2" "$W/$shape.repp" $STEPS "$shape tp 2 -> pp 2 resumed at step 4" 4
done
# --init_from one of our checkpoints: its weights, fresh moments, step 0 (= a run from those weights)
run 1 "$W/llama.init" $LLAMA --init_from "$W/llama.part/ckpt_000000004.bin" -x 2 &&
    grep -q "initialized from .*the weights of a checkpoint" "$W/llama.init.log" &&
    grep -q '"step":2' "$W/llama.init/log.jsonl" && pass || fail "--init_from a checkpoint"
run 1 "$W/llama.contra" $OPEN --init_from "$W/llama.part/ckpt_000000004.bin" --norm layernorm
grep -q "the checkpoint has norm = rmsnorm but the flags ask for layernorm" "$W/llama.contra.log" && pass ||
    { fail "--init_from with a contradicting flag"; tail -2 "$W/llama.contra.log"; }
run 1 "$W/llama.badflag" $OPEN --pos rope --rope_scaling yarn
grep -q "rope_scaling: expected none or llama3, got 'yarn'" "$W/llama.badflag.log" && pass || fail "--rope_scaling yarn"
echo "test_dist: the open models' shape done in $(( $(date +%s) - t0 )) s"

echo "test_dist: $checks checks, $fails failed"
[ $fails -eq 0 ]
