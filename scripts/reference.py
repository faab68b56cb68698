#!/usr/bin/env python3
"""Independent PyTorch reference of the GPT model and AdamW step (the oracle).

This file re-implements, from the math in docs/ARCHITECTURE.md ("The model" and
"Precise semantics"), the model that train_gpt.cu trains, in float32 on the CPU,
with torch autograd for every gradient and a hand-written AdamW. It is NOT a
translation of the C++ code; the C++ is checked against it.

Usage
-----
    python scripts/reference.py --out test/data     # write ref_a.bin ... ref_g.bin
    python scripts/reference.py --selfcheck         # test this file's pieces, prints OK
The files are byte-identical when regenerated with the same torch build; another build (or CPU)
may round some float32 results differently (a few ulps: test_reference's tolerances are far
above that).  --selfcheck also compares the Llama / Qwen2 configs with Hugging Face
transformers' LlamaForCausalLM / Qwen2ForCausalLM when transformers is installed.

As a module (e.g. a GPU benchmark):
    import reference as R
    cfg = R.ModelConfig(vocab_size=300, n_layer=2, n_embd=32, n_head=4, n_kv_head=2,
                        ffn_hidden=64, max_seq_len=64)
    params = R.init_params(cfg, seed=0, device="cuda", kind="default")
    ds = R.compute_doc_start(inputs, eot=256)
    logits = R.forward(params, cfg, inputs, ds, sdpa=True)
    loss = R.cross_entropy_loss(logits, targets)

Model (names/shapes of the parameters, in order: see `param_specs`)
-----
x = wte[tokens] (+ wpe[t - doc_start[t]] when pos=learned); per layer
x += attn.proj(attn(LN1(x))); x += ffn(LN2(x)); LN_f; logits = x @ head[:V]^T with
head = wte (tie_embeddings 1) or lm_head (tie_embeddings 0).
Linear weights are [out, in] and y = x W^T + b. LN is LayerNorm (norm 0: eps 1e-5,
biased variance, weight and bias) or RMSNorm (norm 1: x / sqrt(mean(x^2) + norm_eps) * w,
no bias). Biases (bias 0 all: every linear layer; 1 qkv: attn.qkv only; 2 none); the
router and the head never have one. qkv output features: all q heads, then all k heads,
then all v heads. pos=rope (2): right after the qkv projection, every q and k head is
rotated in Llama's rotate-half pairing, channel i with i + hs/2 (i < hs/2), by the angle
p * inv_freq_i with p = t - doc_start[t]: (x_i, x_{i+hs/2}) -> (x_i cos - x_{i+hs/2} sin,
x_{i+hs/2} cos + x_i sin); inv_freq_i = rope_theta^(-2i/hs), with rope_scaling 1 (llama3)
then rescaled by the wavelength w = 2 pi / inv_freq_i against L = rope_original_max_pos:
w < L / rope_high_freq_factor kept, w > L / rope_low_freq_factor divided by rope_factor,
else ((1 - s) / rope_factor + s) inv_freq_i with s = (L / w - low) / (high - low)
(`llama3_scale`); the angles and cos / sin are computed in float64 and rounded once.
Query head h reads kv head h // (n_head // n_kv_head). Attention allows key j for
query i iff doc_start[i] <= j <= i; score = q.k / sqrt(hs) - slope_h * (i - j)
(ALiBi term only when pos=alibi). SwiGLU fc rows 0..H-1 = gate (silu),
rows H..2H-1 = up. GELU is the tanh approximation. Loss = mean cross-entropy
over targets != -1 using the first V (real) logits. Tensors that do not exist are absent
from the parameter table (ln*.b with rmsnorm, the biases per `bias`, wpe unless learned);
lm_head [padded_vocab, C] comes last, its padding rows zero.

Expert-choice MoE (Zhou et al. 2022) replaces the FFN of layer l iff n_expert E > 0 and
(l + 1) % moe_every == 0; its tensors h{l}.moe.{router.w [E, C], fc.w [E, 2He, C],
fc.b [E, 2He], proj.w [E, C, He], proj.b [E, C]} take the place of h{l}.mlp.*. On the
n = B*T tokens (i = b*T + t) of a micro-batch: S = softmax_e(x W_router^T) [n, E]. Routing
groups: moe_group=batch, all n tokens; moe_group=position, for each t the B tokens at t.
In every group of m tokens each expert takes the k = min(m, ceil(m * c / E)) tokens of
highest S[:, e] (ties: lower token index first; c = capacity_factor as float32, the
quotient in double). Token i's output = sum over the experts e that took it of
S[i, e] * (W2_e (silu(W1_e x + b1_e) * (W3_e x + b3_e)) + b2_e); 0 if none took it.
The selection is a constant for autograd: gradients reach the router through the gate
values S[i, e] of the selected pairs only. Weight decay: ndim >= 2 and the name ends
with '.w' or is wte / wpe / lm_head (so the 2-D per-expert biases are not decayed).

Reference file format (binary, little-endian)
-----
    magic      8 bytes  b"LLMCREF1"
    n_entries  uint32
    then n_entries times:
        name_len  uint32
        name      name_len bytes, utf-8, no NUL terminator
        dtype     uint32   (0 = float32, 1 = int32)
        ndim      uint32
        dims      int64[ndim]
        data      prod(dims) elements of dtype, row-major (a scalar has ndim 0
                  and exactly one element)

Entries written by `make_reference` (in this order):
    config.vocab_size, config.padded_vocab_size, config.n_layer, config.n_embd,
    config.n_head, config.n_kv_head, config.ffn_hidden, config.max_seq_len,
    config.mlp (0 swiglu, 1 gelu), config.pos (0 alibi, 1 learned, 2 rope), config.eot,
    config.n_expert (0 = dense), config.moe_every, config.expert_hidden,
    config.moe_group (0 batch, 1 position)              int32 scalars
    config.capacity_factor                               float32 scalar
    only in files whose model is not GPT-2-shaped (pos rope, or any of these not at its
    default; a reader takes the defaults, in brackets, when they are absent; ref_a .. ref_e
    have none):
    config.norm (0 layernorm [0], 1 rmsnorm), config.bias (0 all [0], 1 qkv, 2 none),
    config.tie_embeddings ([1]), config.rope_scaling (0 none [0], 1 llama3),
    config.rope_original_max_pos ([8192])               int32 scalars
    config.rope_theta ([10000]), config.rope_factor ([8]), config.rope_low_freq_factor ([1]),
    config.rope_high_freq_factor ([4]), config.norm_eps ([1e-5]; rmsnorm's; LayerNorm's eps
    is always 1e-5)                                      float32 scalars; the reference ran
                                                         with exactly these float32 values
    train.B, train.T, train.grad_accum, train.warmup_steps, train.max_steps,
    train.n_steps                                        int32 scalars
    train.lr, train.final_lr_frac, train.weight_decay, train.beta1, train.beta2,
    train.eps, train.grad_clip                           float32 scalars
    inputs, targets, doc_start                           int32 [A, B, T]
    param.<name>                                         float32, initial params
    logits                                               float32 [B, T, V], micro-batch 0
    loss                                                 float32 scalar, micro-batch 0
    grad.<name>                                          float32, d loss(mb 0) / d param
                                                         (NOT divided by A)
    step.loss, step.grad_norm (pre-clip), step.lr        float32 [n_steps]
    final.param.<name>                                   float32, after n_steps steps
Every optimizer step accumulates grad(loss_mb / A) over the A micro-batches
inputs[0..A-1] (the same ones every step); step.loss is the mean of the A
micro-batch losses.
"""

import argparse
import contextlib
import math
import os
import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass

import torch

EOT = 256
MLP_SWIGLU, MLP_GELU = 0, 1
POS_ALIBI, POS_LEARNED, POS_ROPE = 0, 1, 2
NORM_LAYERNORM, NORM_RMSNORM = 0, 1
BIAS_ALL, BIAS_QKV, BIAS_NONE = 0, 1, 2   # which linear layers have a bias
ROPE_SCALING_NONE, ROPE_SCALING_LLAMA3 = 0, 1
LAYERNORM_EPS = 1e-5
MOE_GROUP_BATCH, MOE_GROUP_POSITION = 0, 1
DTYPE_F32, DTYPE_I32 = 0, 1
MAGIC = b"LLMCREF1"


# ----------------------------------------------------------------------------
# configuration

@dataclass
class ModelConfig:
    vocab_size: int
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    ffn_hidden: int
    max_seq_len: int
    mlp: int = MLP_SWIGLU          # 0 swiglu, 1 gelu
    pos: int = POS_ALIBI           # 0 alibi, 1 learned, 2 rope
    padded_vocab_size: int = 0     # 0 -> vocab_size rounded up to a multiple of 128
    # expert-choice mixture of experts (see `moe`): n_expert 0 = dense model
    n_expert: int = 0
    moe_every: int = 1             # layer l is MoE iff n_expert > 0 and (l + 1) % moe_every == 0
    capacity_factor: float = 2.0   # stored (and used) as its float32 value
    moe_group: int = MOE_GROUP_BATCH  # 0 batch (all B*T tokens), 1 position (the B tokens at t)
    expert_hidden: int = 0         # hidden size of each SwiGLU expert; 0 -> ffn_hidden
    # the Llama / Qwen2 shape (see `LLAMA_FIELDS`); the defaults are the GPT-2 shape
    norm: int = NORM_LAYERNORM     # 0 layernorm (eps 1e-5, weight and bias), 1 rmsnorm (norm_eps)
    bias: int = BIAS_ALL           # 0 every linear layer, 1 attn.qkv only, 2 none
    tie_embeddings: int = 1        # 0: an own lm_head [padded_vocab, C] (last in the table)
    norm_eps: float = 1e-5         # rmsnorm's eps, stored (and used) as its float32 value
    rope_theta: float = 10000.0    # rope: inv_freq_i = theta^(-2i/hs), i < hs/2 ...
    rope_scaling: int = ROPE_SCALING_NONE  # ... then 1 = llama3 scaling (`rope_inv_freq`)
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_pos: int = 8192

    def __post_init__(self):
        if self.padded_vocab_size == 0:
            self.padded_vocab_size = (self.vocab_size + 127) // 128 * 128
        assert self.padded_vocab_size % 128 == 0 and self.padded_vocab_size >= self.vocab_size
        assert self.n_embd % self.n_head == 0, "head size = n_embd / n_head"
        assert self.n_head % self.n_kv_head == 0, "n_kv_head must divide n_head"
        assert self.mlp in (MLP_SWIGLU, MLP_GELU) and self.pos in (POS_ALIBI, POS_LEARNED, POS_ROPE)
        assert self.norm in (NORM_LAYERNORM, NORM_RMSNORM)
        assert self.bias in (BIAS_ALL, BIAS_QKV, BIAS_NONE) and self.tie_embeddings in (0, 1)
        assert self.rope_scaling in (ROPE_SCALING_NONE, ROPE_SCALING_LLAMA3)
        assert self.pos != POS_ROPE or self.head_size % 2 == 0, "rope needs an even head size"
        assert 0 < self.norm_eps < 1 and self.rope_theta > 1 and self.rope_original_max_pos > 0
        assert 1 <= self.rope_factor and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        # the real fields as the file stores them (float32), so the oracle runs with those values
        for k in ("norm_eps", "rope_theta", "rope_factor", "rope_low_freq_factor",
                  "rope_high_freq_factor"):
            setattr(self, k, f32(getattr(self, k)))
        assert self.n_expert >= 0 and self.moe_every >= 1 and self.capacity_factor > 0
        assert self.moe_group in (MOE_GROUP_BATCH, MOE_GROUP_POSITION)
        self.capacity_factor = f32(self.capacity_factor)
        if self.expert_hidden == 0:
            self.expert_hidden = self.ffn_hidden

    @property
    def head_size(self):
        return self.n_embd // self.n_head

    @property
    def fc_out(self):
        return 2 * self.ffn_hidden if self.mlp == MLP_SWIGLU else self.ffn_hidden

    def is_moe_layer(self, l):
        return self.n_expert > 0 and (l + 1) % self.moe_every == 0

    @property
    def qkv_bias(self):
        return self.bias != BIAS_NONE

    @property
    def linear_bias(self):  # every linear layer but attn.qkv (and the router: never)
        return self.bias == BIAS_ALL

    def uses_llama_fields(self):
        """True iff a field of LLAMA_FIELDS differs from its default (the GPT-2 shape): only
        then are they written to the reference file (so the older files stay as they were)."""
        default = lambda k, typ: f32(getattr(ModelConfig, k)) if typ is float \
            else getattr(ModelConfig, k)  # noqa: E731
        return self.pos == POS_ROPE or any(
            getattr(self, k) != default(k, typ) for k, typ in LLAMA_FIELDS)


