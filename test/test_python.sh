#!/usr/bin/env bash
# The Python tools against the trainer (make test runs this with the .venv-tools/ python):
#   1. export_hf.py: a GPT-2-shaped checkpoint -> GPT-2 names and shapes, its logits (a numpy
#      GPT-2 on the exported tensors, scripts/compare_hf.py) = our engine's (dev/bin/forward_logits);
#      other shapes keep our names with a layout description; corrupt or foreign files are refused
#   2. plot.py: one run and several runs on one figure; a log without the tokens field
#   3. prepare_text.py --tokenizer bpe: a BPE trained on English + Bengali text, shards with its eot,
#      tokenizer.json + tokenizer.bin; the trainer finds tokenizer.bin and prints valid UTF-8 samples
#   4. prepare_text.py --sep percent|blank on CRLF text
#   5. Bengali end to end (dev/data/bengali_sample.py, a BPE, UTF-8 samples)
#   6. prepare_mc.py round trips and refusals
#   7. import_hf.py: test/data/hf's tiny LlamaForCausalLM (llama3 rope scaling, untied head) and
#      Qwen2ForCausalLM (q/k/v biases, tied) -> model files; our engine's logits (forward_logits, a
#      row per document) = transformers' checked-in logits (relative max error <= 1e-5); its greedy
#      decoding of 64 tokens = transformers' tokens
#   8. import_hf.py: the bf16 model in 2 shards = the fp32 one rounded to bf16, bit for bit; a
#      transformers-4 config.json (rope_theta, rope_scaling "type") and a Mistral config give the same file
#   9. import_hf.py refuses what the engine cannot compute (exit 1, the file and the field named)
#  10. export_hf.py of an imported model: the original tensors bit for bit, LlamaForCausalLM /
#      Qwen2ForCausalLM config.json, the tokenizer's files; the numpy Llama on it = our engine
#  11. prepare_text.py --tokenizer HF_DIR: byte-level (Llama 3 style BOS, Qwen2's <|endoftext|>) and
#      SentencePiece-style vocabularies; tokenizer.bin spells what the tokenizer decodes; 4-byte tokens
#  12. train_gpt_cpu --init_from an imported model, 20 steps on shards of its tokenizer; the export's
#      numpy Llama logits = our engine's (compare_hf.py), greedy decoding the same
#  13. the imported models under mpirun (--init_from): dp 2 -z 3, tp 2 --sp, pp 2 bitwise as one process;
#      a resume of tp 2 --sp bitwise
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${TOOLS_PYTHON:-python3}
export PYTHONPATH=$PWD/test${PYTHONPATH:+:$PYTHONPATH}  # test/llmc_files.py
BIN=$PWD/train_gpt_cpu
W=$(mktemp -d /tmp/llmc_py.XXXXXX)
trap 'rm -rf "$W"' EXIT
export OMP_NUM_THREADS=2
fails=0; checks=0
pass() { checks=$((checks + 1)); }
fail() { checks=$((checks + 1)); fails=$((fails + 1)); echo "FAIL: $*"; }
check() { local what=$1; shift; if "$@" >"$W/check.out" 2>&1; then pass; else fail "$what"; cat "$W/check.out"; fi; }
refused() {  # refused WHAT NEEDLE CMD...: exits 1 with NEEDLE on stderr, no traceback
    local what=$1 needle=$2; shift 2
    "$@" >"$W/ref.out" 2>"$W/ref.err"; local rc=$?
    if [ $rc -eq 1 ] && grep -qF -- "$needle" "$W/ref.err" && ! grep -q Traceback "$W/ref.err"; then pass
    else fail "$what: rc $rc, expected 1 and '$needle'"; cat "$W/ref.err"; fi
}
for tool in "$BIN" dev/bin/forward_logits; do
    [ -x "$tool" ] || { echo "test_python: $tool is missing (make train_gpt_cpu dev/bin/forward_logits)"; exit 1; }
done
"$PY" -c "import numpy, safetensors, matplotlib, tokenizers" || { echo "test_python: $PY lacks the tools (make tools)"; exit 1; }

"$PY" dev/data/prepare_text.py llmc --sep blank --out_dir "$W/data" --val_frac 0.1 >/dev/null || exit 1
DATA="-i $W/data/data_train_*.bin -j $W/data/data_val_*.bin -b 2 -t 32 -m 2 -g 0 -u 2"
GPT2="--n_layer 2 --n_embd 32 --n_head 4 --mlp gelu --pos learned --max_seq_len 64"
"$BIN" $DATA $GPT2 -x 3 -o "$W/gpt2" >"$W/gpt2.log" 2>&1 || { cat "$W/gpt2.log"; exit 1; }
"$BIN" $DATA --n_layer 2 --n_embd 32 --n_head 4 --n_kv_head 2 --n_expert 2 --moe_every 2 -x 2 -o "$W/moe" \
    >"$W/moe.log" 2>&1 || { cat "$W/moe.log"; exit 1; }
CK=$W/gpt2/ckpt_000000003.bin

# ---- 1. export_hf.py
check "export_hf GPT-2" "$PY" scripts/export_hf.py "$CK" "$W/hf"
check "GPT-2 names, shapes and config" "$PY" - "$W/hf" <<'EOF'
import json, sys
from safetensors.numpy import load_file
d = sys.argv[1]
t, cfg = load_file(d + "/model.safetensors"), json.load(open(d + "/config.json"))
C, L, V, T = 32, 2, 257, 64
want = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C),
        "transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,)}
