"""Enumerate the layouts a cluster allows, estimate each, keep what fits, rank by speed."""

from __future__ import annotations

from dataclasses import dataclass

from meshforge.errors import ConfigError
from meshforge.planner.estimate import RECOMPUTE, SCHEDULES, V_SCHEDULES, Estimate, Layout, estimate
from meshforge.planner.hardware import Hardware
from meshforge.planner.shape import Shape


@dataclass
class Fixed:
    """Choices the user fixed (None: search them)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    ep: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    recompute: str | None = None
    virtual_stages: int | None = None
    schedule: str | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_fixed(shape: Shape, gpus: int, f: Fixed, gpus_per_node: int) -> None:
    """Refuse impossible fixed choices with the reason and a fix."""
    if f.ep not in (None, 1):
        raise ConfigError(f"--ep {f.ep}: this model has no experts (MoE); expert parallelism needs --experts")
    if f.tp is not None:
        if f.tp > gpus_per_node:
            raise ConfigError(
                f"--tp {f.tp} is more than --gpus-per-node {gpus_per_node}: tp stays inside a node (its collectives "
                "are on the critical path and need NVLink-class bandwidth); use pp or dp across nodes"
            )
        if shape.heads % f.tp or shape.kv_heads % f.tp:
            ok = [d for d in _divisors(shape.kv_heads) if d <= gpus_per_node]
            raise ConfigError(
                f"--tp {f.tp} does not divide heads {shape.heads} / kv_heads {shape.kv_heads}; use one of {ok}"
            )
    if f.pp is not None and f.pp > shape.layers:
        raise ConfigError(f"--pp {f.pp} is more than the {shape.layers} layers; every stage needs at least one")
    fixed = [x for x in (f.tp, f.pp, f.dp, f.cp) if x is not None]
    prod = 1
    for x in fixed:
        prod *= x
    if gpus % prod:
        raise ConfigError(f"fixed degrees multiply to {prod}, which does not divide --gpus {gpus}")
    if all(x is not None for x in (f.tp, f.pp, f.dp, f.cp)) and prod != gpus:
        raise ConfigError(f"--tp x --pp x --dp x --cp multiply to {prod}, not --gpus {gpus}; leave one out to infer it")
    if f.schedule is not None and f.schedule not in SCHEDULES + V_SCHEDULES:
        raise ConfigError(f"--schedule {f.schedule!r}: one of {', '.join(SCHEDULES + V_SCHEDULES)}")
    if f.recompute is not None and f.recompute not in RECOMPUTE:
        raise ConfigError(f"--recompute {f.recompute!r}: one of {', '.join(RECOMPUTE)}")
    if f.zero is not None and f.zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero {f.zero}: one of 0, 1, 2, 3")


def layouts(shape: Shape, gpus: int, global_batch: int, seq: int, f: Fixed, gpus_per_node: int):
    """Every valid layout (a generator)."""
    tps = [f.tp] if f.tp else [t for t in _divisors(gpus_per_node) if shape.heads % t == 0 and shape.kv_heads % t == 0]
    pps = [f.pp] if f.pp else [p for p in _divisors(gpus) if p <= min(64, shape.layers)]
    cps = [f.cp] if f.cp else [1]
    for tp in tps:
        for pp in pps:
            for cp in cps:
                if gpus % (tp * pp * cp) or (seq % cp) or (seq % tp):
                    continue
                dp = gpus // (tp * pp * cp)
                if f.dp and dp != f.dp:
                    continue
                if global_batch % dp:
                    continue
                local = global_batch // dp
                micros = [f.micro_batch] if f.micro_batch else [b for b in (1, 2, 4, 8, 16) if local % b == 0]
                for mb in micros:
                    if local % mb:
                        continue
                    m = local // mb
                    stages = [0, 1, 2, 3] if dp * cp > 1 else [0]
                    for zero in [f.zero] if f.zero is not None else stages:
                        for rc in [f.recompute] if f.recompute else RECOMPUTE:
                            for sched, v in _schedules(pp, m, shape.layers, f):
                                yield Layout(tp, pp, dp, cp, 1, zero, mb, m, rc, v, sched)


def _schedules(pp: int, m: int, layers: int, f: Fixed):
    if pp == 1:
        yield "none", 1
        return
    for s in [f.schedule] if f.schedule else SCHEDULES:
        if s == "interleaved_1f1b":
            for v in [f.virtual_stages] if f.virtual_stages else (2, 4):
                if m % pp == 0 and layers >= pp * v:
                    yield s, v
        elif s in V_SCHEDULES:  # two chunks per rank in a V (only when asked for)
            if m >= (2 * pp if s == "dualpipev" else pp) and layers >= 2 * pp:
                yield s, 2
        elif m >= pp:  # (torch's GPipe too needs a micro-batch per stage)
            yield s, f.virtual_stages if s == "zero_bubble" and f.virtual_stages else 1


def search(
    shape: Shape,
    hw: Hardware,
    gpus: int,
    gpus_per_node: int,
    global_batch: int,
    seq: int,
    precision: str,
    fixed: Fixed,
) -> tuple[list[Estimate], int]:
    """Fitting layouts, fastest first, and how many were considered."""
    check_fixed(shape, gpus, fixed, gpus_per_node)
    out, considered, smallest = [], 0, None
    for lay in layouts(shape, gpus, global_batch, seq, fixed, gpus_per_node):
        considered += 1
        e = estimate(shape, lay, seq, global_batch, precision, hw, gpus_per_node)
        if e.fits:
            out.append(e)
        elif smallest is None or e.memory["total"] < smallest.memory["total"]:
            smallest = e
    out.sort(key=lambda e: (-e.tokens_per_s_per_gpu, e.memory["total"]))
    if not out:
        bigger = smallest_cluster(shape, hw, gpus, gpus_per_node, global_batch, seq, precision, fixed)
        raise ConfigError(no_fit_message(shape, hw, gpus, considered, smallest, precision, bigger))
    return out, considered


def smallest_cluster(
    shape: Shape, hw: Hardware, gpus: int, gpus_per_node: int, global_batch: int, seq: int, precision: str, f: Fixed
) -> tuple[int, Estimate] | None:
    """The first power-of-two multiple of ``gpus`` (up to 1,048,576) on which some layout
    fits, with its fastest layout; the data-parallel degree is left free."""
    free = Fixed(**{**f.__dict__, "dp": None})
    n = gpus * 2
    while n <= 2**20:
        best = None
        for lay in layouts(shape, n, global_batch, seq, free, gpus_per_node):
            e = estimate(shape, lay, seq, global_batch, precision, hw, gpus_per_node)
            if e.fits and (best is None or e.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu):
                best = e
        if best is not None:
            return n, best
        n *= 2
    return None


def no_fit_message(
    shape: Shape,
    hw: Hardware,
    gpus: int,
    considered: int,
    smallest: Estimate | None,
    precision: str,
    bigger: tuple[int, Estimate] | None = None,
) -> str:
    if considered == 0:
        return (
            f"no layout of {shape.name} on {gpus} GPUs is valid: the degrees must divide the GPUs, heads, layers "
            "and the global batch; try another --gpus or --global-batch"
        )
    need = shape.num_params() * 16 / 2**30  # Adam in mixed precision or fp32: 16 bytes per parameter
    lowest = smallest.memory["total"] if smallest else float("nan")
    msg = (
        f"{shape.name} ({shape.num_params() / 1e9:.1f}B parameters) fits no layout on {gpus} x {hw.name} "
        f"({hw.hbm_gib:.0f} GiB each): the smallest needs {lowest:.1f} GiB per GPU; its model states alone are "
        f"{need:.0f} GiB (16 bytes per parameter). "
    )
    if bigger is None:
        return msg + f"No cluster of up to {2**20} such GPUs fits it: use GPUs with more memory or a smaller model"
    n, e = bigger
    L = e.layout
    return msg + (
        f"The smallest cluster of this kind that fits it (doubling --gpus) is {n} GPUs, e.g. tp {L.tp} pp {L.pp} "
        f"dp {L.dp} zero {L.zero_stage} recompute {L.recompute} at {e.memory['total']:.1f} GiB per GPU; "
        "or use GPUs with more memory"
    )
