"""Estimate every layout candidates.py enumerates, keep what fits, rank by speed.

Whether a layout can exist and whether ``meshforge train`` runs it is not decided here:
every candidate is put to the layout rules in ``parallel/rules.py``. A candidate they call
invalid is skipped; one they call unsupported is estimated and ranked after the runnable
ones, marked with the reason, so the planner never recommends a layout training refuses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from meshforge.config.layout import Layout
from meshforge.errors import ConfigError
from meshforge.models.shape import ModelShape
from meshforge.planner import output
from meshforge.planner.candidates import check_fixed, layouts, offload_modes
from meshforge.planner.estimate import Estimate, estimate
from meshforge.planner.hardware import Hardware


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