for l in range(L):
    p = f"transformer.h.{l}."
    want.update({p + "ln_1.weight": (C,), p + "ln_1.bias": (C,), p + "ln_2.weight": (C,), p + "ln_2.bias": (C,),
                 p + "attn.c_attn.weight": (C, 3 * C), p + "attn.c_attn.bias": (3 * C,),
                 p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
                 p + "mlp.c_fc.weight": (C, 4 * C), p + "mlp.c_fc.bias": (4 * C,),
                 p + "mlp.c_proj.weight": (4 * C, C), p + "mlp.c_proj.bias": (C,)})
got = {k: v.shape for k, v in t.items()}
assert got == want, (sorted(set(got) ^ set(want)), {k: (got.get(k), want[k]) for k in want if got.get(k) != want[k]})
assert cfg["model_type"] == "gpt2" and cfg["architectures"] == ["GPT2LMHeadModel"], cfg
assert (cfg["vocab_size"], cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["n_positions"]) == (V, C, L, 4, T), cfg
assert cfg["activation_function"] == "gelu_new" and cfg["layer_norm_epsilon"] == 1e-5 and cfg["eos_token_id"] == 256
# the folder is made to be uploaded: no local path in it
assert cfg["llmc_checkpoint"]["file"] == "ckpt_000000003.bin" and "/" not in open(d + "/config.json").read(), cfg
EOF
check "GPT-2 export: numpy GPT-2 logits = our engine's" "$PY" scripts/compare_hf.py "$CK" "$W/hf"
check "export_hf other shapes" "$PY" scripts/export_hf.py "$W/moe/ckpt_000000002.bin" "$W/hf_moe"
check "other shapes: our names and a layout" "$PY" - "$W/hf_moe" <<'EOF'
import json, sys
from safetensors.numpy import load_file
d = sys.argv[1]
t, cfg = load_file(d + "/model.safetensors"), json.load(open(d + "/config.json"))
assert cfg["model_type"] == "llmc" and "SwiGLU" in cfg["note"], cfg["note"]
assert cfg["llmc"]["n_kv_head"] == 2 and cfg["llmc"]["n_expert"] == 2 and "hL.attn.qkv.w" in cfg["layout"]
assert t["wte"].shape == (257, 32) and "wpe" not in t
assert t["h0.attn.qkv.w"].shape == ((4 + 2 * 2) * 8, 32) and t["h0.mlp.fc.w"].shape[0] == 2 * cfg["llmc"]["ffn_hidden"]
assert t["h1.moe.fc.w"].shape == (2, 2 * cfg["llmc"]["expert_hidden"], 32) and "h1.moe.router.w" in t
EOF
refused "compare_hf on a non-GPT-2 export" "is not a GPT-2, Llama or Qwen2 export" "$PY" scripts/compare_hf.py "$W/moe/ckpt_000000002.bin" "$W/hf_moe"
cp "$CK" "$W/corrupt.bin"
printf '\001' | dd of="$W/corrupt.bin" bs=1 seek=3000 conv=notrunc 2>/dev/null
refused "corrupt checkpoint" "checksum mismatch" "$PY" scripts/export_hf.py "$W/corrupt.bin" "$W/hf_bad"
refused "not a checkpoint" "not a train_gpt checkpoint" "$PY" scripts/export_hf.py "$W/data/data_val_000.bin" "$W/hf_bad"
head -c 2000 "$CK" >"$W/short.bin"
refused "truncated checkpoint" "truncated or corrupt" "$PY" scripts/export_hf.py "$W/short.bin" "$W/hf_bad"

# ---- 2. plot.py
check "plot one run" "$PY" scripts/plot.py "$W/gpt2"
check "plot several runs" "$PY" scripts/plot.py "$W/gpt2" "$W/moe" -o "$W/runs.png" --title "two runs"
sed 's/,"tokens":[0-9]*//' "$W/moe/log.jsonl" >"$W/old_log.jsonl"
check "plot a log without tokens" "$PY" scripts/plot.py "$W/old_log.jsonl" -o "$W/old.png"
check "plots are PNGs" "$PY" -c "
import sys
for p in sys.argv[1:]:
    b = open(p, 'rb').read()
    assert b[:8] == b'\x89PNG\r\n\x1a\n' and len(b) > 20000, (p, len(b))" "$W/gpt2/plot.png" "$W/runs.png" "$W/old.png"
refused "plot without a log" "cannot read" "$PY" scripts/plot.py "$W/nothing"

# ---- 3. BPE
"$PY" - "$W/corpus.txt" <<'EOF'
import random, sys
words = ["আমি", "বাংলায়", "গান", "গাই", "আমার", "সোনার", "বাংলা", "the", "quick", "brown", "fox", "jumps", "over",
         "lazy", "dog", "কলকাতা", "ঢাকা", "নদী"]
r = random.Random(1)
with open(sys.argv[1], "w", encoding="utf-8") as f:
    for d in range(400):
        f.write(" ".join(r.choice(words) for _ in range(r.randint(5, 40))) + "\n\n")
EOF
check "prepare_text --tokenizer bpe" "$PY" dev/data/prepare_text.py "$W/corpus.txt" --sep blank --tokenizer bpe \
    --vocab_size 300 --out_dir "$W/bpe"
