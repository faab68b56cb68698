#!/usr/bin/env python3
"""Export a train_gpt checkpoint as a Hugging Face model folder: model.safetensors + config.json.

    python scripts/export_hf.py out/run/ckpt_000000700.bin hf/run [--tokenizer data/x/tokenizer.json]

GPT-2-shaped models (--mlp gelu --pos learned, n_kv_head = n_head, ffn_hidden = 4 n_embd, dense)
become a transformers GPT2LMHeadModel: GPT-2's tensor names (transformer.h.N.attn.c_attn.weight,
...), its Conv1D weights, which are [in, out] where ours are [out, in] (so every matrix is
transposed), the vocabulary unpadded (vocab_size rows of wte; the lm head is tied to it, so no
lm_head.weight is stored), activation gelu_new (the tanh GELU), LayerNorm eps 1e-5:

    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained("hf/run")

Transformers' GPT-2 attends over the whole row; our engine restarts attention and positions at
every end-of-text token, so the two agree on text within one document (exactly what GPT-2 does
at inference).

Other shapes (ALiBi, grouped-query attention, SwiGLU, expert-choice MoE) have no transformers
class that computes them exactly. They are written with our tensor names and layouts ([out, in],
wte unpadded) and a config.json with "model_type": "llmc" whose "llmc" entry holds our config and
"layout" says what each tensor means (the same as docs/ARCHITECTURE.md).

The checkpoint (llmc/io/checkpoint.h, version 2 or 1) is read here: its header, its named config
fields and the fp32 parameters (the Adam moments are not exported); a version 2 checksum is
verified (--no_verify skips that, for a quick export of a large model).
"""
import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np

MASK64 = (1 << 64) - 1


def fail(msg):
    sys.exit(f"export_hf.py: {msg}")


# ---- the checkpoint (llmc/io/checkpoint.h)

