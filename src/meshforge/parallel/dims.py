"""The one home of layout rules: degrees, what divides what, and which meshes exist.

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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from meshforge.errors import ConfigError, suggest
from meshforge.layout import DIMS, EXPERT_DIMS, FLATTENED, ISLAND, Layout
from meshforge.models.shape import ModelShape
from meshforge.parallel.schedules import SCHEDULES, schedule_available, schedule_name

__all__ = ["DIMS", "EXPERT_DIMS", "FLATTENED", "ISLAND", "Layout"]  # the layout data lives in meshforge/layout.py

SYNC_DTYPES = ("fp32", "bf16", "fp8")  # DiLoCo pseudo-gradients on the wire


@dataclass(frozen=True)
class Problem:
    key: str
    message: str
    kind: str = "invalid"  # "invalid" | "unsupported"


@dataclass(frozen=True)
class Batch:
    """What the rules read besides the layout and the model: the batch and the node size."""

    seq_len: int
    global_batch: int
    ranks_per_node: int | None = None
    device: str | None = None  # "cuda" / "cpu" where training runs; None: not known (the planner)
    diloco: DiLoCoRules | None = None  # [diloco] when diloco.islands > 1 (the islands are a Layout field)


@dataclass(frozen=True)
class DiLoCoRules:
    """What the DiLoCo rules read of the [diloco] section besides ``Layout.islands``."""

    inner_steps: int = 50
    fragments: int = 1
    delay: int = 0
    sync_dtype: str = "fp32"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    warmup_steps: int = 0


def resolve_degrees(layout: Layout, world_size: int) -> Layout:
    """The layout with one -1 degree inferred; refuses products that do not match the world size
    (under DiLoCo the degrees are one island's: world_size / islands ranks)."""
    islands = layout.islands
    if islands < 1 or world_size % islands:
        raise ConfigError(
            f"diloco.islands = {islands} must be >= 1 and divide the world size {world_size} (every island runs "
            f"the same inner layout); use a divisor of {world_size} or start a multiple of {max(islands, 1)} ranks"
        )
    world_size //= islands
    mesh = layout.degrees()
    for k, v in {**mesh, "ep": layout.ep}.items():
        if v == 0 or v < -1 or (k == "ep" and v < 1):
            raise ConfigError(f"parallel.{k} = {v} must be >= 1" + ("" if k == "ep" else " (or -1 to infer it)"))
    free = [k for k, v in mesh.items() if v == -1]
    if len(free) > 1:
        raise ConfigError(f"only one parallel degree may be -1, got {', '.join('parallel.' + k for k in free)}")
    known = _product(v for v in mesh.values() if v > 0)
    shown = " x ".join(f"{k}={v}" for k, v in mesh.items())
    if free:
        if world_size % known:
            raise ConfigError(
                f"parallel degrees {shown}: world size {world_size} is not divisible by the fixed degrees' "
                f"product {known}; use a world size that is a multiple of {known} or change the degrees"
            )
        mesh[free[0]] = world_size // known
    elif known != world_size:
        rest = known // mesh["dp_shard"]
        hint = (
            f"set parallel.dp_shard = {world_size // rest}"
            if world_size % rest == 0
            else ("make their product equal the world size")
        )
        raise ConfigError(
            f"parallel degrees {shown} multiply to {known}, not the world size {world_size}; "
            f"set parallel.dp_shard = -1 to infer it, or {hint}"
        )
    return layout.replace(**mesh)


def casts_once(d: Layout, precision: str, mixed_precision: str) -> bool:
    """Whether data parallelism runs on FSDP2 beyond ``uses_fsdp``: a world of one under CPU
    offload, and -- for bf16/fp8 with ``train.mixed_precision = "cast_once"`` -- a world of one
    (a one-rank mesh) and DDP's layouts (stage 0: replicated over dp), so that FSDP2's
    mixed-precision policy casts each weight to bf16 once per micro-batch instead of autocast
    at every use. (bf16 ZeRO-1 holds bf16 working weights of its own: parallel/zero1.py.)"""
    if d.uses_fsdp():
        return False
    if d.world_size == 1 and d.offload == "cpu" and d.zero_stage >= 2:
        return True
    once = precision in ("bf16", "fp8") and mixed_precision == "cast_once"
    return once and (d.world_size == 1 or (d.dp_cp > 1 and d.zero_stage == 0))


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


def rank_layout(degrees: dict[str, int]) -> list[dict[str, int]]:
    """Each global rank's coordinate on every mesh dimension (row-major, tp fastest; the
    island dimension first when ``degrees`` has one)."""
    names = [d for d in (ISLAND, *DIMS) if d in degrees]
    sizes = [degrees[d] for d in names]
    out = []
    for r in range(_product(sizes)):
        coord, rest = {}, r
        for d, s in reversed(list(zip(names, sizes, strict=True))):
            coord[d] = rest % s
            rest //= s
        out.append({"rank": r, **{d: coord[d] for d in names}})
    return out


def _product(values: Any) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _axes_available(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    return iter(())  # every axis is available; compositions not yet run are refused by each axis' rule


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


def _async_tp(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    """Async TP overlaps tp collectives through CUDA symmetric memory: no such path on another device."""
    if d.async_tp and t.device is not None and t.device != "cuda":
        yield Problem(
            "parallel.async_tp",
            f"parallel.async_tp = true needs a CUDA device (tp collectives overlapped through CUDA symmetric memory); "
            f"this run's device is {t.device!r}: set parallel.async_tp = false",
        )


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


def _divisible(value: int, tp: int, key: str, what: str, fix: str = "") -> Iterator[Problem]:
    if value % tp:
        smaller = max(x for x in range(1, tp) if tp % x == 0 and value % x == 0)
        yield Problem(
            key,
            f"{key} = {value} is not divisible by parallel.tp = {tp} (tensor parallelism splits the {what} "
            f"evenly over the tp ranks); {fix or f'use a parallel.tp that divides it (e.g. {smaller})'}",
        )


def tp_divides_heads(model: ModelShape, tp: int) -> bool:
    """Whole query and key/value heads per tp rank (shared with the planner's --tp check)."""
    return model.heads % tp == 0 and model.kv_heads % tp == 0


def _tensor_parallel(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    tp = d.tp
    if tp == 1:
        return
    yield from _divisible(model.heads, tp, "model.heads", "query heads")
    yield from _divisible(
        model.kv_heads, tp, "model.kv_heads", "key/value heads (grouped-query attention keeps whole kv heads)"
    )
    yield from _divisible(model.ffn_hidden, tp, "model.ffn_hidden", "feed-forward columns")
    padded = -(-model.vocab_size // tp) * tp
    yield from _divisible(
        model.vocab_size,
        tp,
        "model.vocab_size",
        "vocabulary (embedding rows and head columns)",
        f"pad the vocabulary: set --model.vocab_size={padded} (the extra rows are never produced by the "
        "tokenizer and cost nothing but memory)",
    )
    if d.sequence_parallel:
        yield from _divisible(
            t.seq_len,
            tp,
            "train.seq_len",
            "sequence under sequence parallelism",
            f"use a multiple of {tp} (e.g. {-(-t.seq_len // tp) * tp}) or set parallel.sequence_parallel = false",
        )
    if t.ranks_per_node is not None and tp > t.ranks_per_node:
        yield Problem(
            "parallel.tp",
            f"parallel.tp = {tp} is larger than the {t.ranks_per_node} ranks per node: tensor parallelism "
            "communicates on every layer and must stay on one node's fast links; use parallel.tp <= "
            f"{t.ranks_per_node} and scale out with data or pipeline parallelism",
        )
    if model.qk_norm:
        yield Problem(
            "model.qk_norm",
            f"model.qk_norm = true with parallel.tp = {tp}: the QK-norm weights are not yet sharded by the "
            "tensor-parallel plan; set parallel.tp = 1 or model.qk_norm = false",
            "unsupported",
        )


def _context_parallel(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    if d.cp == 1:
        return
    chunks = 2 * d.cp if d.cp_balance == "zigzag" else d.cp
    if t.seq_len % chunks:
        what = f"2 x parallel.cp = {chunks}" if d.cp_balance == "zigzag" else f"parallel.cp = {chunks}"
        why = "2 x cp load-balanced chunks (cp_balance = zigzag)" if d.cp_balance == "zigzag" else "cp slices"
        yield Problem(
            "train.seq_len",
            f"train.seq_len = {t.seq_len} must be a multiple of {what} (context parallelism splits each sequence "
            f"into {why}); use e.g. {-(-t.seq_len // chunks) * chunks}",
        )
    elif d.tp > 1 and d.sequence_parallel and t.seq_len % (d.cp * d.tp):
        yield Problem(
            "train.seq_len",
            f"train.seq_len = {t.seq_len} must be a multiple of parallel.cp x parallel.tp = {d.cp * d.tp} (sequence "
            f"parallelism splits each cp rank's seq_len / cp tokens over the tp ranks); use e.g. "
            f"{-(-t.seq_len // (d.cp * d.tp * 2)) * d.cp * d.tp * 2} or set parallel.sequence_parallel = false",
        )


def _pipeline(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    if d.pp == 1:
        if d.pp_layers:
            yield Problem(
                "parallel.pp_layers",
                f"parallel.pp_layers = {list(d.pp_layers)} is set but parallel.pp = 1; set parallel.pp or leave "
                "pp_layers empty",
            )
        return
    name = schedule_name(d.pp_schedule)
    if name not in SCHEDULES:
        hint = suggest(name, SCHEDULES)
        yield Problem(
            "parallel.pp_schedule",
            f"parallel.pp_schedule = {d.pp_schedule!r} is not a pipeline schedule"
            + (f"; {hint}" if hint.startswith("did you mean") else "")
            + f" (valid: {', '.join(SCHEDULES)})",
        )
        return
    if not schedule_available(name):
        have = [n for n in SCHEDULES if schedule_available(n)]
        yield Problem(
            "parallel.pp_schedule",
            f"parallel.pp_schedule = {name!r} needs torch.distributed.pipelining.{SCHEDULES[name][0]}, which the "
            f"installed PyTorch lacks; use one of {', '.join(have)} or upgrade PyTorch",
            "unsupported",
        )
        return
    yield from _pipeline_chunks(d, model, t, name)
    yield from _pipeline_microbatches(d, t, name)


def _pipeline_chunks(d: Layout, model: ModelShape, t: Batch, name: str) -> Iterator[Problem]:
    v, rule = d.pp_virtual_stages, SCHEDULES[name][1]
    if not {"1": v == 1, ">=1": v >= 1, ">=2": v >= 2, "2": v == 2}[rule]:
        want = {"1": "1", ">=2": "2 or more", "2": "exactly 2"}[rule]
        yield Problem(
            "parallel.pp_virtual_stages",
            f"parallel.pp_virtual_stages = {v} does not suit parallel.pp_schedule = {name!r}, which runs {want} "
            f"model chunk(s) per rank; set parallel.pp_virtual_stages = {2 if rule != '1' else 1}"
            + (" or pick interleaved_1f1b / zero_bubble for more chunks per rank" if rule == "1" and v > 1 else ""),
        )
        return
    chunks = d.pp * v
    if model.layers < chunks:
        yield Problem(
            "parallel.pp",
            f"model.layers = {model.layers} is fewer than parallel.pp x parallel.pp_virtual_stages = {d.pp} x {v} = "
            f"{chunks} pipeline chunks (each needs at least one block); lower parallel.pp or pp_virtual_stages",
        )
        return
    sizes = d.pp_layers
    if sizes and (len(sizes) != chunks or sum(sizes) != model.layers or min(sizes) < 1):
        even = [model.layers // chunks + (1 if i < model.layers % chunks else 0) for i in range(chunks)]
        yield Problem(
            "parallel.pp_layers",
            f"parallel.pp_layers = {list(sizes)} must list {chunks} chunk sizes (pp x pp_virtual_stages), each "
            f">= 1, summing to model.layers = {model.layers}; e.g. {even}",
        )
    if model.tie_embeddings:
        yield Problem(
            "model.tie_embeddings",
            "model.tie_embeddings = true with parallel.pp > 1: the embedding (first stage) and the head (last "
            "stage) would share one weight across ranks; set model.tie_embeddings = false or parallel.pp = 1",
            "unsupported",
        )


def _pipeline_microbatches(d: Layout, t: Batch, name: str) -> Iterator[Problem]:
    if t.global_batch % d.data_ranks:
        return  # _batch says so
    local, m = d.local_batch(t.global_batch), d.microbatches(t.global_batch)
    if local % m:
        yield Problem(
            "parallel.num_microbatches",
            f"parallel.num_microbatches = {m} does not divide the per-rank batch global_batch_size / dp = "
            f"{local}; use a divisor of {local}",
        )
        return
    if d.micro_batch_size and d.num_microbatches and d.micro_batch_size * d.num_microbatches != local:
        yield Problem(
            "train.micro_batch_size",
            f"train.micro_batch_size = {d.micro_batch_size} x parallel.num_microbatches = {d.num_microbatches} is "
            f"not the per-rank batch {local}; set only one of them",
        )
    need = d.pp * 2 if name == "dualpipev" else d.pp
    if m < need:
        yield Problem(
            "parallel.num_microbatches",
            f"{m} micro-batches per step (parallel.num_microbatches, or the per-rank batch {local} / "
            f"train.micro_batch_size) cannot fill a {name} pipeline of {need} stages: it needs at least {need}; "
            "raise train.global_batch_size or parallel.num_microbatches, or lower train.micro_batch_size",
        )
        return
    if SCHEDULES[name][1] != "1":
        rounds = max(1, m // d.pp)
        if m % rounds:
            good = [k for k in range(m, m + 4 * d.pp) if k % max(1, k // d.pp) == 0 and local % k == 0]
            yield Problem(
                "parallel.num_microbatches",
                f"parallel.num_microbatches = {m}: {name} runs micro-batches in rounds of parallel.pp = {d.pp}, so "
                f"their number must be a multiple of {rounds}; use e.g. "
                + (str(good[0]) if good else f"a multiple of {d.pp}"),
            )


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
    over the cp ranks (parallel/moe_context_parallel.py), but capacity drops the lowest
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


def diloco_problems(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    """DiLoCo (islands > 1): a round of H inner steps, F fragments synced H / F steps apart,
    each applied ``delay`` steps after its send (so at most one sync per fragment is in flight)."""
    c = t.diloco
    if c is None or d.islands == 1:
        return
    h, f, tau = c.inner_steps, c.fragments, c.delay
    checks = (
        (h >= 1, "diloco.inner_steps", f"diloco.inner_steps = {h} must be >= 1 (e.g. 50)"),
        (c.outer_lr > 0, "diloco.outer_lr", f"diloco.outer_lr = {c.outer_lr} must be > 0 (the paper: 0.7)"),
        (
            0 <= c.outer_momentum < 1,
            "diloco.outer_momentum",
            f"diloco.outer_momentum = {c.outer_momentum} must be in [0, 1) (the paper: 0.9)",
        ),
        (
            c.sync_dtype in SYNC_DTYPES,
            "diloco.sync_dtype",
            f"diloco.sync_dtype = {c.sync_dtype!r} is not one of {', '.join(SYNC_DTYPES)}",
        ),
        (
            1 <= f <= model.layers,
            "diloco.fragments",
            f"diloco.fragments = {f} must be between 1 and model.layers = {model.layers} (a fragment is a "
            "contiguous group of blocks); lower diloco.fragments",
        ),
        (
            c.warmup_steps >= 0,
            "diloco.warmup_steps",
            f"diloco.warmup_steps = {c.warmup_steps} must be >= 0 (0: the first round starts at step 1)",
        ),
    )
    for ok, key, message in checks:
        if not ok:
            yield Problem(key, message)
    if h < 1 or not 1 <= f <= model.layers:
        return
    if h % f:
        yield Problem(
            "diloco.inner_steps",
            f"diloco.inner_steps = {h} must be a multiple of diloco.fragments = {f} (fragments sync every "
            f"inner_steps / fragments steps); use e.g. diloco.inner_steps = {-(-h // f) * f}",
        )
    elif not 0 <= tau < h // f:
        yield Problem(
            "diloco.delay",
            f"diloco.delay = {tau} must be in [0, inner_steps / fragments = {h // f}) (a fragment's sync must land "
            f"before the next one is sent); lower diloco.delay to at most {h // f - 1} or raise diloco.inner_steps",
        )
