"""How unevenly ZeRO-1 splits the optimizer state: meshforge's ZeRO-1 is torch's
ZeroRedundancyOptimizer, which assigns whole parameters (per parameter group, largest
first) to the rank holding the fewest elements so far. With few, large tensors (a small
model, or many ranks) the most loaded rank holds noticeably more than 1/N of the state —
on the debug preset over 2 ranks, 53.5%. The planner prices the most loaded rank."""

from __future__ import annotations

import heapq
from functools import lru_cache

from meshforge.models.moe import expert_ffn, is_moe_layer
from meshforge.models.shape import ModelShape


def param_groups(shape: ModelShape, tp: int, pp: int) -> tuple[list[int], list[int]]:
    """Element counts of the parameter tensors on the first pipeline stage's GPU, in the
    optimizer's two groups (train/optimizer.py): matrices with weight decay, then the
    embedding and norms (QK-norm's too) without. Matrices are split over tp; norms are replicated. An MoE
    block (models/moe.py) has the router, the stacked experts (three E x f_e x h tensors,
    whole: ZeRO-1 runs without ep) and the shared experts' SwiGLU instead of the MLP."""
    h, f, hd = shape.hidden, shape.ffn_hidden, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_dim
    attention = [h * q, h * kv, h * kv, q * h]
    mlp = [h * f] * (2 if shape.mlp == "gelu" else 3)
    fe = expert_ffn(shape)
    moe = [shape.num_experts * h] + [shape.num_experts * fe * h] * 3
    moe += [fe * shape.num_shared_experts * h // tp] * 3 if shape.num_shared_experts else []
    layers = -(-shape.layers // pp)
    decay: list[int] = []
    for i in range(layers):
        decay += [x // tp for x in attention] + (moe if is_moe_layer(shape, i) else [x // tp for x in mlp])
    no_decay = [shape.vocab_size * h // tp] + [h] * (2 * layers) + [hd] * (2 * layers if shape.qk_norm else 0)
    if pp == 1:
        no_decay.append(h)  # the final norm
        if not shape.tie_embeddings:
            decay.append(shape.vocab_size * h // tp)
    return decay, no_decay


def greedy_largest(groups: tuple[list[int], ...], n: int) -> int:
    """ZeroRedundancyOptimizer's partition: per group, largest tensor first, to the rank with
    the fewest elements so far (the lowest rank on a tie); the most loaded rank's elements."""
    heap = [(0, r) for r in range(n)]
    for group in groups:
        for size in sorted(group, reverse=True):
            load, rank = heapq.heappop(heap)
            heapq.heappush(heap, (load + size, rank))
    return max(load for load, _ in heap)


@lru_cache(maxsize=4096)
def _share(key: tuple, tp: int, pp: int, n: int) -> float:
    groups = param_groups(ModelShape(**dict(key)), tp, pp)
    total = sum(map(sum, groups))
    return greedy_largest(groups, n) / total if total else 1.0 / n


def largest_share(shape: ModelShape, tp: int, pp: int, n: int) -> float:
    """The fraction of this GPU's optimizer state the most loaded of ``n`` ZeRO-1 ranks holds
    (1/n for an even split)."""
    if n <= 1:
        return 1.0
    return _share(tuple(sorted(vars(shape).items())), tp, pp, n)  # every field: a new one cannot be missed
