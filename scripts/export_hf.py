#!/usr/bin/env python3
"""Export a train_gpt checkpoint (or a model file of scripts/import_hf.py) as a Hugging Face model
folder: model.safetensors + config.json (+ the tokenizer's files).

    python scripts/export_hf.py out/run/ckpt_000000700.bin hf/run [--tokenizer data/x/tokenizer.json]

Llama-shaped models (--pos rope --norm rmsnorm, SwiGLU, dense; --bias none or qkv) become a
transformers LlamaForCausalLM (bias none) or Qwen2ForCausalLM (bias qkv: q/k/v biases only):
model.embed_tokens, model.layers.N.self_attn.{q,k,v,o}_proj (the row blocks of our attn.qkv: RoPE
is the rotate-half convention of both, so no permutation), mlp.{gate,up}_proj (the halves of our
mlp.fc, [W1 | W3]) and down_proj, input_layernorm / post_attention_layernorm / model.norm (RMSNorm),
lm_head.weight only when the head is untied (tie_word_embeddings false); the vocabulary unpadded;
rope_theta and the llama3 rope scaling written for transformers 4 (rope_theta, rope_scaling) and 5
(rope_parameters); rms_norm_eps; float32:

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("hf/run")

A model imported by scripts/import_hf.py and exported unchanged gives the original tensors bit for
bit (test/test_python.sh checks it).

GPT-2-shaped models (--mlp gelu --pos learned, n_kv_head = n_head, ffn_hidden = 4 n_embd, dense,
LayerNorm, biases everywhere, tied head) become a transformers GPT2LMHeadModel: GPT-2's tensor names
(transformer.h.N.attn.c_attn.weight, ...), its Conv1D weights, which are [in, out] where ours are
[out, in] (so every matrix is transposed), the vocabulary unpadded (vocab_size rows of wte; the lm
head is tied to it, so no lm_head.weight is stored), activation gelu_new (the tanh GELU),
LayerNorm eps 1e-5:

    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained("hf/run")

Transformers attends over the whole row; our engine restarts attention and positions at every
document token (the shards' eot), so the two agree on text within one document (exactly what
they do at inference).

Other shapes (ALiBi, grouped-query attention with GPT-2's blocks, SwiGLU with learned positions,
expert-choice MoE, ...) have no transformers class that computes them exactly. They are written
with our tensor names and layouts ([out, in], wte unpadded) and a config.json with
"model_type": "llmc" whose "llmc" entry holds our config and "layout" says what each tensor means
(the same as docs/ARCHITECTURE.md).

--tokenizer FILE_OR_DIR: a tokenizer.json, or a folder holding one (prepare_text.py's out_dir, a
Hugging Face model folder), is copied beside the model with tokenizer_config.json and
special_tokens_map.json when they are beside it; their bos_token / eos_token give config.json's
bos_token_id / eos_token_id; where they name none, the <|endoftext|> token is taken (prepare_text.py
--tokenizer bpe), and for the BOS the shards' document token when tokenizer.bin is beside (Qwen2's
config has its <|endoftext|> as bos_token_id, the token its documents start with in our shards).

The checkpoint (llmc/io/checkpoint.h, version 2 or 1; or a model-only file, field model_only = 1,
the params alone) is read here: its header, its named config fields (the fields added with the
Llama shape take their old values when absent) and the fp32 parameters (the Adam moments are not
exported); a version 2 checksum is verified (--no_verify skips that, for a quick export of a large
model).
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
    sys.exit(f"{os.path.basename(sys.argv[0]) or 'export_hf.py'}: {msg}")


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
    """Returns (fields: name -> int|float, version, params: float32 array in table order).
    A checkpoint holds params, Adam m and Adam v; a model-only file (field model_only = 1,
    scripts/import_hf.py) the params alone. Both verify the same way."""
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
            fail(f"{path}: the header is cut short at {size} bytes (truncated or corrupt)")
    n_params = struct.unpack("<Q", tail[:8])[0]
    stored = struct.unpack("<Q", tail[8:16])[0] if version >= 2 else None
    header = head + raw_fields + tail[:8]
    data_offset = len(header) + (8 if version >= 2 else 0)
    fields = {}
    for k in range(n_fields):
        rec = raw_fields[48 * k:48 * (k + 1)]
        name = rec[:32].split(b"\0", 1)[0].decode(errors="replace")
        kind = chr(rec[32])
        if kind == "i":
            fields[name] = struct.unpack("<q", rec[40:48])[0]
        elif kind == "f":
            fields[name] = struct.unpack("<d", rec[40:48])[0]
        else:
            fail(f"{path}: field {k} has kind {rec[32]}, expected 'i' or 'f'")
    arrays = 1 if fields.get("model_only") == 1 else 3
    if size != data_offset + 4 * arrays * n_params:
        fail(f"{path}: {'model file' if arrays == 1 else 'checkpoint'} is {size} bytes, expected "
             f"{data_offset + 4 * arrays * n_params} for {n_params} parameters (truncated or corrupt?)")
    data = np.memmap(path, dtype="<u4", mode="r", offset=data_offset, shape=(arrays * n_params,))
    if verify and version >= 2:
        h = 0x243F6A8885A308D3
        for b in header:
            h = _splitmix_int(h ^ b)
        total = (h + _hash_words(data, 0)) & MASK64
        if total != stored:
            fail(f"{path}: checksum mismatch (stored {stored:016x}, content {total:016x}): the file is corrupt")
    params = np.asarray(data[:n_params]).view("<f4")
    return fields, version, params


def header_bytes(fields, n_params):
    """magic, version 2, the named fields ([(name, 'i'|'f', value)]) and n_params, as checkpoint.h
    writes them (the checksum follows)."""
    out = bytearray(b"LLMCCKPT" + struct.pack("<II", 2, len(fields)))
    for name, kind, value in fields:
        if len(name.encode()) >= 32:
            fail(f"field name too long: {name}")
        rec = bytearray(48)
        rec[:len(name)] = name.encode()
        rec[32] = ord(kind)
        rec[40:48] = struct.pack("<q", int(value)) if kind == "i" else struct.pack("<d", float(value))
        out += rec
    return bytes(out + struct.pack("<Q", n_params))


def write_model_file(path, cfg, n_params, chunks):
    """A model-only file (checkpoint version 2, field model_only = 1, the params array alone): the
    config's fields, then the float32 arrays `chunks` yields in table order (n_params in all),
    streamed; the checksum (header hash + per-word terms) is written last, then the file renamed
    into place. What train_gpt --init_from and dev/bin/forward_logits read."""
    fields = [("config." + k, "i", cfg[k]) for k in CONFIG_INTS] + \
             [("config." + k, "f", cfg[k]) for k in CONFIG_REALS] + [("model_only", "i", 1)]
    header = header_bytes(fields, n_params)
    h = 0x243F6A8885A308D3
    for b in header:
        h = _splitmix_int(h ^ b)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(header + b"\0" * 8)
            at = 0
            for chunk in chunks:
                words = np.ascontiguousarray(chunk, dtype="<f4").reshape(-1).view("<u4")
                h = (h + _hash_words(words, at)) & MASK64
                f.write(memoryview(words))
                at += len(words)
            if at != n_params:
                fail(f"internal error: wrote {at} parameters, the table has {n_params}")
            f.seek(len(header))
            f.write(struct.pack("<Q", h))
        os.replace(tmp, path)
    except OSError as e:
        fail(f"{path}: cannot write ({e.strerror})")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---- our config and parameter table (build_param_table in train_gpt.cu)

CONFIG_INTS = ["vocab_size", "n_layer", "n_embd", "n_head", "n_kv_head", "ffn_hidden", "max_seq_len", "mlp", "pos",
               "n_expert", "moe_every", "moe_group", "expert_hidden", "norm", "bias", "tie_embeddings", "rope_scaling",
               "rope_original_max_pos"]
CONFIG_REALS = ["capacity_factor", "norm_eps", "rope_theta", "rope_factor", "rope_low_freq_factor",
                "rope_high_freq_factor"]
# the fields added with the Llama / Qwen2 shape: a file written before has these values
ADDED_LATER = {"norm": 0, "bias": 0, "tie_embeddings": 1, "rope_scaling": 0, "rope_original_max_pos": 8192,
               "norm_eps": 1e-5, "rope_theta": 10000.0, "rope_factor": 8.0, "rope_low_freq_factor": 1.0,
               "rope_high_freq_factor": 4.0}
# codes: mlp 0 swiglu, 1 gelu; pos 0 alibi, 1 learned, 2 rope; norm 0 layernorm, 1 rmsnorm;
# bias 0 all (GPT-2), 1 qkv (Qwen2), 2 none (Llama); rope_scaling 0 none, 1 llama3
POS_LEARNED, POS_ROPE = 1, 2
NORM_RMSNORM = 1
BIAS_ALL, BIAS_QKV, BIAS_NONE = 0, 1, 2


def config_of(fields, path):
    cfg = {}
    for k in CONFIG_INTS + CONFIG_REALS:
        if "config." + k in fields:
            cfg[k] = fields["config." + k]
        elif k in ADDED_LATER:
            cfg[k] = ADDED_LATER[k]
        elif k == "capacity_factor":
            cfg[k] = 0.0
        else:
            fail(f"{path}: checkpoint has no field config.{k}")
        cfg[k] = int(cfg[k]) if k in CONFIG_INTS else float(cfg[k])
    cfg["padded_vocab_size"] = (cfg["vocab_size"] + 127) // 128 * 128
    return cfg


def is_moe(cfg, layer):
    return cfg["n_expert"] > 0 and (layer + 1) % cfg["moe_every"] == 0


def param_table(cfg):
    """[(name, shape, offset)] in the flat buffer's order, each tensor at a multiple of 8 elements;
    the total (build_param_table in llmc/gpt/config.h)."""
    C, hs = cfg["n_embd"], cfg["n_embd"] // cfg["n_head"]
    qkv = (cfg["n_head"] + 2 * cfg["n_kv_head"]) * hs
    H = cfg["ffn_hidden"]
    fc = 2 * H if cfg["mlp"] == 0 else H
    E, He = cfg["n_expert"], cfg["expert_hidden"]
    ln = cfg.get("norm", 0) != NORM_RMSNORM          # LayerNorm has a bias, RMSNorm none
    qkv_b = cfg.get("bias", 0) != BIAS_NONE          # Qwen2 and GPT-2
    lin_b = cfg.get("bias", 0) == BIAS_ALL           # GPT-2's other linear layers
    table, offset = [], 0

    def add(name, shape):
        nonlocal offset
        table.append((name, tuple(shape), offset))
        offset += (int(np.prod(shape)) + 7) // 8 * 8

    add("wte", [cfg["padded_vocab_size"], C])
    if cfg["pos"] == POS_LEARNED:
        add("wpe", [cfg["max_seq_len"], C])
    for l in range(cfg["n_layer"]):
        h = f"h{l}."
        add(h + "ln1.w", [C])
        if ln: add(h + "ln1.b", [C])
        add(h + "attn.qkv.w", [qkv, C])
        if qkv_b: add(h + "attn.qkv.b", [qkv])
        add(h + "attn.proj.w", [C, cfg["n_head"] * hs])
        if lin_b: add(h + "attn.proj.b", [C])
        add(h + "ln2.w", [C])
        if ln: add(h + "ln2.b", [C])
        if is_moe(cfg, l):
            add(h + "moe.router.w", [E, C])
            add(h + "moe.fc.w", [E, 2 * He, C])
            if lin_b: add(h + "moe.fc.b", [E, 2 * He])
            add(h + "moe.proj.w", [E, C, He])
            if lin_b: add(h + "moe.proj.b", [E, C])
        else:
            add(h + "mlp.fc.w", [fc, C])
            if lin_b: add(h + "mlp.fc.b", [fc])
            add(h + "mlp.proj.w", [C, H])
            if lin_b: add(h + "mlp.proj.b", [C])
    add("lnf.w", [C])
    if ln: add("lnf.b", [C])
    if not cfg.get("tie_embeddings", 1):
        add("lm_head", [cfg["padded_vocab_size"], C])
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
    if "lm_head" in out:
        out["lm_head"] = out["lm_head"][:cfg["vocab_size"]]
    return out


def gpt2_shaped(cfg):
    """None when the config is GPT-2's shape, else what differs."""
    if cfg["mlp"] != 1:
        return "SwiGLU MLP"
    if cfg["pos"] != POS_LEARNED:
        return "rotary positions" if cfg["pos"] == POS_ROPE else "ALiBi positions"
    if cfg["norm"] != 0:
        return "RMSNorm"
    if cfg["bias"] != BIAS_ALL:
        return "linear layers without biases"
    if not cfg["tie_embeddings"]:
        return "an untied lm head"
    if cfg["n_kv_head"] != cfg["n_head"]:
        return "grouped-query attention"
    if cfg["ffn_hidden"] != 4 * cfg["n_embd"]:
        return f"ffn_hidden {cfg['ffn_hidden']} != 4 * n_embd"
    if cfg["n_expert"] > 0:
        return "mixture of experts"
    return None


