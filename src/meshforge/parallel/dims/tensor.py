"""Tensor (and sequence) parallelism and async TP."""

from __future__ import annotations

from collections.abc import Iterator

from meshforge.layout import Layout
from meshforge.models.shape import ModelShape

from .core import Batch, Problem


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


def _async_tp(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    """Async TP overlaps tp collectives through CUDA symmetric memory: no such path on another device."""
    if d.async_tp and t.device is not None and t.device != "cuda":
        yield Problem(
            "parallel.async_tp",
            f"parallel.async_tp = true needs a CUDA device (tp collectives overlapped through CUDA symmetric memory); "
            f"this run's device is {t.device!r}: set parallel.async_tp = false",
        )
