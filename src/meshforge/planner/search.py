"""Enumerate the layouts a cluster allows, estimate each, keep what fits, rank by speed.

Whether a layout can exist and whether ``meshforge train`` runs it is not decided here:
every candidate is put to the layout rules in ``parallel/dims/``. A candidate they call
invalid is skipped; one they call unsupported is estimated and ranked after the runnable
ones, marked with the reason, so the planner never recommends a layout training refuses.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from meshforge.errors import ConfigError
from meshforge.layout import Layout
from meshforge.models.shape import ModelShape
from meshforge.parallel import dims
from meshforge.parallel.dims import RECOMPUTE, Batch, Spelling, tp_divides_heads
from meshforge.planner import output
from meshforge.planner.estimate import SCHEDULES, V_SCHEDULES, Estimate, estimate, plan_layout, run_layout
from meshforge.planner.hardware import Hardware
from meshforge.planner.offload_costs import can_offload


def _divisors(n: int) -> list[int]:
    """n's divisors, ascending, in O(sqrt n) (a million GPUs or experts is searched at once)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


# the planner's flags for the layout rules' keys (dims.partial_problems speaks them)
PLAN_FLAGS = Spelling(
    {
        **{f"parallel.{k}": f"--{k}" for k in ("tp", "pp", "cp", "ep", "offload")},
        **{"parallel.dp_shard": "--dp", "parallel.zero_stage": "--zero", "parallel.pp_schedule": "--schedule"},
        **{"parallel.pp_layers": "--pp-layers", "parallel.pp_virtual_stages": "--virtual-stages"},
        **{"train.activation_checkpoint": "--recompute", "model.num_experts": "--experts"},
        **{"model.heads": "heads", "model.kv_heads": "kv_heads", "gpus": "--gpus", "gpus_per_node": "--gpus-per-node"},
    },
    sep=" ",
)


def check_fixed(shape: ModelShape, gpus: int, f: Layout, gpus_per_node: int) -> None:
    """Refuse impossible fixed choices with the layout rules' reason and fix (``dims.partial_problems``)."""
    for problem in dims.partial_problems(f, shape, gpus, gpus_per_node, PLAN_FLAGS):
        if problem.kind == "invalid":
            raise ConfigError(problem.message)


def offload_modes(f: Layout, hw: Hardware) -> list[str]:
    """The offload settings to search, in order: a fixed one, or (auto) none first and CPU
    offload only if nothing runnable fits without it, where the hardware has a host to offload to."""
    mode = f.offload or "auto"
    if mode == "cpu" and not can_offload(hw):
        raise ConfigError(
            f"--offload cpu: {hw.name} has no host to offload to (on a CPU the state already lives in host "
            "memory; a calibrated profile needs host_link_bw and host_mem_bw); use --offload none or a GPU preset"
        )
    if mode == "auto":
        return ["none", "cpu"] if can_offload(hw) else ["none"]
    return [mode]


def judge(lay: Layout, shape: ModelShape, seq: int, global_batch: int, gpus_per_node: int) -> tuple[bool, str]:
    """(exists, why train refuses it or ""): the layout rules' verdict on the layout as its
    emitted config states it (``run_layout``)."""
    found = dims.problems(run_layout(lay), shape, Batch(seq, global_batch, gpus_per_node))
    if any(p.kind == "invalid" for p in found):
        return False, found[0].message
    return True, found[0].message if found else ""


