#!/usr/bin/env python3
"""Our attention kernels (llmc/ops/attention.cuh) next to PyTorch's, on the same problems, in one process.

Runs on the GPU machine (PyTorch with CUDA, nvcc; no internet needed):
    python3 scripts/bench_attention.py            # default grid (~10 minutes, mostly torch.compile)
    python3 scripts/bench_attention.py --full     # T up to 8192, as dev/cuda/attention_*.cu
    python3 scripts/bench_attention.py --quick    # the device check's trimmed grid (~2 minutes): hs 64 and
        # 128, T 1024 and 4096, GQA ratio 4 only, packed and unpacked, SDPA at hs 128 T 4096 only,
        # shorter timing runs; with --no-build --lib PATH it uses a prebuilt library
        # (make dev/cuda/bin/libllmc_attention.so)

What it does
  1. builds dev/cuda/attention_lib.cu (extern "C" wrappers of attention_forward / attention_backward taking
     raw device pointers) into /tmp/libllmc_attention.so with nvcc, and loads it with ctypes
  2. builds each problem: B*T = 65536 tokens, n_head 16, hs 64 / 128, GQA ratio 1 / 4 / 8, rows either
     packed (documents of random length uniform in [1, T/4), mean ~T/8, as dev/cuda/attention_*.cu) or
     unpacked (one document per row: plain causal); ALiBi on the FlexAttention grid, off on the SDPA grid
  3. the PyTorch side of the same problem:
       FlexAttention (torch.nn.attention.flex_attention, compiled with torch.compile): mask_mod = doc_start
         semantics (key j visible to query i iff doc_start[i] <= j <= i), score_mod = ALiBi
         (- slope_h * (i - j), the same slopes), enable_gqa=True
       SDPA with the flash and the cuDNN backends, is_causal=True, on unpacked rows without ALiBi (K, V
         expanded to n_head heads beforehand for GQA, outside the timed region)
  4. validates before timing: our out, lse and dq, dk, dv against FlexAttention's (and our out against
     SDPA's on the causal problems), relative L2 <= 1e-2 (bf16) for out, 2e-2 for the gradients (both
     sides are bf16 approximations), lse relative max <= 1e-3
  5. times forward and forward+backward (median, triton.testing.do_bench if triton is there, else CUDA
     events); PyTorch's backward = its (forward+backward) - forward; ours are timed separately
  6. prints TFLOP/s counting only the visible score elements (forward 4 hs, backward 10 hs per visible
     pair and head, the FlashAttention-2 convention: same count for every implementation), our ratio to
     FlexAttention and to SDPA, and checks the targets:
       - forward and backward >= 1.3x FlexAttention on packed + GQA + ALiBi problems
       - >= 70% of cuDNN SDPA causal-only at hs 128, T 4096 (forward and backward)
       - packed rows (mean document T/8) >= 2x faster than unpacked rows, forward and backward
Exit status: 1 if a validation failed (targets only print MISS).
"""
import argparse
import ctypes
import inspect
import math
import os
import random
import subprocess
import sys

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB_PATH = "/tmp/libllmc_attention.so"
DEVICE = "cuda"


# ---------------------------------------------------------------------------------------------------
# our kernels through ctypes

