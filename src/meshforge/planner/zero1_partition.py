"""How unevenly ZeRO-1 splits the optimizer state: meshforge's ZeRO-1 is torch's
ZeroRedundancyOptimizer, which assigns whole parameters (per parameter group, largest
first) to the rank holding the fewest elements so far. With few, large tensors (a small
model, or many ranks) the most loaded rank holds noticeably more than 1/N of the state —
on the debug preset over 2 ranks, 53.5%. The planner prices the most loaded rank."""

from __future__ import annotations

import heapq
from functools import lru_cache

from meshforge.planner.shape import Shape


def param_groups(shape: Shape, tp: int, pp: int) -> tuple[list[int], list[int]]:
    """Element counts of the parameter tensors on the first pipeline stage's GPU, in the
    optimizer's two groups (train/optimizer.py): matrices with weight decay, then the
    embedding and norms without. Matrices are split over tp; norms are replicated."""
    h, f, hd = shape.hidden, shape.ffn_hidden, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_dim
    mlp = [h * f] * (2 if shape.mlp == "gelu" else 3)
    block = [h * q, h * kv, h * kv, q * h, *mlp]
    layers = -(-shape.layers // pp)
    decay = [x // tp for x in block] * layers
    no_decay = [shape.vocab * h // tp] + [h] * (2 * layers)
    if pp == 1:
        no_decay.append(h)  # the final norm
        if not shape.tie_embeddings:
            decay.append(shape.vocab * h // tp)
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
    shape = Shape(*key)
    groups = param_groups(shape, tp, pp)
    total = sum(map(sum, groups))
    return greedy_largest(groups, n) / total if total else 1.0 / n


def largest_share(shape: Shape, tp: int, pp: int, n: int) -> float:
    """The fraction of this GPU's optimizer state the most loaded of ``n`` ZeRO-1 ranks holds
    (1/n for an even split)."""
    if n <= 1:
        return 1.0
    key = (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn_hidden, shape.vocab, shape.mlp)
    key += (shape.tie_embeddings, shape.max_positions, shape.name, shape.head_dim)
    return _share(key, tp, pp, n)