check "BPE shards and vocabulary agree" "$PY" - "$W/bpe" <<'EOF'
import struct, sys
from tokenizers import Tokenizer
d = sys.argv[1]
tok = Tokenizer.from_file(d + "/tokenizer.json")
h = open(d + "/bpe_train_000.bin", "rb").read(64)
magic, version, width, n, vocab, eot = h[:8], *struct.unpack("<IIQII", h[8:32])
assert magic == b"LLMCSHRD" and vocab == tok.get_vocab_size() == 300 and eot == tok.token_to_id("<|endoftext|>"), (vocab, eot)
from llmc_files import read_vocab
header, pieces = read_vocab(d + "/tokenizer.bin")
assert header == (1, 300, eot, 0)
text = "আমার সোনার বাংলা, the lazy dog"
assert b"".join(pieces[i] for i in tok.encode(text).ids) == text.encode()
EOF
"$BIN" -i "$W/bpe/bpe_train_*.bin" -j "$W/bpe/bpe_val_*.bin" --vocab_size 300 --n_layer 1 --n_embd 32 --n_head 2 \
    -b 2 -t 32 -x 20 -m 1 -g 80 --seed 3 -o "$W/bpe_run" >"$W/bpe_run.log" 2>&1
check "BPE training run" grep -q "^step    20/20" "$W/bpe_run.log"
check "the trainer found tokenizer.bin" grep -q "^tokenizer: $W/bpe/tokenizer.bin (BPE vocabulary)" "$W/bpe_run.log"
# bits per byte: the val targets (-m 1: one batch of 2 rows of 32, the shard's tokens 1..64) over the
# UTF-8 bytes of their pieces (EOT: 0), the logged loss converted; the step line says it too
check "val bits per byte = the val targets' nats over their text's bytes" "$PY" - "$W/bpe" "$W/bpe_run" <<'EOF'
import json, math, sys
from llmc_files import read_shard, read_vocab
d, run = sys.argv[1:]
(_, _, eot, _), pieces = read_vocab(d + "/tokenizer.bin")
tokens = read_shard(d + "/bpe_val_000.bin")
n_bytes = sum(0 if t == eot else len(pieces[t]) for t in tokens[1:65])
rec = [json.loads(l) for l in open(run + "/log.jsonl") if "val_loss" in l][-1]
assert abs(rec["val_bytes_per_token"] - n_bytes / 64) < 1e-8 * n_bytes / 64, (rec, n_bytes)  # (the log keeps 9 digits)
want = rec["val_loss"] * 64 / (n_bytes * math.log(2))
assert abs(rec["val_bpb"] - want) < 1e-7 * want and n_bytes > 64, (rec, want, n_bytes)
EOF
check "the val line gives bits per byte" grep -qE "^step    20/20 \| val loss [0-9.]+ \| [0-9.]+ bits per byte$" "$W/bpe_run.log"
check "plot --per byte" "$PY" scripts/plot.py "$W/bpe_run" --per byte -o "$W/bpe_bpb.png"
check "the sample is valid UTF-8 with Bengali letters" "$PY" -c "
import sys
t = open(sys.argv[1], 'rb').read().decode('utf-8')  # strict: raises on a split character
s = t.split('---- sample ----')[1]
assert any('\u0980' <= c <= '\u09ff' for c in s), s" "$W/bpe_run.log"
refused "--vocab_size with the byte tokenizer" "--vocab_size is for --tokenizer bpe" \
    "$PY" dev/data/prepare_text.py "$W/corpus.txt" --sep blank --vocab_size 300 --out_dir "$W/x"
refused "a stale tokenizer is refused" "shard or tokenizer file(s)" \
    "$PY" dev/data/prepare_text.py "$W/corpus.txt" --sep blank --out_dir "$W/bpe" --name other

# ---- 4. document separators in CRLF (Windows) text: 2 files x 3000 documents = 6000 documents,
# each keeping its inner CRLF
"$PY" - "$W/crlf" <<'EOF'
import os, sys
os.makedirs(sys.argv[1])
for k in range(2):
    docs = [b"doc %d %d, line one\r\nline two" % (k, i) for i in range(3000)]
    open(f"{sys.argv[1]}/percent{k}.txt", "wb").write(b"".join(d + b"\r\n%\r\n" for d in docs))
    open(f"{sys.argv[1]}/blank{k}.txt", "wb").write(b"".join(d + b"\r\n \r\n\r\n" for d in docs))
EOF
for sep in percent blank; do
    "$PY" dev/data/prepare_text.py "$W/crlf/${sep}0.txt" "$W/crlf/${sep}1.txt" --sep $sep --val_frac 0.5 \
        --out_dir "$W/crlf/$sep" >"$W/crlf.$sep.log" 2>&1
    check "CRLF text, --sep $sep: 6000 documents of their own bytes" "$PY" -c "
import re, sys
s = open(sys.argv[1]).read()
n = [int(x) for m in re.findall(r'(\d+) documents, (\d+) tokens', s) for x in m]
want = sum(len(b'doc %d %d, line one\r\nline two' % (k, i)) + 1 for k in range(2) for i in range(3000))  # + EOT
assert len(n) == 4 and n[0] + n[2] == 6000 and n[1] + n[3] == want, (s, want)" "$W/crlf.$sep.log"
done

# ---- 5. Bengali end to end (dev/data/bengali_sample.py: the Bengali gettext catalogues Debian ships):
# a BPE of 1024 tokens, the fertility line, a training run whose sample and every decoded val
# document are valid UTF-8 with Bengali letters
check "bengali_sample.py" "$PY" dev/data/bengali_sample.py "$W/bn"
check "the corpus holds Bengali text (>= 50000 characters)" "$PY" -c "
import sys
t = open(sys.argv[1], encoding='utf-8').read()
assert sum('\u0980' <= c <= '\u09ff' for c in t) >= 50000" "$W/bn/corpus.txt"
"$PY" dev/data/prepare_text.py "$W/bn/corpus.txt" --sep blank --tokenizer bpe --vocab_size 1024 --out_dir "$W/bn/bpe" \
    >"$W/bn/prepare.log" 2>/dev/null
