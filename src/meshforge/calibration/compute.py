"""Compute measurements for ``meshforge calibrate``: matmul throughput over a sweep of sizes
(peak and half-efficiency size), the attention core's fraction of the peak, memory
bandwidth, a Llama block's work outside GEMMs and attention, and (CPU) a block's fixed
costs. Every rank measures at the same time, as ranks compute side by side in training.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshforge.models.llama import Block, rope_cos_sin, rope_inv_freq
from meshforge.models.shape import ModelShape


def timed(fn, repeat: int, min_s: float = 0.0, calls: int = 0) -> float:
    """Seconds per call: the median of ``repeat`` rounds (training step times are reported
    as medians too), each of enough calls to last ``min_s`` (so that ranks measuring side by
    side really overlap), or of ``calls`` calls (collectives: every rank must make as many).
    Ranks line up first."""
    sync_ranks()
    fn()
    if not calls:
        t0 = time.perf_counter()
        while calls == 0 or time.perf_counter() - t0 < min_s / max(repeat, 1):
            fn()
            calls += 1
    rounds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / calls)
    return statistics.median(rounds)


def sync_ranks() -> None:
    if dist.is_initialized() and SYNC_COMPUTE[0]:
        dist.barrier()


SYNC_COMPUTE = [False]  # line ranks up before each compute measurement
MIN_S = 0.3  # per measurement, so that concurrent ranks overlap


def matmul_sweep(device: torch.device, dtype: torch.dtype, sizes: list[int], repeat: int) -> list[tuple[float, float]]:
    """(GEMM FLOPs, FLOP/s) per size, on a transformer's shapes: (tokens n) x (hidden n/2)
    by (n/2) x (3n/2), in its forward, input-gradient and weight-gradient orientations."""
    out = []
    for n in sizes:
        m, k, f = n, n // 2, 3 * n // 2
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(k, f, device=device, dtype=dtype)
        g = torch.randn(m, f, device=device, dtype=dtype)
        t = sum(
            timed(fn, repeat, MIN_S / 3)
            for fn in (lambda x=x, w=w: x @ w, lambda g=g, w=w: g @ w.T, lambda x=x, g=g: x.T @ g)
        )
        out.append((2.0 * m * k * f, 3 * 2.0 * m * k * f / t))
    return out


def fit_half(points: list[tuple[float, float]], peak: float) -> float:
    """f_half such that efficiency(f) = f / (f + f_half) best matches the sweep."""
    halves = [f * (peak / r - 1) for f, r in points if r < peak * 0.999]
    return statistics.median(halves) if halves else 1.0


def attention_fraction(device: torch.device, dtype: torch.dtype, peak: float, repeat: int) -> float:
    b, h, s, d = 4, 8, 256, 64
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    t = timed(run, repeat, MIN_S)
    flops = 3 * 4.0 * b * h * s * s * d  # fwd + bwd over the full square, as the planner counts
    return flops / t / peak


def bandwidth(device: torch.device, repeat: int) -> float:
    x = torch.empty(64 * 2**20 // 4, device=device)
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), repeat, MIN_S)
    return 2 * x.numel() * 4 / t


def elementwise_bytes_per_hidden(device: torch.device, bw: float, repeat: int) -> float:
    """Effective bytes per (token x hidden x element) of one pass of a block's elementwise work."""
    tokens, hdim = 2048, 256
    x = torch.randn(tokens, hdim, device=device, requires_grad=True)
    w = torch.ones(hdim, device=device, requires_grad=True)
    g = torch.randn(tokens, 3 * hdim, device=device, requires_grad=True)
    u = torch.randn(tokens, 3 * hdim, device=device, requires_grad=True)

    def run():
        y = x + F.rms_norm(x, (hdim,), w)  # norm + residual (twice per block)
        z = x + F.rms_norm(y, (hdim,), w)
        a = F.silu(g) * u
        (y.sum() + z.sum() + a.sum()).backward()

    t = timed(run, repeat, MIN_S)
    passes = 3  # forward and backward (x2), as the planner counts them
    return t * bw / (tokens * hdim * 4 * passes)