def _splitmix_int(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _splitmix_np(x):
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _hash_words(words, first):
    """sum over k of splitmix(splitmix(first + k) ^ words[k]) mod 2^64 (uint64 arithmetic wraps)"""
    total = np.uint64(0)
    chunk = 1 << 22
    with np.errstate(over="ignore"):
        for lo in range(0, len(words), chunk):
            w = words[lo:lo + chunk].astype(np.uint64)
            idx = np.arange(first + lo, first + lo + len(w), dtype=np.uint64)
            total = total + np.add.reduce(_splitmix_np(_splitmix_np(idx) ^ w), dtype=np.uint64)
    return int(total)


def read_checkpoint(path, verify=True):
    """Returns (fields: name -> int|float, version, params: float32 array in table order, step)."""
    try:
        size = os.path.getsize(path)
        f = open(path, "rb")
    except OSError as e:
        fail(f"{path}: cannot open ({e.strerror})")
    with f:
        head = f.read(16)
        if len(head) < 16 or head[:8] != b"LLMCCKPT":
            fail(f"{path}: not a train_gpt checkpoint: expected the magic LLMCCKPT")
        version, n_fields = struct.unpack("<II", head[8:16])
        if version not in (1, 2):
            fail(f"{path}: checkpoint version {version}, this script reads 1 and 2")
        if n_fields > 4096:
            fail(f"{path}: header claims {n_fields} fields (corrupt header?)")
        raw_fields = f.read(48 * n_fields)
        tail = f.read(16 if version >= 2 else 8)
        if len(raw_fields) < 48 * n_fields or len(tail) < (16 if version >= 2 else 8):
            fail(f"{path}: truncated header")
        n_params = struct.unpack("<Q", tail[:8])[0]
        stored = struct.unpack("<Q", tail[8:16])[0] if version >= 2 else None
        header = head + raw_fields + tail[:8]
        data_offset = len(header) + (8 if version >= 2 else 0)
        if size != data_offset + 12 * n_params:
            fail(f"{path}: checkpoint is {size} bytes, expected {data_offset + 12 * n_params} for {n_params} "
                 "parameters (truncated or corrupt?)")
    fields = {}
    for k in range(n_fields):
        rec = raw_fields[48 * k:48 * (k + 1)]
        name = rec[:32].split(b"\0", 1)[0].decode()
        kind = chr(rec[32])
        if kind == "i":
            fields[name] = struct.unpack("<q", rec[40:48])[0]
        elif kind == "f":
            fields[name] = struct.unpack("<d", rec[40:48])[0]
        else:
            fail(f"{path}: field {k} has kind {rec[32]}, expected 'i' or 'f'")
    data = np.memmap(path, dtype="<u4", mode="r", offset=data_offset, shape=(3 * n_params,))
    if verify and version >= 2:
        h = 0x243F6A8885A308D3
        for b in header:
            h = _splitmix_int(h ^ b)
        total = (h + _hash_words(data, 0)) & MASK64
        if total != stored:
            fail(f"{path}: checksum mismatch (stored {stored:016x}, content {total:016x}): the file is corrupt")
    params = np.asarray(data[:n_params]).view("<f4")
    return fields, version, params


# ---- our config and parameter table (build_param_table in train_gpt.cu)

CONFIG_INTS = ["vocab_size", "n_layer", "n_embd", "n_head", "n_kv_head", "ffn_hidden", "max_seq_len", "mlp", "pos",
               "n_expert", "moe_every", "moe_group", "expert_hidden"]


def config_of(fields, path):
    cfg = {}
    for k in CONFIG_INTS:
        if "config." + k not in fields:
            fail(f"{path}: checkpoint has no field config.{k}")
        cfg[k] = int(fields["config." + k])
    cfg["capacity_factor"] = float(fields.get("config.capacity_factor", 0.0))
    cfg["padded_vocab_size"] = (cfg["vocab_size"] + 127) // 128 * 128
    return cfg


def is_moe(cfg, layer):
    return cfg["n_expert"] > 0 and (layer + 1) % cfg["moe_every"] == 0


def param_table(cfg):
    """[(name, shape, offset)] in the flat buffer's order, each tensor at a multiple of 8 elements."""
    C, hs = cfg["n_embd"], cfg["n_embd"] // cfg["n_head"]
    qkv = (cfg["n_head"] + 2 * cfg["n_kv_head"]) * hs
    H = cfg["ffn_hidden"]
    fc = 2 * H if cfg["mlp"] == 0 else H
    E, He = cfg["n_expert"], cfg["expert_hidden"]
    table, offset = [], 0

    def add(name, shape):
        nonlocal offset
        table.append((name, tuple(shape), offset))
        offset += (int(np.prod(shape)) + 7) // 8 * 8

    add("wte", [cfg["padded_vocab_size"], C])
    if cfg["pos"] == 1:
        add("wpe", [cfg["max_seq_len"], C])
    for l in range(cfg["n_layer"]):
        h = f"h{l}."
        add(h + "ln1.w", [C]); add(h + "ln1.b", [C])
        add(h + "attn.qkv.w", [qkv, C]); add(h + "attn.qkv.b", [qkv])
        add(h + "attn.proj.w", [C, cfg["n_head"] * hs]); add(h + "attn.proj.b", [C])
        add(h + "ln2.w", [C]); add(h + "ln2.b", [C])
        if is_moe(cfg, l):
            add(h + "moe.router.w", [E, C])
            add(h + "moe.fc.w", [E, 2 * He, C]); add(h + "moe.fc.b", [E, 2 * He])
            add(h + "moe.proj.w", [E, C, He]); add(h + "moe.proj.b", [E, C])
        else:
            add(h + "mlp.fc.w", [fc, C]); add(h + "mlp.fc.b", [fc])
            add(h + "mlp.proj.w", [C, H]); add(h + "mlp.proj.b", [C])
    add("lnf.w", [C]); add("lnf.b", [C])
    return table, offset


def tensors_of(cfg, params, path):
    table, total = param_table(cfg)
    if total != len(params):
        fail(f"{path}: the checkpoint holds {len(params)} parameters but its config makes {total}: "
             "written by another version of the engine?")
    out = {}
    for name, shape, off in table:
        out[name] = np.asarray(params[off:off + int(np.prod(shape))]).reshape(shape)
    out["wte"] = out["wte"][:cfg["vocab_size"]]  # the padding rows are zero and unused
    return out


def gpt2_shaped(cfg):
    """None when the config is GPT-2's shape, else what differs."""
    if cfg["mlp"] != 1:
        return "SwiGLU MLP"
    if cfg["pos"] != 1:
        return "ALiBi positions"
    if cfg["n_kv_head"] != cfg["n_head"]:
        return "grouped-query attention"
    if cfg["ffn_hidden"] != 4 * cfg["n_embd"]:
        return f"ffn_hidden {cfg['ffn_hidden']} != 4 * n_embd"
    if cfg["n_expert"] > 0:
        return "mixture of experts"
    return None


# ---- the two exports

def to_gpt2(cfg, t, eot):
    """transformers' GPT-2 names; Conv1D weights are [in, out]: our [out, in] matrices transposed."""
    hf = {"transformer.wte.weight": t["wte"], "transformer.wpe.weight": t["wpe"]}
    for l in range(cfg["n_layer"]):
        h, p = f"h{l}.", f"transformer.h.{l}."
        for ours, theirs in [("ln1.w", "ln_1.weight"), ("ln1.b", "ln_1.bias"), ("ln2.w", "ln_2.weight"),
                             ("ln2.b", "ln_2.bias"), ("attn.qkv.b", "attn.c_attn.bias"),
                             ("attn.proj.b", "attn.c_proj.bias"), ("mlp.fc.b", "mlp.c_fc.bias"),
                             ("mlp.proj.b", "mlp.c_proj.bias")]:
            hf[p + theirs] = t[h + ours]
        # rows [Q | K | V] head-major = GPT-2's c_attn columns (split(n_embd) into q, k, v; heads
        # are consecutive hs-wide column blocks of each)
        for ours, theirs in [("attn.qkv.w", "attn.c_attn.weight"), ("attn.proj.w", "attn.c_proj.weight"),
                             ("mlp.fc.w", "mlp.c_fc.weight"), ("mlp.proj.w", "mlp.c_proj.weight")]:
            hf[p + theirs] = t[h + ours].T
    hf["transformer.ln_f.weight"], hf["transformer.ln_f.bias"] = t["lnf.w"], t["lnf.b"]
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg["vocab_size"], "n_positions": cfg["max_seq_len"], "n_ctx": cfg["max_seq_len"],
        "n_embd": cfg["n_embd"], "n_layer": cfg["n_layer"], "n_head": cfg["n_head"], "n_inner": cfg["ffn_hidden"],
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_first_dropout": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True, "use_cache": True, "torch_dtype": "float32",
    }
    if eot is not None:
        config["bos_token_id"] = config["eos_token_id"] = eot
    return hf, config