check "prepare_text reports the fertility" grep -qE "^train: .* tokens per character, [0-9.]+ per word$" "$W/bn/prepare.log"
"$BIN" -i "$W/bn/bpe/bpe_train_*.bin" -j "$W/bn/bpe/bpe_val_*.bin" --vocab_size 1024 --n_layer 1 --n_embd 32 \
    --n_head 2 -b 2 -t 64 -x 20 -m 1 -g 120 --seed 5 -o "$W/bn/run" >"$W/bn/run.log" 2>&1
check "Bengali: the sample is valid UTF-8 with Bengali letters" "$PY" -c "
import sys
t = open(sys.argv[1], 'rb').read().decode('utf-8')
s = t.split('---- sample ----')[1]
assert any('\u0980' <= c <= '\u09ff' for c in s), s" "$W/bn/run.log"
check "Bengali: every val document decodes as UTF-8" "$PY" - "$W/bn/bpe" <<'EOF'
import sys
from llmc_files import read_shard, read_vocab
d = sys.argv[1]
(_, _, eot, _), pieces = read_vocab(d + "/tokenizer.bin")
tokens = read_shard(d + "/bpe_val_000.bin")
docs, cur = [], []
for t in tokens[1:] + [eot]:
    if t == eot:
        docs.append(b"".join(pieces[x] for x in cur)); cur = []
    else:
        cur.append(t)
assert len(docs) >= 5 and all(any("\u0980" <= c <= "\u09ff" for c in doc.decode("utf-8")) for doc in docs), len(docs)
EOF

# ---- 6. prepare_mc.py: the handmade HellaSwag / Belebele / MMLU-CSV files of test/data/mc round-trip
# (contexts, endings and labels read back from the binary as the trainer reads it), with the byte
# tokenizer and a BPE; bad files are refused with the line named
for f in hellaswag.jsonl belebele.jsonl mmlu.csv; do
    check "prepare_mc $f" "$PY" scripts/prepare_mc.py test/data/mc/$f "$W/$f.bin"
    check "prepare_mc $f (BPE)" "$PY" scripts/prepare_mc.py test/data/mc/$f "$W/$f.bpe.bin" --tokenizer "$W/bpe/tokenizer.json"
done
check "prepare_mc round trip" "$PY" - "$W" "$W/bpe/tokenizer.json" <<'EOF'
import struct, sys
from tokenizers import Tokenizer
W, tj = sys.argv[1:]
bpe = Tokenizer.from_file(tj)

def read(path):
    b = open(path, "rb").read()
    assert b[:8] == b"LLMCMCQA"
    version, n, vocab, eot = struct.unpack("<4I", b[8:24])
    at, items = 64, []
    def u32():
        nonlocal at
        at += 4
        return struct.unpack("<I", b[at - 4:at])[0]
    for _ in range(n):
        label, n_end, n_ctx = u32(), u32(), u32()
        ctx = [u32() for _ in range(n_ctx)]
        ends = []
        for _ in range(n_end):
            ends.append([u32() for _ in range(u32())])
        items.append((ctx, ends, label))
    assert at == len(b) and version == 1
    return vocab, eot, items

want = {
    "hellaswag.jsonl": [("Baking cookies: A woman pours flour into a bowl. She", " adds two eggs and stirs.", 0, 4),
                        ("রান্না: একজন লোক চাল ধুয়ে নিচ্ছে। তারপর সে", " চাল হাঁড়িতে দেয়।", 1, 4),
                        ("The sun set over the quiet river and", " the birds flew home.", 0, 2)],
    "belebele.jsonl": [("ঢাকা বাংলাদেশের রাজধানী। শহরটি বুড়িগঙ্গা নদীর তীরে অবস্থিত।\nQuestion: ঢাকা কোন নদীর তীরে?\nAnswer:",
                        " বুড়িগঙ্গা", 1, 4),
                       ("The library opens at nine and closes at five.\nQuestion: When does the library close?\nAnswer:",
                        " At five", 2, 4)],
    "mmlu.csv": [("Question: What is 2 + 2?\nAnswer:", " 4", 1, 4), ("Question: Which is a prime, number?\nAnswer:", " 7", 2, 4),
                 ("Question: বাংলার রাজধানী কোনটি?\nAnswer:", " ঢাকা", 0, 4)],
}
for name, items in want.items():
    vocab, eot, got = read(f"{W}/{name}.bin")
    assert (vocab, eot) == (257, 256) and len(got) == len(items), name
    for (ctx, ends, label), (c, right, l, n) in zip(got, items):
        assert ctx[0] == eot and bytes(ctx[1:]).decode() == c, (name, bytes(ctx[1:]).decode(), c)
        assert label == l and len(ends) == n and bytes(ends[label]).decode() == right, (name, label, ends)
    vocab, eot, got = read(f"{W}/{name}.bpe.bin")
    assert vocab == bpe.get_vocab_size() and eot == bpe.token_to_id("<|endoftext|>")
    for (ctx, ends, label), (c, right, l, n) in zip(got, items):
        assert ctx[0] == eot and bpe.decode(ctx[1:]) == c and bpe.decode(ends[label]) == right and label == l
