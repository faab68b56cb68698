#!/usr/bin/env python3
"""Check an exported model (scripts/export_hf.py) against our engine: the logits of one row of
tokens from the engine's forward (dev/bin/forward_logits on the checkpoint or model file) and
from the exported folder, computed by transformers (--engine transformers: needs torch and
transformers; AutoModelForCausalLM, which must load the folder without a missing or unexpected
key) or by a small numpy model written here from the architecture's definition over the exported
tensors, in float64 (--engine numpy, the default: what CI runs):

  GPT-2 (model_type gpt2)    learned positions, LayerNorm, tanh GELU, Conv1D [in, out] weights
  Llama / Qwen2 / Mistral    RMSNorm, rotate-half RoPE (rope_theta; llama3 frequency scaling),
                             grouped-query attention, SwiGLU (down(silu(gate x) * up x)), Qwen2's
                             q/k/v biases, a tied or an untied head

    make dev/bin/forward_logits
    python scripts/compare_hf.py out/run/ckpt_000000700.bin hf/run [--engine transformers] [--greedy 64]

The row is random tokens (--seed) seen as one document (positions 0..T-1 in both). Prints the
largest absolute difference, the relative one (max |diff| / max |logit|) and the relative L2
error; exits 1 when either relative figure exceeds --rtol (default 1e-5: fp32 against float64 or
fp32 with other summation orders). --greedy N also decodes N tokens greedily after the row's first
--prompt_len tokens in both (ours: one forward_logits call per token) and exits 1 when they differ.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

FORWARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev", "bin", "forward_logits")


def fail(msg):
    sys.exit(f"compare_hf.py: {msg}")


# ---- our engine

def engine_logits(checkpoint, tokens, vocab_size, forward=FORWARD):
    """dev/bin/forward_logits on one row (one document): float64 [T, vocab_size]."""
    tokens = np.asarray(tokens, dtype="<i4")
    with tempfile.TemporaryDirectory() as tmp:
        tokens.tofile(os.path.join(tmp, "tokens.bin"))
        r = subprocess.run([forward, checkpoint, os.path.join(tmp, "tokens.bin"), os.path.join(tmp, "out.bin")],
                           capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"{forward} failed: {r.stderr.strip()}")
        out = np.fromfile(os.path.join(tmp, "out.bin"), dtype="<f4")
    if out.size != len(tokens) * vocab_size:
        fail(f"{forward} wrote {out.size} logits, expected {len(tokens)} x {vocab_size}")
    return out.reshape(len(tokens), vocab_size).astype(np.float64)


def engine_greedy(checkpoint, prompt, n, vocab_size, forward=FORWARD):
    """n tokens decoded greedily after prompt by our engine (the whole row recomputed per token)."""
    row = [int(t) for t in prompt]
    for _ in range(n):
        row.append(int(engine_logits(checkpoint, row, vocab_size, forward)[-1].argmax()))
    return row[len(prompt):]


# ---- numpy references

def load_folder(folder):
    from safetensors.numpy import load_file
    try:
        cfg = json.load(open(os.path.join(folder, "config.json")))
    except (OSError, ValueError) as e:
        fail(f"{folder}/config.json: cannot read ({e}); make it with scripts/export_hf.py")
    w = load_file(os.path.join(folder, "model.safetensors"))
    return cfg, {k: v.astype(np.float64) for k, v in w.items()}


def numpy_gpt2(folder, tokens):
    """GPT-2 over the exported tensors by their Hugging Face names (Conv1D: y = x @ W + b)."""
    cfg, f64 = load_folder(folder)
    C, nh, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    hs, T = C // nh, len(tokens)

    def ln(x, p):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * f64[p + ".weight"] + f64[p + ".bias"]

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    x = f64["transformer.wte.weight"][tokens] + f64["transformer.wpe.weight"][:T]
    mask = np.tril(np.ones((T, T), dtype=bool))
    for l in range(cfg["n_layer"]):
        p = f"transformer.h.{l}."
        qkv = ln(x, p + "ln_1") @ f64[p + "attn.c_attn.weight"] + f64[p + "attn.c_attn.bias"]
        q, k, v = (qkv[:, i * C:(i + 1) * C].reshape(T, nh, hs).transpose(1, 0, 2) for i in range(3))
        att = q @ k.transpose(0, 2, 1) / np.sqrt(hs)
        att = np.where(mask, att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(1, 0, 2).reshape(T, C)
        x = x + y @ f64[p + "attn.c_proj.weight"] + f64[p + "attn.c_proj.bias"]
        h = gelu_tanh(ln(x, p + "ln_2") @ f64[p + "mlp.c_fc.weight"] + f64[p + "mlp.c_fc.bias"])
        x = x + h @ f64[p + "mlp.c_proj.weight"] + f64[p + "mlp.c_proj.bias"]
    return ln(x, "transformer.ln_f") @ f64["transformer.wte.weight"].T


def rope_inv_freq(cfg, hs):
    """The hs/2 inverse frequencies theta^(-2i/hs), rescaled by Llama 3.1's recipe when the config's
    rope scaling is llama3 (transformers 5: rope_parameters; 4: rope_theta and rope_scaling)."""
    rp = cfg.get("rope_parameters") or {}
    scaling = rp if rp else (cfg.get("rope_scaling") or {})
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    inv = theta ** (-np.arange(0, hs, 2, dtype=np.float64) / hs)
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        orig = scaling.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - low) / (high - low)
        inv = np.where(wavelen < orig / high, inv,                                  # high frequencies: kept
                       np.where(wavelen > orig / low, inv / factor,                 # low frequencies: / factor
                                (1 - smooth) * inv / factor + smooth * inv))        # between: interpolated
    elif kind != "default":
        fail(f"rope type {kind!r}: the numpy reference computes default and llama3 only")
    return inv


def numpy_llama(folder, tokens):
    """Llama / Qwen2 / Mistral (full attention) over the exported tensors by their Hugging Face names."""
    cfg, f64 = load_folder(folder)
    C, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hs, T, eps = cfg.get("head_dim") or C // nh, len(tokens), cfg["rms_norm_eps"]

    def rmsnorm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def linear(x, p):
        y = x @ f64[p + ".weight"].T
        return y + f64[p + ".bias"] if p + ".bias" in f64 else y

    # rotate-half RoPE: channel i is paired with i + hs/2, rotated by p * inv_freq_i
    ang = np.arange(T, dtype=np.float64)[:, None] * rope_inv_freq(cfg, hs)[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))  # [T, hs]

    def rope(x):  # [heads, T, hs]
        rot = np.concatenate([-x[..., hs // 2:], x[..., :hs // 2]], -1)
        return x * cos + rot * sin

    x = f64["model.embed_tokens.weight"][tokens]
    mask = np.tril(np.ones((T, T), dtype=bool))
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rmsnorm(x, f64[p + "input_layernorm.weight"])
        q = rope(linear(h, p + "self_attn.q_proj").reshape(T, nh, hs).transpose(1, 0, 2))
        k = rope(linear(h, p + "self_attn.k_proj").reshape(T, nkv, hs).transpose(1, 0, 2))
        v = linear(h, p + "self_attn.v_proj").reshape(T, nkv, hs).transpose(1, 0, 2)
        k, v = np.repeat(k, nh // nkv, axis=0), np.repeat(v, nh // nkv, axis=0)  # query head j reads kv head j // group
        att = np.where(mask, q @ k.transpose(0, 2, 1) / np.sqrt(hs), -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + linear((att @ v).transpose(1, 0, 2).reshape(T, nh * hs), p + "self_attn.o_proj")
        h = rmsnorm(x, f64[p + "post_attention_layernorm.weight"])
        g = linear(h, p + "mlp.gate_proj")
        x = x + linear(g / (1 + np.exp(-g)) * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    head = f64["lm_head.weight"] if "lm_head.weight" in f64 else f64["model.embed_tokens.weight"]
    return rmsnorm(x, f64["model.norm.weight"]) @ head.T


LLAMA_TYPES = ("llama", "qwen2", "mistral")


def numpy_logits(folder, tokens):
    cfg = json.load(open(os.path.join(folder, "config.json")))
    return (numpy_gpt2 if cfg["model_type"] == "gpt2" else numpy_llama)(folder, list(tokens))


# ---- transformers

def transformers_model(folder):
    import torch
    from transformers import AutoModelForCausalLM
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    except TypeError:  # transformers 4 before dtype=
        model, info = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, output_loading_info=True)
    bad = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if bad or info.get("error_msgs"):
        fail(f"{folder}: transformers loaded it with {bad or info['error_msgs']}")
    return model.eval()


def transformers_logits(folder, tokens, model=None):
    import torch
    model = model or transformers_model(folder)
    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0].double().numpy()


def transformers_greedy(folder, prompt, n, model=None):
    import torch
    model = model or transformers_model(folder)
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             num_beams=1, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def reference_greedy(folder, prompt, n):
    row = list(prompt)
    for _ in range(n):
        row.append(int(numpy_logits(folder, row)[-1].argmax()))
    return row[len(prompt):]


def diff_line(what, ours, theirs):
    """(max |diff|, max |diff| / max |theirs|, relative L2) and the line that says them."""
    diff = np.abs(ours - theirs)
    rel_max = diff.max() / max(np.abs(theirs).max(), 1e-30)
    rel_l2 = np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30)
    same = float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))
    return (diff.max(), rel_max, rel_l2), (
        f"{what}: max |diff| {diff.max():.3e} (logits up to {np.abs(theirs).max():.3f}; relative {rel_max:.3e}), "
        f"relative L2 {rel_l2:.3e}, same argmax {100 * same:.0f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint or model file of ours")
    ap.add_argument("hf_dir", help="its export (scripts/export_hf.py)")
    ap.add_argument("--engine", choices=["numpy", "transformers"], default="numpy")
    ap.add_argument("--forward", default=FORWARD, help="our engine's logits tool (make dev/bin/forward_logits)")
    ap.add_argument("--tokens", type=int, default=0, help="row length (default: the model's context, at most 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--greedy", type=int, default=0, help="also decode this many tokens greedily in both")
    ap.add_argument("--prompt_len", type=int, default=8, help="--greedy: the prompt is the row's first tokens")
    args = ap.parse_args()
    try:
        cfg = json.load(open(os.path.join(args.hf_dir, "config.json")))
    except (OSError, ValueError) as e:
        fail(f"{args.hf_dir}/config.json: cannot read ({e}); make it with scripts/export_hf.py")
    mt = cfg.get("model_type")
    if mt != "gpt2" and mt not in LLAMA_TYPES:
        fail(f"{args.hf_dir} is not a GPT-2, Llama or Qwen2 export (model_type {mt})")
    V = cfg["vocab_size"]
    ctx = cfg["n_positions"] if mt == "gpt2" else cfg["max_position_embeddings"]
    T = args.tokens or min(64, ctx)
    tokens = np.random.default_rng(args.seed).integers(0, V, T).astype("<i4")
    ours = engine_logits(args.checkpoint, tokens, V, args.forward)
    model = transformers_model(args.hf_dir) if args.engine == "transformers" else None
    theirs = numpy_logits(args.hf_dir, tokens) if model is None else transformers_logits(args.hf_dir, tokens, model)
    (_, rel_max, rel_l2), line = diff_line(f"{args.engine} vs our engine, {T} tokens x {V} logits", ours, theirs)
    print(f"compare_hf.py: {line}")
    ok = rel_max <= args.rtol and rel_l2 <= args.rtol
    if args.greedy:
        prompt = tokens[:args.prompt_len].tolist()
        a = engine_greedy(args.checkpoint, prompt, args.greedy, V, args.forward)
        b = reference_greedy(args.hf_dir, prompt, args.greedy) if model is None else \
            transformers_greedy(args.hf_dir, prompt, args.greedy, model)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"compare_hf.py: greedy decoding of {args.greedy} tokens after {len(prompt)}: "
              + ("the same tokens" if a == b else f"differs from token {same} (ours {a[same:same + 4]}, "
                                                  f"{args.engine} {b[same:same + 4]})"))
        ok = ok and a == b
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
