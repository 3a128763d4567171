"""A partial layout's fixed choices, judged before a search: the planner's --tp/--pp/--ep/...
and the explorer's fixed ep. Only the fields that are set (not None) are judged, against the
model, the GPU count and the GPUs per node; every candidate the search fills in is then put
to ``problems`` whole. Messages name settings in the caller's spelling (``Spelling``): config
keys (``parallel.tp = 3``) by default, or a tool's flags (``--tp 3``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from meshforge.config.layout import Layout
from meshforge.models.shape import ModelShape
from meshforge.parallel.data.rules import offload_problem
from meshforge.parallel.pipeline.rules import sizes_ok
from meshforge.parallel.pipeline.schedules import SCHEDULES, V_SHAPED
from meshforge.parallel.rule_types import Problem, product
from meshforge.parallel.tensor.rules import tp_divides_heads

RECOMPUTE = ("none", "selective", "full")  # train.activation_checkpoint, in the planner's search order
OFFLOAD = ("auto", "none", "cpu")  # parallel.offload; "auto" (or None): the search decides
ZERO_STAGES = (0, 1, 2, 3)
SCHEDULE_NAMES = (*(s for s in SCHEDULES if s not in V_SHAPED), *V_SHAPED)  # the V-shaped ones last
FIXED_DEGREES = ("parallel.tp", "parallel.pp", "parallel.dp_shard", "parallel.cp")  # their product vs the GPUs


@dataclass(frozen=True)
class Spelling:
    """How a message names a setting: ``names`` maps a key (``parallel.tp``; ``gpus``,
    ``gpus_per_node`` for the cluster) to the caller's name for it, ``sep`` joins name and value."""

    names: Mapping[str, str] = field(default_factory=dict)
    sep: str = " = "

    def name(self, key: str) -> str:
        return self.names.get(key, key)

    def say(self, key: str, value: object) -> str:
        return f"{self.name(key)}{self.sep}{value}"


CONFIG = Spelling()  # config keys: "parallel.tp = 3"


def partial_problems(
    d: Layout, model: ModelShape, gpus: int, gpus_per_node: int, spell: Spelling = CONFIG
) -> list[Problem]:
    """Every reason the set fields of this partial layout cannot run this model on ``gpus``
    GPUs, ``gpus_per_node`` to a node (empty: a search may find a layout)."""
    out: list[Problem] = []
    for rule in (_fixed_experts, _fixed_tensor, _fixed_pipeline, _fixed_product):
        out.extend(rule(d, model, gpus, gpus_per_node, spell))
    out.extend(_fixed_values(d, spell))
    return out


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _fixed_experts(d: Layout, model: ModelShape, gpus: int, node: int, s: Spelling) -> Iterator[Problem]:
    experts = model.num_experts
    if d.ep not in (None, 1) and experts <= 0:
        yield Problem(
            "parallel.ep",
            f"{s.say('parallel.ep', d.ep)}: this model has no experts (it is dense); expert parallelism needs "
            f"{s.name('model.num_experts')} > 0",
        )
    elif d.ep is not None and (d.ep < 1 or (experts and experts % d.ep)):
        yield Problem(
            "parallel.ep",
            f"{s.say('parallel.ep', d.ep)} must divide {s.say('model.num_experts', experts)} (whole experts per "
            f"rank); one of {_divisors(max(1, experts))}",
        )


def _fixed_tensor(d: Layout, model: ModelShape, gpus: int, node: int, s: Spelling) -> Iterator[Problem]:
    if d.tp is None:
        return
    if d.tp > node:
        yield Problem(
            "parallel.tp",
            f"{s.say('parallel.tp', d.tp)} is more than {s.say('gpus_per_node', node)}: tp stays inside a node "
            "(its collectives are on the critical path and need NVLink-class bandwidth); use pp or dp across nodes",
        )
    if not tp_divides_heads(model, d.tp):
        ok = [k for k in _divisors(node) if tp_divides_heads(model, k)]
        yield Problem(
            "parallel.tp",
            f"{s.say('parallel.tp', d.tp)} does not divide {s.say('model.heads', model.heads)} / "
            f"{s.say('model.kv_heads', model.kv_heads)}; use one of {ok}",
        )