EOF
printf '{"ctx": "a", "endings": ["b", "c"], "label": 0}\n{"ctx": "a", "endings": ["b"], "label": 0}\n' >"$W/one_ending.jsonl"
refused "prepare_mc: one ending" "one_ending.jsonl:2: 1 endings, expected 2..16" "$PY" scripts/prepare_mc.py "$W/one_ending.jsonl" "$W/x.bin"
printf '{"ctx": "a", "endings": ["b", "c"], "label": 0}\n{"ctx": "a", "endings": ["b", "c"], "label": 5}\n' >"$W/label.jsonl"
refused "prepare_mc: a label past the endings" "label.jsonl:2: label 5 but 2 endings" "$PY" scripts/prepare_mc.py "$W/label.jsonl" "$W/x.bin"
printf '{"ctx": "a", "endings": ["b", "c"], "label": 0}\nnot json\n' >"$W/broken.jsonl"
refused "prepare_mc: a line that is not JSON" "broken.jsonl:2: not a hellaswag item" "$PY" scripts/prepare_mc.py "$W/broken.jsonl" "$W/x.bin"
printf '{"flores_passage": "p", "question": "q", "mc_answer1": "a", "correct_answer_num": "1"}\n' >"$W/bb.jsonl"
refused "prepare_mc: a Belebele item without its answers" "bb.jsonl:1: not a belebele item (missing field 'mc_answer2')" \
    "$PY" scripts/prepare_mc.py "$W/bb.jsonl" "$W/x.bin"
printf 'q,1,2,3,4,E\n' >"$W/bad.csv"
refused "prepare_mc: an answer letter past the choices" "bad.csv:1: the answer 'E' is not one of the letters A..D" \
    "$PY" scripts/prepare_mc.py "$W/bad.csv" "$W/x.bin"
[ ! -e "$W/x.bin" ] && pass || fail "prepare_mc wrote a file for a refused input"

# ---- 7. import_hf.py: the tiny Llama and Qwen2 of test/data/hf (scripts/make_hf_testdata.py made them and
# transformers' outputs on them, once); our engine's logits, one forward_logits row per document, against
# transformers', and its greedy decoding
HF=test/data/hf
for m in llama qwen2; do
    check "import_hf $m" "$PY" scripts/import_hf.py $HF/$m "$W/$m.bin"
    check "$m: our engine's logits = transformers' (relative max error <= 1e-5)" "$PY" - $HF/ref_$m.npz "$W/$m.bin" <<'EOF'
import sys
import numpy as np
sys.path.insert(0, "scripts")
from compare_hf import engine_logits
ref, model = np.load(sys.argv[1]), sys.argv[2]
worst = 0.0
for k in range(3):
    doc, theirs = ref[f"doc{k}"], ref[f"logits{k}"].astype(np.float64)
    ours = engine_logits(model, doc, theirs.shape[1])
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"document {k} ({len(doc)} tokens): max |diff| {np.abs(ours - theirs).max():.2e}, relative {err:.2e}")
    worst = max(worst, err)
    assert err <= 1e-5, err
print(f"relative max error {worst:.2e}")
EOF
    sed -n "s/^relative max error/test_python: $m, our engine vs transformers: relative max error/p" "$W/check.out"
    check "$m: greedy decoding of 64 tokens = transformers'" "$PY" - $HF/ref_$m.npz "$W/$m.bin" <<'EOF'
import sys
import numpy as np
sys.path.insert(0, "scripts")
from compare_hf import engine_greedy
ref, model = np.load(sys.argv[1]), sys.argv[2]
ours = engine_greedy(model, ref["prompt"].tolist(), 64, ref["logits0"].shape[1])
assert ours == ref["greedy"].tolist(), (ours, ref["greedy"].tolist())
EOF
done

# ---- 8. the bf16 model in 2 shards (torch's cast of the qwen2 one: round to nearest even) = the fp32 import
# rounded to bf16, bit for bit; the same config in transformers 4's words, and as a Mistral, give the same file
check "import_hf bf16, 2 shards" "$PY" scripts/import_hf.py $HF/qwen2_bf16 "$W/qwen2_bf16.bin"
check "bf16 import = the fp32 import rounded to bf16" "$PY" - "$W/qwen2.bin" "$W/qwen2_bf16.bin" <<'EOF'
import sys
import numpy as np
sys.path.insert(0, "scripts")
from export_hf import read_checkpoint
(f32, _, p32), (f16, _, p16) = read_checkpoint(sys.argv[1]), read_checkpoint(sys.argv[2])
assert f32 == f16
u = p32.view(np.uint32).astype(np.uint64)
rne = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32)
assert np.array_equal(rne, p16.view(np.uint32)) and not np.array_equal(p32, p16)
EOF
"$PY" - $HF "$W/cfg" <<'EOF'
import json, os, sys
hf, out = sys.argv[1:]
def variant(name, src, edit):
    os.makedirs(f"{out}/{name}")
    for f in os.listdir(f"{hf}/{src}"):
        if f != "config.json":
            os.symlink(os.path.abspath(f"{hf}/{src}/{f}"), f"{out}/{name}/{f}")
    c = json.load(open(f"{hf}/{src}/config.json"))
    edit(c)
    json.dump(c, open(f"{out}/{name}/config.json", "w"))
