"""Cutting the model into pipeline chunks and giving them to the pp ranks.

The layer stack is cut into ``pp x pp_virtual_stages`` chunks; chunk 0 also holds the
embedding, the last chunk the final norm and head. Each chunk is the model itself with
the other layers deleted (``layers`` is a ModuleDict keyed by layer index), so parameter
names -- and so checkpoints -- are those of the whole model and a checkpoint saved under
one pp degree loads under any other.

Chunks go to ranks in a loop (chunk c on rank c mod pp: rank 0 holds chunks 0 and pp, ...)
for the interleaved schedules, and in a V (rank r holds chunks r and 2pp-1-r) for the
V-shaped ones (``zbv``, ``dualpipev``), which keeps the first and last chunk on rank 0.

Blocks are balanced by cost, not count: a block costs its matmul FLOPs, the head its
vocab x hidden matmul (several blocks' worth for a large vocabulary), and the embedding a
third of the head (a lookup forward, but a dense vocab x hidden gradient and optimizer
update). ``parallel.pp_layers`` overrides the split.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from meshforge.models import flops
from meshforge.models.llama import ModelShape, Transformer
from meshforge.parallel.pipeline.schedules import V_SHAPED


def _costs(args: ModelShape, seq_len: int) -> tuple[float, float, float]:
    """Relative forward+backward cost of a block, the embedding and the final norm + head."""
    head = flops.head_flops_per_token(args)
    return flops.block_flops_per_token(args, seq_len), head / 3.0, head


def balanced_split(args: ModelShape, seq_len: int, chunks: int) -> list[int]:
    """Blocks per chunk (contiguous, each >= 1) minimising the most loaded chunk's cost."""
    block, emb, head = _costs(args, seq_len)
    n = args.layers

    def cost(c: int, k: int) -> float:
        return k * block + (emb if c == 0 else 0.0) + (head if c == chunks - 1 else 0.0)

    # best[c][i]: the smallest maximum over chunks 0..c-1 holding blocks 0..i-1 (dynamic programme)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0.0
    for c in range(1, chunks + 1):
        for i in range(c, n - (chunks - c) + 1):
            for j in range(c - 1, i):
                v = max(best[c - 1][j], cost(c - 1, i - j))
                if v < best[c][i] - 1e-9:
                    best[c][i], cut[c][i] = v, j
    sizes, i = [], n
    for c in range(chunks, 0, -1):
        j = cut[c][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def chunk_ranks(pp: int, v: int, schedule: str) -> list[int]:
    """The pipeline rank of each chunk: a loop, or a V for the V-shaped schedules."""
    if schedule in V_SHAPED:
        return [c if c < pp else 2 * pp - 1 - c for c in range(2 * pp)]
    return [c % pp for c in range(pp * v)]


def split_model(model: Transformer, sizes: list[int], chunks: list[int]) -> list[Transformer]:
    """Copies of ``model`` (on the meta device) that keep only the given chunks' parts."""
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    last = len(sizes) - 1
    parts = []
    for c in chunks:
        part = copy.deepcopy(model)
        keep = {str(i) for i in range(starts[c], starts[c] + sizes[c])}
        for name in list(part.layers.keys()):
            if name not in keep:
                del part.layers[name]
        if c != 0:
            part.tok_embeddings = None
        if c != last:
            part.norm = None
            part.output = None
        parts.append(part)
    return parts


def give_positions(part: Transformer, current: Callable[[], dict | None], seq_len: int | None) -> None:
    """Give a stage the forward arguments of the micro-batch being run: ``current()`` returns
    what the step runner set (``Pipeline.stage_args``: its positions and packed documents);
    when it set nothing, stages after the first (whose inputs may be sequence shards under SP)
    get ``arange(seq_len)`` and the first (``seq_len`` None) its own default."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = args[0]
        device = x.to_local().device if hasattr(x, "to_local") else x.device
        given = current()
        if given is None:
            if seq_len is None:
                return args, kwargs
            given = {"positions": torch.arange(seq_len, device=device)}
        given = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in given.items() if v is not None}
        return args, {**kwargs, **given}

    part.register_forward_pre_hook(hook, with_kwargs=True)


def model_view(parts: list[Transformer]) -> nn.Module:
    """One module over this rank's chunks with the whole model's parameter names (a
    subset of them): what the optimizer, clipping, state dicts and checkpoints see."""
    view = nn.Module()
    view.shape = parts[0].shape
    view.layers = nn.ModuleDict()
    blocks = {k: b for part in parts for k, b in part.layers.items()}
    for k in sorted(blocks, key=int):
        view.layers[k] = blocks[k]
    for name in ("tok_embeddings", "norm", "output"):
        for part in parts:
            if getattr(part, name, None) is not None:
                setattr(view, name, getattr(part, name))
    return view
