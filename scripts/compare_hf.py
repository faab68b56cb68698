#!/usr/bin/env python3
"""Check an exported GPT-2 (scripts/export_hf.py) against our engine: the logits of one row of
tokens from the engine's forward (dev/bin/forward_logits on the checkpoint) and from the exported
model folder, computed by transformers' GPT2LMHeadModel (--engine transformers: needs torch and
transformers) or by a small numpy GPT-2 written here from GPT-2's definition over the exported
tensors (--engine numpy, the default: what CI runs).

    make dev/bin/forward_logits
    python scripts/compare_hf.py out/run/ckpt_000000700.bin hf/run [--engine transformers]

Prints the largest absolute and relative differences; exits 1 when the relative L2 error of the
logits exceeds --rtol (default 1e-5: fp32 in both, different summation orders).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def numpy_gpt2(folder, tokens):
    """GPT-2 over the exported tensors by their Hugging Face names (Conv1D: y = x @ W + b)."""
    from safetensors.numpy import load_file
    w = load_file(os.path.join(folder, "model.safetensors"))
    cfg = json.load(open(os.path.join(folder, "config.json")))
    C, nh, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    hs, T = C // nh, len(tokens)
    f64 = {k: v.astype(np.float64) for k, v in w.items()}

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


def transformers_gpt2(folder, tokens):
    import torch
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double().numpy()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("hf_dir")
    ap.add_argument("--engine", choices=["numpy", "transformers"], default="numpy")
    ap.add_argument("--forward", default=os.path.join(os.path.dirname(__file__), "..", "dev", "bin", "forward_logits"),
                    help="our engine's logits tool (make dev/bin/forward_logits)")
    ap.add_argument("--tokens", type=int, default=0, help="row length (default: the model's context, at most 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rtol", type=float, default=1e-5)
    args = ap.parse_args()
    try:
        cfg = json.load(open(os.path.join(args.hf_dir, "config.json")))
    except (OSError, ValueError) as e:
        sys.exit(f"compare_hf.py: {args.hf_dir}/config.json: cannot read ({e}); make it with scripts/export_hf.py")
    if cfg.get("model_type") != "gpt2":
        sys.exit(f"compare_hf.py: {args.hf_dir} is not a GPT-2 export (model_type {cfg.get('model_type')})")
    T = args.tokens or min(64, cfg["n_positions"])
    tokens = np.random.default_rng(args.seed).integers(0, cfg["vocab_size"], T).astype("<i4")
    with tempfile.TemporaryDirectory() as tmp:
        tokens.tofile(os.path.join(tmp, "tokens.bin"))
        r = subprocess.run([args.forward, args.checkpoint, os.path.join(tmp, "tokens.bin"), os.path.join(tmp, "out.bin")],
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"compare_hf.py: {args.forward} failed: {r.stderr.strip()}")
        ours = np.fromfile(os.path.join(tmp, "out.bin"), dtype="<f4").reshape(T, cfg["vocab_size"]).astype(np.float64)
    theirs = (numpy_gpt2 if args.engine == "numpy" else transformers_gpt2)(args.hf_dir, tokens.tolist())
    diff = np.abs(ours - theirs)
    rel_l2 = np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30)
    same_argmax = float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))
    print(f"compare_hf.py: {args.engine} vs our engine, {T} tokens x {cfg['vocab_size']} logits: max |diff| "
          f"{diff.max():.3e} (logits up to {np.abs(theirs).max():.3f}), relative L2 {rel_l2:.3e}, "
          f"same argmax {100 * same_argmax:.0f}%")
    sys.exit(0 if rel_l2 <= args.rtol else 1)


if __name__ == "__main__":
    main()