# the Llama / Qwen2 fields, in the order of the file's config.* entries, and their types
LLAMA_FIELDS = [("norm", int), ("bias", int), ("tie_embeddings", int),
                ("rope_scaling", int), ("rope_original_max_pos", int),
                ("rope_theta", float), ("rope_factor", float), ("rope_low_freq_factor", float),
                ("rope_high_freq_factor", float), ("norm_eps", float)]


@dataclass
class TrainConfig:
    B: int
    T: int
    grad_accum: int = 2
    warmup_steps: int = 5
    max_steps: int = 10
    n_steps: int = 3
    lr: float = 1e-3
    final_lr_frac: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0

    def rounded(self):
        """Copy whose float fields hold exactly their float32 values (what the file stores)."""
        d = dict(self.__dict__)
        for k in ("lr", "final_lr_frac", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
            d[k] = f32(d[k])
        return TrainConfig(**d)


def f32(x):
    """Round a Python float to the nearest float32 value."""
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


# ----------------------------------------------------------------------------
# parameters

def param_specs(cfg):
    """Ordered list of (name, shape) of every parameter. Tensors that do not exist are left
    out: the norm biases with rmsnorm, the linear biases per cfg.bias, wpe unless the positions
    are learned; lm_head (untied head) comes last."""
    C, hs, L = cfg.n_embd, cfg.head_size, cfg.n_layer
    qkv = (cfg.n_head + 2 * cfg.n_kv_head) * hs
    ln = cfg.norm == NORM_LAYERNORM  # rmsnorm: weight only
    lb = cfg.linear_bias
    specs = [("wte", (cfg.padded_vocab_size, C))]
    if cfg.pos == POS_LEARNED:
        specs.append(("wpe", (cfg.max_seq_len, C)))
    for l in range(L):
        p = f"h{l}."
        specs += [(p + "ln1.w", (C,))] + [(p + "ln1.b", (C,))] * ln
        specs += [(p + "attn.qkv.w", (qkv, C))] + [(p + "attn.qkv.b", (qkv,))] * cfg.qkv_bias
        specs += [(p + "attn.proj.w", (C, cfg.n_head * hs))] + [(p + "attn.proj.b", (C,))] * lb
        specs += [(p + "ln2.w", (C,))] + [(p + "ln2.b", (C,))] * ln
        if cfg.is_moe_layer(l):
            # E SwiGLU experts of hidden size He (fc rows 0..He-1 gate, He..2He-1 up) and a
            # bias-free router; they replace the dense mlp.* tensors of this layer
            E, He = cfg.n_expert, cfg.expert_hidden
            specs += [(p + "moe.router.w", (E, C))]
            specs += [(p + "moe.fc.w", (E, 2 * He, C))] + [(p + "moe.fc.b", (E, 2 * He))] * lb
            specs += [(p + "moe.proj.w", (E, C, He))] + [(p + "moe.proj.b", (E, C))] * lb
        else:
            specs += [(p + "mlp.fc.w", (cfg.fc_out, C))] + [(p + "mlp.fc.b", (cfg.fc_out,))] * lb
            specs += [(p + "mlp.proj.w", (C, cfg.ffn_hidden))] + [(p + "mlp.proj.b", (C,))] * lb
    specs += [("lnf.w", (C,))] + [("lnf.b", (C,))] * ln
    if not cfg.tie_embeddings:
        specs.append(("lm_head", (cfg.padded_vocab_size, C)))
    return specs


def is_residual_proj(name):
    return name.endswith(("attn.proj.w", "mlp.proj.w", "moe.proj.w"))


def is_layernorm(name):
    return name.startswith("lnf.") or ".ln1." in name or ".ln2." in name


TEST_ROUTER_STD = 0.3


def init_params(cfg, seed=0, kind="default", device="cpu", dtype=torch.float32):
    """Parameters as an OrderedDict name -> leaf tensor (requires_grad=True).

    kind="default": the training init of DESIGN.md (normal(0, 0.02), residual output
    projections std 0.02/sqrt(2L), biases 0, LayerNorm / RMSNorm weight 1, bias 0).
    kind="test": like default for weights, but biases ~ normal(0, 0.02), LayerNorm / RMSNorm
    weights 1 + normal(0, 0.1), LayerNorm biases normal(0, 0.02), so that a test
    exercises them, and the MoE router weights ~ normal(0, TEST_ROUTER_STD).
    Values are drawn on the CPU from one seeded generator, in param_specs order.
    An untied lm_head is normal(0, 0.02) like wte, its rows past vocab_size 0 (either kind).
    """
    assert kind in ("default", "test")
    g = torch.Generator().manual_seed(seed)
    std_res = 0.02 / math.sqrt(2 * cfg.n_layer)
    params = OrderedDict()
    for name, shape in param_specs(cfg):
        n = torch.randn(shape, generator=g, dtype=torch.float32)
        if is_layernorm(name):
            if name.endswith(".w"):
                t = 1.0 + 0.1 * n if kind == "test" else torch.ones(shape)
            else:
                t = 0.02 * n if kind == "test" else torch.zeros(shape)
        elif name.endswith(".b"):  # linear bias (per expert for moe.*.b: 2-D)
            t = 0.02 * n if kind == "test" else torch.zeros(shape)
        elif kind == "test" and name.endswith("moe.router.w"):
            t = TEST_ROUTER_STD * n  # decisive routing: gates far from 1/E, wide score gaps
        else:
            t = (std_res if is_residual_proj(name) else 0.02) * n
        if name == "lm_head":
            t[cfg.vocab_size:] = 0.0  # no token's logit: the padding rows stay zero
        params[name] = t.to(device=device, dtype=dtype).requires_grad_(True)
    return params


def decays(name, p):
    """Weight decay applies to tensors with ndim >= 2 whose name ends with '.w' or is
    wte / wpe / lm_head: embeddings, the untied head, linear weights, the per-expert weights and
    the router, but not the 2-D per-expert biases moe.fc.b / moe.proj.b."""
    return p.dim() >= 2 and (name.endswith(".w") or name in ("wte", "wpe", "lm_head"))


# ----------------------------------------------------------------------------
# model pieces (each works for any float dtype / device)

def linear(x, w, b=None):
    y = x @ w.t()
    return y + b if b is not None else y


def layernorm(x, w, b, eps=1e-5):
    mean = x.mean(dim=-1, keepdim=True)
    xc = x - mean
    var = (xc * xc).mean(dim=-1, keepdim=True)  # biased variance
    return xc * torch.rsqrt(var + eps) * w + b


def rmsnorm(x, w, eps):
    """RMSNorm (Zhang & Sennrich 2019; Llama): x / sqrt(mean(x^2) + eps) * w, no mean, no bias."""
    ms = (x * x).mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(ms + eps) * w


def norm(x, params, name, cfg):
    """The block's / final norm `name` (ln1, ln2 of a layer prefix, or lnf) per cfg.norm."""
    if cfg.norm == NORM_RMSNORM:
        return rmsnorm(x, params[name + ".w"], cfg.norm_eps)
    return layernorm(x, params[name + ".w"], params[name + ".b"])


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def silu(x):
    return x * torch.sigmoid(x)


def alibi_slopes(n):
    """ALiBi head slopes (Press et al.), including non power-of-two head counts."""
    def pow2(m):
        return [2.0 ** (-8.0 * (h + 1) / m) for h in range(m)]
    if n & (n - 1) == 0:
        return pow2(n)
    m = 2 ** int(math.floor(math.log2(n)))
    return pow2(m) + pow2(2 * m)[0::2][: n - m]


def llama3_scale(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_pos):
    """Llama 3.1's long-context rescaling of one inverse frequency. With the wavelength
    w = 2 pi / inv_freq and the pre-training context L = original_max_pos: short wavelengths
    (w < L / high_freq_factor) are kept, long ones (w > L / low_freq_factor) are divided by
    factor, and in between the two are blended linearly in L / w:
    s = (L / w - low) / (high - low), inv_freq ((1 - s) / factor + s)."""
    w = 2.0 * math.pi / inv_freq
    if w < original_max_pos / high_freq_factor:
        return inv_freq
    if w > original_max_pos / low_freq_factor:
        return inv_freq / factor
    s = (original_max_pos / w - low_freq_factor) / (high_freq_factor - low_freq_factor)
    return (1.0 - s) * inv_freq / factor + s * inv_freq


def rope_inv_freq(cfg):
    """The hs/2 inverse frequencies (Python floats, double precision) of cfg's rotary
    embedding: theta^(-2i/hs), i < hs/2, then llama3_scale when rope_scaling is llama3."""
    hs = cfg.head_size
    inv = [cfg.rope_theta ** (-2.0 * i / hs) for i in range(hs // 2)]
    if cfg.rope_scaling == ROPE_SCALING_LLAMA3:
        inv = [llama3_scale(f, cfg.rope_factor, cfg.rope_low_freq_factor,
                            cfg.rope_high_freq_factor, cfg.rope_original_max_pos) for f in inv]
    return inv


def rope_cos_sin(cfg, doc_start, dtype=torch.float32):
    """cos, sin [B, 1, T, hs/2] of the angles p * inv_freq_i, p = t - doc_start[t] (the
    position inside the token's document); the angles and their cos / sin in float64, then
    rounded to dtype."""
    T = doc_start.shape[-1]
    pos = torch.arange(T, device=doc_start.device).view(1, T) - doc_start.long()   # [B, T]
    inv = torch.tensor(rope_inv_freq(cfg), dtype=torch.float64, device=doc_start.device)
    ang = pos.to(torch.float64).unsqueeze(-1) * inv                                  # [B, T, hs/2]
    return torch.cos(ang).to(dtype).unsqueeze(1), torch.sin(ang).to(dtype).unsqueeze(1)


def apply_rope(x, cos, sin):
    """Rotates x [B, heads, T, hs] in Llama's rotate-half pairing: channel i with i + hs/2,
    (x_i, x_{i+hs/2}) -> (x_i cos - x_{i+hs/2} sin, x_{i+hs/2} cos + x_i sin)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def compute_doc_start(inputs, eot=EOT):
    """doc_start[..., t] = largest s <= t with inputs[..., s] == eot, else 0. Any leading dims."""
    T = inputs.shape[-1]
    idx = torch.arange(T, device=inputs.device).expand(inputs.shape)
    marks = torch.where(inputs == eot, idx, torch.zeros_like(idx))
    return torch.cummax(marks, dim=-1).values.to(torch.int32)


def attention_bias(doc_start, n_head, slopes=None, dtype=torch.float32):
    """Additive score bias [B, n_head or 1, T, T]: -slope_h*(i-j) on allowed keys
    (doc_start[i] <= j <= i), -inf elsewhere."""
    B, T = doc_start.shape
    dev = doc_start.device
    i = torch.arange(T, device=dev).view(T, 1)
    j = torch.arange(T, device=dev).view(1, T)
    allowed = (j <= i).view(1, T, T) & (j.view(1, 1, T) >= doc_start.long().view(B, T, 1))
    allowed = allowed.view(B, 1, T, T)
    if slopes is not None:
        s = torch.tensor(slopes, dtype=dtype, device=dev).view(1, n_head, 1, 1)
        bias = -s * (i - j).to(dtype).view(1, 1, T, T)
    else:
        bias = torch.zeros(1, 1, T, T, dtype=dtype, device=dev)
    return bias.masked_fill(~allowed, float("-inf"))


def attention_core(q, k, v, bias, sdpa=False):
    """q [B, nh, T, hs], k/v [B, nkv, T, hs], bias [B, nh|1, T, T] -> [B, nh, T, hs]."""
    nh, nkv, hs = q.shape[1], k.shape[1], q.shape[3]
    rep = nh // nkv
    k = k.repeat_interleave(rep, dim=1)  # query head h reads kv head h // rep
    v = v.repeat_interleave(rep, dim=1)
    if sdpa:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs)) + bias
    att = torch.softmax(att, dim=-1)
    return att @ v


def attention(x, params, prefix, cfg, bias, sdpa=False, rope=None):
    """Multi-head (GQA) attention sub-layer, input already normed: [B,T,C] -> [B,T,C].
    rope: (cos, sin) of `rope_cos_sin` (pos rope): q and k rotated after the projection."""
    B, T, _ = x.shape
    nh, nkv, hs = cfg.n_head, cfg.n_kv_head, cfg.head_size
    qkv = linear(x, params[prefix + "attn.qkv.w"], params.get(prefix + "attn.qkv.b"))
    q = qkv[..., : nh * hs].view(B, T, nh, hs).transpose(1, 2)
    k = qkv[..., nh * hs: (nh + nkv) * hs].view(B, T, nkv, hs).transpose(1, 2)
    v = qkv[..., (nh + nkv) * hs:].view(B, T, nkv, hs).transpose(1, 2)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    y = attention_core(q, k, v, bias, sdpa=sdpa)
    y = y.transpose(1, 2).reshape(B, T, nh * hs)
    return linear(y, params[prefix + "attn.proj.w"], params.get(prefix + "attn.proj.b"))


def mlp(x, params, prefix, cfg):
    """Dense FFN sub-layer (SwiGLU or GELU), input already layer-normed."""
    h = linear(x, params[prefix + "mlp.fc.w"], params.get(prefix + "mlp.fc.b"))
    if cfg.mlp == MLP_SWIGLU:
        H = cfg.ffn_hidden
        h = silu(h[..., :H]) * h[..., H:]
    else:
        h = gelu_tanh(h)
    return linear(h, params[prefix + "mlp.proj.w"], params.get(prefix + "mlp.proj.b"))


# ---- expert-choice mixture of experts (Zhou et al. 2022)

_moe_trace = None  # a list while `trace_moe()` is active: one record per MoE layer call


@contextlib.contextmanager
def trace_moe():
    """Collects, for every MoE layer run inside the block, a dict with the layer prefix,
    the selection margin (see `expert_choice_select`; None when the selection was given),
    how many experts took each token (`taken` [n]) and the selection (`chosen` [E, *])."""
    global _moe_trace
    old, _moe_trace = _moe_trace, []
    try:
        yield _moe_trace
    finally:
        _moe_trace = old


def moe_capacity(m, n_expert, capacity_factor):
    """Tokens each expert takes from a routing group of m tokens: min(m, ceil(m * c / E)),
    the quotient in double precision (c is the float32 value of the config)."""
    return min(m, math.ceil(float(m) * float(capacity_factor) / n_expert))


def routing_groups(B, T, moe_group, device="cpu"):
    """Token ids (i = b*T + t) of every routing group as [G, m], ascending along each row.
    batch: one group of all B*T tokens; position: T groups, group t = {b*T + t : b < B}."""
    if moe_group == MOE_GROUP_BATCH:
        return torch.arange(B * T, device=device).view(1, B * T)
    assert moe_group == MOE_GROUP_POSITION
    return torch.arange(T, device=device).view(T, 1) + T * torch.arange(B, device=device).view(1, B)


@torch.no_grad()
def expert_choice_select(scores, groups, k):
    """Expert-choice selection, held constant by the caller (no gradient flows through it).

    scores: [n, E] router probabilities; groups: [G, m] token ids (ascending per row).
    In every group, every expert takes the k tokens with the highest score; among equal
    scores the lower token id wins. Returns (chosen, margin): chosen [E, G*k] token ids
    (group by group, best first) and margin = the smallest gap, over experts and groups,
    between the k-th and the (k+1)-th highest score (inf when k == m: nothing is left out),
    i.e. how far the selection is from flipping."""
    G, m = groups.shape
    E = scores.shape[1]
    s = scores[groups].permute(2, 0, 1)  # [E, G, m]
    # a stable sort keeps equal scores in input order = ascending token id
    vals, order = torch.sort(s, dim=-1, descending=True, stable=True)
    chosen = torch.gather(groups.expand(E, G, m), -1, order[..., :k]).reshape(E, G * k)
    margin = (vals[..., k - 1] - vals[..., k]).min().item() if k < m else math.inf
    return chosen, margin


def expert_ffn(x, params, prefix, e, cfg):
    """SwiGLU expert e of an MoE layer on tokens x [N, C] -> [N, C]."""
    He = cfg.expert_hidden
    b1, b2 = params.get(prefix + "moe.fc.b"), params.get(prefix + "moe.proj.b")
    h = linear(x, params[prefix + "moe.fc.w"][e], None if b1 is None else b1[e])
    h = silu(h[..., :He]) * h[..., He:]
    return linear(h, params[prefix + "moe.proj.w"][e], None if b2 is None else b2[e])


def moe(x, params, prefix, cfg, chosen=None):
    """Expert-choice MoE FFN sub-layer on layer-normed x [B, T, C] -> [B, T, C].

    S = softmax over experts of x W_router^T; the selection (from S, or `chosen` [E, *]
    token ids when given) is a constant; token i gets sum over the experts e that took it
    of S[i, e] * expert_e(x_i), so gradients reach the router only through the gate
    values S[i, e] of the selected pairs. Tokens no expert took get 0."""
    B, T, C = x.shape
    E = cfg.n_expert
    xf = x.reshape(B * T, C)
    scores = torch.softmax(linear(xf, params[prefix + "moe.router.w"]), dim=-1)  # [n, E]
    margin = None
    if chosen is None:
        groups = routing_groups(B, T, cfg.moe_group, x.device)
        k = moe_capacity(groups.shape[1], E, cfg.capacity_factor)
        chosen, margin = expert_choice_select(scores.detach(), groups, k)
    out = torch.zeros_like(xf)
    for e in range(E):
        idx = chosen[e]
        gate = scores[idx, e].unsqueeze(-1)
        out = out.index_add(0, idx, gate * expert_ffn(xf[idx], params, prefix, e, cfg))
    if _moe_trace is not None:
        taken = torch.zeros(B * T, dtype=torch.long, device=x.device)
        for e in range(E):
            taken[chosen[e]] += 1
        _moe_trace.append(dict(prefix=prefix, margin=margin, taken=taken.cpu(),
                               chosen=chosen.cpu()))
    return out.view(B, T, C)


def ffn(x, params, layer, cfg):
    """FFN of layer `layer`: the expert-choice MoE on MoE layers, else the dense MLP."""
    prefix = f"h{layer}."
    if cfg.is_moe_layer(layer):
        return moe(x, params, prefix, cfg)
    return mlp(x, params, prefix, cfg)


def block(x, params, layer, cfg, bias, sdpa=False, rope=None):
    p = f"h{layer}."
    x = x + attention(norm(x, params, p + "ln1", cfg), params, p, cfg, bias, sdpa=sdpa, rope=rope)
    x = x + ffn(norm(x, params, p + "ln2", cfg), params, layer, cfg)
    return x


def embed(params, cfg, inputs, doc_start):
    x = params["wte"][inputs.long()]
    if cfg.pos == POS_LEARNED:
        T = inputs.shape[-1]
        t = torch.arange(T, device=inputs.device).view(1, T)
        x = x + params["wpe"][t - doc_start.long()]
    return x


def forward(params, cfg, inputs, doc_start, sdpa=False):
    """inputs, doc_start: int [B, T]. Returns logits [B, T, V] (real vocab only)."""
    x = embed(params, cfg, inputs, doc_start)
    slopes = alibi_slopes(cfg.n_head) if cfg.pos == POS_ALIBI else None
    bias = attention_bias(doc_start, cfg.n_head, slopes, dtype=x.dtype)
    rope = rope_cos_sin(cfg, doc_start, dtype=x.dtype) if cfg.pos == POS_ROPE else None
    for l in range(cfg.n_layer):
        x = block(x, params, l, cfg, bias, sdpa=sdpa, rope=rope)
    x = norm(x, params, "lnf", cfg)
    head = params["wte"] if cfg.tie_embeddings else params["lm_head"]
    return x @ head[: cfg.vocab_size].t()


def cross_entropy_loss(logits, targets):
    """Mean over targets != -1 of -log softmax(logits)[target]."""
    logp = torch.log_softmax(logits, dim=-1)
    valid = targets != -1
    tgt = torch.where(valid, targets, torch.zeros_like(targets)).long()
    nll = -logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return (nll * valid.to(nll.dtype)).sum() / valid.sum()


# ----------------------------------------------------------------------------
# optimizer

def lr_at(step, tc):
    """Learning rate for 0-based step: linear warmup, then cosine to final_lr_frac*lr."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    p = (step - tc.warmup_steps) / max(1, tc.max_steps - tc.warmup_steps)
    lr_min = tc.final_lr_frac * tc.lr
    return lr_min + 0.5 * (tc.lr - lr_min) * (1.0 + math.cos(math.pi * p))


def accumulate_grads(params, cfg, inputs, targets, doc_start, sdpa=False):
    """grads = sum over micro-batches of grad(loss_mb / A). inputs etc.: [A, B, T].
    Returns (mean micro-batch loss as float, OrderedDict of grads)."""
    A = inputs.shape[0]
    grads = OrderedDict((n, torch.zeros_like(p)) for n, p in params.items())
    losses = []
    for a in range(A):
        loss = cross_entropy_loss(forward(params, cfg, inputs[a], doc_start[a], sdpa=sdpa),
                                  targets[a])
        gs = torch.autograd.grad(loss / A, list(params.values()))
        for (n, acc), gr in zip(grads.items(), gs):
            acc.add_(gr)
        losses.append(loss.detach())
    return torch.stack(losses).mean().item(), grads


def global_norm(grads):
    return torch.sqrt(sum((g * g).sum() for g in grads.values()))


class AdamW:
    """Hand-written AdamW with PyTorch semantics (decoupled decay, bias correction)."""

    def __init__(self, params, tc):
        self.tc = tc
        self.m = OrderedDict((n, torch.zeros_like(p)) for n, p in params.items())
        self.v = OrderedDict((n, torch.zeros_like(p)) for n, p in params.items())

    @torch.no_grad()
    def update(self, params, grads, step, lr):
        tc, t = self.tc, step + 1
        bc1 = 1.0 - tc.beta1 ** t
        bc2 = 1.0 - tc.beta2 ** t
        for n, p in params.items():
            g, m, v = grads[n], self.m[n], self.v[n]
            if decays(n, p):
                p.sub_(p * (lr * tc.weight_decay))
            m.mul_(tc.beta1).add_(g * (1.0 - tc.beta1))
            v.mul_(tc.beta2).add_(g * g * (1.0 - tc.beta2))
            p.sub_(lr * (m / bc1) / (torch.sqrt(v / bc2) + tc.eps))


def train_step(params, opt, cfg, tc, step, inputs, targets, doc_start, sdpa=False):
    """One optimizer step. Returns (loss, pre-clip grad norm, lr) as Python floats."""
    loss, grads = accumulate_grads(params, cfg, inputs, targets, doc_start, sdpa=sdpa)
    norm = global_norm(grads)
    if tc.grad_clip > 0:
        scale = torch.clamp(tc.grad_clip / (norm + 1e-6), max=1.0)
        for g in grads.values():
            g.mul_(scale)
    lr = f32(lr_at(step, tc))
    opt.update(params, grads, step, lr)
    return loss, norm.item(), lr


# ----------------------------------------------------------------------------
# reference file I/O

def write_ref(path, entries):
    """entries: list of (name, value); value is a tensor (float32 -> f32, int -> i32),
    a Python int (i32 scalar) or a Python float (f32 scalar)."""
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<I", len(entries)))
        for name, val in entries:
            if isinstance(val, bool):
                raise TypeError(name)
            if isinstance(val, int):
                val = torch.tensor(val, dtype=torch.int32)
            elif isinstance(val, float):
                val = torch.tensor(val, dtype=torch.float32)
            val = val.detach().cpu().contiguous()
            if val.dtype.is_floating_point:
                dt, fmt, val = DTYPE_F32, "f", val.to(torch.float32)
            else:
                dt, fmt, val = DTYPE_I32, "i", val.to(torch.int32)
            nb = name.encode("utf-8")
            f.write(struct.pack("<I", len(nb)) + nb)
            f.write(struct.pack("<II", dt, val.dim()))
            f.write(struct.pack("<%dq" % val.dim(), *val.shape))
            flat = val.reshape(-1).tolist()
            f.write(struct.pack("<%d%s" % (len(flat), fmt), *flat))


def read_ref(path):
    """Inverse of write_ref: OrderedDict name -> tensor (float32 or int32)."""
    out = OrderedDict()
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == MAGIC, "bad magic"
    (n,), off = struct.unpack_from("<I", data, 8), 12
    for _ in range(n):
        (ln,) = struct.unpack_from("<I", data, off); off += 4
        name = data[off: off + ln].decode("utf-8"); off += ln
        dt, nd = struct.unpack_from("<II", data, off); off += 8
        dims = struct.unpack_from("<%dq" % nd, data, off); off += 8 * nd
        cnt = math.prod(dims)
        fmt = "f" if dt == DTYPE_F32 else "i"
        vals = struct.unpack_from("<%d%s" % (cnt, fmt), data, off); off += 4 * cnt
        out[name] = torch.tensor(vals, dtype=torch.float32 if dt == DTYPE_F32 else torch.int32
                                 ).reshape(dims)
    assert off == len(data), "trailing bytes"
    return out


# ----------------------------------------------------------------------------
# test data and the reference configs

def make_batch(A, B, T, V, seed, eot=EOT):
    """Packed rows of several documents. Per micro-batch, row 0 starts mid-document
    (no EOT at 0) and holds a length-1 document (two adjacent EOTs); row 1 has EOT at
    position 0 and a length-1 document at the row's end; row 2 (if any) alternates
    between no EOT at all (one document continuing through the row) and random EOTs.
    targets = next tokens of the stream, a few replaced by random ids in [0, V) and a
    few by -1."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, 256, (A, B, T + 1), generator=g, dtype=torch.int64)
    for a in range(A):
        for b in range(B):
            row = inputs[a, b]
            r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
            if b == 0:
                p = r(3, T // 2)
                row[p] = row[p + 1] = eot               # doc [p] has length 1
                row[r(T // 2 + 2, T - 1)] = eot
            elif b == 1:
                row[0] = eot
                row[r(2, T // 2)] = eot
                row[T - 1] = eot                        # length-1 doc at the end
                row[T] = r(0, 256)
            elif (a + b) % 2 == 0:
                pass                                    # a single document, mid-stream
            else:
                for _ in range(3):
                    row[r(0, T)] = eot
    targets = inputs[:, :, 1:].clone()
    inputs = inputs[:, :, :T].contiguous()
    for a in range(A):
        for b in range(B):
            for _ in range(3):  # random ids anywhere in [0, V), incl. > EOT
                targets[a, b, int(torch.randint(0, T, (1,), generator=g))] = int(
                    torch.randint(eot + 1, V, (1,), generator=g))
            for _ in range(2):
                targets[a, b, int(torch.randint(0, T, (1,), generator=g))] = -1
    inputs, targets = inputs.to(torch.int32), targets.to(torch.int32)
    ds = compute_doc_start(inputs, eot)
    assert (inputs[:, 0, 0] != eot).all() and (inputs[:, 1, 0] == eot).all()
    assert ((targets != -1).sum(-1) > 0).all()
    return inputs, targets, ds


CONFIGS = {
    # (a) swiglu + alibi, GQA 4 query heads / 2 kv heads
    "a": dict(model=dict(vocab_size=300, n_layer=3, n_embd=32, n_head=4, n_kv_head=2,
                         ffn_hidden=80, max_seq_len=64, mlp=MLP_SWIGLU, pos=POS_ALIBI),
              train=dict(B=2, T=29), seed=1),
    # (b) GPT-2 style: gelu + learned positions, multi-head (nkv == nh)
    "b": dict(model=dict(vocab_size=300, n_layer=2, n_embd=32, n_head=4, n_kv_head=4,
                         ffn_hidden=128, max_seq_len=32, mlp=MLP_GELU, pos=POS_LEARNED),
              train=dict(B=3, T=23), seed=2),
    # (c) swiglu + alibi, 6 heads (non power of two slopes), multi-query (nkv = 1)
    "c": dict(model=dict(vocab_size=385, n_layer=2, n_embd=48, n_head=6, n_kv_head=1,
                         ffn_hidden=64, max_seq_len=64, mlp=MLP_SWIGLU, pos=POS_ALIBI),
              train=dict(B=2, T=19), seed=3),
    # (d) swiglu + alibi + GQA, expert-choice MoE in layer 1 (layers 0 and 2 dense), routed
    # over the whole micro-batch: n = 46 tokens, k = ceil(46 * 1.5 / 4) = 18 (17.25 rounded up)
    "d": dict(model=dict(vocab_size=300, n_layer=3, n_embd=32, n_head=4, n_kv_head=2,
                         ffn_hidden=64, max_seq_len=64, mlp=MLP_SWIGLU, pos=POS_ALIBI,
                         n_expert=4, moe_every=2, capacity_factor=1.5,
                         moe_group=MOE_GROUP_BATCH, expert_hidden=24),
              train=dict(B=2, T=23), seed=11),
    # (e) as (d) but routed per position: at each t every expert takes
    # ceil(4 * 1.0 / 4) = 1 of the B = 4 tokens
    "e": dict(model=dict(vocab_size=300, n_layer=3, n_embd=32, n_head=4, n_kv_head=2,
                         ffn_hidden=64, max_seq_len=64, mlp=MLP_SWIGLU, pos=POS_ALIBI,
                         n_expert=4, moe_every=2, capacity_factor=1.0,
                         moe_group=MOE_GROUP_POSITION, expert_hidden=24),
              train=dict(B=4, T=21), seed=14),
    # (f) Llama-shaped: rope (theta 5e5, llama3 scaling), rmsnorm eps 1e-5, no linear biases,
    # untied lm_head, GQA 4 / 2, swiglu; positions restart at every document. At hs = 8 the
    # wavelengths 2 pi / theta^(-2i/8) are 6.3, 167, 4.4e3, 1.2e5 tokens; with L = 320,
    # low 1.25, high 5 (kept below L / 5 = 64, divided by 4 above L / 1.25 = 256) frequency 0 is
    # kept, 1 is smoothed (s = 0.18) and 2, 3 are scaled (make_reference checks all three occur).
    # factor / low / high / L differ from the engine's defaults: a reader dropping them fails.
    "f": dict(model=dict(vocab_size=300, n_layer=3, n_embd=32, n_head=4, n_kv_head=2,
                         ffn_hidden=80, max_seq_len=64, mlp=MLP_SWIGLU, pos=POS_ROPE,
                         norm=NORM_RMSNORM, norm_eps=1e-5, bias=BIAS_NONE, tie_embeddings=0,
                         rope_theta=5e5, rope_scaling=ROPE_SCALING_LLAMA3, rope_factor=4.0,
                         rope_low_freq_factor=1.25, rope_high_freq_factor=5.0,
                         rope_original_max_pos=320),
              train=dict(B=2, T=29), seed=21),
    # (g) Qwen2-shaped: rope (theta 1e6, no scaling), rmsnorm eps 1e-6, biases on q/k/v only,
    # tied embeddings, GQA 4 / 2 with head size 12, swiglu
    "g": dict(model=dict(vocab_size=300, n_layer=2, n_embd=48, n_head=4, n_kv_head=2,
                         ffn_hidden=64, max_seq_len=64, mlp=MLP_SWIGLU, pos=POS_ROPE,
                         norm=NORM_RMSNORM, norm_eps=1e-6, bias=BIAS_QKV, tie_embeddings=1,
                         rope_theta=1e6, rope_scaling=ROPE_SCALING_NONE),
              train=dict(B=3, T=23), seed=22),
}
# Selections must not sit near a tie: an fp32 difference between two implementations must
# not flip which tokens an expert takes. make_reference checks every forward it runs.
MIN_SELECTION_MARGIN = 1e-4


def rope_regimes(cfg):
    """Per frequency of cfg's rope: 'kept', 'smoothed' or 'scaled' by the llama3 rule."""
    out = []
    for i in range(cfg.head_size // 2):
        w = 2.0 * math.pi / cfg.rope_theta ** (-2.0 * i / cfg.head_size)
        L = cfg.rope_original_max_pos
        out.append("kept" if w < L / cfg.rope_high_freq_factor else
                   "scaled" if w > L / cfg.rope_low_freq_factor else "smoothed")
    return out


def run_steps(params, cfg, tc, inputs, targets, ds):
    opt = AdamW(params, tc)
    hist = []
    for s in range(tc.n_steps):
        hist.append(train_step(params, opt, cfg, tc, s, inputs, targets, ds))
    return hist


def make_reference(key, seed=None):
    """Entries of reference file `key`; `seed` overrides the config's seed (seed search)."""
    with trace_moe() as trace:
        out = _make_reference(key, seed)
    margins = [r["margin"] for r in trace if r["margin"] is not None]
    if margins:
        worst = min(margins)
        assert worst > MIN_SELECTION_MARGIN, \
            f"config {key}: an MoE selection is {worst:g} from a tie (need > " \
            f"{MIN_SELECTION_MARGIN:g}): choose another seed"
    return out + (trace,)


def _make_reference(key, seed):
    spec = CONFIGS[key]
    cfg = ModelConfig(**spec["model"])
    tc0 = TrainConfig(**spec["train"], grad_accum=2, warmup_steps=5, max_steps=10, n_steps=3,
                      lr=1e-3, final_lr_frac=0.1, weight_decay=0.1, beta1=0.9, beta2=0.95,
                      eps=1e-8)
    seed = spec["seed"] if seed is None else seed
    assert tc0.T <= cfg.max_seq_len
    if cfg.pos == POS_ROPE and cfg.rope_scaling == ROPE_SCALING_LLAMA3:
        regimes = set(rope_regimes(cfg))
        assert regimes == {"kept", "smoothed", "scaled"}, \
            f"config {key}: llama3 regimes at hs {cfg.head_size}: {sorted(regimes)}"
    inputs, targets, ds = make_batch(tc0.grad_accum, tc0.B, tc0.T, cfg.vocab_size,
                                     seed=1000 + seed)
    init = init_params(cfg, seed=seed, kind="test")
    init = OrderedDict((n, p.detach().clone()) for n, p in init.items())

    def fresh():
        return OrderedDict((n, p.clone().requires_grad_(True)) for n, p in init.items())

    # grad_clip = half of the first step's pre-clip norm (3 significant digits), so
    # clipping is active.
    _, g0 = accumulate_grads(fresh(), cfg, inputs, targets, ds)
    n0 = global_norm(g0).item()
    clip = float("%.3g" % (0.5 * n0))
    tc = TrainConfig(**{**tc0.__dict__, "grad_clip": clip}).rounded()

    params = fresh()
    logits = forward(params, cfg, inputs[0], ds[0])
    loss = cross_entropy_loss(logits, targets[0])
    grads = torch.autograd.grad(loss, list(params.values()))

    params = fresh()
    hist = run_steps(params, cfg, tc, inputs, targets, ds)
    for s, (_, norm, _) in enumerate(hist):
        assert norm > tc.grad_clip, f"config {key}: clipping not active at step {s}"

    e = []
    for k in ("vocab_size", "padded_vocab_size", "n_layer", "n_embd", "n_head", "n_kv_head",
              "ffn_hidden", "max_seq_len", "mlp", "pos"):
        e.append(("config." + k, int(getattr(cfg, k))))
    e.append(("config.eot", EOT))
    for k in ("n_expert", "moe_every", "expert_hidden", "moe_group"):
        e.append(("config." + k, int(getattr(cfg, k))))
    e.append(("config.capacity_factor", float(cfg.capacity_factor)))
    if cfg.uses_llama_fields():  # (absent from the GPT-2-shaped files: defaults)
        for k, typ in LLAMA_FIELDS:
            e.append(("config." + k, typ(getattr(cfg, k))))
    for k in ("B", "T", "grad_accum", "warmup_steps", "max_steps", "n_steps"):
        e.append(("train." + k, int(getattr(tc, k))))
    for k in ("lr", "final_lr_frac", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
        e.append(("train." + k, float(getattr(tc, k))))
    e += [("inputs", inputs), ("targets", targets), ("doc_start", ds)]
    e += [("param." + n, p) for n, p in init.items()]
    e += [("logits", logits), ("loss", loss)]
    e += [("grad." + n, g) for n, g in zip(init.keys(), grads)]
    e += [("step.loss", torch.tensor([h[0] for h in hist])),
          ("step.grad_norm", torch.tensor([h[1] for h in hist])),
          ("step.lr", torch.tensor([h[2] for h in hist]))]
    e += [("final.param." + n, p) for n, p in params.items()]
    return cfg, tc, e, hist


# ----------------------------------------------------------------------------
# self-check: this file's pieces against brute force

def _close(a, b, tol, what):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    if not (a.shape == b.shape and err <= tol):
        raise AssertionError(f"{what}: max abs err {err:g} (tol {tol:g}), shapes "
                             f"{tuple(a.shape)} vs {tuple(b.shape)}")


def selfcheck_adamw(key, B=2, seed=3, data_seed=8):
    """Hand-written AdamW (with `decays`) vs torch.optim.AdamW, 4 steps, no clipping.
    With MoE layers the seeds must keep every selection clear of ties (checked): the two
    runs differ by rounding, which must not flip a selection."""
    cfg = ModelConfig(**CONFIGS[key]["model"])
    tc = TrainConfig(B=B, T=11, grad_clip=0.0, warmup_steps=2, max_steps=4).rounded()
    inp, tgt, dsa = make_batch(2, B, 11, cfg.vocab_size, seed=data_seed)
    mine = init_params(cfg, seed=seed, kind="test", dtype=torch.float64)
    theirs = init_params(cfg, seed=seed, kind="test", dtype=torch.float64)
    opt = AdamW(mine, tc)

    def by_name(n):  # independent of decays(): embeddings, the head, linear weights, router
        return n in ("wte", "wpe", "lm_head") or (
            n.endswith(".w") and n.split(".")[-2] in ("qkv", "proj", "fc", "router"))
    n_moe = sum(cfg.is_moe_layer(l) for l in range(cfg.n_layer))
    assert sum(map(by_name, theirs)) == 1 + (cfg.pos == POS_LEARNED) + 4 * cfg.n_layer + n_moe \
        + (not cfg.tie_embeddings)
    assert [n for n in mine if decays(n, mine[n])] == [n for n in theirs if by_name(n)]
    topt = torch.optim.AdamW(
        [{"params": [q for n, q in theirs.items() if by_name(n)], "weight_decay": tc.weight_decay},
         {"params": [q for n, q in theirs.items() if not by_name(n)], "weight_decay": 0.0}],
        lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, foreach=False)
    for s in range(4):
        with trace_moe() as tr:
            train_step(mine, opt, cfg, tc, s, inp, tgt, dsa)
        assert all(r["margin"] > 1e-6 for r in tr), f"adamw {key}: seeds give a near-tie"
        _, gr = accumulate_grads(theirs, cfg, inp, tgt, dsa)
        for n, q in theirs.items():
            q.grad = gr[n]
        for grp in topt.param_groups:
            grp["lr"] = f32(lr_at(s, tc))
        topt.step()
    for n in mine:
        _close(mine[n].detach(), theirs[n].detach(), 1e-12, f"adamw {key} {n}")


def _brute_select(S, B, T, E, c, group):
    """Expert-choice selection by the definition: per group, per expert, the k tokens first
    in the order (higher score, lower token id). S: nested lists [n][E]. -> [E][...] ids."""
    if group == MOE_GROUP_BATCH:
        groups = [list(range(B * T))]
    else:
        groups = [[b * T + t for b in range(B)] for t in range(T)]
    out = [[] for _ in range(E)]
    for gr in groups:
        k = min(len(gr), math.ceil(len(gr) * c / E))
        for e in range(E):
            out[e] += sorted(gr, key=lambda i: (-S[i][e], i))[:k]
    return out


def selfcheck_moe(g):
    """Selection vs brute force (with ties), capacity, gates, position groups, FD gradient."""
    # capacity k = min(m, ceil(m c / E))
    assert moe_capacity(46, 4, 1.5) == 18 and moe_capacity(4, 4, 1.0) == 1
    assert moe_capacity(8, 4, 2.0) == 4 and moe_capacity(9, 4, 2.0) == 5
    assert moe_capacity(5, 2, 10.0) == 5 and moe_capacity(3, 8, f32(0.1)) == 1

    # selection vs brute force; scores on a coarse grid so ties are everywhere
    for B, T, E, c, group in [(2, 7, 4, 1.5, 0), (3, 5, 3, 1.0, 0), (4, 6, 4, 1.0, 1),
                              (5, 3, 2, 1.25, 1), (2, 4, 8, 0.5, 0), (3, 4, 2, 4.0, 1),
                              (1, 9, 3, 2.0, 1), (4, 5, 4, 0.75, 1)]:
        for trial in range(4):
            n = B * T
            if trial == 0:
                S = torch.full((n, E), 0.25, dtype=torch.float64)   # all tied
            else:
                S = torch.randint(0, 1 + 2 * trial, (n, E), generator=g).double() / 4
            groups = routing_groups(B, T, group)
            k = moe_capacity(groups.shape[1], E, f32(c))
            chosen, margin = expert_choice_select(S, groups, k)
            want = _brute_select(S.tolist(), B, T, E, f32(c), group)
            assert chosen.tolist() == want, f"selection B{B} T{T} E{E} c{c} g{group} #{trial}"
            for e in range(E):  # exactly k distinct tokens per group
                assert chosen[e].numel() == groups.shape[0] * k == len(set(chosen[e].tolist()))
            if trial == 0:  # all tied: the lowest ids win
                first = groups[:, :k].reshape(-1)
                assert all(torch.equal(chosen[e], first) for e in range(E)), "tie rule"
            if k < groups.shape[1]:
                srt = S[groups].sort(dim=1, descending=True).values  # [G, m, E]
                _close(margin, (srt[:, k - 1] - srt[:, k]).min(), 0, "margin")
            else:
                assert margin == math.inf
    # a tie on the boundary between two tokens: the lower id is taken, either order of scores
    S = torch.tensor([[0.1, 0.9], [0.5, 0.5], [0.7, 0.3], [0.5, 0.5]], dtype=torch.float64)
    ch, margin = expert_choice_select(S, routing_groups(1, 4, MOE_GROUP_BATCH), 2)
    assert ch.tolist() == [[2, 1], [0, 1]] and margin == 0.0

    # moe_group=position: an expert never chooses among tokens of different positions
    B, T, E = 4, 6, 4
    groups = routing_groups(B, T, MOE_GROUP_POSITION)
    assert all(int(i) % T == t for t in range(T) for i in groups[t])
    S = torch.rand(B * T, E, generator=g, dtype=torch.float64)
    kp = moe_capacity(B, E, 2.0)
    chosen, _ = expert_choice_select(S, groups, kp)
    assert torch.equal(chosen.view(E, T, kp) % T, torch.arange(T).view(1, T, 1).expand(E, T, kp))
    for t in range(T):  # making every other position's tokens more attractive changes nothing
        S2 = S.clone()
        S2.view(B, T, E)[:, [u for u in range(T) if u != t]] += 10.0
        ch2, _ = expert_choice_select(S2, groups, kp)
        assert torch.equal(ch2.view(E, T, kp)[:, t], chosen.view(E, T, kp)[:, t]), "position"

    # the MoE layer: gates, zero for untaken tokens, position locality, FD with selection fixed
    for group, c in [(MOE_GROUP_BATCH, 1.5), (MOE_GROUP_POSITION, 1.0), (MOE_GROUP_POSITION, 2.0)]:
        cfg = ModelConfig(vocab_size=300, n_layer=1, n_embd=8, n_head=2, n_kv_head=1,
                          ffn_hidden=12, max_seq_len=16, n_expert=3, moe_every=1,
                          capacity_factor=c, moe_group=group, expert_hidden=5)
        B, T, C, E, He = 4, 5, cfg.n_embd, cfg.n_expert, cfg.expert_hidden
        p = init_params(cfg, seed=11, kind="test", dtype=torch.float64)
        with torch.no_grad():  # a router and experts of unit scale: clear routing, big gates
            for nm in ("router.w", "fc.w", "proj.w"):
                p["h0.moe." + nm].normal_(0.0, 0.5, generator=g)
        x = torch.randn(B, T, C, generator=g, dtype=torch.float64)
        with trace_moe() as tr:
            y = moe(x, p, "h0.", cfg)
        chosen, margin = tr[0]["chosen"], tr[0]["margin"]
        assert margin > 1e-4, "selfcheck MoE data sits near a tie"
        # brute force: scores by exp / sum, experts element by element
        xs = x.view(B * T, C).tolist()
        P = {k: v.detach().tolist() for k, v in p.items()}
        S = []
        for i in range(B * T):
            z = [sum(P["h0.moe.router.w"][e][j] * xs[i][j] for j in range(C)) for e in range(E)]
            ez = [math.exp(v - max(z)) for v in z]
            S.append([v / sum(ez) for v in ez])
        sel = _brute_select(S, B, T, E, cfg.capacity_factor, group)
        assert chosen.tolist() == sel
        want = [[0.0] * C for _ in range(B * T)]
        for e in range(E):
            W1, b1 = P["h0.moe.fc.w"][e], P["h0.moe.fc.b"][e]
            W2, b2 = P["h0.moe.proj.w"][e], P["h0.moe.proj.b"][e]
            for i in sel[e]:
                h = [sum(W1[r][j] * xs[i][j] for j in range(C)) + b1[r] for r in range(2 * He)]
                a = [h[r] / (1 + math.exp(-h[r])) * h[He + r] for r in range(He)]
                for o in range(C):
                    want[i][o] += S[i][e] * (sum(W2[o][r] * a[r] for r in range(He)) + b2[o])
        _close(y.detach().view(B * T, C), want, 1e-12, f"moe output group={group}")
        untaken = [i for i in range(B * T) if all(i not in sel[e] for e in range(E))]
        assert (y.detach().view(B * T, C)[untaken] == 0).all()
        if group == MOE_GROUP_POSITION:  # output at t depends on the tokens at t only
            x2 = x.clone()
            x2[:, 1:] = torch.randn(B, T - 1, C, generator=g, dtype=torch.float64)
            _close(moe(x2, p, "h0.", cfg).detach()[:, 0], y.detach()[:, 0], 0, "position locality")
        # gradient with the selection fixed vs central differences
        R = torch.randn(B, T, C, generator=g, dtype=torch.float64)
        xr = x.clone().requires_grad_(True)
        names = [n for n in p if ".moe." in n]
        grads = torch.autograd.grad((moe(xr, p, "h0.", cfg) * R).sum(), [xr] + [p[n] for n in names])
        assert grads[1].abs().max() > 0, "the gates carry no gradient to the router"
        with torch.no_grad():
            for name, t, gr in zip(["x"] + names, [xr] + [p[n] for n in names], grads):
                for k in torch.randperm(t.numel(), generator=g)[:6].tolist():
                    flat = t.view(-1)
                    old = flat[k].item()
                    fl = []
                    for v in (old + 1e-6, old - 1e-6):
                        flat[k] = v
                        fl.append((moe(xr, p, "h0.", cfg, chosen=chosen) * R).sum().item())
                        with trace_moe() as tr:  # the free selection stays the fixed one here
                            moe(xr, p, "h0.", cfg)
                        assert torch.equal(tr[0]["chosen"], chosen)
                    flat[k] = old
                    fd = (fl[0] - fl[1]) / 2e-6
                    _close(gr.view(-1)[k], fd, 1e-8 + 1e-6 * abs(fd), f"moe fd {name} g{group}")


def selfcheck_llama(g):
    """RMSNorm, the llama3 frequency rule, RoPE and the parameter table of the Llama / Qwen2
    shape against their definitions (brute force)."""
    # rmsnorm: x / sqrt(mean(x^2) + eps) * w, element by element; torch's own where it has one
    x = torch.randn(3, 4, 16, generator=g, dtype=torch.float64)
    w = 1.0 + 0.1 * torch.randn(16, generator=g, dtype=torch.float64)
    for eps in (1e-5, 1e-6, 0.5):
        want = [[[x[a, b, c].item() / math.sqrt(sum(v * v for v in x[a, b].tolist()) / 16 + eps)
                  * w[c].item() for c in range(16)] for b in range(4)] for a in range(3)]
        _close(rmsnorm(x, w, eps), want, 1e-12, f"rmsnorm eps {eps}")
        if hasattr(torch.nn.functional, "rms_norm"):
            _close(rmsnorm(x, w, eps), torch.nn.functional.rms_norm(x, (16,), w, eps), 1e-12,
                   "rmsnorm vs F.rms_norm")

    # the llama3 rule: the three regimes, its values at their boundaries (continuous there)
    L, lo, hi, fac = 320, 1.25, 5.0, 4.0
    inv_at = lambda wl: 2 * math.pi / wl  # noqa: E731
    for wl, want in [(10.0, 1.0), (63.9, 1.0), (256.1, 1 / fac), (1e5, 1 / fac),
                     (L / hi, 1.0), (L / lo, 1 / fac)]:
        _close(llama3_scale(inv_at(wl), fac, lo, hi, L) / inv_at(wl), want, 1e-12, f"llama3 {wl}")
    for wl in (L / hi, L / lo):  # continuous at both boundaries
        a, b = (llama3_scale(inv_at(wl * (1 + d)), fac, lo, hi, L) / inv_at(wl * (1 + d))
                for d in (-1e-9, 1e-9))
        _close(a, b, 1e-8, f"llama3 continuous at {wl}")
    wl = L / ((lo + hi) / 2)  # s = 1/2: halfway between 1/factor and 1
    _close(llama3_scale(inv_at(wl), fac, lo, hi, L) / inv_at(wl), 0.5 / fac + 0.5, 1e-12, "s 1/2")
    cf = ModelConfig(**CONFIGS["f"]["model"])
    raw = [cf.rope_theta ** (-i / 4.0) for i in range(4)]  # hs 8: theta^(-2i/8)
    got = rope_inv_freq(cf)
    assert rope_regimes(cf) == ["kept", "smoothed", "scaled", "scaled"]
    s1 = (L / (2 * math.pi / raw[1]) - lo) / (hi - lo)
    _close(got, [raw[0], raw[1] * ((1 - s1) / fac + s1), raw[2] / fac, raw[3] / fac], 1e-15,
           "inv_freq f")
    cg = ModelConfig(**CONFIGS["g"]["model"])
    _close(rope_inv_freq(cg), [1e6 ** (-2.0 * i / 12) for i in range(6)], 1e-15, "inv_freq g")

    # rope: rotate-half pairs by p * inv_freq_i, p = t - doc_start[t], vs a loop; a rotation
    # (norms kept); scores depend on the positions' difference only
    for cfg in (cf, cg):
        hs, half = cfg.head_size, cfg.head_size // 2
        B, T = 2, 13
        toks = torch.randint(0, 256, (B, T), generator=g)
        toks[0, 4] = toks[0, 9] = toks[1, 0] = EOT
        ds = compute_doc_start(toks)
        xq = torch.randn(B, 3, T, hs, generator=g, dtype=torch.float64)
        got = apply_rope(xq, *rope_cos_sin(cfg, ds, torch.float64))
        inv = rope_inv_freq(cfg)
        want = torch.zeros_like(xq)
        for b in range(B):
            for t in range(T):
                p = t - int(ds[b, t])
                for h in range(3):
                    for i in range(half):
                        c, s_ = math.cos(p * inv[i]), math.sin(p * inv[i])
                        x1, x2 = xq[b, h, t, i].item(), xq[b, h, t, i + half].item()
                        want[b, h, t, i] = x1 * c - x2 * s_
                        want[b, h, t, i + half] = x2 * c + x1 * s_
        _close(got, want, 1e-12, f"rope hs {hs}")
        _close(got.norm(dim=-1), xq.norm(dim=-1), 1e-12, "rope keeps norms")
        zero = torch.zeros(1, T, dtype=torch.int32)
        q, k = xq[:1, :1], xq[1:, 1:2]
        sc = [apply_rope(q, *rope_cos_sin(cfg, zero - d, torch.float64))
              @ apply_rope(k, *rope_cos_sin(cfg, zero - d, torch.float64)).transpose(-2, -1)
              for d in (0, 7)]  # doc_start -d: positions t + d
        _close(sc[0], sc[1], 1e-12, "rope scores are relative")

    # the parameter table of the new shapes
    names = [n for n, _ in param_specs(cf)]
    assert names[-2:] == ["lnf.w", "lm_head"] and not any(n.endswith(".b") for n in names)
    assert "wpe" not in names and len(names) == 1 + 6 * cf.n_layer + 2
    names = [n for n, _ in param_specs(cg)]
    assert [n for n in names if n.endswith(".b")] == [f"h{l}.attn.qkv.b" for l in range(2)]
    assert names[-1] == "lnf.w" and len(names) == 1 + 7 * cg.n_layer + 1
    p = init_params(cf, seed=1, kind="test")
    V = cf.vocab_size
    assert p["lm_head"][V:].abs().max() == 0 and p["lm_head"][:V].std() > 0.01
    assert (p["h0.ln1.w"] != 1).all() and decays("lm_head", p["lm_head"])
    assert not decays("h0.ln1.w", p["h0.ln1.w"])


def selfcheck_hf():
    """The Llama- and Qwen2-shaped configs against Hugging Face transformers' own models (when
    transformers is installed: else skipped), on one document per row. HF computes RMSNorm and
    the rotary tables in float32 even in a float64 model, hence the loose tolerances; the
    inverse frequencies are HF's float32 ones (compared first), the rest float64."""
    try:
        import transformers
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:
        print("selfcheck: transformers not installed, the Hugging Face comparison is skipped")
        return
    for key, arch in (("f", "Llama"), ("g", "Qwen2")):
        cfg = ModelConfig(**CONFIGS[key]["model"])
        rp = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_scaling == ROPE_SCALING_LLAMA3:
            rp.update(rope_type="llama3", factor=cfg.rope_factor,
                      low_freq_factor=cfg.rope_low_freq_factor,
                      high_freq_factor=cfg.rope_high_freq_factor,
                      original_max_position_embeddings=cfg.rope_original_max_pos)
        kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd,
                  intermediate_size=cfg.ffn_hidden, num_hidden_layers=cfg.n_layer,
                  num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                  max_position_embeddings=4 * cfg.rope_original_max_pos,
                  rms_norm_eps=cfg.norm_eps, tie_word_embeddings=bool(cfg.tie_embeddings),
                  rope_parameters=rp, hidden_act="silu")
        if arch == "Llama":
            assert cfg.bias == BIAS_NONE
            hc = transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **kw)
            model = transformers.LlamaForCausalLM(hc)
        else:
            assert cfg.bias == BIAS_QKV  # Qwen2: q, k, v biases, none elsewhere
            hc = transformers.Qwen2Config(**kw)
            model = transformers.Qwen2ForCausalLM(hc)
        hc._attn_implementation = "eager"
        if cfg.rope_scaling == ROPE_SCALING_LLAMA3:
            hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hc, "cpu")
        else:
            hf_inv = model.model.rotary_emb.inv_freq
        mine_inv = torch.tensor(rope_inv_freq(cfg), dtype=torch.float64)
        _close(hf_inv.double() / mine_inv, torch.ones_like(mine_inv), 1e-6, f"HF inv_freq {key}")
        _close(model.model.rotary_emb.inv_freq.double() / mine_inv, torch.ones_like(mine_inv),
               1e-6, f"HF model inv_freq {key}")
        p = init_params(cfg, seed=31, kind="test", dtype=torch.float64)
        nh, nkv, hs, H, V = cfg.n_head, cfg.n_kv_head, cfg.head_size, cfg.ffn_hidden, cfg.vocab_size
        q_, k_, all_ = nh * hs, (nh + nkv) * hs, slice(None)
        # HF name -> (our name, the rows of ours it is)
        sd = {"model.embed_tokens.weight": ("wte", slice(0, V)),
              "model.norm.weight": ("lnf.w", all_)}
        if not cfg.tie_embeddings:
            sd["lm_head.weight"] = ("lm_head", slice(0, V))
        for l in range(cfg.n_layer):
            h, m = f"h{l}.", f"model.layers.{l}."
            qkv = {"q": slice(0, q_), "k": slice(q_, k_), "v": slice(k_, None)}
            for n, sl in qkv.items():
                sd[m + f"self_attn.{n}_proj.weight"] = (h + "attn.qkv.w", sl)
                if cfg.qkv_bias:
                    sd[m + f"self_attn.{n}_proj.bias"] = (h + "attn.qkv.b", sl)
            sd[m + "self_attn.o_proj.weight"] = (h + "attn.proj.w", all_)
            sd[m + "mlp.gate_proj.weight"] = (h + "mlp.fc.w", slice(0, H))
            sd[m + "mlp.up_proj.weight"] = (h + "mlp.fc.w", slice(H, None))
            sd[m + "mlp.down_proj.weight"] = (h + "mlp.proj.w", all_)
            sd[m + "input_layernorm.weight"] = (h + "ln1.w", all_)
            sd[m + "post_attention_layernorm.weight"] = (h + "ln2.w", all_)
        model = model.to(torch.float64)
        hp = dict(model.named_parameters())
        with torch.no_grad():
            for n, (ours, rows) in sd.items():
                hp[n].copy_(p[ours][rows])
        loaded = {n for n in sd} | ({"lm_head.weight"} if cfg.tie_embeddings else set())
        assert set(hp) <= loaded, f"HF {key}: parameters not set: {sorted(set(hp) - loaded)}"
        # rows of one document each (no EOT: positions 0 .. T-1)
        inp = torch.randint(0, EOT, (2, 17), generator=torch.Generator().manual_seed(5))
        tgt = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(6))
        ds = compute_doc_start(inp)
        assert ds.abs().max() == 0
        logits = forward(p, cfg, inp, ds)
        hl = model(input_ids=inp.long()).logits
        err = ((logits - hl).abs().max() / hl.abs().max()).item()
        assert err < 1e-5, f"HF {key}: logits max abs err / max abs {err:g}"
        loss, hloss = cross_entropy_loss(logits, tgt), cross_entropy_loss(hl, tgt)
        grads = dict(zip(p.keys(), torch.autograd.grad(loss, list(p.values()))))
        hg = dict(zip(hp.keys(), torch.autograd.grad(hloss, list(hp.values()))))
        worst = 0.0
        for n, (ours, rows) in sd.items():  # our gradient in HF's slicing vs HF's
            e = ((grads[ours][rows] - hg[n]).norm() / hg[n].norm()).item()
            worst = max(worst, e)
            assert e < 1e-5, f"HF {key}: grad {n} (ours {ours}): rel L2 err {e:g}"
        print(f"selfcheck: {key} vs transformers {transformers.__version__} {arch}: logits "
              f"{err:.2g} (max abs err / max abs), grads {worst:.2g} (rel L2, worst)")


def selfcheck():
    import tempfile
    F = torch.nn.functional
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(123)

    # ALiBi slopes
    _close(alibi_slopes(8), [2.0 ** -k for k in range(1, 9)], 0, "slopes(8)")
    paper12 = [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625,
               0.7071067811865476, 0.35355339059327373, 0.17677669529663687,
               0.08838834764831843]
    _close(alibi_slopes(12), paper12, 1e-15, "slopes(12)")
    _close(alibi_slopes(6), [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125], 0, "slopes(6)")
    _close(alibi_slopes(4), [0.25, 0.0625, 0.015625, 0.00390625], 0, "slopes(4)")
    _close(alibi_slopes(1), [2.0 ** -8], 0, "slopes(1)")

    # doc_start vs loops
    toks = torch.randint(250, 258, (3, 4, 17), generator=g)
    ds = compute_doc_start(toks)
    for idx in [(a, b) for a in range(3) for b in range(4)]:
        last = 0
        for t in range(17):
            if toks[idx][t] == EOT:
                last = t
            assert ds[idx][t] == last, "doc_start"

    # layernorm / gelu / silu / cross-entropy vs torch's own
    x = torch.randn(3, 5, 16, generator=g, dtype=torch.float64)
    w = torch.randn(16, generator=g, dtype=torch.float64)
    b = torch.randn(16, generator=g, dtype=torch.float64)
    _close(layernorm(x, w, b), F.layer_norm(x, (16,), w, b, 1e-5), 1e-12, "layernorm")
    _close(gelu_tanh(x), F.gelu(x, approximate="tanh"), 1e-12, "gelu")
    _close(silu(x), F.silu(x), 1e-12, "silu")
    lg = torch.randn(2, 7, 11, generator=g, dtype=torch.float64)
    tg = torch.randint(0, 11, (2, 7), generator=g)
    tg[0, 3] = -1
    tg[1, 0] = -1
    _close(cross_entropy_loss(lg, tg),
           F.cross_entropy(lg.reshape(-1, 11), tg.reshape(-1), ignore_index=-1), 1e-12, "ce")

    # attention vs explicit loops (GQA, ALiBi, packed documents), float64
    for nh, nkv, use_alibi in [(4, 2, True), (6, 1, True), (3, 3, False)]:
        cfg = ModelConfig(vocab_size=300, n_layer=1, n_embd=4 * nh, n_head=nh, n_kv_head=nkv,
                          ffn_hidden=8, max_seq_len=16,
                          pos=POS_ALIBI if use_alibi else POS_LEARNED)
        B, T, hs = 2, 9, cfg.head_size
        toks = torch.randint(0, 256, (B, T), generator=g)
        toks[0, 3] = toks[0, 4] = toks[0, 8] = EOT
        toks[1, 0] = toks[1, 6] = EOT
        dsb = compute_doc_start(toks)
        p = init_params(cfg, seed=5, kind="test", dtype=torch.float64)
        xin = torch.randn(B, T, cfg.n_embd, generator=g, dtype=torch.float64)
        slopes = alibi_slopes(nh) if use_alibi else None
        bias = attention_bias(dsb, nh, slopes, dtype=torch.float64)
        got = attention(xin, p, "h0.", cfg, bias).detach()
        got_sdpa = attention(xin, p, "h0.", cfg, bias, sdpa=True).detach()
        W, bb = p["h0.attn.qkv.w"].detach(), p["h0.attn.qkv.b"].detach()
        Wp, bp = p["h0.attn.proj.w"].detach(), p["h0.attn.proj.b"].detach()
        want = torch.zeros(B, T, cfg.n_embd, dtype=torch.float64)
        for bi in range(B):
            qkv = [[sum(W[f, c].item() * xin[bi, t, c].item() for c in range(cfg.n_embd))
                    + bb[f].item() for f in range(W.shape[0])] for t in range(T)]
            y = [[0.0] * (nh * hs) for _ in range(T)]
            for h in range(nh):
                kvh = h // (nh // nkv)
                qo, ko, vo = h * hs, (nh + kvh) * hs, (nh + nkv + kvh) * hs
                for i in range(T):
                    js = [j for j in range(T) if dsb[bi, i] <= j <= i]
                    sc = []
                    for j in js:
                        s = sum(qkv[i][qo + d] * qkv[j][ko + d] for d in range(hs))
                        s /= math.sqrt(hs)
                        if use_alibi:
                            s -= slopes[h] * (i - j)
                        sc.append(s)
                    mx = max(sc)
                    ex = [math.exp(s - mx) for s in sc]
                    z = sum(ex)
                    for d in range(hs):
                        y[i][h * hs + d] = sum(e / z * qkv[j][vo + d] for e, j in zip(ex, js))
            for t in range(T):
                for c in range(cfg.n_embd):
                    want[bi, t, c] = sum(Wp[c, f].item() * y[t][f] for f in range(nh * hs)) \
                        + bp[c].item()
        _close(got, want, 1e-10, f"attention nh={nh} nkv={nkv} alibi={use_alibi}")
        _close(got_sdpa, want, 1e-10, f"attention(sdpa) nh={nh} nkv={nkv}")

    selfcheck_moe(g)
    selfcheck_llama(g)
    selfcheck_hf()

    # full model: packed rows == each document run alone; autograd == finite differences
    for key in CONFIGS:
        cfg = ModelConfig(**CONFIGS[key]["model"])
        p = init_params(cfg, seed=9, kind="test", dtype=torch.float64)
        inp, tgt, dsa = make_batch(1, 3, 21, cfg.vocab_size, seed=77)
        inp, tgt, dsa = inp[0], tgt[0], dsa[0]
        with torch.no_grad(), trace_moe() as tr:
            full = forward(p, cfg, inp, dsa)
            base_sel = [r["chosen"] for r in tr]
            assert all(r["margin"] > 1e-5 for r in tr), f"selfcheck {key}: data near a tie"
            # with MoE layers a token's routing depends on the other tokens of its group
            # (other documents, other rows): packing equivalence holds for dense models only
            for bi in range(3 if cfg.n_expert == 0 else 0):
                starts = sorted(set(dsa[bi].tolist()))
                bounds = starts + [inp.shape[1]]
                for s, e in zip(bounds[:-1], bounds[1:]):
                    doc = inp[bi: bi + 1, s:e]
                    alone = forward(p, cfg, doc, torch.zeros_like(doc))
                    _close(full[bi: bi + 1, s:e], alone, 1e-10, f"packing {key} row {bi}")
        loss = cross_entropy_loss(forward(p, cfg, inp, dsa), tgt)
        grads = dict(zip(p.keys(), torch.autograd.grad(loss, list(p.values()))))
        assert grads["wte"][cfg.vocab_size:].abs().max() == 0, "padded wte rows get no grad"
        gen = torch.Generator().manual_seed(4)
        names = ["wte", "h0.ln1.w", "h0.attn.qkv.w", "h0.attn.qkv.b", "h1.mlp.fc.w",
                 "h1.mlp.proj.b", "h1.ln2.w", "h1.moe.router.w", "h1.moe.fc.w", "h1.moe.fc.b",
                 "h1.moe.proj.w", "h1.moe.proj.b", "h2.mlp.fc.b", "lnf.w", "lnf.b", "wpe",
                 "lm_head"]
        with torch.no_grad():
            for name in [n for n in names if n in p]:
                t = p[name]
                for _ in range(3):
                    k = int(torch.randint(0, t.numel(), (1,), generator=gen))
                    if name == "wte":
                        k = int(inp.reshape(-1)[k % inp.numel()]) * cfg.n_embd + k % cfg.n_embd
                    flat = t.view(-1)
                    old = flat[k].item()
                    fl = []
                    for x in (old + 1e-6, old - 1e-6):
                        flat[k] = x
                        with trace_moe() as tr:
                            fl.append(cross_entropy_loss(forward(p, cfg, inp, dsa), tgt).item())
                        # the step must not flip a selection (else the loss is not smooth there)
                        assert all(torch.equal(r["chosen"], c) for r, c in zip(tr, base_sel)), \
                            f"fd {key} {name}: the perturbation changed an MoE selection"
                    flat[k] = old
                    lp, lm = fl
                    fd = (lp - lm) / 2e-6
                    _close(grads[name].view(-1)[k], fd, 1e-7 + 1e-5 * abs(fd), f"fd {key} {name}")

    # hand-written AdamW vs torch.optim.AdamW (decay only on ndim >= 2), no clipping
    selfcheck_adamw("b")
    selfcheck_adamw("e", B=4, data_seed=192)  # MoE; a batch without tied (identical) tokens
    selfcheck_adamw("f")  # untied head (decayed), rmsnorm weights and no biases (not decayed)

    # clipping: clipped norm equals grad_clip
    cfg = ModelConfig(**CONFIGS["b"]["model"])
    tc = TrainConfig(B=2, T=11, grad_clip=0.0, warmup_steps=2, max_steps=4).rounded()
    inp, tgt, dsa = make_batch(2, 2, 11, cfg.vocab_size, seed=8)
    mine = init_params(cfg, seed=3, kind="test", dtype=torch.float64)

    # clipping: clipped norm equals grad_clip
    _, gr = accumulate_grads(mine, cfg, inp, tgt, dsa)
    nrm = global_norm(gr)
    _close(nrm, torch.sqrt(sum((v.double() ** 2).sum() for v in gr.values())), 1e-5 * nrm.item(),
           "global norm")
    clip = 0.5 * nrm.item()
    scale = min(1.0, clip / (nrm.item() + 1e-6))
    _close(global_norm({k: v * scale for k, v in gr.items()}), clip, 1e-5 * clip, "clip")

    # lr schedule
    tc = TrainConfig(B=1, T=1, lr=1e-3, warmup_steps=5, max_steps=10, final_lr_frac=0.1)
    _close([lr_at(s, tc) for s in range(5)], [2e-4, 4e-4, 6e-4, 8e-4, 1e-3], 1e-15, "warmup")
    _close(lr_at(5, tc), 1e-3, 1e-15, "lr peak")
    _close(lr_at(10, tc), 1e-4, 1e-15, "lr end")
    _close(lr_at(7, tc), 1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.4)), 1e-15, "lr cos")

    # file round trip
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.bin")
        ent = [("i", 7), ("f", 0.5), ("v", torch.arange(6, dtype=torch.int32).view(2, 3)),
               ("w", torch.randn(3, 1, 2)), ("é", torch.zeros(0))]
        write_ref(path, ent)
        back = read_ref(path)
        assert list(back.keys()) == [n for n, _ in ent]
        assert back["i"].shape == () and back["i"].item() == 7 and back["i"].dtype == torch.int32
        assert back["f"].item() == 0.5 and back["f"].dtype == torch.float32
        assert torch.equal(back["v"], ent[2][1]) and torch.equal(back["w"], ent[3][1])
        assert back["é"].shape == (0,)
    print("OK")


