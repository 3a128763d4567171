"""Tensor (and sequence) parallelism and async TP."""

from __future__ import annotations

from collections.abc import Iterator

from meshforge.config.layout import Layout
from meshforge.models.shape import ModelShape
from meshforge.parallel.rule_types import Batch, Problem


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
    """Async TP decomposes sequence parallelism's all-gather and reduce-scatter; its ring
    multiplies plain weights, so fp8 linears need inductor's fused path (compiled, CUDA)."""
    if not d.async_tp or d.tp <= 1:
        return
    if not d.sequence_parallel:
        yield Problem(
            "parallel.async_tp",
            "parallel.async_tp = true with parallel.sequence_parallel = false: async TP overlaps sequence "
            "parallelism's all-gather and reduce-scatter with the GEMMs beside them; set "
            "parallel.sequence_parallel = true or parallel.async_tp = false",
        )
    if t.precision == "fp8" and async_tp_mode(d, t.device, t.compile, False) != "micro_pipeline":
        yield Problem(
            "parallel.async_tp",
            "parallel.async_tp = true with train.precision = 'fp8' needs train.compile = true on CUDA (inductor's "
            "micro-pipeline TP fuses the fp8 matmuls; the decomposed ring multiplies plain weights); set "
            "parallel.async_tp = false or train.precision = 'bf16'",
            "unsupported",
        )


def async_tp_mode(d: Layout, device: str | None, compiled: bool | None, symm_mem: bool) -> str:
    """How a run overlaps its tp collectives (a RunPlan decision): ``off``; ``micro_pipeline``
    (CUDA, compiled: inductor fuses DTensor's collectives with the matmuls); ``symm_mem`` (CUDA,
    eager, where torch has the symmetric-memory fused ops); ``ring`` (any backend: the
    decomposed collective matmul of parallel/tensor/async_tp.py)."""
    if not d.async_tp or d.tp <= 1:
        return "off"
    if device == "cuda" and compiled:
        return "micro_pipeline"
    return "symm_mem" if device == "cuda" and symm_mem else "ring"