LAYOUT = {
    "block": "pre-LayerNorm: x = x + attn(ln1(x)); x = x + ffn(ln2(x)); logits = lnf(x) @ wte.T (lm head tied to wte)",
    "linear": "y = x @ W.T + b with W [out, in] (torch.nn.Linear); every linear layer has a bias except the lm "
              "head and the MoE router",
    "layernorm": "weight and bias, eps 1e-5",
    "wte": "[vocab_size, n_embd] (the engine pads it to a multiple of 128 rows; the zero padding is not exported)",
    "wpe": "[max_seq_len, n_embd], pos == learned only; indexed by the position inside the document",
    "hL.attn.qkv.w": "[(n_head + 2 n_kv_head) head_size, n_embd]: rows [Q | K | V], each part head-major (hs rows "
                     "per head); query head h reads kv head h // (n_head // n_kv_head)",
    "hL.attn.proj.w": "[n_embd, n_head head_size], input columns head-major",
    "attention": "scale 1/sqrt(head_size), causal inside each document: query i sees keys j with doc_start(i) <= j <= i, "
                 "doc_start(i) = the last end-of-text token at or before i",
    "alibi": "pos == alibi: score(i, j) -= slope_h (i - j); n heads a power of two: slope_h = 2^(-8 (h+1) / n); "
             "otherwise m = 2^floor(log2 n): the m slopes of m heads, then the even-indexed slopes (0, 2, 4, ...) "
             "of 2m heads, the first n - m of them",
    "hL.mlp.fc.w (swiglu)": "[2 ffn_hidden, n_embd]: rows [W1 | W3]; h = silu(W1 x + b1) * (W3 x + b3); "
                            "out = hL.mlp.proj.w h + hL.mlp.proj.b",
    "hL.mlp.fc.w (gelu)": "[ffn_hidden, n_embd]; h = gelu_tanh(fc x + b); out = proj h + b",
    "hL.moe.*": "layers l with (l + 1) % moe_every == 0 when n_expert > 0: router.w [E, n_embd] (no bias), scores = "
                "softmax(x router.w.T); expert-choice routing: each expert takes the ceil(capacity_factor * tokens / E) "
                "tokens it scores highest (ties to the lower token index) over the routing group (moe_group 0: the "
                "micro-batch, 1: the B tokens at one position); a token's output is the sum over the experts that took "
                "it of score * expert(x); expert e: SwiGLU with fc.w[e] [2 expert_hidden, n_embd] rows [W1 | W3], "
                "fc.b[e], proj.w[e] [n_embd, expert_hidden], proj.b[e]",
    "codes": "mlp 0 = swiglu, 1 = gelu; pos 0 = alibi, 1 = learned; moe_group 0 = batch, 1 = position",
}


