"""``meshforge calibrate``: measure this machine into a hardware profile for the planner.

One "device" is what one rank gets: a GPU, or on a CPU a 1/nproc share of the cores (the
threads ``meshforge train --nproc N`` gives each rank). Measured:

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

from meshforge.planner.hardware import PRESETS, Hardware


def _timed(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_sweep(device: torch.device, dtype: torch.dtype, sizes: list[int], repeat: int) -> list[tuple[float, float]]:
    """(GEMM FLOPs, FLOP/s) per size."""
    out = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        t = _timed(lambda a=a, b=b: a @ b, repeat)
        out.append((2.0 * n**3, 2.0 * n**3 / t))
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

    t = _timed(run, repeat)
    flops = 3 * 4.0 * b * h * s * s * d  # fwd + bwd over the full square, as the planner counts
    return flops / t / peak


def bandwidth(device: torch.device, repeat: int) -> float:
    x = torch.empty(64 * 2**20 // 4, device=device)
    y = torch.empty_like(x)
    t = _timed(lambda: y.copy_(x), repeat)
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

    t = _timed(run, repeat)
    passes = 3  # forward and backward (x2), as the planner counts them
    return t * bw / (tokens * hdim * 4 * passes)


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], repeat: int, out: str, threads: int):
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    res = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, device=dev)
        dist.barrier()
        t = _timed(lambda x=x: dist.all_reduce(x), repeat)
        tt = torch.tensor([t], device=dev)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        res.append((nbytes, float(tt)))
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def collectives(nproc: int, sizes: list[int], repeat: int, threads: int) -> tuple[float, float, list]:
    """(latency α, bandwidth B) of a ring all-reduce between ``nproc`` local ranks."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    mp.spawn(_collective_worker, args=(nproc, port, sizes, repeat, out, threads), nprocs=nproc, join=True)
    points = json.loads(Path(out).read_text())
    # least squares for t = a + b*S with a = 2(n-1)α and b = 2(n-1)/n / B
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    icpt = max(my - slope * mx, 0.0)
    alpha = icpt / (2 * (nproc - 1))
    bw = 2 * (nproc - 1) / nproc / slope
    return alpha, bw, points


def calibrate(nproc: int, quick: bool) -> Hardware:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    threads = max(1, (os.cpu_count() or 1) // nproc)
    if not cuda:
        torch.set_num_threads(threads)
    repeat = 3 if quick else 6
    sizes = [128, 256, 512, 1024] if quick else [128, 256, 384, 512, 768, 1024, 1536]
    if cuda:
        sizes = [512, 1024, 2048, 4096, 8192]
    main = "bf16" if cuda else "fp32"  # the precision training uses here by default
    peaks, half = {}, 1.0
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        # a CPU without bf16 matmul units is ~50x slower in bf16: measure only small sizes there
        pts = matmul_sweep(device, dtype, sizes if name == main else sizes[:2], repeat)
        peaks[name] = max(r for _, r in pts)
        if name == main:
            half = fit_half(pts, peaks[name])
    attn = attention_fraction(device, torch.bfloat16 if cuda else torch.float32, peaks[main], repeat)
    bw = bandwidth(device, repeat)
    elem = elementwise_bytes_per_hidden(device, bw, repeat)
    msg = [2**k for k in range(12, 22 if quick else 25, 2)]
    alpha, link, points = collectives(nproc, msg, repeat, threads) if nproc > 1 else (10e-6, 1e10, [])
    base = PRESETS["cpu"] if not cuda else PRESETS["h100-sxm"]
    return Hardware(
        name=("cuda:" + torch.cuda.get_device_name()) if cuda else f"cpu/{nproc}",
        peak_flops=peaks,
        hbm_gib=(torch.cuda.get_device_properties(0).total_memory / 2**30) if cuda else _ram_gib() / nproc,
        hbm_bw=bw,
        intra_bw=link,
        inter_bw=link,
        intra_latency=alpha,
        inter_latency=alpha,
        gemm_efficiency=1.0,  # the peak is the best measured matmul
        gemm_half_flop=half,
        attention_efficiency=attn,
        elementwise_bytes_per_hidden=elem,
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