def llama_shaped(cfg):
    """None when the config is Llama's (bias none) or Qwen2's (bias qkv) shape, else what differs."""
    if cfg["pos"] != POS_ROPE:
        return "learned positions" if cfg["pos"] == POS_LEARNED else "ALiBi positions"
    if cfg["norm"] != NORM_RMSNORM:
        return "LayerNorm"
    if cfg["mlp"] != 0:
        return "GELU MLP"
    if cfg["bias"] == BIAS_ALL:
        return "biases in every linear layer"
    if cfg["n_expert"] > 0:
        return "mixture of experts"
    return None


def eps_text(eps):
    """norm_eps is a float32 in the engine: the shortest decimal that is that float (1e-05, not
    9.999999747378752e-06; transformers adds eps in the activations' dtype)."""
    return float(str(np.float32(eps)))


# ---- the exports

def to_gpt2(cfg, t, ids):
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
    eot = ids["eos"]
    if eot is not None:
        config["bos_token_id"] = config["eos_token_id"] = eot
    return hf, config


def to_llama(cfg, t, ids):
    """LlamaForCausalLM (bias none) or Qwen2ForCausalLM (bias qkv): the q/k/v projections are the
    row blocks of attn.qkv (RoPE is the rotate-half convention of both, applied to what the
    projections give: no permutation), gate/up the row halves of mlp.fc ([W1 | W3])."""
    C, nh, nkv = cfg["n_embd"], cfg["n_head"], cfg["n_kv_head"]
    hs, H = C // nh, cfg["ffn_hidden"]
    qwen2 = cfg["bias"] == BIAS_QKV
    hf = {"model.embed_tokens.weight": t["wte"]}
    cuts = [0, nh * hs, (nh + nkv) * hs, (nh + 2 * nkv) * hs]
    for l in range(cfg["n_layer"]):
        h, p = f"h{l}.", f"model.layers.{l}."
        hf[p + "input_layernorm.weight"] = t[h + "ln1.w"]
        for k, proj in enumerate(["q_proj", "k_proj", "v_proj"]):
            hf[p + f"self_attn.{proj}.weight"] = t[h + "attn.qkv.w"][cuts[k]:cuts[k + 1]]
            if qwen2:
                hf[p + f"self_attn.{proj}.bias"] = t[h + "attn.qkv.b"][cuts[k]:cuts[k + 1]]
        hf[p + "self_attn.o_proj.weight"] = t[h + "attn.proj.w"]
        hf[p + "post_attention_layernorm.weight"] = t[h + "ln2.w"]
        hf[p + "mlp.gate_proj.weight"] = t[h + "mlp.fc.w"][:H]
        hf[p + "mlp.up_proj.weight"] = t[h + "mlp.fc.w"][H:]
        hf[p + "mlp.down_proj.weight"] = t[h + "mlp.proj.w"]
    hf["model.norm.weight"] = t["lnf.w"]
    tied = bool(cfg["tie_embeddings"])
    if not tied:
        hf["lm_head.weight"] = t["lm_head"]
    rope = None
    if cfg["rope_scaling"] == 1:
        rope = {"rope_type": "llama3", "factor": cfg["rope_factor"], "low_freq_factor": cfg["rope_low_freq_factor"],
                "high_freq_factor": cfg["rope_high_freq_factor"],
                "original_max_position_embeddings": cfg["rope_original_max_pos"]}
    config = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": cfg["vocab_size"], "hidden_size": C, "intermediate_size": H,
        "num_hidden_layers": cfg["n_layer"], "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hs,
        "hidden_act": "silu", "max_position_embeddings": cfg["max_seq_len"], "rms_norm_eps": eps_text(cfg["norm_eps"]),
        # transformers 4 reads rope_theta / rope_scaling, 5 rope_parameters (and converts the former)
        "rope_theta": cfg["rope_theta"], "rope_scaling": rope,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"]} if rope is None
        else dict(rope, rope_theta=cfg["rope_theta"]),
        "tie_word_embeddings": tied, "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": "float32", "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
    }
    if qwen2:
        config.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg["n_layer"]})
    else:
        config.update({"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1})
    return hf, config


LAYOUT = {
    "block": "pre-norm: x = x + attn(ln1(x)); x = x + ffn(ln2(x)); logits = lnf(x) @ W.T, W = wte "
             "(tie_embeddings 1) or lm_head [vocab_size, n_embd] (tie_embeddings 0)",
    "linear": "y = x @ W.T + b with W [out, in] (torch.nn.Linear); bias 0 (all): every linear layer has a bias except "
              "the lm head and the MoE router; bias 1 (qkv): only attn.qkv; bias 2 (none): no linear layer",
    "norm": "norm 0: LayerNorm, weight and bias, eps 1e-5; norm 1: RMSNorm y = x / sqrt(mean(x^2) + norm_eps) * w "
            "(no bias)",
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
    "rope": "pos == rope: each q and k head (as the projection gives it) rotated, rotate-half pairing (channel i with "
            "i + hs/2) by the angle p inv_freq_i, p the position inside the document, inv_freq_i = "
            "rope_theta^(-2i/hs), with rope_scaling 1 (llama3) rescaled as Llama 3.1 (rope_factor, "
            "rope_low_freq_factor, rope_high_freq_factor, rope_original_max_pos)",
    "hL.mlp.fc.w (swiglu)": "[2 ffn_hidden, n_embd]: rows [W1 | W3]; h = silu(W1 x + b1) * (W3 x + b3); "
                            "out = hL.mlp.proj.w h + hL.mlp.proj.b",
    "hL.mlp.fc.w (gelu)": "[ffn_hidden, n_embd]; h = gelu_tanh(fc x + b); out = proj h + b",
    "hL.moe.*": "layers l with (l + 1) % moe_every == 0 when n_expert > 0: router.w [E, n_embd] (no bias), scores = "
                "softmax(x router.w.T); expert-choice routing: each expert takes the ceil(capacity_factor * tokens / E) "
                "tokens it scores highest (ties to the lower token index) over the routing group (moe_group 0: the "
                "micro-batch, 1: the B tokens at one position); a token's output is the sum over the experts that took "
                "it of score * expert(x); expert e: SwiGLU with fc.w[e] [2 expert_hidden, n_embd] rows [W1 | W3], "
                "fc.b[e], proj.w[e] [n_embd, expert_hidden], proj.b[e]",
    "codes": "mlp 0 = swiglu, 1 = gelu; pos 0 = alibi, 1 = learned, 2 = rope; norm 0 = layernorm, 1 = rmsnorm; "
             "bias 0 = all, 1 = qkv, 2 = none; rope_scaling 0 = none, 1 = llama3; moe_group 0 = batch, 1 = position",
}


def to_llmc(cfg, t, ids, why):
    config = {
        "architectures": ["LlmcGPT"], "model_type": "llmc",
        "note": f"not loadable by transformers: {why} has no exact transformers class; tensors keep llmc's names "
                "and layouts (see 'layout' and docs/ARCHITECTURE.md of the llmc engine)",
        "llmc": {k: cfg[k] for k in CONFIG_INTS + CONFIG_REALS + ["padded_vocab_size"]},
        "layout": LAYOUT, "torch_dtype": "float32",
    }
    if ids["eos"] is not None:
        config["eos_token_id"] = ids["eos"]
    return dict(t), config


# ---- the tokenizer files beside the model

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def tokenizer_ids(path):
    """(files to copy, {"bos": id|None, "eos": id|None}) of --tokenizer: a tokenizer.json or a folder
    holding one (prepare_text.py's out_dir, a Hugging Face model folder); tokenizer_config.json and
    special_tokens_map.json beside it come along and name the BOS / EOS; what they leave unnamed is
    the <|endoftext|> token when the vocabulary has it (prepare_text.py --tokenizer bpe), and the BOS
    the shards' document token when tokenizer.bin is beside (Qwen2: <|endoftext|>)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    tj = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        tok = json.load(open(tj, encoding="utf-8"))
        vocab = dict(tok["model"]["vocab"]) if isinstance(tok["model"].get("vocab"), dict) else \
            {p[0]: i for i, p in enumerate(tok["model"].get("vocab") or [])}  # Unigram: [[piece, score], ...]
        for a in tok.get("added_tokens") or []:
            vocab[a["content"]] = a["id"]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        fail(f"--tokenizer {tj}: not a tokenizers tokenizer.json ({e})")
    files = [tj] + [os.path.join(folder, n) for n in TOKENIZER_FILES[1:] if os.path.isfile(os.path.join(folder, n))]
    named = {}
    for n in reversed(TOKENIZER_FILES[1:]):  # tokenizer_config.json has the last word
        p = os.path.join(folder, n)
        if os.path.isfile(p):
            try:
                d = json.load(open(p, encoding="utf-8"))
            except (OSError, ValueError) as e:
                fail(f"{p}: not JSON ({e})")
            for k in ("bos", "eos"):
                if f"{k}_token" in d:
                    v = d[f"{k}_token"]
                    named[k] = v.get("content") if isinstance(v, dict) else v
    ids = {}
    for k in ("bos", "eos"):
        text = named.get(k)
        if text is not None and text not in vocab:
            fail(f"--tokenizer {tj}: its {k}_token {text!r} is not in the vocabulary")
        ids[k] = vocab[text] if text is not None else vocab.get("<|endoftext|>")
    # no BOS named: the token that starts the documents (prepare_text.py's tokenizer.bin says it; Qwen2's
    # config.json has its <|endoftext|> as bos_token_id too)
    vb = os.path.join(folder, "tokenizer.bin")
    if not named.get("bos") and os.path.isfile(vb):
        with open(vb, "rb") as f:
            head = f.read(24)
        if head[:8] == b"LLMCVOCB":
            ids["bos"] = struct.unpack("<I", head[16:20])[0]
    return files, ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a ckpt_*.bin of train_gpt, or a model file of scripts/import_hf.py")
    ap.add_argument("out_dir", help="folder for model.safetensors and config.json (created)")
    ap.add_argument("--tokenizer", help="tokenizer.json, or a folder holding it (prepare_text.py's out_dir, a Hugging "
                                        "Face model folder), to copy into out_dir with tokenizer_config.json and "
                                        "special_tokens_map.json when they are beside it")
    ap.add_argument("--eot", type=int, help="end-of-text id for config.json (default: GPT-2's 50256 for vocab "
                                            "50257, 256 for the byte tokenizer, the tokenizer's otherwise)")
    ap.add_argument("--no_verify", action="store_true", help="skip the checksum (large checkpoints)")
    args = ap.parse_args()
    try:
        from safetensors.numpy import save_file
    except ImportError:
        fail("needs safetensors and numpy: pip install -r scripts/requirements-tools.txt")

    fields, version, params = read_checkpoint(args.checkpoint, verify=not args.no_verify)
    cfg = config_of(fields, args.checkpoint)
    tensors = tensors_of(cfg, params, args.checkpoint)
    files, ids = tokenizer_ids(args.tokenizer) if args.tokenizer else ([], {"bos": None, "eos": None})
    if args.eot is not None:
        ids["eos"] = args.eot
    if ids["eos"] is None and not args.tokenizer:
        ids["eos"] = {50257: 50256, 257: 256}.get(cfg["vocab_size"])
    for k, v in ids.items():
        if v is not None and not 0 <= v < cfg["vocab_size"]:
            fail(f"the {k} token id {v} is outside the model's vocab_size {cfg['vocab_size']}")
    why_not_gpt2, why_not_llama = gpt2_shaped(cfg), llama_shaped(cfg)
    if why_not_gpt2 is None:
        (hf, config), kind = to_gpt2(cfg, tensors, ids), "GPT2LMHeadModel"
    elif why_not_llama is None:
        (hf, config), kind = to_llama(cfg, tensors, ids), None
        kind = config["architectures"][0]
    else:
        why = why_not_gpt2 if cfg["pos"] != POS_ROPE else why_not_llama
        (hf, config), kind = to_llmc(cfg, tensors, ids, why), f"llmc tensors ({why}: no transformers class)"
    # the file's name, never its local path: the folder is made to be uploaded
    config["llmc_checkpoint"] = {"file": os.path.basename(args.checkpoint), "step": fields.get("step"),
                                 "version": version}
    os.makedirs(args.out_dir, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in hf.items()},
              os.path.join(args.out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    for src in files:
        dst = os.path.join(args.out_dir, os.path.basename(src))
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)
    n = sum(v.size for v in hf.values())
    print(f"wrote {args.out_dir}/model.safetensors ({len(hf)} tensors, {n} parameters) and config.json: {kind}"
          + (f"; {', '.join(os.path.basename(p) for p in files)}" if files else ""))


if __name__ == "__main__":
    main()
