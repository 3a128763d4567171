"""``meshforge calibrate``: measure this machine into a hardware profile for the planner.

One "device" is what one rank gets: a GPU, or on a CPU a 1/nproc share of the cores (the
threads ``meshforge train --nproc N`` gives each rank). Every rank measures at the same
time, as they compute in training (sharing caches, memory bandwidth and clocks), and the
slowest rank's figures are kept. Measured:

- matmul throughput over a sweep of sizes and dtypes; the best is the peak, and the
  half-efficiency size is fitted to the rest (efficiency(f) = f / (f + f_half));
- the attention core (SDPA forward + backward) as a fraction of that peak;
- memory bandwidth (a large copy), and the bytes an RMSNorm + residual + SwiGLU pass moves;
- all-reduce time between ``nproc`` local ranks (gloo on CPU, NCCL on GPU) over message
  sizes, fitted to t = 2(n-1)·α + 2(n-1)/n · S / B for latency α and bandwidth B.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from meshforge.errors import ConfigError
from meshforge.planner.hardware import PRESETS, Hardware


def _timed(fn, repeat: int, min_s: float = 0.0, calls: int = 0) -> float:
    """Seconds per call: the median of ``repeat`` rounds (training step times are reported
    as medians too), each of enough calls to last ``min_s`` (so that ranks measuring side by
    side really overlap), or of ``calls`` calls (collectives: every rank must make as many).
    Ranks line up first."""
    _sync()
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


def _sync() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and _SYNC_COMPUTE[0]:
        dist.barrier()


_SYNC_COMPUTE = [False]  # line ranks up before each compute measurement
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
            _timed(fn, repeat, MIN_S / 3)
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

    t = _timed(run, repeat, MIN_S)
    flops = 3 * 4.0 * b * h * s * s * d  # fwd + bwd over the full square, as the planner counts
    return flops / t / peak


def bandwidth(device: torch.device, repeat: int) -> float:
    x = torch.empty(64 * 2**20 // 4, device=device)
    y = torch.empty_like(x)
    t = _timed(lambda: y.copy_(x), repeat, MIN_S)
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

    t = _timed(run, repeat, MIN_S)
    passes = 3  # forward and backward (x2), as the planner counts them
    return t * bw / (tokens * hdim * 4 * passes)


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
    return {
        "peaks": peaks,
        "half": half,
        "attn": attn,
        "bw": bw,
        "elem": elementwise_bytes_per_hidden(device, bw, repeat),
    }


def all_reduce_times(dev: torch.device, sizes: list[int], repeat: int) -> list[tuple[int, float]]:
    import torch.distributed as dist

    res = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, device=dev)
        dist.barrier()
        t = _timed(lambda x=x: dist.all_reduce(x), repeat, calls=max(1, 2**22 // nbytes))
        tt = torch.tensor([t], device=dev)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        res.append((nbytes, float(tt)))
    return res


def _worker(rank: int, world: int, port: int, quick: bool, threads: int, out: str) -> None:
    """One rank: compute measured while every rank computes (they share the machine as in
    training), then all-reduce timings; rank 0 writes the slowest rank's figures."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(threads)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
        dist.barrier()
        _SYNC_COMPUTE[0] = True
    mine = compute_profile(dev, quick)
    _SYNC_COMPUTE[0] = False
    if world > 1:
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        slowest = min(every, key=lambda c: c["peaks"]["bf16" if cuda else "fp32"])
        sizes = [2**k for k in range(12, 22 if quick else 25, 2)]
        points = all_reduce_times(dev, sizes, 3 if quick else 6)
        if rank == 0:
            Path(out).write_text(json.dumps({"compute": slowest, "points": points}))
        dist.destroy_process_group()
    else:
        Path(out).write_text(json.dumps({"compute": mine, "points": []}))


def fit_alpha_beta(points: list, nproc: int) -> tuple[float, float]:
    """Least squares for t = a + b·S with a = 2(n-1)α and b = 2(n-1)/n / B."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    icpt = max(my - slope * mx, 0.0)
    return icpt / (2 * (nproc - 1)), 2 * (nproc - 1) / nproc / slope


def calibrate(nproc: int, quick: bool) -> Hardware:
    import torch.multiprocessing as mp

    cuda = torch.cuda.is_available()
    if cuda and nproc > torch.cuda.device_count():
        raise ConfigError(f"--nproc {nproc}: only {torch.cuda.device_count()} GPU(s) are visible")
    threads = max(1, (os.cpu_count() or 1) // nproc)
    out = tempfile.mktemp(suffix=".json")
    if nproc == 1:
        _worker(0, 1, 0, quick, threads, out)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(nproc, port, quick, threads, out), nprocs=nproc, join=True)
    res = json.loads(Path(out).read_text())
    Path(out).unlink()
    c, points = res["compute"], res["points"]
    alpha, link = fit_alpha_beta(points, nproc) if nproc > 1 else (10e-6, 1e10)
    base = PRESETS["cpu"] if not cuda else PRESETS["h100-sxm"]
    return Hardware(
        name=("cuda:" + torch.cuda.get_device_name()) if cuda else f"cpu/{nproc}",
        peak_flops=c["peaks"],
        hbm_gib=(torch.cuda.get_device_properties(0).total_memory / 2**30) if cuda else _ram_gib() / nproc,
        hbm_bw=c["bw"],
        intra_bw=link,
        inter_bw=link,
        intra_latency=alpha,
        inter_latency=alpha,
        gemm_efficiency=1.0,  # the peak is the best measured matmul
        gemm_half_flop=c["half"],
        attention_efficiency=c["attn"],
        elementwise_bytes_per_hidden=c["elem"],
        reserve_gib=base.reserve_gib,
        source="calibrated",
        extra={"threads_per_rank": threads, "nproc": nproc, "allreduce_points": points, "time": time.time()},
    )


def _ram_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 16.0


def run(args: argparse.Namespace) -> int:
    hw = calibrate(args.nproc, args.quick)
    Path(args.out).write_text(json.dumps(asdict(hw), indent=1))
    print(
        f"wrote {args.out}: {hw.name}, peak "
        + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in hw.peak_flops.items())
        + ", "
        f"GEMM half-efficiency at {hw.gemm_half_flop / 1e6:.1f} MFLOP, attention {100 * hw.attention_efficiency:.0f}% "
        f"of peak, memory {hw.hbm_bw / 1e9:.1f} GB/s, elementwise {hw.elementwise_bytes_per_hidden:.1f} B/h, "
        f"all-reduce α {hw.intra_latency * 1e6:.0f} us, B {hw.intra_bw / 1e9:.2f} GB/s between {args.nproc} ranks"
    )
    print(f"plan with it: meshforge plan --hardware {args.out} --gpus {args.nproc} --gpus-per-node {args.nproc} ...")
    return 0
