"""Data parallelism (DDP, ZeRO, HSDP), CPU offload and the batch split over the data-parallel ranks."""

from __future__ import annotations

from collections.abc import Iterator

from meshforge.config.layout import Layout
from meshforge.models.shape import ModelShape
from meshforge.parallel.rule_types import Batch, Problem


def casts_once(d: Layout, precision: str, mixed_precision: str) -> bool:
    """Whether data parallelism runs on FSDP2 beyond ``uses_fsdp``: a world of one under CPU
    offload, and -- for bf16/fp8 with ``train.mixed_precision = "cast_once"`` -- a world of one
    (a one-rank mesh) and DDP's layouts (stage 0: replicated over dp), so that FSDP2's
    mixed-precision policy casts each weight to bf16 once per micro-batch instead of autocast
    at every use. (bf16 ZeRO-1 holds bf16 working weights of its own: parallel/data/zero1.py.)"""
    if d.uses_fsdp():
        return False
    if d.world_size == 1 and d.offload == "cpu" and d.zero_stage >= 2:
        return True
    once = precision in ("bf16", "fp8") and mixed_precision == "cast_once"
    return once and (d.world_size == 1 or (d.dp_cp > 1 and d.zero_stage == 0))


def gathers_weights(d: Layout) -> bool:
    """Whether FSDP2 all-gathers weights over more than one rank (ZeRO-2/3 and HSDP with a
    shard group of dp_shard x cp > 1). Only then does fp8 all-gather save anything: on a
    one-rank shard group (a world of one, DDP's cast-once layout) it only adds a per-weight
    cast outside the compiled blocks (parallel/fp8.py)."""
    return d.uses_fsdp() and d.zero_stage >= 2 and d.dp_shard * d.cp > 1


def uses_flat_zero1(d: Layout, precision: str) -> bool:
    """bf16 (and fp8: bf16 around fp8 matmuls) ZeRO-1 over more than one data-parallel rank runs on
    FlatZero1 (parallel/data/zero1.py: bf16 working weights, fp32 master shards); fp32 ZeRO-1 keeps
    ZeroRedundancyOptimizer."""
    return precision in ("bf16", "fp8") and d.zero_stage == 1 and d.dp_cp > 1


def _data_parallel(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    if d.dp_replicate > 1 and d.zero_stage < 2:
        yield Problem(
            "parallel.dp_replicate",
            f"parallel.dp_replicate = {d.dp_replicate} (HSDP: replicate across groups, shard within) needs "
            f"parallel.zero_stage = 2 or 3; for plain data parallel use parallel.dp_shard = {d.dp} with "
            "dp_replicate = 1",
        )
    if d.zero_stage == 1 and d.tp > 1:
        yield Problem(
            "parallel.zero_stage",
            f"parallel.zero_stage = 1 with parallel.tp = {d.tp}: ZeRO-1 (ZeroRedundancyOptimizer) does not take "
            "tensor-parallel shards; use parallel.zero_stage = 2 (the same communication as ZeRO-1, and "
            "gradients sharded too) or 0",
            "unsupported",
        )
    if d.zero_stage == 1 and d.pp > 1:
        yield Problem(
            "parallel.zero_stage",
            "parallel.zero_stage = 1 with parallel.pp > 1: data parallelism under pipelining runs on FSDP2; use "
            "parallel.zero_stage = 2 (the same communication as ZeRO-1, gradients sharded too), 3, or 0",
            "unsupported",
        )


def offload_problem(d: Layout) -> Problem | None:
    """Why ``parallel.offload = "cpu"`` cannot run on this layout (None: it can). FSDP2's
    CPUOffloadPolicy offloads FSDP2's sharded state, so it needs ZeRO-2/3 on FSDP2: over more
    than one data-parallel rank, or a world of one (a one-rank FSDP2 mesh, as DeepSpeed and
    FSDP2 offload a single GPU); the experts' own FSDP units (ep > 1) take no offload policy yet.
    The planner puts its fixed choices to this rule too."""
    if d.offload != "cpu":
        return None
    if d.zero_stage < 2:
        return Problem(
            "parallel.offload",
            f"parallel.offload = 'cpu' needs FSDP2's sharded state (parallel.zero_stage = 2 or 3; here "
            f"zero_stage = {d.zero_stage}); set parallel.zero_stage = 3 or parallel.offload = 'none'",
        )
    if not (d.uses_fsdp() or d.world_size == 1):
        return Problem(
            "parallel.offload",
            f"parallel.offload = 'cpu' on {d.world_size} ranks with one data-parallel rank (dp = {d.dp_cp}): the "
            "model-parallel axes alone do not run on FSDP2; use more data-parallel ranks (parallel.dp_shard) or "
            "parallel.offload = 'none'",
        )
    if d.ep > 1:
        return Problem(
            "parallel.offload",
            f"parallel.offload = 'cpu' with parallel.ep = {d.ep}: the experts' FSDP units (over edp) are not "
            "offloaded in this version; use parallel.ep = 1 or parallel.offload = 'none'",
            "unsupported",
        )
    return None


def _offload(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    found = offload_problem(d)
    if found:
        yield found


def _batch(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    dp = d.data_ranks
    if t.global_batch % dp:
        what = f"diloco.islands x dp = {d.islands} x {d.dp}" if d.islands > 1 else "the data-parallel degree"
        yield Problem(
            "train.global_batch_size",
            f"train.global_batch_size = {t.global_batch} is not divisible by {what} {dp}; "
            f"use a multiple of {dp}, e.g. {max(dp, (t.global_batch // dp) * dp) or dp}",
        )
        return
    local = t.global_batch // dp
    micro = d.micro_batch_size or local
    if d.pp == 1 and (micro <= 0 or local % micro):
        yield Problem(
            "train.micro_batch_size",
            f"train.micro_batch_size = {d.micro_batch_size} must divide the per-rank batch "
            f"global_batch_size / dp = {local}",
        )