def to_llmc(cfg, t, eot, why):
    config = {
        "architectures": ["LlmcGPT"], "model_type": "llmc",
        "note": f"not loadable by transformers: {why} has no exact transformers class; tensors keep llmc's names "
                "and layouts (see 'layout' and docs/ARCHITECTURE.md of the llmc engine)",
        "llmc": {k: cfg[k] for k in CONFIG_INTS + ["capacity_factor", "padded_vocab_size"]},
        "layout": LAYOUT, "torch_dtype": "float32",
    }
    if eot is not None:
        config["eos_token_id"] = eot
    return dict(t), config


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a ckpt_*.bin of train_gpt")
    ap.add_argument("out_dir", help="folder for model.safetensors and config.json (created)")
    ap.add_argument("--tokenizer", help="tokenizer.json to copy into out_dir (prepare_text.py --tokenizer bpe)")
    ap.add_argument("--eot", type=int, help="end-of-text id for config.json (default: GPT-2's 50256 for vocab "
                                            "50257, 256 for the byte tokenizer, the tokenizer.json's otherwise)")
    ap.add_argument("--no_verify", action="store_true", help="skip the checksum (large checkpoints)")
    args = ap.parse_args()
    try:
        from safetensors.numpy import save_file
    except ImportError:
        fail("needs safetensors and numpy: pip install -r scripts/requirements-tools.txt")

    fields, version, params = read_checkpoint(args.checkpoint, verify=not args.no_verify)
    cfg = config_of(fields, args.checkpoint)
    tensors = tensors_of(cfg, params, args.checkpoint)
    eot = args.eot
    if eot is None and args.tokenizer:
        try:
            eot = json.load(open(args.tokenizer))["model"]["vocab"].get("<|endoftext|>")
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail(f"--tokenizer {args.tokenizer}: not a tokenizers tokenizer.json ({e})")
    if eot is None:
        eot = {50257: 50256, 257: 256}.get(cfg["vocab_size"])
    why = gpt2_shaped(cfg)
    hf, config = to_gpt2(cfg, tensors, eot) if why is None else to_llmc(cfg, tensors, eot, why)
    # the file's name, never its local path: the folder is made to be uploaded
    config["llmc_checkpoint"] = {"file": os.path.basename(args.checkpoint), "step": fields.get("step"),
                                 "version": version}
    os.makedirs(args.out_dir, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in hf.items()},
              os.path.join(args.out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    if args.tokenizer:
        shutil.copyfile(args.tokenizer, os.path.join(args.out_dir, "tokenizer.json"))
    n = sum(v.size for v in hf.values())
    kind = "GPT2LMHeadModel" if why is None else f"llmc tensors ({why}: no transformers class)"
    print(f"wrote {args.out_dir}/model.safetensors ({len(hf)} tensors, {n} parameters) and config.json: {kind}")


if __name__ == "__main__":
    main()
