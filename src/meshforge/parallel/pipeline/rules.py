"""Pipeline parallelism: the schedule, the chunks per rank, the layers per chunk and the micro-batches."""

from __future__ import annotations

from collections.abc import Iterator

from meshforge.config.layout import Layout
from meshforge.errors import suggest
from meshforge.models.shape import ModelShape
from meshforge.parallel.pipeline.schedules import SCHEDULES, schedule_available, schedule_name
from meshforge.parallel.rule_types import Batch, Problem


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
    if model.layers < chunks and not d.pp_layers:
        yield Problem(
            "parallel.pp",
            f"model.layers = {model.layers} is fewer than parallel.pp x parallel.pp_virtual_stages = {d.pp} x {v} = "
            f"{chunks} pipeline chunks (each needs at least one block); lower parallel.pp or pp_virtual_stages",
        )
        return
    sizes = d.pp_layers
    if sizes and (len(sizes) != chunks or sum(sizes) != model.layers or not sizes_ok(sizes)):
        even = [model.layers // chunks + (1 if i < model.layers % chunks else 0) for i in range(chunks)]
        yield Problem(
            "parallel.pp_layers",
            f"parallel.pp_layers = {list(sizes)} must list {chunks} chunk sizes (pp x pp_virtual_stages), each "
            f">= 1 (the first and the last may be 0: a chunk of only the embedding or only the head), summing to "
            f"model.layers = {model.layers}; e.g. {even}",
        )
    if model.tie_embeddings:
        yield Problem(
            "model.tie_embeddings",
            "model.tie_embeddings = true with parallel.pp > 1: the embedding (first stage) and the head (last "
            "stage) would share one weight across ranks; set model.tie_embeddings = false or parallel.pp = 1",
            "unsupported",
        )


def sizes_ok(sizes: tuple[int, ...]) -> bool:
    """Every chunk holds a block, except that the first may hold only the embedding and the last
    only the head (Llama 3's balancing of the stages that carry them)."""
    return min(sizes) >= 0 and min(sizes[1:-1], default=1) >= 1 and sum(sizes) > 0


def _pipeline_microbatches(d: Layout, t: Batch, name: str) -> Iterator[Problem]:
    if t.global_batch % d.data_ranks:
        return  # _batch says so
    split = d.batch_split(t.global_batch)
    local, m = split.local, split.count
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