# ----------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for the ref_<config>.bin files")
    ap.add_argument("--selfcheck", action="store_true", help="test this file's pieces")
    ap.add_argument("--configs", default="".join(CONFIGS),
                    help="which configs to write (default: all, %(default)s)")
    args = ap.parse_args()
    if not args.out and not args.selfcheck:
        ap.error("give --out DIR and/or --selfcheck")
    torch.set_num_threads(1)  # reproducible float32 sums
    torch.use_deterministic_algorithms(True)
    if args.selfcheck:
        selfcheck()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for key in args.configs:
            cfg, tc, entries, hist, trace = make_reference(key)
            path = os.path.join(args.out, f"ref_{key}.bin")
            write_ref(path, entries)
            back = read_ref(path)
            assert list(back.keys()) == [n for n, _ in entries]
            print(f"{path}: {os.path.getsize(path)} bytes, {len(entries)} entries; "
                  f"V={cfg.vocab_size} Vp={cfg.padded_vocab_size} L={cfg.n_layer} "
                  f"C={cfg.n_embd} nh={cfg.n_head} nkv={cfg.n_kv_head} H={cfg.ffn_hidden} "
                  f"mlp={'swiglu' if cfg.mlp == MLP_SWIGLU else 'gelu'} "
                  f"pos={['alibi', 'learned', 'rope'][cfg.pos]} "
                  f"B={tc.B} T={tc.T} A={tc.grad_accum} clip={tc.grad_clip:.6g}")
            if cfg.uses_llama_fields():
                rope = ""
                if cfg.pos == POS_ROPE:
                    rope = f" rope theta={cfg.rope_theta:g}"
                    if cfg.rope_scaling == ROPE_SCALING_LLAMA3:
                        rope += (f" llama3 (factor {cfg.rope_factor:g}, low "
                                 f"{cfg.rope_low_freq_factor:g}, high "
                                 f"{cfg.rope_high_freq_factor:g}, L {cfg.rope_original_max_pos}:"
                                 f" {' '.join(rope_regimes(cfg))})")
                print(f"  norm={['layernorm', 'rmsnorm'][cfg.norm]} eps={cfg.norm_eps:g} "
                      f"bias={['all', 'qkv', 'none'][cfg.bias]} tied={cfg.tie_embeddings}{rope}")
            if cfg.n_expert:
                taken = torch.stack([r["taken"] for r in trace])
                print(f"  MoE: E={cfg.n_expert} every {cfg.moe_every} He={cfg.expert_hidden} "
                      f"c={cfg.capacity_factor:g} group="
                      f"{'batch' if cfg.moe_group == MOE_GROUP_BATCH else 'position'}; "
                      f"{len(trace)} routings, smallest selection margin "
                      f"{min(r['margin'] for r in trace):.3g}; tokens taken by 0 / 1 / >1 "
                      f"experts: {(taken == 0).float().mean():.3f} / "
                      f"{(taken == 1).float().mean():.3f} / {(taken > 1).float().mean():.3f}")
            for s, (l, n, lr) in enumerate(hist):
                print(f"  step {s}: loss {l:.6f} norm {n:.6f} lr {lr:.6g}")


if __name__ == "__main__":
    sys.exit(main())
