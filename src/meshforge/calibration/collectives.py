"""Collective measurements for ``meshforge calibrate``: each collective as training issues it,
over message sizes, fitted to the planner's α-β formula for it; and how much of an
all-reduce hides under concurrent matmuls.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshforge.compat import all_gather_flat, reduce_scatter_flat
from meshforge.metrics.compute_profile import Timer
from meshforge.parallel.data.apply import AllReduceScatter
from meshforge.planner.hardware import cost_coefficients

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
        return lambda: reduce_scatter_flat(out, x)
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


def collective_times(
    kind: str, dev: torch.device, sizes: list[int], repeat: int, timer: Timer, mesh=None, round_bytes: int = 2**22
) -> list[tuple[int, float]]:
    """(payload bytes, seconds per call) over ``sizes``; the slowest rank's time (each the fastest
    of its rounds, ``timer``). Each round
    makes enough calls to move ``round_bytes``: small messages are latency-bound, so on a CPU
    (gloo, ~1 ms a call) the smallest sizes' thousand calls a round were most of the time."""
    res = []
    for nbytes in sizes:
        fn = _collective_call(kind, nbytes, dev, mesh)
        dist.barrier()
        calls = max(1, round_bytes // nbytes)
        if isinstance(fn, tuple):  # (whole, part to subtract, more to subtract)
            parts = [timer.time(f, repeat, calls=calls) for f in fn]
            t = max(parts[0] - sum(parts[1:]), 0.0)
        else:
            t = timer.time(fn, repeat, calls=calls)
        tt = torch.tensor([t], device=dev)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        res.append((nbytes, float(tt)))
    return res


def comm_overlap(dev: torch.device, repeat: int, timer: Timer) -> float:
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

    t_comm = timer.time(comm, 3, calls=2)
    t_mm = timer.time(lambda: (a @ b, sync()), 3, calls=3)
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
        tc, ta, tb = (timer.time(f, 1, calls=2) for f in (compute, comm, both))
        ratios.append((tb - tc) / ta)
    exposed = statistics.median(ratios)
    return min(1.0, max(0.0, 1.0 - exposed))


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