def build_lib(nvcc, path):
    # Makefile-independent: one nvcc line (the same as make dev/cuda/bin/libllmc_attention.so)
    cmd = [nvcc, "-O3", "-std=c++17", "-arch=sm_90", "--use_fast_math", "-Xcompiler", "-fPIC", "-shared",
           "-DLLMC_ATTENTION_LIB", "-I" + REPO, os.path.join(REPO, "dev", "cuda", "attention_lib.cu"),
           "-o", path]
    print("building:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


class Ours:
    """attention_forward / attention_backward of llmc/ops/attention.cuh (version 0: what the trainer runs,
    1: the simple kernels, 2: the flash kernels), on torch tensors' device pointers"""

    def __init__(self, path, version):
        lib = ctypes.CDLL(path)
        vp, ci = ctypes.c_void_p, ctypes.c_int
        lib.llmc_attention_forward.argtypes = [vp] * 4 + [ci] * 7
        lib.llmc_attention_forward.restype = ci
        lib.llmc_attention_backward.argtypes = [vp] * 6 + [ci] * 7
        lib.llmc_attention_backward.restype = ci
        lib.llmc_attention_sync.argtypes = []
        lib.llmc_attention_sync.restype = ci
        lib.llmc_attention_last_error.argtypes = []
        lib.llmc_attention_last_error.restype = ctypes.c_char_p
        self.lib, self.version = lib, version

    def _check(self, rc):
        if rc != 0:
            raise RuntimeError("llmc attention: " + self.lib.llmc_attention_last_error().decode())

    def forward(self, p, out, lse, alibi):
        self._check(self.lib.llmc_attention_forward(out.data_ptr(), lse.data_ptr(), p.qkv.data_ptr(),
                                                    p.doc_start.data_ptr(), p.B, p.T, p.NH, p.KVH, p.hs,
                                                    int(alibi), self.version))

    def backward(self, p, dqkv, out, lse, alibi):
        self._check(self.lib.llmc_attention_backward(dqkv.data_ptr(), p.dout.data_ptr(), p.qkv.data_ptr(),
                                                     out.data_ptr(), lse.data_ptr(), p.doc_start.data_ptr(),
                                                     p.B, p.T, p.NH, p.KVH, p.hs, int(alibi), self.version))

    def sync(self):
        self._check(self.lib.llmc_attention_sync())


# ---------------------------------------------------------------------------------------------------
# problems

def alibi_slope(h, n_head):
    # cpu::alibi_slope (Press et al.): m = 2^floor(log2 n) slopes, then every other slope of 2m heads
    m = 1
    while m * 2 <= n_head:
        m *= 2
    if h < m:
        return 2.0 ** (-8.0 * (h + 1) / m)
    return 2.0 ** (-8.0 * (2 * (h - m) + 1) / (2 * m))


def make_doc_start(B, T, packed, seed):
    # packed: documents of random length uniform in [1, T/4) (mean ~T/8), the row starting inside one
    ds = torch.zeros(B, T, dtype=torch.int32)
    if packed:
        rng = random.Random(seed)
        max_len = max(2, T // 4)
        for b in range(B):
            start, nxt = 0, 1 + rng.randrange(max_len - 1)
            while start < T:
                ds[b, start:min(nxt, T)] = start
                start, nxt = nxt, nxt + 1 + rng.randrange(max_len - 1)
    return ds.to(DEVICE)


class Problem:
    def __init__(self, hs, T, ratio, packed, alibi, n_head=16, tokens=65536, seed=0):
        self.hs, self.T, self.ratio, self.packed, self.alibi = hs, T, ratio, packed, alibi
        self.NH, self.KVH, self.B = n_head, n_head // ratio, tokens // T
        B, NH, KVH = self.B, self.NH, self.KVH
        g = torch.Generator(device=DEVICE).manual_seed(1000 + seed)
        self.qkv = torch.randn(B, T, (NH + 2 * KVH) * hs, device=DEVICE, generator=g).to(torch.bfloat16)
        self.dout = torch.randn(B, T, NH * hs, device=DEVICE, generator=g).to(torch.bfloat16)
        self.doc_start = make_doc_start(B, T, packed, seed)
        # PyTorch layouts [B, heads, T, hs], contiguous copies made once (not timed)
        x = self.qkv.view(B, T, NH + 2 * KVH, hs).transpose(1, 2)
        self.q = x[:, :NH].contiguous()
        self.k = x[:, NH:NH + KVH].contiguous()
        self.v = x[:, NH + KVH:].contiguous()
        self.dout_t = self.dout.view(B, T, NH, hs).transpose(1, 2).contiguous()
        self.slopes = torch.tensor([alibi_slope(h, NH) for h in range(NH)], dtype=torch.float32, device=DEVICE)
        pos = torch.arange(T, device=DEVICE, dtype=torch.int64)
        self.pairs = float((pos[None, :] - self.doc_start.long() + 1).sum().item())  # visible (i, j), per head

    def name(self):
        return "hs%-3d T%-5d GQA%d %-8s %s" % (self.hs, self.T, self.ratio, "packed" if self.packed else "unpacked",
                                               "alibi" if self.alibi else "causal")

    def flops(self, what):
        per_pair = {"fwd": 4, "bwd": 10, "f+b": 14}[what]
        return per_pair * self.hs * self.NH * self.pairs


def rel_l2(a, b):
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def rel_max(a, b):
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------------
# timing

try:
    from triton.testing import do_bench as _triton_do_bench
except Exception:  # triton missing: CUDA events
    _triton_do_bench = None


BENCH_WARMUP_MS, BENCH_REP_MS, BENCH_EVENTS = 25, 100, 20  # --quick: 10, 40, 10


def bench_ms(fn, grad_to_none=None):
    if _triton_do_bench is not None:
        return _triton_do_bench(fn, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS, grad_to_none=grad_to_none,
                                return_mode="median")
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(BENCH_EVENTS):
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def tflops(p, what, ms):
    return p.flops(what) / (ms * 1e-3) / 1e12 if ms and ms > 0 else float("nan")


# ---------------------------------------------------------------------------------------------------
# PyTorch implementations

from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:
    AuxRequest = None
_FLEX_HAS_AUX = AuxRequest is not None and "return_aux" in inspect.signature(flex_attention).parameters
try:
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 1024)
except AttributeError:
    pass
flex_compiled = torch.compile(flex_attention, dynamic=False)


class Flex:
    def __init__(self, p):
        ds, slopes = p.doc_start, p.slopes

        def doc_causal(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (kv_idx >= ds[b, q_idx])

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).to(torch.float32)

        self.score_mod = alibi if p.alibi else None
        try:
            self.block_mask = create_block_mask(doc_causal, p.B, None, p.T, p.T, device=DEVICE, _compile=True)
        except TypeError:
            self.block_mask = create_block_mask(doc_causal, p.B, None, p.T, p.T, device=DEVICE)

    def __call__(self, q, k, v, lse=False):
        kw = dict(score_mod=self.score_mod, block_mask=self.block_mask, enable_gqa=True)
        if not lse:
            return flex_compiled(q, k, v, **kw)
        if _FLEX_HAS_AUX:
            out, aux = flex_compiled(q, k, v, return_aux=AuxRequest(lse=True), **kw)
            return out, aux.lse
        return flex_compiled(q, k, v, return_lse=True, **kw)


def sdpa_backends():
    from torch.nn.attention import SDPBackend
    return [("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)]


# ---------------------------------------------------------------------------------------------------

def run_problem(p, ours, with_sdpa, results, failures):
    print("\n== " + p.name() + "  (B %d, n_kv_head %d)" % (p.B, p.KVH), flush=True)
    B, T, NH, KVH, hs = p.B, p.T, p.NH, p.KVH, p.hs
    out = torch.empty(B, T, NH * hs, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty(B, NH, T, dtype=torch.float32, device=DEVICE)
    dqkv = torch.empty_like(p.qkv)
    flex = Flex(p)

    # ---- validation: ours vs FlexAttention (forward, lse, gradients)
    ours.forward(p, out, lse, p.alibi)
    ours.backward(p, dqkv, out, lse, p.alibi)
    ours.sync()
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v))
    f_out, f_lse = flex(qg, kg, vg, lse=True)
    f_out.backward(p.dout_t)
    torch.cuda.synchronize()
    d = dqkv.view(B, T, NH + 2 * KVH, hs).transpose(1, 2)
    errs = {
        "out": rel_l2(out, f_out.transpose(1, 2).reshape(B, T, NH * hs)),
        "lse": rel_max(lse, f_lse),
        "dq": rel_l2(d[:, :NH], qg.grad),
        "dk": rel_l2(d[:, NH:NH + KVH], kg.grad),
        "dv": rel_l2(d[:, NH + KVH:], vg.grad),
    }
    tol = {"out": 1e-2, "lse": 1e-3, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2}
    bad = [k for k in errs if not errs[k] <= tol[k]]
    print("  validate vs FlexAttention: " + "  ".join("%s %.1e" % (k, v) for k, v in errs.items()) +
          ("  ok" if not bad else "  MISMATCH (" + ", ".join(bad) + ")"), flush=True)
    if bad:
        failures.append(p.name() + " vs flex: " + ", ".join(bad))
    del qg, kg, vg, f_out, f_lse

    # ---- timing
    r = {}
    r["ours fwd"] = bench_ms(lambda: ours.forward(p, out, lse, p.alibi))
    r["ours bwd"] = bench_ms(lambda: ours.backward(p, dqkv, out, lse, p.alibi))
    r["ours f+b"] = r["ours fwd"] + r["ours bwd"]
    r["flex fwd"] = bench_ms(lambda: flex(p.q, p.k, p.v))
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v))
    r["flex f+b"] = bench_ms(lambda: flex(qg, kg, vg).backward(p.dout_t), grad_to_none=[qg, kg, vg])
    r["flex bwd"] = r["flex f+b"] - r["flex fwd"]
    del qg, kg, vg
    line = "  TFLOP/s   " + "   ".join(
        "%s: ours %6.1f flex %6.1f (%.2fx)" % (w, tflops(p, w, r["ours " + w]), tflops(p, w, r["flex " + w]),
                                               r["flex " + w] / r["ours " + w])
        for w in ("fwd", "bwd", "f+b"))
    print(line, flush=True)

    if with_sdpa:
        k_e = p.k.repeat_interleave(p.ratio, dim=1) if p.ratio > 1 else p.k
        v_e = p.v.repeat_interleave(p.ratio, dim=1) if p.ratio > 1 else p.v
        from torch.nn.attention import sdpa_kernel
        for name, backend in sdpa_backends():
            try:
                with sdpa_kernel([backend]):
                    s_out = F.scaled_dot_product_attention(p.q, k_e, v_e, is_causal=True)
                    e = rel_l2(out, s_out.transpose(1, 2).reshape(B, T, NH * hs))
                    print("  validate vs %s: out %.1e %s" % (name, e, "ok" if e <= 1e-2 else "MISMATCH"))
                    if not e <= 1e-2:
                        failures.append(p.name() + " vs " + name)
                    r[name + " fwd"] = bench_ms(lambda: F.scaled_dot_product_attention(p.q, k_e, v_e, is_causal=True))
                    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (p.q, k_e, v_e))
                    r[name + " f+b"] = bench_ms(
                        lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(p.dout_t),
                        grad_to_none=[qg, kg, vg])
                    r[name + " bwd"] = r[name + " f+b"] - r[name + " fwd"]
                    del qg, kg, vg
                print("  TFLOP/s   %s: fwd %6.1f bwd %6.1f f+b %6.1f   ours / %s: fwd %.2f bwd %.2f f+b %.2f" % (
                    name, tflops(p, "fwd", r[name + " fwd"]), tflops(p, "bwd", r[name + " bwd"]),
                    tflops(p, "f+b", r[name + " f+b"]), name, r[name + " fwd"] / r["ours fwd"],
                    r[name + " bwd"] / r["ours bwd"], r[name + " f+b"] / r["ours f+b"]), flush=True)
            except RuntimeError as ex:  # backend not available for this shape / build
                print("  %s: not available (%s)" % (name, str(ex).splitlines()[0][:120]))
        del k_e, v_e
    results[(p.hs, p.T, p.ratio, p.packed, p.alibi)] = r
    del out, lse, dqkv, flex
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="T = 1024, 2048, 4096, 8192 (default 1024, 4096)")
    ap.add_argument("--hs", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--T", type=int, nargs="+", default=None)
    ap.add_argument("--ratios", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--version", type=int, default=0, help="ours: 0 dispatch (default), 1 simple, 2 flash")
    ap.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"))
    ap.add_argument("--no-build", action="store_true", help="use an existing library (--lib)")
    ap.add_argument("--lib", default=LIB_PATH, help=f"the library of our kernels (default {LIB_PATH})")
    ap.add_argument("--quick", action="store_true",
                    help="the device check's grid: hs 64/128, T 1024/4096, GQA 4, packed and unpacked, "
                         "SDPA at hs 128 T 4096 only, shorter timings")
    args = ap.parse_args()
    Ts = args.T or ([1024, 2048, 4096, 8192] if args.full else [1024, 4096])
    global BENCH_WARMUP_MS, BENCH_REP_MS, BENCH_EVENTS
    if args.quick:
        BENCH_WARMUP_MS, BENCH_REP_MS, BENCH_EVENTS = 10, 40, 10

    if not args.no_build:
        build_lib(args.nvcc, args.lib)
    ours = Ours(args.lib, args.version)
    print("torch %s on %s, FlexAttention lse via %s, timing with %s" % (
        torch.__version__, torch.cuda.get_device_name(), "return_aux" if _FLEX_HAS_AUX else "return_lse",
        "triton.testing.do_bench" if _triton_do_bench else "CUDA events"))
    print("TFLOP/s over visible score elements only: forward 4 hs, backward 10 hs (2.5x), f+b 14 hs per pair")

    results, failures = {}, []
    if args.quick:
        # the most wanted numbers first (a timeout keeps what was printed): T 4096 before 1024, the
        # cuDNN comparison (hs 128, T 4096) right after its FlexAttention pair
        for hs, T in ((128, 4096), (64, 4096), (128, 1024), (64, 1024)):
            for packed in (True, False):
                run_problem(Problem(hs, T, 4, packed, True, seed=T + 4), ours, False, results, failures)
            if (hs, T) == (128, 4096):
                run_problem(Problem(hs, T, 1, False, False, seed=7 + T), ours, True, results, failures)
        args.hs, Ts = [], []  # the grids below are skipped
    # the FlexAttention grid: packed and unpacked rows, GQA, ALiBi
    for hs in args.hs:
        for T in Ts:
            for ratio in args.ratios:
                for packed in (True, False):
                    run_problem(Problem(hs, T, ratio, packed, True, seed=T + ratio), ours, False, results, failures)
    # the SDPA grid: causal only (unpacked, no ALiBi), no GQA
    for hs in args.hs:
        for T in Ts:
            run_problem(Problem(hs, T, 1, False, False, seed=7 + T), ours, True, results, failures)

    print("\n== targets")

    def verdict(ok):
        return "PASS" if ok else "MISS"

    # 1. >= 1.3x FlexAttention on packed + GQA + ALiBi
    for w in ("fwd", "bwd"):
        xs = [(r["flex " + w] / r["ours " + w], k) for k, r in results.items() if k[3] and k[2] > 1 and k[4]]
        if xs:
            worst = min(xs)
            print("  %s >= 1.3x FlexAttention on packed + GQA + ALiBi: worst %.2fx (hs %d T %d GQA %d), "
                  "mean %.2fx: %s" % (w, worst[0], worst[1][0], worst[1][1], worst[1][2],
                                      sum(x for x, _ in xs) / len(xs), verdict(worst[0] >= 1.3)))
    # 2. >= 70% of cuDNN SDPA, causal only, hs 128, T 4096
    r = results.get((128, 4096, 1, False, False))
    if r and "sdpa-cudnn fwd" in r:
        for w in ("fwd", "bwd"):
            frac = r["sdpa-cudnn " + w] / r["ours " + w]
            print("  %s >= 70%% of cuDNN SDPA (causal, hs 128, T 4096): %.0f%%: %s" % (w, 100 * frac,
                                                                                      verdict(frac >= 0.7)))
    else:
        print("  cuDNN SDPA at hs 128, T 4096: not measured (not in the grid or backend unavailable)")
    # 3. packed >= 2x faster than unpacked
    for w in ("fwd", "bwd"):
        xs = []
        for (hs, T, ratio, packed, alibi), rp in results.items():
            ru = results.get((hs, T, ratio, False, alibi))
            if packed and ru:
                xs.append((ru["ours " + w] / rp["ours " + w], (hs, T, ratio)))
        if xs:
            worst = min(xs)
            print("  %s packed (mean document T/8) >= 2x faster than unpacked: worst %.2fx (hs %d T %d GQA %d): %s"
                  % (w, worst[0], *worst[1], verdict(worst[0] >= 2.0)))
    if failures:
        print("\nVALIDATION FAILED: " + "; ".join(failures))
        sys.exit(1)
    print("\nall validations passed")


if __name__ == "__main__":
    main()
