"""Compute measurements of this machine, for ``meshforge calibrate`` and for the planner's own
profile of this CPU (metrics/cpu_peak.py): matmul throughput over a sweep of sizes (peak and
half-efficiency size), the attention core's fraction of the peak, memory bandwidth, a Llama
block's work outside GEMMs and attention, and (CPU) a block's fixed costs. Under calibrate every
rank measures at the same time, as ranks compute side by side in training.

Timings that know their noise (``Timer``): each figure is the fastest of repeated rounds (what
the machine can do; a round slowed by other work says nothing about it), with its spread (the
median round over the fastest, less one) recorded. A figure whose spread is over ``NOISY`` is
measured again, up to ``ATTEMPTS`` times (the ranks agree on it: a rank must never measure alone);
what stays noisy is named in the profile (``noisy``) and by ``meshforge calibrate``. One sanity
limit: the matmul peak is never below a plain square GEMM measured on its own (a sweep slowed by
other work is a measurement error, not a slow machine).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshforge.models.llama import Block, rope_cos_sin, rope_inv_freq
from meshforge.models.shape import ModelShape

NOISY = 0.20  # a figure whose rounds spread more than this (median over fastest, less one) is measured again
ATTEMPTS = 3  # measurements of a figure at most
PLAIN_GEMM = 1024  # the plain square GEMM the matmul peak is held against
SYNC_COMPUTE = [False]  # line ranks up before each compute measurement
MIN_S = 0.3  # per measurement, so that concurrent ranks overlap


def rounds(fn: Callable[[], Any], repeat: int, min_s: float = 0.0, calls: int = 0) -> list[float]:
    """Seconds per call of ``repeat`` rounds, each of enough calls to last ``min_s`` (so that ranks
    measuring side by side really overlap), or of ``calls`` calls (collectives: every rank must
    make as many). Ranks line up first."""
    sync_ranks()
    fn()
    if not calls:
        t0 = time.perf_counter()
        while calls == 0 or time.perf_counter() - t0 < min_s / max(repeat, 1):
            fn()
            calls += 1
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / calls)
    return out


def sync_ranks() -> None:
    if dist.is_initialized() and SYNC_COMPUTE[0]:
        dist.barrier()


def agree_max(value: float) -> float:
    """The largest ``value`` over the ranks (every rank calls it; one rank alone: itself)."""
    if not dist.is_initialized():
        return value
    nccl = dist.get_backend() == "nccl"
    t = torch.tensor([value], dtype=torch.float64, device=torch.cuda.current_device() if nccl else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


@dataclass
class Timer:
    """Times figures and keeps each one's spread; ``rounds_fn`` and ``agree`` are injectable (tests
    give noisy rounds without timing anything; calibrate's ranks agree on a figure's spread)."""

    rounds_fn: Callable[..., list[float]] = rounds
    agree: Callable[[float], float] = agree_max
    spreads: dict[str, float] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    _figure: str = "other"

    def time(self, fn: Callable[[], Any], repeat: int, min_s: float = 0.0, calls: int = 0) -> float:
        """Seconds per call: the fastest round; its spread counts toward the current figure's."""
        r = self.rounds_fn(fn, repeat, min_s, calls)
        low = min(r)
        spread = statistics.median(r) / low - 1 if low > 0 else 0.0
        self.spreads[self._figure] = max(self.spreads.get(self._figure, 0.0), spread)
        return low

    def figure(self, name: str, measure: Callable[[], Any]) -> Any:
        """``measure()``, again while its spread stays over NOISY (at most ATTEMPTS times in all)."""
        for attempt in range(1, ATTEMPTS + 1):
            self._figure, self.spreads[name] = name, 0.0
            value = measure()
            self.spreads[name] = self.agree(self.spreads[name])
            self.attempts[name] = attempt
            if self.spreads[name] <= NOISY:
                break
        self._figure = "other"
        return value

    def noisy(self) -> list[str]:
        """The figures still noisy after their last measurement."""
        return sorted(k for k, v in self.spreads.items() if v > NOISY)

    def report(self) -> dict[str, Any]:
        """What the profile records of its own measurement."""
        spreads = {k: round(v, 4) for k, v in self.spreads.items()}
        return {"spreads": spreads, "attempts": dict(self.attempts), "noisy": self.noisy(), "errors": list(self.errors)}


