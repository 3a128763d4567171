"""``meshforge calibrate``: measure this machine into a hardware profile for the planner.

One "device" is what one rank gets: a GPU, or on a CPU a 1/nproc share of the cores (the
threads ``meshforge train --nproc N`` gives each rank). Every rank measures at the same
time, as they compute in training (sharing caches, memory bandwidth and clocks), and the
slowest rank's figures are kept. Measured:

- matmul throughput over a sweep of sizes and dtypes; the best is the peak, and the
  half-efficiency size is fitted to the rest (efficiency(f) = f / (f + f_half));
- the attention core (SDPA forward + backward) as a fraction of that peak;
- memory bandwidth (a large copy), and the cost of a Llama block's work outside GEMMs and
  attention (norms, RoPE, residuals, SwiGLU, copies): a real block's forward + backward
  less the GEMM and attention time the profile predicts for it, in bytes per token x hidden;
- between ``nproc`` local ranks (gloo on CPU, NCCL on GPU), each collective as training
  issues it (c10d all-reduce, flat all-gather and reduce-scatter as FSDP2 does, DTensor
  redistributes as tensor parallelism does, batched send/recv as pipelining does) over
  message sizes, each fitted to the planner's α-β formula for that collective;
- how much of an all-reduce hides under concurrent matmuls.
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
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshforge.calibration.layout_fixed import layout_fixed_costs
from meshforge.errors import ConfigError
from meshforge.models.llama import Block, ModelArgs, rope_cos_sin, rope_inv_freq
from meshforge.parallel.collectives import all_gather_flat
from meshforge.parallel.data_parallel import AllReduceScatter
from meshforge.planner.hardware import PRESETS, Hardware, cost_coefficients


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
    args = ModelArgs(hidden=h, layers=1, heads=heads, kv_heads=kv, ffn_hidden=f, vocab_size=256, max_seq_len=s)
    block = Block(args, 0).to(device, dtype)
    for prm in block.parameters():
        torch.nn.init.normal_(prm, std=0.02)
    x = torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(rope_inv_freq(args, device), torch.arange(s, device=device))

    def run():
        block(x, cos, sin).sum().backward()

    t = _timed(run, repeat, MIN_S)
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
    args = ModelArgs(hidden=64, layers=1, heads=2, kv_heads=1, ffn_hidden=128, vocab_size=256, max_seq_len=8)
    block = Block(args, 0).to(device, dtype)
    x = torch.randn(1, 4, 64, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(rope_inv_freq(args, device), torch.arange(4, device=device))
    t_block = _timed(lambda: block(x, cos, sin).sum().backward(), repeat, MIN_S)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-4, foreach=device.type == "cpu")
    t_opt = _timed(opt.step, repeat, MIN_S)
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


# collectives the way training issues them: DDP all-reduces, ZeRO-1 all-gathers, FSDP2
# units gathering and reducing their parameters (copying them into and out of flat buffers;
# on gloo the reduce-scatter is an all-reduce, see AllReduceScatter), tensor parallelism redistributes DTensors along
# the sequence dimension, pipelining sends activations point to point. On NCCL they differ
# little; gloo's all-gather and reduce-scatter are several times slower than its all-reduce
# and DTensor adds dispatch and copies, which one all-reduce figure cannot represent.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "fsdp_all_gather",
    "fsdp_reduce_scatter",
    "dtensor_all_gather",
    "dtensor_reduce_scatter",
    "send_recv",
)


def _collective_call(kind: str, nbytes: int, dev: torch.device, mesh):
    """A callable performing one ``kind`` collective whose full (unsharded) payload is
    ``nbytes`` - the size the planner's α-β formulas take."""
    world = dist.get_world_size()
    n = max(world, nbytes // 4 // world * world)
    if kind == "all_reduce":
        x = torch.zeros(n, device=dev)
        return lambda: dist.all_reduce(x)
    if kind == "all_gather":
        x, out = torch.zeros(n // world, device=dev), torch.empty(n, device=dev)
        return lambda: all_gather_flat(out, x)
    if kind == "reduce_scatter":
        x, out = torch.zeros(n, device=dev), torch.empty(n // world, device=dev)
        if dist.get_backend() == "gloo":  # FSDP2 reduces gradients this way on gloo
            rs = AllReduceScatter()
            return lambda: rs(out, x, None, dist.ReduceOp.SUM)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, x)
    if kind == "send_recv":  # a stage boundary: each rank sends to the next, receives from the previous
        rank = dist.get_rank()
        x, y = torch.zeros(n, device=dev), torch.empty(n, device=dev)
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, y, (rank - 1) % world)]

        def p2p():
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        return p2p
    if kind.startswith("fsdp_"):
        return _fsdp_call(kind, n, dev, mesh)
    hidden = 256  # activations (batch, sequence, hidden) sharded on the sequence, as under SP
    seq = max(world, n // (4 * hidden) // world * world)

    def done(t: torch.Tensor) -> None:
        if hasattr(t, "wait"):  # an AsyncCollectiveTensor still in flight
            t.wait()

    if kind == "dtensor_all_gather":
        x = DTensor.from_local(torch.zeros(4, seq // world, hidden, device=dev), mesh, [Shard(1)])
        return lambda: done(x.redistribute(mesh, [Replicate()]).to_local())
    if kind == "dtensor_reduce_scatter":
        x = DTensor.from_local(torch.zeros(4, seq, hidden, device=dev), mesh, [Partial()])
        return lambda: done(x.redistribute(mesh, [Shard(1)]).to_local())
    raise ValueError(kind)


def _fsdp_call(kind: str, n: int, dev: torch.device, mesh):
    """An FSDP2 unit of four matrices, ``n`` elements in all: unshard + reshard is its
    all-gather with copy-in/out; a forward + backward adds the gradient reduction, which is
    timed as the difference (each call runs both, the caller subtracts)."""
    world = dist.get_world_size()
    cols = 256
    rows = max(world, n // 4 // cols // world * world)
    unit = torch.nn.Module()
    unit.w = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(rows, cols, device=dev)) for _ in range(4))
    unit.forward = lambda: sum(w.sum() for w in unit.w)
    fully_shard(unit, mesh=mesh)
    if dist.get_backend() == "gloo":
        unit.set_custom_reduce_scatter(AllReduceScatter())

    def gather() -> None:
        unit.unshard()
        unit.reshard()

    if kind == "fsdp_all_gather":
        return gather
    plain = [torch.zeros(rows, cols, device=dev, requires_grad=True) for _ in range(4)]

    def local() -> None:  # the same forward + backward without FSDP
        sum(w.sum() for w in plain).backward()

    def step() -> None:
        unit().backward()

    return step, gather, local


def collective_times(kind: str, dev: torch.device, sizes: list[int], repeat: int, mesh=None) -> list[tuple[int, float]]:
    """(payload bytes, seconds per call) over ``sizes``; the slowest rank's time."""
    res = []
    for nbytes in sizes:
        fn = _collective_call(kind, nbytes, dev, mesh)
        dist.barrier()
        calls = max(1, 2**22 // nbytes)
        if isinstance(fn, tuple):  # (whole, part to subtract, more to subtract)
            t = max(_timed(fn[0], repeat, calls=calls) - sum(_timed(f, repeat, calls=calls) for f in fn[1:]), 0.0)
        else:
            t = _timed(fn, repeat, calls=calls)
        tt = torch.tensor([t], device=dev)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        res.append((nbytes, float(tt)))
    return res


def comm_overlap(dev: torch.device, repeat: int) -> float:
    """How much of a gradient all-reduce hides under compute running at the same time:
    1 - (t(both) - t(compute)) / t(all-reduce), from the medians of interleaved rounds.
    Near 1 where communication has its own engine (NCCL on GPUs); near 0 on a CPU whose
    cores the communication threads share with the matmuls."""
    big = 8192 if dev.type == "cuda" else 768
    a, b = torch.randn(big, big, device=dev), torch.randn(big, big, device=dev)
    g = torch.zeros(2**24 // 4 if dev.type != "cuda" else 2**28 // 4, device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def comm() -> None:
        dist.all_reduce(g)
        sync()

    t_comm = _timed(comm, 3, calls=2)
    t_mm = _timed(lambda: (a @ b, sync()), 3, calls=3)
    k = max(1, round(t_comm / t_mm))  # a compute window about as long as the communication

    def compute() -> None:
        for _ in range(k):
            a @ b
        sync()

    def both() -> None:
        w = dist.all_reduce(g, async_op=True)
        for _ in range(k):
            a @ b
        w.wait()
        sync()

    ratios = []
    for _ in range(max(3, repeat)):
        tc, ta, tb = (_timed(f, 1, calls=2) for f in (compute, comm, both))
        ratios.append((tb - tc) / ta)
    exposed = statistics.median(ratios)
    return min(1.0, max(0.0, 1.0 - exposed))


def _worker(rank: int, world: int, port: int, quick: bool, threads: int, out: str) -> None:
    """One rank: compute measured while every rank computes (they share the machine as in
    training), then all-reduce timings; rank 0 writes the slowest rank's figures."""
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
        mesh = init_device_mesh(dev.type, (world,))
        sizes = [2**k for k in range(12, 23 if quick else 25, 2)]
        points = {kind: collective_times(kind, dev, sizes, 3 if quick else 6, mesh) for kind in COLLECTIVES}
        _SYNC_COMPUTE[0] = True
        overlap = comm_overlap(dev, 3 if quick else 5)
        kinds = {} if cuda else _slowest(layout_fixed_costs(world, _fixed_timer(quick)), world)
        if rank == 0:
            res = {"compute": slowest, "points": points, "overlap": overlap, "layout_fixed": kinds}
            Path(out).write_text(json.dumps(res))
        dist.destroy_process_group()
    else:
        Path(out).write_text(json.dumps({"compute": mine, "points": {}, "overlap": 1.0}))


def _fixed_timer(quick: bool):
    """Seconds per call of a tiny model's step, every rank making as many calls."""
    return lambda fn: _timed(fn, 3, calls=3) if quick else _timed(fn, 5, calls=10)


def _slowest(costs: dict[str, dict[str, float]], world: int) -> dict[str, dict[str, float]]:
    """Each figure's largest value over the ranks (the step waits for the slowest)."""
    every: list = [None] * world
    dist.all_gather_object(every, costs)
    return {k: {f: max(c[k][f] for c in every) for f in costs[k]} for k in costs}


def fit_alpha_beta(points: list, nproc: int, kind: str = "all_reduce") -> tuple[float, float]:
    """t = a + b·S, read as a = steps·α and b = mult / B (the planner's α-β model of
    ``kind``, ``cost_coefficients``). Robust to the noise of a shared machine: b is the
    least-squares slope over the larger half of the messages (where bandwidth shows), a the
    median over all of them of what that slope leaves."""
    pts = sorted(points)
    big = pts[len(pts) // 2 :] if len(pts) >= 4 else pts
    mx, my = statistics.fmean(x for x, _ in big), statistics.fmean(y for _, y in big)
    slope = sum((x - mx) * (y - my) for x, y in big) / sum((x - mx) ** 2 for x, _ in big)
    slope = max(slope, 1e-15)  # a flat curve: effectively unlimited bandwidth
    a = max(statistics.median(y - slope * x for x, y in pts), 0.0)
    steps, mult = cost_coefficients(kind, nproc)
    return a / steps, mult / slope


def calibrate(nproc: int, quick: bool) -> Hardware:
    cuda = torch.cuda.is_available()
    if cuda and nproc > torch.cuda.device_count():
        raise ConfigError(f"--nproc {nproc}: only {torch.cuda.device_count()} GPU(s) are visible")
    threads = max(1, (os.cpu_count() or 1) // nproc)
    out = tempfile.mktemp(suffix=".json")
    single = None
    if not cuda and nproc > 1:  # `meshforge train --nproc 1` gives its one rank every core's thread
        torch.set_num_threads(os.cpu_count() or 1)
        single = compute_profile(torch.device("cpu"), quick)
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
    fits = {kind: list(fit_alpha_beta(pts, nproc, kind)) for kind, pts in points.items()}
    alpha, link = fits.get("all_reduce", (10e-6, 1e10))
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
        attention_half_seq=0.0,  # measured at one length
        elementwise_bytes_per_hidden=c["elem"],
        block_fixed_s=c.get("fixed", 0.0),
        optimizer_fixed_s=c.get("opt", 0.0),
        layout_fixed_s=res.get("layout_fixed", {}),
        by_ranks={"1": _compute_fields(single)} if single else {},
        reserve_gib=base.reserve_gib,
        collectives=fits,
        comm_overlap=res["overlap"],
        source="calibrated",
        extra={"threads_per_rank": threads, "nproc": nproc, "collective_points": points, "time": time.time()},
    )


def _compute_fields(c: dict) -> dict:
    """A compute profile (``compute_profile``) as the Hardware fields it sets."""
    return {
        "peak_flops": c["peaks"],
        "hbm_bw": c["bw"],
        "gemm_half_flop": c["half"],
        "attention_efficiency": c["attn"],
        "elementwise_bytes_per_hidden": c["elem"],
        "block_fixed_s": c.get("fixed", 0.0),
        "optimizer_fixed_s": c.get("opt", 0.0),
    }


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
        f"per block fixed {hw.block_fixed_s * 1e3:.2f} ms (fwd+bwd) + {hw.optimizer_fixed_s * 1e3:.2f} ms (AdamW), "
        + "".join(
            f"under {k}: block {v['block'] * 1e3:.2f} ms, ends {v['ends'] * 1e3:.2f} ms per micro-batch, "
            f"+ {v['block_step'] * 1e3:.2f} / {v['ends_step'] * 1e3:.2f} ms per step, "
            for k, v in hw.layout_fixed_s.items()
        )
        + "".join(
            f"as {n} rank(s): peak fp32 {f['peak_flops']['fp32'] / 1e9:.1f} GFLOP/s, " for n, f in hw.by_ranks.items()
        )
        + f"between {args.nproc} ranks: "
        + ", ".join(f"{k} α {a * 1e6:.0f} us B {b / 1e9:.2f} GB/s" for k, (a, b) in hw.collectives.items())
        + (f"; {100 * hw.comm_overlap:.0f}% of an all-reduce hides under compute" if args.nproc > 1 else "")
    )
    print(f"plan with it: meshforge plan --hardware {args.out} --gpus {args.nproc} --gpus-per-node {args.nproc} ...")
    return 0
