"""Mixtures of experts and expert parallelism (ep borrows data-parallel ranks: dp_shard x cp)."""

from __future__ import annotations

from collections.abc import Iterator

from meshforge.config.layout import Layout
from meshforge.models.shape import ModelShape
from meshforge.parallel.rule_types import Batch, Problem


def _experts(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    """Mixtures of experts and expert parallelism (ep borrows data-parallel ranks: dp_shard x cp)."""
    experts = getattr(model, "num_experts", 0)
    if experts:
        yield from _moe_unsupported(d)
        yield from _moe_context_parallel(d, model)
    shared = getattr(model, "num_shared_experts", 0) * (getattr(model, "moe_ffn_hidden", 0) or model.ffn_hidden)
    if experts and d.tp > 1 and shared % d.tp:
        yield Problem(
            "model.num_shared_experts",
            f"the shared experts' {shared} columns (model.num_shared_experts x model.moe_ffn_hidden) are not "
            f"divisible by parallel.tp = {d.tp} (they are column/row tensor-parallel); use a parallel.tp that "
            "divides them or a multiple of it for model.moe_ffn_hidden",
        )
    if d.ep == 1:
        return
    if not experts:
        yield Problem(
            "parallel.ep",
            f"parallel.ep = {d.ep} splits the experts of a mixture-of-experts model, but this model is dense "
            "(model.num_experts = 0); set parallel.ep = 1, or use an MoE model (e.g. model.preset = debug-moe)",
        )
        return
    if (d.dp_shard * d.cp) % d.ep:
        yield Problem(
            "parallel.ep",
            f"parallel.ep = {d.ep} must divide parallel.dp_shard x parallel.cp = {d.dp_shard * d.cp} (expert "
            f"parallelism borrows data-parallel ranks); use a divisor of {d.dp_shard * d.cp} or raise dp_shard",
        )
    if experts % d.ep:
        fits = [k for k in range(1, d.ep) if experts % k == 0 and (d.dp_shard * d.cp) % k == 0]
        yield Problem(
            "parallel.ep",
            f"parallel.ep = {d.ep} must divide model.num_experts = {experts} (whole experts per rank); use e.g. "
            f"parallel.ep = {max(fits)}",
        )


def ep_chunks_of(d: Layout, ranks_per_node: int | None) -> int:
    """``parallel.ep_chunks`` as a run uses it: ``0`` (auto) is 2 where the ep group's all-to-alls
    cross nodes (its ep x tp neighbouring ranks outgrow one node's ``ranks_per_node``: a slow link
    worth hiding under the experts) and 1 inside a node, where the chunks' smaller expert GEMMs
    and extra all-to-alls cost more than a fast link's transfers hide (bench/bench_overlap.py:
    debug-moe's chunked step on a CPU's loopback, 2.3x the one-chunk step). Not knowing the node
    (None: no launcher told us) counts as inside one."""
    if d.ep_chunks:
        return d.ep_chunks
    return 2 if d.ep > 1 and ranks_per_node is not None and d.ep * d.tp > ranks_per_node else 1


def _moe_unsupported(d: Layout) -> Iterator[Problem]:
    """Mixtures of experts under axes that this version does not run them on (each is refused
    until an equivalence test covers it): tp without ep would leave the experts to the dense
    plan."""
    for key, degree, why in (
        (
            "parallel.tp",
            d.tp if d.ep == 1 else 1,
            "tensor parallelism runs the experts expert-parallel, so it needs parallel.ep >= 2 "
            "(e.g. parallel.ep = 2 with parallel.dp_shard = 2)",
        ),
    ):
        if degree > 1:
            yield Problem(
                key,
                f"{key} = {degree} with a mixture-of-experts model (model.num_experts > 0): {why}; this version of "
                f"meshforge does not run it; set {key} = 1 (use parallel.ep and dp_shard to scale out)",
                "unsupported",
            )


def _moe_context_parallel(d: Layout, model: ModelShape) -> Iterator[Problem]:
    """Under cp a rank routes its shard of each sequence; the balance statistics are summed
    over the cp ranks (parallel/context/moe.py), but capacity drops the lowest
    scores per expert among a micro-batch's tokens, which no rank sees whole."""
    capacity = getattr(model, "capacity_factor", 0)
    if d.cp > 1 and capacity > 0:
        yield Problem(
            "model.capacity_factor",
            f"model.capacity_factor = {capacity} with parallel.cp = {d.cp}: capacity would be enforced per "
            "sequence shard, not per micro-batch as on one device; set model.capacity_factor = 0 (dropless) "
            "or parallel.cp = 1",
            "unsupported",
        )