def noise_warning(report: dict[str, Any]) -> str:
    """The warning a noisy profile is written with ("" when none): the figures, their spreads."""
    noisy = report.get("noisy") or []
    lines = []
    if noisy:
        figs = ", ".join(f"{k} ({100 * report['spreads'][k]:.0f}%)" for k in noisy)
        lines.append(
            f"these figures stayed noisy after {ATTEMPTS} measurements (median round over the fastest): {figs}; "
            "the machine was busy: measure again with nothing else running"
        )
    lines += report.get("errors") or []
    return "; ".join(lines)


def matmul_sweep(
    device: torch.device, dtype: torch.dtype, sizes: list[int], repeat: int, timer: Timer
) -> list[tuple[float, float]]:
    """(GEMM FLOPs, FLOP/s) per size, on a transformer's shapes: (tokens n) x (hidden n/2)
    by (n/2) x (3n/2), in its forward, input-gradient and weight-gradient orientations."""
    out = []
    for n in sizes:
        m, k, f = n, n // 2, 3 * n // 2
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(k, f, device=device, dtype=dtype)
        g = torch.randn(m, f, device=device, dtype=dtype)
        t = sum(
            timer.time(fn, repeat, MIN_S / 3)
            for fn in (lambda x=x, w=w: x @ w, lambda g=g, w=w: g @ w.T, lambda x=x, g=g: x.T @ g)
        )
        out.append((2.0 * m * k * f, 3 * 2.0 * m * k * f / t))
    return out


def fit_half(points: list[tuple[float, float]], peak: float) -> float:
    """f_half such that efficiency(f) = f / (f + f_half) best matches the sweep."""
    halves = [f * (peak / r - 1) for f, r in points if r < peak * 0.999]
    return statistics.median(halves) if halves else 1.0


def attention_fraction(device: torch.device, dtype: torch.dtype, peak: float, repeat: int, timer: Timer) -> float:
    b, h, s, d = 4, 8, 256, 64
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    t = timer.time(run, repeat, MIN_S)
    flops = 3 * 4.0 * b * h * s * s * d  # fwd + bwd over the full square, as the planner counts
    return flops / t / peak