def v4(c):  # transformers 4: rope_theta beside, the scaling's kind under "type"
    rp = c.pop("rope_parameters")
    c["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    c["rope_scaling"] = rp
variant("llama_v4", "llama", v4)
variant("mistral", "llama", lambda c: c.update(architectures=["MistralForCausalLM"], model_type="mistral",
                                               sliding_window=None, head_dim=None))
EOF
check "a transformers-4 config.json gives the same file" "$PY" scripts/import_hf.py "$W/cfg/llama_v4" "$W/llama_v4.bin"
check "the same bytes (transformers 4 config)" cmp "$W/llama.bin" "$W/llama_v4.bin"
check "a Mistral (no sliding window) gives the same file" "$PY" scripts/import_hf.py "$W/cfg/mistral" "$W/mistral.bin"
check "the same bytes (Mistral)" cmp "$W/llama.bin" "$W/mistral.bin"

# ---- 9. refusals: copies of the models with one thing changed each
"$PY" - $HF "$W/bad" <<'EOF'
import json, os, shutil, sys
import numpy as np
from safetensors.numpy import load_file, save_file
hf, out = sys.argv[1:]
def variant(name, src, edit=None, tensors=None):
    d = f"{out}/{name}"
    os.makedirs(d)
    c = json.load(open(f"{hf}/{src}/config.json"))
    if edit:
        edit(c)
    json.dump(c, open(f"{d}/config.json", "w"))
    if tensors:
        t = load_file(f"{hf}/{src}/model.safetensors")
        tensors(t)
        save_file(t, f"{d}/model.safetensors")
    else:
        os.symlink(os.path.abspath(f"{hf}/{src}/model.safetensors"), f"{d}/model.safetensors")
def rope(kind, **kw):
    return lambda c: c.update(rope_parameters=dict(rope_type=kind, rope_theta=5e5, **kw))
variant("arch", "llama", lambda c: c.update(architectures=["MixtralForCausalLM"], model_type="mixtral"))
variant("moe", "llama", lambda c: c.update(num_local_experts=8))
variant("linear", "llama", rope("linear", factor=2.0))
variant("yarn", "llama", rope("yarn", factor=4.0, original_max_position_embeddings=64))
variant("dynamic_v4", "llama", lambda c: c.update(rope_parameters=None, rope_theta=5e5,
                                                   rope_scaling={"type": "dynamic", "factor": 2.0}))
variant("longrope", "llama", rope("longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8))
variant("partial", "llama", lambda c: c.update(partial_rotary_factor=0.5))
variant("mistral_window", "llama", lambda c: c.update(architectures=["MistralForCausalLM"], model_type="mistral",
                                                       sliding_window=128))
variant("qwen2_window", "qwen2", lambda c: c.update(use_sliding_window=True, sliding_window=64))
variant("qwen2_layers", "qwen2", lambda c: c.update(layer_types=["full_attention", "sliding_attention"]))
variant("attention_bias", "llama", lambda c: c.update(attention_bias=True))
variant("mlp_bias", "llama", lambda c: c.update(mlp_bias=True))
variant("head_dim", "llama", lambda c: c.update(head_dim=32))
variant("gelu", "llama", lambda c: c.update(hidden_act="gelu_pytorch_tanh"))
variant("shape", "llama", lambda c: c.update(intermediate_size=96))
variant("missing", "llama", tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
variant("unexpected", "llama", tensors=lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)}))
variant("untied_missing", "qwen2", lambda c: c.update(tie_word_embeddings=False))
variant("tied_differs", "qwen2", tensors=lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] * 2}))
variant("f64", "llama", tensors=lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.float64)}))
variant("nan", "llama", tensors=lambda t: t["model.norm.weight"].__setitem__(3, np.nan))
os.makedirs(f"{out}/pickled")
shutil.copy(f"{hf}/llama/config.json", f"{out}/pickled/config.json")
open(f"{out}/pickled/pytorch_model.bin", "wb").close()
EOF
while IFS='|' read -r name needle; do
    refused "import_hf refuses $name" "$needle" "$PY" scripts/import_hf.py "$W/bad/$name" "$W/bad/$name.bin" </dev/null
    [ -e "$W/bad/$name.bin" ] && fail "import_hf wrote $name.bin for a refused model"
done <<'EOF'
arch|bad/arch/config.json: architectures ['MixtralForCausalLM']: only LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM
moe|bad/moe/config.json: num_local_experts = 8: mixture-of-experts models are not imported
linear|bad/linear/config.json: rope_parameters rope_type 'linear': only llama3 scaling (or none) is imported
yarn|bad/yarn/config.json: rope_parameters rope_type 'yarn'
dynamic_v4|bad/dynamic_v4/config.json: rope_scaling rope_type 'dynamic'
longrope|bad/longrope/config.json: rope_parameters rope_type 'longrope'
partial|bad/partial/config.json: partial_rotary_factor 0.5
mistral_window|bad/mistral_window/config.json: sliding_window 128 < max_position_embeddings 256
qwen2_window|bad/qwen2_window/config.json: use_sliding_window true
qwen2_layers|bad/qwen2_layers/config.json: layer_types ['full_attention', 'sliding_attention']
attention_bias|bad/attention_bias/config.json: attention_bias true
mlp_bias|bad/mlp_bias/config.json: mlp_bias true
head_dim|bad/head_dim/config.json: head_dim 32 != hidden_size / num_attention_heads = 16
gelu|bad/gelu/config.json: hidden_act 'gelu_pytorch_tanh': only silu
shape|bad/shape/model.safetensors: tensor model.layers.0.mlp.gate_proj.weight has shape [128, 64], config.json makes [96, 64]
missing|bad/missing/model.safetensors: tensor model.layers.1.mlp.up_proj.weight is missing
unexpected|bad/unexpected/model.safetensors: unexpected tensor model.layers.0.self_attn.q_norm.weight
untied_missing|bad/untied_missing/model.safetensors: tensor lm_head.weight is missing
tied_differs|bad/tied_differs/model.safetensors: lm_head.weight differs from model.embed_tokens.weight but tie_word_embeddings is true
f64|bad/f64/model.safetensors: tensor model.norm.weight is F64: only F32, F16 and BF16
nan|bad/nan/model.safetensors: tensor model.norm.weight holds non-finite values
pickled|bad/pickled: no model.safetensors or model.safetensors.index.json (found pytorch_model.bin
EOF

# ---- 10. export_hf.py of the imported models: the original tensors bit for bit, a config.json of
# LlamaForCausalLM / Qwen2ForCausalLM, the tokenizer's files beside; the numpy Llama on the export = our engine
for m in llama qwen2; do
    check "export_hf $m" "$PY" scripts/export_hf.py "$W/$m.bin" "$W/hf_$m" --tokenizer $HF/$m
    check "$m: import then export = the original tensors, bit for bit" "$PY" - $HF/$m "$W/hf_$m" <<'EOF'
import json, os, sys
from safetensors.numpy import load_file
src, out = sys.argv[1:]
a, b = load_file(src + "/model.safetensors"), load_file(out + "/model.safetensors")
assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes(), k
c, o = json.load(open(src + "/config.json")), json.load(open(out + "/config.json"))
for k in ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
          "bos_token_id", "eos_token_id"]:
    assert c[k] == o[k], (k, c[k], o[k])