def block_elementwise(
    device: torch.device,
    dtype: torch.dtype,
    peak: float,
    half: float,
    attn: float,
    bw: float,
    repeat: int,
    fixed: float = 0.0,
) -> float:
    """Bytes per (token x hidden x element) of a Llama block's work outside GEMMs and the
    attention core (norms, RoPE, residuals, SwiGLU, layout copies, the dispatch of each):
    a real block's forward + backward, less the GEMM and attention time this profile
    predicts for it - the rest of the block as the planner counts it."""
    cuda = device.type == "cuda"
    h, heads, kv, f, b, s = (2048, 16, 8, 5632, 4, 2048) if cuda else (256, 4, 2, 768, 8, 256)
    args = ModelShape(hidden=h, layers=1, heads=heads, kv_heads=kv, ffn_hidden=f, vocab_size=256, max_seq_len=s)
    block = Block(args, 0).to(device, dtype)
    for prm in block.parameters():
        torch.nn.init.normal_(prm, std=0.02)
    x = torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(rope_inv_freq(args, device), torch.arange(s, device=device))

    def run():
        block(x, cos, sin).sum().backward()

    t = timed(run, repeat, MIN_S)
    tokens, kv_dim = b * s, kv * (h // heads)
    gemm_flops = 6.0 * tokens * (2 * h * h + 2 * h * kv_dim + 3 * h * f)
    typical = 2.0 * tokens * h * max(f, h)
    predicted = gemm_flops / (peak * typical / (typical + half)) + 12.0 * s * h * tokens / (peak * attn) + fixed
    bpe = torch.finfo(dtype).bits // 8
    return max(t - predicted, 0.0) * bw / (tokens * h * bpe * 3)


def block_fixed_costs(device: torch.device, dtype: torch.dtype, repeat: int) -> tuple[float, float]:
    """Seconds a Llama block costs whatever its size: its forward + backward and its AdamW
    (foreach) step on a few tokens of a tiny block, where the work is nothing and per-op
    dispatch (Python, autograd, the dispatcher, allocation) is everything. On a CPU these
    per-step costs dominate small models; a GPU hides them behind asynchronous launches."""
    args = ModelShape(hidden=64, layers=1, heads=2, kv_heads=1, ffn_hidden=128, vocab_size=256, max_seq_len=8)
    block = Block(args, 0).to(device, dtype)
    x = torch.randn(1, 4, 64, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(rope_inv_freq(args, device), torch.arange(4, device=device))
    t_block = timed(lambda: block(x, cos, sin).sum().backward(), repeat, MIN_S)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-4, foreach=device.type == "cpu")
    t_opt = timed(opt.step, repeat, MIN_S)
    return t_block, t_opt


def compute_profile(device: torch.device, quick: bool) -> dict:
    """Matmul peaks and efficiency curve, attention fraction, bandwidth, elementwise cost."""
    cuda = device.type == "cuda"
    repeat = 3 if quick else 6
    sizes = [128, 256, 512, 768, 1024] if quick else [128, 256, 384, 512, 768, 1024, 1536]
    if cuda:
        sizes = [512, 1024, 2048, 4096, 8192, 16384]
    main = "bf16" if cuda else "fp32"  # the precision training uses here by default
    peaks, half = {}, 1.0
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        # a CPU without bf16 matmul units is ~50x slower in bf16: measure only small sizes there
        pts = matmul_sweep(device, dtype, sizes if name == main else sizes[:2], repeat)
        peaks[name] = statistics.median(sorted(r for _, r in pts)[-3:])  # robust to one lucky size
        if name == main:
            half = fit_half(pts, peaks[name])
    attn = attention_fraction(device, torch.bfloat16 if cuda else torch.float32, peaks[main], repeat)
    bw = bandwidth(device, repeat)
    dtype = torch.bfloat16 if cuda else torch.float32
    fixed, opt_fixed = (0.0, 0.0) if cuda else block_fixed_costs(device, dtype, repeat)
    # a whole block's non-GEMM work less its fixed cost; the bare elementwise passes are its floor (noise)
    elem = max(
        block_elementwise(device, dtype, peaks[main], half, attn, bw, repeat, fixed),
        elementwise_bytes_per_hidden(device, bw, repeat),
    )
    return {"peaks": peaks, "half": half, "attn": attn, "bw": bw, "elem": elem, "fixed": fixed, "opt": opt_fixed}