def _fixed_pipeline(d: Layout, model: ModelShape, gpus: int, node: int, s: Spelling) -> Iterator[Problem]:
    if d.pp is not None and d.pp > model.layers and not d.pp_layers:
        yield Problem(
            "parallel.pp",
            f"{s.say('parallel.pp', d.pp)} is more than the {model.layers} layers; every stage needs at least one",
        )
    if d.pp_layers:
        yield from _fixed_split(d, model, s)


def _fixed_split(d: Layout, model: ModelShape, s: Spelling) -> Iterator[Problem]:
    """A fixed stage split needs pp fixed, pp x chunks per rank entries, and model.layers blocks."""
    sizes, v = d.pp_layers, d.pp_virtual_stages
    if d.pp is None or d.pp < 2:
        yield Problem("parallel.pp_layers", f"{s.name('parallel.pp_layers')} needs {s.name('parallel.pp')} >= 2")
    elif len(sizes) % d.pp or (v and len(sizes) != d.pp * v) or sum(sizes) != model.layers or not sizes_ok(sizes):
        chunks = f"{d.pp} x {v}" if v else f"a multiple of {s.say('parallel.pp', d.pp)}"
        yield Problem(
            "parallel.pp_layers",
            f"{s.name('parallel.pp_layers')} must list {chunks} chunk sizes summing to the {model.layers} layers, "
            f"each >= 1 but the first and last (which may be 0); got {len(sizes)} summing to {sum(sizes)}",
        )


def _fixed_product(d: Layout, model: ModelShape, gpus: int, node: int, s: Spelling) -> Iterator[Problem]:
    """The fixed degrees must divide the GPUs, and multiply to them when all are fixed (ep borrows dp ranks)."""
    fixed = [getattr(d, k.partition(".")[2]) for k in FIXED_DEGREES]
    prod = product(x for x in fixed if x is not None)
    if gpus % prod:
        yield Problem("gpus", f"fixed degrees multiply to {prod}, which does not divide {s.say('gpus', gpus)}")
    elif None not in fixed and prod != gpus:
        names = " x ".join(s.name(k) for k in FIXED_DEGREES)
        yield Problem("gpus", f"{names} multiply to {prod}, not {s.say('gpus', gpus)}; leave one out to infer it")


def _fixed_values(d: Layout, s: Spelling) -> Iterator[Problem]:
    """Settings outside their values, and CPU offload with a ZeRO stage the offload rule refuses."""
    for key, value, allowed in (
        ("parallel.pp_schedule", d.pp_schedule, SCHEDULE_NAMES),
        ("train.activation_checkpoint", d.activation_checkpoint, RECOMPUTE),
        ("parallel.zero_stage", d.zero_stage, ZERO_STAGES),
        ("parallel.offload", d.offload, OFFLOAD),
    ):
        if value is not None and value not in allowed:
            shown = value if isinstance(value, int) else repr(value)
            yield Problem(key, f"{s.say(key, shown)}: one of {', '.join(map(str, allowed))}")
    if d.offload == "cpu" and d.zero_stage is not None:
        # an unset dp is judged at 2 ranks (where ZeRO-2/3 runs on FSDP2): then only the stage is judged
        lay = Layout(pp=d.pp or 1, dp_shard=d.dp_shard or 2, cp=d.cp or 1, tp=d.tp or 1, ep=d.ep or 1)
        found = offload_problem(lay.replace(zero_stage=d.zero_stage, offload="cpu"))
        if found is not None:
            prefix = f"{s.say('parallel.offload', 'cpu')} {s.say('parallel.zero_stage', d.zero_stage)}"
            yield Problem(found.key, f"{prefix}: {found.message}", found.kind)