assert o["rope_parameters"] == c["rope_parameters"] and o["rope_theta"] == c["rope_parameters"]["rope_theta"], o
assert o["torch_dtype"] == "float32" and ("lm_head.weight" in b) == (not o["tie_word_embeddings"])
assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
EOF
    check "$m export: numpy Llama logits = our engine's" "$PY" scripts/compare_hf.py "$W/$m.bin" "$W/hf_$m" --tokens 48
done

# ---- 11. prepare_text.py --tokenizer HF_DIR: the shards' document token, tokenizer.bin against the tokenizer's own
# decoding, the tokenizer's files beside the shards
"$PY" - "$W/hf_corpus.txt" <<'EOF'
import random, sys
words = "the quick brown fox jumps over lazy dog river night আমার সোনার বাংলা naïve café Ω 42".split()
r = random.Random(7)
open(sys.argv[1], "w", encoding="utf-8").write(
    "\n\n".join(" ".join(r.choice(words) for _ in range(r.randint(5, 60))) for _ in range(300)) + "\n")
EOF
for spec in "llama|$HF/llama|<|begin_of_text|>|the model's BOS" \
            "qwen2|$HF/qwen2/tokenizer.json|<|endoftext|>|the end-of-text token: the model has no BOS" \
            "sp|$HF/sp_tokenizer|<s>|the model's BOS"; do
    name=${spec%%|*}; rest=${spec#*|}; tok=${rest%%|*}; rest=${rest#*|}
    doc=${rest%|*}; why=${rest##*|}
    check "prepare_text --tokenizer $tok" "$PY" dev/data/prepare_text.py "$W/hf_corpus.txt" --sep blank --tokenizer "$tok" \
        --out_dir "$W/tok_$name" --val_frac 0.1
    cp "$W/check.out" "$W/tok_$name.out"
    check "$name: documents start with $doc ($why)" grep -qF "documents start with '$doc' (id" "$W/tok_$name.out"
    check "$name: documents start with $doc ($why)" grep -qF "$why)" "$W/tok_$name.out"
    check "$name: shards, tokenizer.bin and the tokenizer agree" "$PY" - "$W/tok_$name" "$tok" "$doc" <<'EOF'
import os, struct, sys
from tokenizers import Tokenizer
from llmc_files import read_shard, read_vocab
d, tok, doc = sys.argv[1:]
t = Tokenizer.from_file(tok if tok.endswith(".json") else tok + "/tokenizer.json")
n, eot = max(t.get_vocab(with_added_tokens=True).values()) + 1, t.token_to_id(doc)
(version, vocab, veot, _), pieces = read_vocab(d + "/tokenizer.bin")
assert (version, vocab, veot, len(pieces)) == (1, n, eot, n), (version, vocab, veot, n, eot)
name = os.path.basename(d)
width, _, svocab, seot = struct.unpack("<IQII", open(f"{d}/{name}_train_000.bin", "rb").read(64)[12:32])
assert (width, svocab, seot) == (2, n, eot)
tokens = read_shard(f"{d}/{name}_train_000.bin")
assert tokens[0] == eot
docs, cur = [], []
for x in tokens[1:] + [eot]:
    if x == eot:
        docs.append(cur)
        cur = []
    else:
        cur.append(x)
assert len(docs) == 270 and all(docs), len(docs)  # one document token each, never doubled
for ids in docs:
    got = b"".join(pieces[i] for i in ids).decode("utf-8")
    want = t.decode(ids, skip_special_tokens=False)
    assert got == want or got == " " + want, (got, want)  # SentencePiece's decoder drops the first space
assert any("\u0980" <= c <= "\u09ff" for ids in docs for c in t.decode(ids))
files = sorted(os.listdir(d))
assert "tokenizer.json" in files and "tokenizer_config.json" in files, files
EOF
done
check "the SentencePiece vocabulary: ▁ is a space, <0xXX> a byte" "$PY" - "$W/tok_sp" <<'EOF'
import sys
from tokenizers import Tokenizer
from llmc_files import read_vocab
_, pieces = read_vocab(sys.argv[1] + "/tokenizer.bin")
t = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
assert pieces[t.token_to_id("▁the")] == b" the" and pieces[t.token_to_id("<0xCE>")] == b"\xce"
assert pieces[t.token_to_id("<s>")] == b"<s>"
EOF
check "prepare_text --doc_token" "$PY" dev/data/prepare_text.py "$W/hf_corpus.txt" --sep blank --tokenizer $HF/llama \
    --doc_token "<|end_of_text|>" --out_dir "$W/tok_doc"
cp "$W/check.out" "$W/tok_doc.out"
check "--doc_token is the shards' document token" grep -qF "documents start with '<|end_of_text|>' (id 453, --doc_token)" \
    "$W/tok_doc.out"
refused "a document token not in the vocabulary" "the document token '<|nope|>' (--doc_token) is not in its vocabulary" \
    "$PY" dev/data/prepare_text.py "$W/hf_corpus.txt" --sep blank --tokenizer $HF/llama --doc_token "<|nope|>" --out_dir "$W/x"
refused "--tokenizer neither byte, bpe nor a tokenizer" "--tokenizer $W/nothing: expected byte, bpe, a tokenizer.json or a folder" \
    "$PY" dev/data/prepare_text.py "$W/hf_corpus.txt" --sep blank --tokenizer "$W/nothing" --out_dir "$W/x"
# more than 65536 ids: 4-byte tokens (a byte-level vocabulary of 70000 entries, its BOS the last id)
"$PY" - "$W/big" <<'EOF'
import json, os, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
vocab = {c: i for i, c in enumerate(alphabet)}
for i in range(len(vocab), 69999):
    vocab[f"{alphabet[i % 256]}{alphabet[(i // 256) % 256]}{alphabet[i // 65536]}"] = i
t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
t.add_special_tokens(["<|begin_of_text|>"])
os.makedirs(sys.argv[1])
t.save(sys.argv[1] + "/tokenizer.json")
json.dump({"bos_token": "<|begin_of_text|>"}, open(sys.argv[1] + "/tokenizer_config.json", "w"))
EOF
check "prepare_text --tokenizer: 70000 ids" "$PY" dev/data/prepare_text.py "$W/hf_corpus.txt" --sep blank --tokenizer "$W/big" \
    --out_dir "$W/tok_big"
check "70000 ids: 4-byte tokens" "$PY" - "$W/tok_big" <<'EOF'
import struct, sys
from llmc_files import read_shard, read_vocab
d = sys.argv[1]
width, _, vocab, eot = struct.unpack("<IQII", open(d + "/tok_big_train_000.bin", "rb").read(64)[12:32])
assert (width, vocab, eot) == (4, 70000, 69999), (width, vocab, eot)
tokens = read_shard(d + "/tok_big_train_000.bin")
_, pieces = read_vocab(d + "/tokenizer.bin")
assert tokens[0] == 69999 and b"".join(pieces[t] for t in tokens[1:30] if t != 69999).decode("utf-8")
EOF

# ---- 12. fine-tune an imported model: train_gpt_cpu --init_from, 20 steps on shards of its tokenizer, export;
# the export's numpy Llama logits = our engine's on the checkpoint, and greedy decoding the same
for m in llama qwen2; do
    "$BIN" --init_from "$W/$m.bin" -i "$W/tok_$m/tok_${m}_train_*.bin" -j "$W/tok_$m/tok_${m}_val_*.bin" -b 2 -t 64 \
        -x 20 -m 1 -g 16 -u 2 --seed 5 -o "$W/ft_$m" >"$W/ft_$m.log" 2>&1
    check "$m: 20 steps --init_from the imported model" grep -q "^step    20/20 | val loss" "$W/ft_$m.log"
    check "$m: initialized from the model file" grep -qF "initialized from $W/$m.bin" "$W/ft_$m.log"
    check "$m: export of the fine-tuned checkpoint" "$PY" scripts/export_hf.py "$W/ft_$m/ckpt_000000020.bin" "$W/hf_ft_$m" \
        --tokenizer "$W/tok_$m"
    check "$m fine-tuned: numpy Llama logits = our engine's, greedy decoding the same" "$PY" scripts/compare_hf.py \
        "$W/ft_$m/ckpt_000000020.bin" "$W/hf_ft_$m" --greedy 16
    sed -n "s/^compare_hf.py: numpy vs our engine, /test_python: $m fine-tuned, numpy vs our engine: /p" "$W/check.out"
done

# ---- 13. the imported models under mpirun: --init_from in dp 2 -z 3, tp 2 --sp, pp 2, each bitwise as one
# process given the layout's gradient blocks; a resume of the tp 2 run (at step 4 of 8) bitwise
if command -v mpirun >/dev/null; then
    MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none -x OMP_NUM_THREADS=1"
    for m in llama qwen2; do
        DATA="-i $W/tok_$m/tok_${m}_train_*.bin -j $W/tok_$m/tok_${m}_val_*.bin -x 8 -m 1 -g 0 -u 2"
        FT="--init_from $W/$m.bin $DATA -b 2 -t 32 -d 256 --seed 5"
        for layout in "-z 3" "--tp 2 --sp" "--pp 2"; do
            out=$W/lay_$m.$(echo $layout | tr -d ' -')
            $MPIRUN -np 2 "$BIN" $FT $layout -n 4 -o "$out" >"$out.log" 2>&1 || { fail "$m np 2 $layout: rc $?"; tail -3 "$out.log"; continue; }
            G=$(grep -o "^gradient sum: [0-9]*" "$out.log" | grep -o "[0-9]*$")
            ref=$W/lay_$m.ref$G
            [ -d "$ref" ] || OMP_NUM_THREADS=1 "$BIN" $FT --grad_blocks "${G:-1}" -o "$ref" >"$ref.log" 2>&1
            check "$m np 2 $layout = one process (--grad_blocks ${G:-1}), bitwise" cmp "$ref/ckpt_000000008.bin" "$out/ckpt_000000008.bin"
        done
        out=$W/lay_$m.tp2sp
        $MPIRUN -np 2 "$BIN" $DATA --tp 2 --sp -y "$out/ckpt_000000004.bin" -o "$out.resumed" >"$out.resumed.log" 2>&1
        check "$m tp 2 --sp resumed at step 4 = uninterrupted, bitwise" cmp "$out/ckpt_000000008.bin" "$out.resumed/ckpt_000000008.bin"
    done
else
    fail "section 13 needs mpirun (openmpi-bin)"
fi

echo "test_python: $checks passed, $fails failed"
[ $fails -eq 0 ]
