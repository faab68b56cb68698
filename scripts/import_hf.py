#!/usr/bin/env python3
"""Import a Hugging Face Llama, Qwen2 or Mistral model as a train_gpt model file.

    python scripts/import_hf.py HF_DIR OUT.bin
    ./train_gpt_cpu --init_from OUT.bin -i "data/x/x_train_*.bin" ...     # fine-tune it
    python dev/data/prepare_text.py texts/ --tokenizer HF_DIR --out_dir data/x   # its tokenizer's shards

HF_DIR is a transformers folder of a LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM:
config.json and model.safetensors, or the shards a model.safetensors.index.json lists; tensors in
float32, float16 or bfloat16 (bf16 is widened to fp32 exactly: its 16 bits are the high half of the
float32). OUT.bin is a model-only file: the checkpoint format (llmc/io/checkpoint.h, version 2)
with the config.* fields, model_only = 1 and the parameters alone (no Adam moments), checksummed as
a checkpoint; train_gpt --init_from starts from it (fresh AdamW state, step 0), dev/bin/forward_logits
and scripts/export_hf.py read it.

The mapping (our parameter table, llmc/gpt/config.h; docs/INTEROP.md):
  model.embed_tokens          -> wte, padded with zero rows to a multiple of 128
  layers.N.input_layernorm    -> hN.ln1.w          post_attention_layernorm -> hN.ln2.w
  self_attn.{q,k,v}_proj      -> hN.attn.qkv.w rows [Q | K | V] (and .b: Qwen2's q/k/v biases), as
                                 they are: RoPE is the rotate-half convention in both engines
  self_attn.o_proj            -> hN.attn.proj.w
  mlp.gate_proj, mlp.up_proj  -> hN.mlp.fc.w rows [gate | up] (h = silu(gate x) * (up x))
  mlp.down_proj               -> hN.mlp.proj.w
  model.norm                  -> lnf.w             lm_head -> lm_head (untied), absent when tied
and the config: pos rope, norm rmsnorm (norm_eps = rms_norm_eps), mlp swiglu, bias none (Llama,
Mistral) or qkv (Qwen2), ffn_hidden = intermediate_size, max_seq_len = max_position_embeddings,
n_kv_head = num_key_value_heads, rope_theta, rope scaling none or llama3 (factor, low_freq_factor,
high_freq_factor, original_max_position_embeddings); config.json in transformers 4's form
(rope_theta, rope_scaling with "rope_type" or "type") or 5's (rope_parameters). A key transformers
defaults when absent takes the class's default, as from_pretrained would.

What the engine cannot compute exactly is refused (exit 1, one line naming the file and the field),
never approximated: another architecture (MoE variants included), a rope scaling other than llama3
(linear, dynamic, yarn, longrope, ...), partial rotary, a sliding window in use (Mistral's
sliding_window below max_position_embeddings, Qwen2's use_sliding_window or a sliding layer type),
biases other than Qwen2's q/k/v (attention_bias / mlp_bias true), head_dim != hidden_size /
num_attention_heads, hidden_act other than silu, quantized weights, tensors missing, unexpected, of
the wrong shape, of another dtype or not finite.
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_hf import ADDED_LATER, BIAS_NONE, BIAS_QKV, POS_ROPE, NORM_RMSNORM, param_table, write_model_file  # noqa: E402

ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
# transformers' class defaults (5.x; the same in 4.x) for the keys that change the model
DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu"},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
              "num_key_value_heads": 32},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                "hidden_act": "silu", "num_key_value_heads": 8, "sliding_window": 4096},
}
MOE_KEYS = ["num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_routed_experts",
            "shared_expert_intermediate_size"]


class Refused(Exception):
    pass


def refuse(where, msg):
    raise Refused(f"{where}: {msg}")


# ---- config.json -> our config

def model_config(hf_dir):
    path = os.path.join(hf_dir, "config.json")
    try:
        c = json.load(open(path, encoding="utf-8"))
    except OSError as e:
        refuse(path, f"cannot read ({e.strerror}): HF_DIR must be a transformers model folder")
    except ValueError as e:
        refuse(path, f"not JSON ({e})")
    if not isinstance(c, dict):
        refuse(path, "not a JSON object")
    archs = c.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHS:
        refuse(path, f"architectures {archs}: only {', '.join(ARCHS)} are imported (MoE and other variants have "
                     "no exact counterpart here)")
    kind = ARCHS[archs[0]]
    if c.get("model_type", kind) != kind:
        refuse(path, f"model_type {c.get('model_type')!r} does not match architectures {archs}")
    d = DEFAULTS[kind]

    def get(key, required=False):
        if key in c and c[key] is not None:
            return c[key]
        if required or key not in d:
            refuse(path, f"{key} is missing")
        return d[key]

    def pos_int(key, v=None):
        v = get(key, required=True) if v is None else v
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            refuse(path, f"{key} = {v!r}: expected a positive integer")
        return v

    if c.get("quantization_config"):
        refuse(path, "quantization_config: quantized weights are not imported (dequantize them first)")
    for k in MOE_KEYS:
        if c.get(k):
            refuse(path, f"{k} = {c[k]}: mixture-of-experts models are not imported")
    V, C, L = pos_int("vocab_size"), pos_int("hidden_size"), pos_int("num_hidden_layers")
    nh, I = pos_int("num_attention_heads"), pos_int("intermediate_size")
    nkv = pos_int("num_key_value_heads", c.get("num_key_value_heads") or d.get("num_key_value_heads", nh))
    max_pos = pos_int("max_position_embeddings", get("max_position_embeddings"))
    if C % nh:
        refuse(path, f"hidden_size {C} is not a multiple of num_attention_heads {nh}")
    hs = C // nh
    if c.get("head_dim") is not None and c["head_dim"] != hs:
        refuse(path, f"head_dim {c['head_dim']} != hidden_size / num_attention_heads = {hs}: the engine's heads are "
                     "n_embd / n_head wide")
    if hs % 2:
        refuse(path, f"head_dim {hs} is odd: rotary positions pair the channels of a head")
    if nh % nkv:
        refuse(path, f"num_key_value_heads {nkv} does not divide num_attention_heads {nh}")
    act = get("hidden_act")
    if act != "silu":
        refuse(path, f"hidden_act {act!r}: only silu (SwiGLU) is imported")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            refuse(path, f"{key} true: only Qwen2's q/k/v biases are imported (the engine has no other bias for the "
                         "Llama shape)")
    # sliding-window attention
    if kind == "qwen2":
        if c.get("use_sliding_window"):
            refuse(path, "use_sliding_window true: sliding-window attention is not imported")
    elif kind == "mistral":
        sw = c["sliding_window"] if "sliding_window" in c else d["sliding_window"]
        if sw is not None and sw < max_pos:
            refuse(path, f"sliding_window {sw} < max_position_embeddings {max_pos}: sliding-window attention is not "
                         "imported")
    lt = c.get("layer_types")
    if lt and any(t != "full_attention" for t in lt):
        refuse(path, f"layer_types {sorted(set(lt))}: only full attention is imported")
    # rotary positions: transformers 5 (rope_parameters) or 4 (rope_theta, rope_scaling)
    rp = c.get("rope_parameters")
    if rp is not None and not isinstance(rp, dict):
        refuse(path, f"rope_parameters {rp!r}: expected an object")
    rp = rp or {}
    if rp and all(isinstance(v, dict) for v in rp.values()):
        refuse(path, f"rope_parameters per layer type ({', '.join(rp)}): only one rope for every layer is imported")
    scaling = rp if rp else (c.get("rope_scaling") or {})
    if not isinstance(scaling, dict):
        refuse(path, f"rope_scaling {scaling!r}: expected an object or null")
    key = "rope_parameters" if rp else "rope_scaling"
    theta = rp.get("rope_theta", c.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not 1 < theta < 1e12:
        refuse(path, f"rope_theta {theta!r}: expected a number in (1, 1e12)")
    partial = rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        refuse(path, f"partial_rotary_factor {partial}: only rotary positions over the whole head are imported")
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    cfg = {"vocab_size": V, "n_layer": L, "n_embd": C, "n_head": nh, "n_kv_head": nkv, "ffn_hidden": I,
           "max_seq_len": max_pos, "mlp": 0, "pos": POS_ROPE, "n_expert": 0, "moe_every": 1, "moe_group": 0,
           "expert_hidden": I, "norm": NORM_RMSNORM, "bias": BIAS_QKV if kind == "qwen2" else BIAS_NONE,
           "tie_embeddings": 1 if get("tie_word_embeddings") else 0, "capacity_factor": 2.0,
           "norm_eps": float(get("rms_norm_eps")), "rope_theta": float(theta)}
    for k in ("rope_scaling", "rope_original_max_pos", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
        cfg[k] = ADDED_LATER[k]
    if rtype == "llama3":
        cfg["rope_scaling"] = 1
        for ours, theirs in [("rope_factor", "factor"), ("rope_low_freq_factor", "low_freq_factor"),
                             ("rope_high_freq_factor", "high_freq_factor")]:
            v = scaling.get(theirs)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                refuse(path, f"{key}.{theirs} {v!r}: llama3 scaling needs a positive number")
            cfg[ours] = float(v)
        if not (cfg["rope_factor"] >= 1 and cfg["rope_high_freq_factor"] > cfg["rope_low_freq_factor"]):
            refuse(path, f"{key}: llama3 scaling needs factor >= 1 and high_freq_factor > low_freq_factor")
        # transformers' order: a top-level original_max_position_embeddings, the scaling's, max_position_embeddings
        orig = c.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings") or max_pos
        cfg["rope_original_max_pos"] = pos_int("original_max_position_embeddings", orig)
    elif rtype != "default":
        refuse(path, f"{key} rope_type {rtype!r}: only llama3 scaling (or none) is imported, the engine computes no "
                     "other exactly")
    if not 0 < cfg["norm_eps"] < 1:
        refuse(path, f"rms_norm_eps {cfg['norm_eps']}: expected a number in (0, 1)")
    if V > (1 << 24):
        refuse(path, f"vocab_size {V}: the engine takes at most 2^24 tokens")
    return cfg, kind


# ---- the tensors

def shard_files(hf_dir):
    """{tensor name: file} over model.safetensors or the index's shards."""
    single, index = os.path.join(hf_dir, "model.safetensors"), os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            wm = json.load(open(index, encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            refuse(index, f"cannot read its weight_map ({e})")
        return {k: os.path.join(hf_dir, v) for k, v in wm.items()}
    if os.path.isfile(single):
        from safetensors import safe_open
        with safe_open(single, framework="np") as f:
            return {k: single for k in f.keys()}
    others = [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt") if
              os.path.exists(os.path.join(hf_dir, n))]
    refuse(hf_dir, "no model.safetensors or model.safetensors.index.json" +
           (f" (found {others[0]}: pickled weights are not read; save them as safetensors with transformers' "
            "save_pretrained)" if others else ""))


class Tensors:
    """Reads one tensor at a time from the safetensors files, as float32: F32 as it is, F16 through
    numpy, BF16 from its raw bytes (numpy has no bfloat16: the 16 bits are the top half of a
    float32, so widening is exact)."""

    def __init__(self, where):
        from safetensors import safe_open
        self.safe_open, self.where, self.open = safe_open, where, {}

    def _file(self, path):
        if path not in self.open:
            try:
                self.open[path] = (self.safe_open(path, framework="np"), self._header(path))
            except Refused:
                raise
            except Exception as e:  # OSError, a bad header (safetensors raises its own errors)
                refuse(path, f"cannot read as safetensors ({e})")
        return self.open[path]

    @staticmethod
    def _header(path):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > 100 << 20:
                refuse(path, f"safetensors header of {n} bytes (corrupt?)")
            return 8 + n, json.loads(f.read(n))

    def names(self, path):
        return list(self._file(path)[0].keys())

    def get(self, path, name):
        f, (base, header) = self._file(path)
        dtype = header[name]["dtype"]
        if dtype == "F32":
            a = f.get_tensor(name).astype("<f4", copy=False)
        elif dtype == "F16":
            a = f.get_tensor(name).astype(np.float32)
        elif dtype == "BF16":
            lo, hi = header[name]["data_offsets"]
            shape = header[name]["shape"]
            raw = np.fromfile(path, dtype="<u2", count=(hi - lo) // 2, offset=base + lo)
            a = (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
        else:
            refuse(path, f"tensor {name} is {dtype}: only F32, F16 and BF16 are imported exactly")
        if not np.all(np.isfinite(a)):
            refuse(path, f"tensor {name} holds non-finite values")
        return a


def hf_names(cfg, kind):
    """The tensors the model must have: {name: shape}."""
    C, nh, nkv, I, V = cfg["n_embd"], cfg["n_head"], cfg["n_kv_head"], cfg["ffn_hidden"], cfg["vocab_size"]
    hs = C // nh
    want = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    for l in range(cfg["n_layer"]):
        p = f"model.layers.{l}."
        want.update({p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
                     p + "self_attn.q_proj.weight": (nh * hs, C), p + "self_attn.k_proj.weight": (nkv * hs, C),
                     p + "self_attn.v_proj.weight": (nkv * hs, C), p + "self_attn.o_proj.weight": (C, nh * hs),
                     p + "mlp.gate_proj.weight": (I, C), p + "mlp.up_proj.weight": (I, C),
                     p + "mlp.down_proj.weight": (C, I)})
        if kind == "qwen2":
            want.update({p + "self_attn.q_proj.bias": (nh * hs,), p + "self_attn.k_proj.bias": (nkv * hs,),
                         p + "self_attn.v_proj.bias": (nkv * hs,)})
    if not cfg["tie_embeddings"]:
        want["lm_head.weight"] = (V, C)
    return want


def import_model(hf_dir, out):
    cfg, kind = model_config(hf_dir)
    where = shard_files(hf_dir)
    src = Tensors(hf_dir)
    # every file's tensors are the index's, and the index's are in their files
    files = sorted(set(where.values()))
    for path in files:
        if not os.path.isfile(path):
            refuse(path, "listed in model.safetensors.index.json but missing")
        for n in src.names(path):
            if where.get(n) != path:
                refuse(path, f"tensor {n} is not listed for this file in model.safetensors.index.json")
    want = hf_names(cfg, kind)
    ignored = [n for n in where if n.endswith(".rotary_emb.inv_freq")]  # a buffer old saves hold: the config's
    tied_head = "lm_head.weight" in where and cfg["tie_embeddings"]
    unexpected = sorted(n for n in where if n not in want and n not in ignored and not (tied_head and n == "lm_head.weight"))
    if unexpected:
        refuse(files[0] if len(files) == 1 else hf_dir,
               f"unexpected tensor {unexpected[0]}" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
               + f": not part of a {kind} model this script maps")
    missing = sorted(n for n in want if n not in where)
    if missing:
        refuse(files[0] if len(files) == 1 else hf_dir,
               f"tensor {missing[0]} is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

    def get(name):
        a = src.get(where[name], name)
        if tuple(a.shape) != want[name]:
            refuse(where[name], f"tensor {name} has shape {list(a.shape)}, config.json makes {list(want[name])}")
        return a

    if tied_head:  # both stored: they must be the one matrix transformers ties
        head = src.get(where["lm_head.weight"], "lm_head.weight")
        if head.shape != want["model.embed_tokens.weight"] or \
                not np.array_equal(head.view(np.uint32), get("model.embed_tokens.weight").view(np.uint32)):
            refuse(where["lm_head.weight"], "lm_head.weight differs from model.embed_tokens.weight but "
                                            "tie_word_embeddings is true")

    V, Vp = cfg["vocab_size"], (cfg["vocab_size"] + 127) // 128 * 128
    cfg["padded_vocab_size"] = Vp

    def ours(name, shape):
        """the tensor of our table (wte and lm_head without their zero padding rows)"""
        l, _, rest = name.partition(".")
        p = f"model.layers.{l[1:]}." if name.startswith("h") else ""
        if name == "wte":
            return get("model.embed_tokens.weight")
        if name == "lm_head":
            return get("lm_head.weight")
        if name == "lnf.w":
            return get("model.norm.weight")
        return {
            "ln1.w": lambda: get(p + "input_layernorm.weight"),
            "ln2.w": lambda: get(p + "post_attention_layernorm.weight"),
            "attn.qkv.w": lambda: np.concatenate([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
            "attn.qkv.b": lambda: np.concatenate([get(p + f"self_attn.{x}_proj.bias") for x in "qkv"]),
            "attn.proj.w": lambda: get(p + "self_attn.o_proj.weight"),
            "mlp.fc.w": lambda: np.concatenate([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
            "mlp.proj.w": lambda: get(p + "mlp.down_proj.weight"),
        }[rest]()

    table, total = param_table(cfg)

    def chunks():
        """the table's tensors in order, one at a time, and the zeros between and after them (a
        tensor starts at a multiple of 8 elements; wte's and lm_head's rows past vocab_size)"""
        at = 0
        for name, shape, off in table:
            if off > at:
                yield np.zeros(off - at, np.float32)
            a = ours(name, shape)
            assert a.shape == shape or (name in ("wte", "lm_head") and a.shape == (V, shape[1])), (name, a.shape)
            yield a
            at = off + a.size
        if total > at:
            yield np.zeros(total - at, np.float32)

    write_model_file(out, cfg, total, chunks())
    n_hf = sum(int(np.prod(s)) for s in want.values())
    rope = "none" if cfg["rope_scaling"] == 0 else (
        f"llama3 (factor {cfg['rope_factor']:g}, low {cfg['rope_low_freq_factor']:g}, high "
        f"{cfg['rope_high_freq_factor']:g}, original {cfg['rope_original_max_pos']})")
    print(f"import_hf.py: {hf_dir} ({kind}, {len(files)} file(s), {n_hf} parameters) -> {out}: {cfg['n_layer']} layers, "
          f"n_embd {cfg['n_embd']}, {cfg['n_head']} heads / {cfg['n_kv_head']} kv heads, ffn {cfg['ffn_hidden']}, "
          f"vocab {V} (padded {Vp}), max_seq_len {cfg['max_seq_len']}, rope_theta {cfg['rope_theta']:g}, scaling "
          f"{rope}, rms eps {cfg['norm_eps']:g}, bias {'qkv' if cfg['bias'] == BIAS_QKV else 'none'}, "
          f"{'tied' if cfg['tie_embeddings'] else 'untied'} head" +
          (f"; ignored {len(ignored)} rotary_emb.inv_freq buffer(s) (the config gives them)" if ignored else ""))
    print(f"import_hf.py: the model's vocab_size is {V}: give the engine shards of this model's tokenizer "
          f"(prepare_text.py --tokenizer {hf_dir})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir", help="a transformers model folder (config.json + safetensors)")
    ap.add_argument("out", help="the model file to write (train_gpt --init_from)")
    args = ap.parse_args()
    try:
        import safetensors  # noqa: F401
    except ImportError:
        sys.exit("import_hf.py: needs numpy and safetensors: pip install -r scripts/requirements-tools.txt "
                 "(make tools)")
    try:
        import_model(args.hf_dir, args.out)
    except Refused as e:
        sys.exit(f"import_hf.py: {e}")


if __name__ == "__main__":
    main()