def candidates(
    shape: ModelShape, gpus: int, global_batch: int, seq: int, f: Layout, gpus_per_node: int
) -> Iterator[Layout]:
    """Every combination of the searched choices (valid or not: the rules judge them)."""
    tps = [f.tp] if f.tp else [t for t in _divisors(gpus_per_node) if tp_divides_heads(shape, t)]
    pps = [f.pp] if f.pp else [p for p in _divisors(gpus) if p <= min(64, shape.layers)]
    for tp in tps:
        for pp in pps:
            for cp in [f.cp] if f.cp else [1]:
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                if (f.dp_shard and dp != f.dp_shard) or global_batch % dp:
                    continue
                for ep in _ep_choices(shape, dp * cp, f):
                    yield from _per_rank_choices(tp, pp, dp, cp, ep, global_batch // dp, f, shape)


def _ep_choices(shape: ModelShape, dp_cp: int, f: Layout) -> list[int]:
    """Expert-parallel degrees to try: the fixed one, else (MoE) every divisor of the experts
    that divides the data-parallel ranks it borrows (the rules judge the rest)."""
    if f.ep:
        return [f.ep]
    return [e for e in _divisors(max(1, shape.num_experts)) if dp_cp % e == 0]


def _zero_choices(dp_cp: int, ep: int, f: Layout) -> list[int]:
    """ZeRO stages to try; under ep the model runs on FSDP2 (dims.uses_fsdp), searched as stages 2 and 3,
    as is CPU offload on one data-parallel rank (the layout rule refuses it except on a world of one)."""
    if f.zero_stage is not None:
        return [f.zero_stage]
    if dp_cp == 1:  # a world of one offloads on a one-rank FSDP2 mesh (ZeRO-2/3; dims.offload_problem)
        return [2, 3] if f.offload == "cpu" else [0]
    return [2, 3] if ep > 1 else [0, 1, 2, 3]


def _per_rank_choices(
    tp: int, pp: int, dp: int, cp: int, ep: int, local: int, f: Layout, shape: ModelShape
) -> Iterator[Layout]:
    micros = [f.micro_batch_size] if f.micro_batch_size else [b for b in (1, 2, 4, 8, 16) if local % b == 0]
    offload = "cpu" if f.offload == "cpu" else "none"  # one setting per pass (offload_modes)
    for mb in micros:
        if local % mb:
            continue
        for zero in _zero_choices(dp * cp, ep, f):
            for rc in [f.activation_checkpoint] if f.activation_checkpoint else RECOMPUTE:
                for sched, v, split in _schedules(pp, f, shape.layers):
                    yield plan_layout(
                        tp,
                        pp,
                        dp,
                        cp=cp,
                        ep=ep,
                        zero_stage=zero,
                        micro_batch_size=mb,
                        num_microbatches=local // mb,
                        activation_checkpoint=rc,
                        pp_virtual_stages=v,
                        pp_schedule=sched,
                        sequence_parallel=f.sequence_parallel,
                        async_tp=f.async_tp,
                        offload=offload,
                        pp_layers=split,
                    )


def layouts(
    shape: ModelShape,
    gpus: int,
    global_batch: int,
    seq: int,
    f: Layout,
    gpus_per_node: int,
    stop: Callable[[], bool] | None = None,
):
    """Every layout the rules let exist, with (runnable, reason); ends early when ``stop()`` says so."""
    for lay in candidates(shape, gpus, global_batch, seq, f, gpus_per_node):
        if stop is not None and stop():
            return
        exists, reason = judge(lay, shape, seq, global_batch, gpus_per_node)
        if exists:
            yield lay, reason


def _schedules(pp: int, f: Layout, layers: int = 0) -> Iterator[tuple[str, int, tuple[int, ...]]]:
    """(schedule, chunks per rank, blocks per chunk or ()) to try; the V schedules only when asked
    for. Interleaved 1F1B is searched only as Megatron-LM can run it: pp > 2 (its parallel_state
    refuses the interleaved schedule at pp <= 2), over the chunk counts ``_interleavings`` gives;
    a fixed --virtual-stages (or a --pp-layers split, which implies it) is priced as asked."""
    if pp == 1:
        yield "none", 1, f.pp_layers
        return
    for s in [f.pp_schedule] if f.pp_schedule else SCHEDULES:
        if s == "interleaved_1f1b":
            if f.pp_virtual_stages or f.pp_layers:
                yield s, f.pp_virtual_stages or max(1, len(f.pp_layers) // pp), f.pp_layers
            elif pp > 2:
                yield from ((s, v, split) for v, split in _interleavings(pp, layers))
        elif s in V_SCHEDULES:
            yield s, 2, f.pp_layers
        else:
            yield s, f.pp_virtual_stages if s == "zero_bubble" and f.pp_virtual_stages else 1, f.pp_layers


def _interleavings(pp: int, layers: int) -> Iterator[tuple[int, tuple[int, ...]]]:
    """The chunk counts Megatron-LM runs: every v >= 2 dividing the blocks per stage, ceil(L/p)
    (its arguments check num_layers_per_pipeline_stage % layers_per_virtual_stage == 0), evenly
    split; and every v for which the blocks plus the embedding and the loss, each counted as one
    block (Megatron's account_for_embedding/loss_in_pipeline_split; Llama 3's 126 blocks in
    16 x 8 chunks), divide into pp x v equal chunks: then the first and the last chunk hold one
    block fewer (none, at one block per chunk)."""
    per_stage = -(-layers // pp)
    for v in range(2, per_stage + 1):
        if per_stage % v == 0:
            yield v, ()
    for v in range(2, (layers + 2) // pp + 1):
        k, rest = divmod(layers + 2, pp * v)
        if not rest and k >= 1 and (k > 1 or layers >= pp * v - 2):
            yield v, (k - 1,) + (k,) * (pp * v - 2) + (k - 1,)


class Ranked(list):
    """The ranking, plus the fitting layouts the layout rules say train does not run.
    ``fits_nothing``: every degree was fixed and that layout overflows; the ranking is then
    the overflowing layout(s), smallest first, so the caller can show what they would need."""

    refused: list[Estimate] = []
    fits_nothing: bool = False
    partial: bool = False  # the search stopped at its deadline: the best of the layouts it got to


def fully_fixed(f: Layout, gpus: int | None = None) -> bool:
    """The degrees and the ZeRO stage are determined: tp, pp and the ZeRO stage given, and dp given
    or implied by --gpus (dp = gpus / (tp x pp x cp), cp 1 unless given). The question is then
    "what does this layout need?", answered as asked even when it overflows (the ZeRO paper's
    Table 1 question); micro-batch and recompute may still be searched."""
    if any(x is None for x in (f.tp, f.pp, f.zero_stage)):
        return False
    return f.dp_shard is not None or (gpus is not None and gpus % (f.tp * f.pp * (f.cp or 1)) == 0)


def _overflowing(found: list[Estimate]) -> Ranked:
    """The fixed layout(s) that do not fit, the smallest first, marked ``fits_nothing``."""
    found.sort(key=lambda e: (e.memory["total"], -e.tokens_per_s_per_gpu))
    ranked = Ranked(found)
    ranked.fits_nothing = True
    return ranked


@dataclass
class _Scan:
    """One pass over the layouts with one offload setting."""

    fitting: list[Estimate] = field(default_factory=list)
    overflowing: list[Estimate] = field(default_factory=list)  # kept when every degree is fixed
    smallest: Estimate | None = None
    considered: int = 0
    partial: bool = False


def _scan(
    shape: ModelShape,
    hw: Hardware,
    gpus: int,
    gpus_per_node: int,
    global_batch: int,
    seq: int,
    precision: str,
    f: Layout,
    stop: Callable[[], bool] | None = None,
) -> _Scan:
    out, keep_all = _Scan(), fully_fixed(f, gpus)
    for lay, reason in layouts(shape, gpus, global_batch, seq, f, gpus_per_node, stop):
        out.considered += 1
        e = estimate(shape, lay, seq, global_batch, precision, hw, gpus_per_node)
        e.not_runnable = reason
        if e.fits:
            out.fitting.append(e)
        else:
            if keep_all:
                out.overflowing.append(e)
            if out.smallest is None or e.memory["total"] < out.smallest.memory["total"]:
                out.smallest = e
    out.partial = stop is not None and stop()  # the loop ended at the deadline (or the caller left)
    return out


def search(
    shape: ModelShape,
    hw: Hardware,
    gpus: int,
    gpus_per_node: int,
    global_batch: int,
    seq: int,
    precision: str,
    fixed: Layout,
    max_gpus: int = 2**20,
    deadline: float | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> tuple[Ranked, int]:
    """Fitting layouts that meshforge train runs, fastest first (``.refused``: fitting ones it
    does not run, with the reason), and how many were considered. When only refused layouts
    fit (e.g. every degree fixed to one train cannot run yet), they are the ranking, marked.
    With every degree fixed and nothing fitting, the overflowing layouts are the answer
    (``fits_nothing``); an open search that fits nothing is refused with what would fit.
    When none fits, the error names the smallest cluster of up to ``max_gpus`` that does.
    CPU offload (``fixed.offload``, ``offload_modes``) is searched only when nothing runnable
    fits without it, unless fixed; never for a fixed layout (``fully_fixed``) unless asked.
    ``deadline`` (a ``time.monotonic()`` time) and ``cancelled`` end the search early: the
    ranking is then of the layouts considered so far, marked ``partial``."""
    check_fixed(shape, gpus, fixed, gpus_per_node)
    modes = offload_modes(fixed, hw)
    if fully_fixed(fixed, gpus) and fixed.offload is None:
        modes = ["none"]  # a fixed layout is answered as asked: offloaded only with --offload cpu
    scans: list[_Scan] = []
    stop = _stopper(deadline, cancelled)
    for mode in modes:
        f = replace(fixed, offload=mode)
        scans.append(_scan(shape, hw, gpus, gpus_per_node, global_batch, seq, precision, f, stop))
        if scans[-1].partial or any(not e.not_runnable for e in scans[-1].fitting):
            break
    ranked, considered = _rank(
        scans, shape, hw, gpus, gpus_per_node, global_batch, seq, precision, fixed, max_gpus, stop
    )
    ranked.partial = any(sc.partial for sc in scans)
    return ranked, considered


def _stopper(deadline: float | None, cancelled: Callable[[], bool] | None) -> Callable[[], bool] | None:
    """One check for the candidate loop: past the deadline, or the caller gave up."""
    if deadline is None and cancelled is None:
        return None
    return lambda: (deadline is not None and time.monotonic() > deadline) or (cancelled is not None and cancelled())


def _rank(
    scans: list[_Scan],
    shape: ModelShape,
    hw: Hardware,
    gpus: int,
    gpus_per_node: int,
    global_batch: int,
    seq: int,
    precision: str,
    fixed: Layout,
    max_gpus: int,
    stop: Callable[[], bool] | None = None,
) -> tuple[Ranked, int]:
    """The scans' answer (see ``search``); ``stop`` bounds the hunt for a larger cluster."""
    modes = offload_modes(fixed, hw)
    fitting = [e for sc in scans for e in sc.fitting]
    overflowing = [e for sc in scans for e in sc.overflowing]
    considered = sum(sc.considered for sc in scans)
    if not fitting and overflowing:
        return _overflowing(overflowing), considered
    if not fitting and any(sc.partial for sc in scans):
        raise ConfigError(
            f"the search stopped at its deadline after {considered} layouts of {shape.name} on {gpus} GPUs, none of "
            "them fitting yet; fix some degrees (tp, pp, ZeRO stage, micro-batch) to narrow it"
        )
    if not fitting:
        tried = [sc.smallest for sc in scans if sc.smallest is not None]
        smallest = min(tried, key=lambda e: e.memory["total"]) if tried else None
        try:
            bigger = smallest_cluster(
                shape, hw, gpus, gpus_per_node, global_batch, seq, precision, fixed, max_gpus, stop
            )
        except _Stopped:
            raise ConfigError(
                f"{shape.name} fits no layout on {gpus} x {hw.name} ({considered} considered); the search for a larger "
                "cluster that fits stopped at its deadline: try more GPUs, GPUs with more memory or a smaller model"
            ) from None
        msg = no_fit_message(shape, hw, gpus, considered, smallest, precision, bigger, max_gpus, global_batch)
        raise ConfigError(msg + (" (CPU offload searched too)" if "cpu" in modes and considered else ""))
    fitting.sort(key=lambda e: (-e.tokens_per_s_per_gpu, e.memory["total"]))
    runs = Ranked(e for e in fitting if not e.not_runnable)
    if not runs:
        return Ranked(fitting), considered
    runs.refused = [e for e in fitting if e.not_runnable]
    return runs, considered


class _Stopped(Exception):
    """The deadline passed during the hunt for a larger cluster."""


def smallest_cluster(
    shape: ModelShape,
    hw: Hardware,
    gpus: int,
    gpus_per_node: int,
    global_batch: int,
    seq: int,
    precision: str,
    f: Layout,
    max_gpus: int = 2**20,
    stop: Callable[[], bool] | None = None,
) -> tuple[int, Estimate] | None:
    """The first power-of-two multiple of ``gpus`` (up to ``max_gpus``) on which some layout
    fits, with its fastest layout; the data-parallel degree is left free, offload as in search."""
    n = gpus * 2
    while n <= max_gpus:
        for mode in offload_modes(f, hw):  # at each size without offload first, as search does
            best = None
            free = f.replace(dp_shard=None, offload=mode)
            for lay, reason in layouts(shape, n, global_batch, seq, free, gpus_per_node, stop):
                e = estimate(shape, lay, seq, global_batch, precision, hw, gpus_per_node)
                if e.fits and not reason and (best is None or e.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu):
                    best = e
            if stop is not None and stop():
                raise _Stopped
            if best is not None:
                return n, best
        n *= 2
    return None


def no_fit_message(
    shape: ModelShape,
    hw: Hardware,
    gpus: int,
    considered: int,
    smallest: Estimate | None,
    precision: str,
    bigger: tuple[int, Estimate] | None = None,
    max_gpus: int = 2**20,
    global_batch: int = 0,
) -> str:
    if considered == 0:
        return (
            f"no layout of {shape.name} on {gpus} GPUs is valid: the degrees must divide the GPUs, heads, layers "
            "and the global batch; try another --gpus or --global-batch"
        )
    need = shape.num_params() * 16 / 2**30  # Adam in mixed precision or fp32: 16 bytes per parameter
    lowest = smallest.memory["total"] if smallest else float("nan")
    least = f"the smallest needs {lowest:.1f} GiB per GPU"
    if smallest is not None and smallest.layout.offload == "cpu":  # small on the device, too big for the host
        least = f"the smallest, with CPU offload, needs {lowest:.1f} GiB per GPU and still overflows "
        least += f"({smallest.overflow})"
    msg = (
        f"{shape.name} ({output.count(shape.num_params())} parameters) fits no layout on {gpus} x {hw.name} "
        f"({hw.hbm_gib:.0f} GiB each): {least}; its model states alone are {need:.0f} GiB (16 bytes per parameter). "
    )
    if bigger is None:
        batch = (
            f" (with a global batch of {global_batch} sequences the data-parallel degree is at most "
            f"{global_batch}, so more GPUs cannot share the state: a larger --global-batch lets them)"
            if global_batch
            else ""
        )
        end = "use GPUs with more memory, a larger batch or a smaller model"
        return msg + f"No cluster of up to {max_gpus} such GPUs fits it{batch}: {end}"
    n, e = bigger
    L = e.layout
    offload = " with CPU offload" if L.offload == "cpu" else ""
    return msg + (
        f"The smallest cluster of this kind that fits it (doubling --gpus) is {n} GPUs, e.g. tp {L.tp} pp {L.pp} "
        f"dp {L.dp} zero {L.zero_stage} recompute {L.activation_checkpoint}{offload} at {e.memory['total']:.1f} "
        "GiB per GPU; "
        "or use GPUs with more memory"
    )
