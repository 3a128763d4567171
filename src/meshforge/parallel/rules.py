"""Every axis's layout rules gathered (each lives beside its code: ``parallel/<axis>/rules.py``):
degrees, what divides what, and which meshes exist.

``Layout`` is pure Python (no process groups, no tensors), so the config check
before launch, the device mesh, ``parallelize.py`` and the planner's search all ask the
same object whether a layout can run, and a layout the planner ranks is one ``meshforge
train`` runs (or it is marked not runnable with the reason this file gives).

Mesh dimensions, outermost to innermost: ``pp, dp_replicate, dp_shard, cp, tp``. Tensor
parallel is innermost so its ranks are neighbours (one node's fast links); pipeline is
outermost because its point-to-point traffic is the lightest. ``ep`` is no dimension of
the main mesh: expert parallelism borrows ranks from ``dp_shard x cp``, as torchtitan does.
Under ep > 1 a second mesh over the same ranks in the same order, ``EXPERT_DIMS`` = ``pp,
dp_replicate, edp, ep, tp``, splits dp_shard x cp into ``edp`` (the ranks that hold the same
experts; FSDP shards expert weights over them) x ``ep`` (innermost: the experts are split
over neighbouring data-parallel ranks, whose all-to-all stays on the fastest links).
Flattened sub-meshes give the axes the groups they need:

- ``dp``          = dp_replicate x dp_shard: the data-parallel ranks (the sampler's slices)
- ``dp_shard_cp`` = dp_shard x cp: what FSDP shards parameters over (cp ranks hold the same
  parameters and see different tokens, so they shard and average like dp ranks); under HSDP
  FSDP's 2-D mesh is (dp_replicate, dp_shard_cp)
- ``dp_cp``       = dp_replicate x dp_shard x cp: the ranks that average the loss, and DDP's
  and ZeRO-1's group under cp > 1

A rule answers with ``Problem``s: ``invalid`` layouts cannot exist (a degree that does not
divide the heads), ``unsupported`` ones could, but this version of meshforge does not run
them (ZeRO-1 under tp, a mixture of experts under tp). Each problem names the key
and the fix.

Each axis's rules live beside its code: ``data/rules.py`` (DDP/ZeRO/HSDP, offload, the batch),
``tensor/rules.py`` (tp, sequence parallelism, async TP), ``context/rules.py`` (cp),
``pipeline/rules.py``, ``expert/rules.py``, ``diloco/rules.py``; beside this module
``degrees.py`` (inferring a -1 degree, each rank's coordinates), ``partial_rules.py`` (a partial
layout's fixed choices, judged before a search) and ``rule_types.py`` (the vocabulary).
"""

from __future__ import annotations

from collections.abc import Iterator

from meshforge.config.layout import DIMS, EXPERT_DIMS, FLATTENED, ISLAND, Layout
from meshforge.errors import ConfigError
from meshforge.models.shape import ModelShape
from meshforge.parallel.context.rules import _context_parallel
from meshforge.parallel.data.rules import (
    _batch,
    _data_parallel,
    _offload,
    casts_once,
    gathers_weights,
    offload_problem,
    uses_flat_zero1,
)
from meshforge.parallel.degrees import rank_layout, resolve_degrees
from meshforge.parallel.diloco.rules import diloco_problems
from meshforge.parallel.expert.rules import _experts, ep_chunks_of
from meshforge.parallel.partial_rules import CONFIG, OFFLOAD, RECOMPUTE, Spelling, partial_problems
from meshforge.parallel.pipeline.rules import _pipeline
from meshforge.parallel.rule_types import SYNC_DTYPES, Batch, DiLoCoRules, Problem
from meshforge.parallel.tensor.rules import _async_tp, _tensor_parallel, async_tp_mode, tp_divides_heads

__all__ = [  # the layout data lives in meshforge/config/layout.py; the rules here
    "CONFIG",
    "DIMS",
    "EXPERT_DIMS",
    "FLATTENED",
    "ISLAND",
    "OFFLOAD",
    "RECOMPUTE",
    "SYNC_DTYPES",
    "Batch",
    "DiLoCoRules",
    "Layout",
    "Problem",
    "Spelling",
    "async_tp_mode",
    "casts_once",
    "ep_chunks_of",
    "check",
    "diloco_problems",
    "gathers_weights",
    "offload_problem",
    "partial_problems",
    "problems",
    "rank_layout",
    "resolve_degrees",
    "tp_divides_heads",
    "uses_flat_zero1",
]


def problems(d: Layout, model: ModelShape, t: Batch) -> list[Problem]:
    """Every reason this layout cannot run this model with this batch (empty: it runs)."""
    out: list[Problem] = []
    rules = (
        _axes_available,
        _data_parallel,
        _batch,
        _tensor_parallel,
        _context_parallel,
        _pipeline,
        _offload,
        _async_tp,
    )
    for rule in (*rules, _experts, diloco_problems):
        out.extend(rule(d, model, t))
    return out


def check(d: Layout, model: ModelShape, t: Batch) -> None:
    """Raise the first problem as a ConfigError."""
    found = problems(d, model, t)
    if found:
        raise ConfigError(found[0].message)


def _axes_available(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    return iter(())  # every axis is available; compositions not yet run are refused by each axis' rule