def bandwidth(device: torch.device, repeat: int, timer: Timer) -> float:
    x = torch.empty(64 * 2**20 // 4, device=device)
    y = torch.empty_like(x)
    t = timer.time(lambda: y.copy_(x), repeat, MIN_S)
    return 2 * x.numel() * 4 / t


def elementwise_bytes_per_hidden(device: torch.device, bw: float, repeat: int, timer: Timer) -> float:
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

    t = timer.time(run, repeat, MIN_S)
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
    timer: Timer,
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

    t = timer.time(run, repeat, MIN_S)
    tokens, kv_dim = b * s, kv * (h // heads)
    gemm_flops = 6.0 * tokens * (2 * h * h + 2 * h * kv_dim + 3 * h * f)
    typical = 2.0 * tokens * h * max(f, h)
    predicted = gemm_flops / (peak * typical / (typical + half)) + 12.0 * s * h * tokens / (peak * attn) + fixed
    bpe = torch.finfo(dtype).bits // 8
    return max(t - predicted, 0.0) * bw / (tokens * h * bpe * 3)


def block_fixed_costs(device: torch.device, dtype: torch.dtype, repeat: int, timer: Timer) -> tuple[float, float]:
    """Seconds a Llama block costs whatever its size: its forward + backward and its AdamW
    (foreach) step on a few tokens of a tiny block, where the work is nothing and per-op
    dispatch (Python, autograd, the dispatcher, allocation) is everything. On a CPU these
    per-step costs dominate small models; a GPU hides them behind asynchronous launches."""
    args = ModelShape(hidden=64, layers=1, heads=2, kv_heads=1, ffn_hidden=128, vocab_size=256, max_seq_len=8)
    block = Block(args, 0).to(device, dtype)
    x = torch.randn(1, 4, 64, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(rope_inv_freq(args, device), torch.arange(4, device=device))
    t_block = timer.time(lambda: block(x, cos, sin).sum().backward(), repeat, MIN_S)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-4, foreach=device.type == "cpu")
    t_opt = timer.time(opt.step, repeat, MIN_S)
    return t_block, t_opt


def plain_gemm_rate(device: torch.device, dtype: torch.dtype, repeat: int, timer: Timer) -> float:
    """FLOP/s of one plain square GEMM (``PLAIN_GEMM``), the floor the matmul peak is held to."""
    n = PLAIN_GEMM
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2.0 * n**3 / timer.time(lambda: a @ b, repeat, MIN_S / 3)


def _peaks(device: torch.device, sizes: list[int], main: str, repeat: int, timer: Timer) -> tuple[dict, float]:
    """The matmul peak per precision and the half-efficiency size of the main one. The main
    precision's peak is held against a plain GEMM measured on its own: below it is a measurement
    error (the sweep was slowed by other work), measured again, and if it stays, the plain GEMM's
    rate is the peak and the profile says so."""
    peaks, half = {}, 1.0
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        # a CPU without bf16 matmul units is ~50x slower in bf16: measure only small sizes there
        size = sizes if name == main else sizes[:2]
        for attempt in range(ATTEMPTS if name == main else 1):
            pts = timer.figure(f"matmul {name}", lambda d=dtype, z=size: matmul_sweep(device, d, z, repeat, timer))
            peaks[name] = statistics.median(sorted(r for _, r in pts)[-3:])  # robust to one lucky size
            if name != main:
                break
            plain = timer.figure("plain gemm", lambda d=dtype: plain_gemm_rate(device, d, repeat, timer))
            if peaks[name] >= plain / 2 or attempt == ATTEMPTS - 1:
                break
        if name == main:
            if peaks[name] < plain / 2:
                timer.errors.append(
                    f"the {name} matmul peak ({peaks[name] / 1e9:.1f} GFLOP/s) stayed below half a plain "
                    f"{PLAIN_GEMM}x{PLAIN_GEMM} GEMM's rate ({plain / 1e9:.1f}): a measurement error; that rate used"
                )
            peaks[name] = max(peaks[name], plain)
            half = fit_half(pts, peaks[name])
    return peaks, half


def compute_profile(device: torch.device, quick: bool, timer: Timer | None = None) -> dict:
    """Matmul peaks and efficiency curve, attention fraction, bandwidth, elementwise cost, and how
    noisy each figure was (``timing``: ``Timer.report``)."""
    timer = timer or Timer()
    cuda = device.type == "cuda"
    repeat = 3 if quick else 6
    sizes = [128, 256, 512, 768, 1024] if quick else [128, 256, 384, 512, 768, 1024, 1536]
    if cuda:
        sizes = [512, 1024, 2048, 4096, 8192, 16384]
    main = "bf16" if cuda else "fp32"  # the precision training uses here by default
    peaks, half = _peaks(device, sizes, main, repeat, timer)
    dtype = torch.bfloat16 if cuda else torch.float32
    attn = timer.figure("attention", lambda: attention_fraction(device, dtype, peaks[main], repeat, timer))
    bw = timer.figure("bandwidth", lambda: bandwidth(device, repeat, timer))
    fixed, opt_fixed = (
        (0.0, 0.0) if cuda else timer.figure("block fixed", lambda: block_fixed_costs(device, dtype, repeat, timer))
    )
    # a whole block's non-GEMM work less its fixed cost; the bare elementwise passes are its floor (noise)
    block = timer.figure(
        "elementwise",
        lambda: block_elementwise(device, dtype, peaks[main], half, attn, bw, repeat, timer, fixed),
    )
    passes = timer.figure("elementwise passes", lambda: elementwise_bytes_per_hidden(device, bw, repeat, timer))
    return {
        **{"peaks": peaks, "half": half, "attn": attn, "bw": bw, "elem": max(block, passes)},
        **{"fixed": fixed, "opt": opt_fixed, "timing": timer.report()},
    }
