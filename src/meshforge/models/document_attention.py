"""Block-causal attention over packed documents: a token attends to the tokens before it in
its own document only (``models/documents.py`` says where the documents are).

Three ways to run it, all exact, chosen by where it runs:

- **CUDA: FlexAttention** (``torch.nn.attention.flex_attention``, compiled once per process),
  with a block mask built once per micro-batch (``Documents.prepare``): 128 x 128 tiles of
  the score square that lie between documents are skipped, partial ones masked.
- **CPU, eager: query tiles.** Rows that hold one document run together on SDPA's causal
  kernel. Every other row is cut into query tiles of ``TILE`` tokens; a tile attends to the
  key tiles from the one where the document of its first query starts up to itself, through
  SDPA with a boolean mask of that rectangle. Whole documents before it are never touched, so
  the work falls with the document length; a tile inside one document that starts there runs
  the causal kernel unmasked. The plan and its masks are built once per micro-batch and
  shared by the layers.
- **CPU, compiled** (``torch.compiler.is_compiling()``): SDPA with the dense boolean mask,
  built from the document ids inside the graph (no host data, so no recompilation per batch).

``dense_mask`` is the reference the others are tested against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from meshforge.models.documents import Documents

TILE = 128  # query tokens per tile of the CPU path (bench/bench_packed.py measured 128 against 64 and 256)


def dense_mask(ids_q: torch.Tensor, ids_k: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """(rows, 1, sq, sk) bool: query i sees key j when both are in one document and j <= i + offset
    (``offset``: where the queries start relative to the keys)."""
    sq, sk = ids_q.shape[1], ids_k.shape[1]
    qpos = torch.arange(sq, device=ids_q.device).unsqueeze(1) + offset
    causal = qpos >= torch.arange(sk, device=ids_q.device).unsqueeze(0)
    return ((ids_q.unsqueeze(2) == ids_k.unsqueeze(1)) & causal).unsqueeze(1)


def is_grouped(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether q has more heads than k (grouped-query attention), as a plain bool. Written as a
    branch because a compiled step that met another head count earlier in the process sees the
    head dims as symbols: ``!=`` alone yields a SymBool, which SDPA's ``enable_gqa`` refuses
    (a TypeError at trace time); the branch makes dynamo guard on it and hand back a constant."""
    if q.shape[1] != k.shape[1]:
        return True
    return False


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents) -> torch.Tensor:
    """Block-causal attention of q (b, h, s, d) over k, v (b, h_kv, s, d) (see the module doc)."""
    documents.check_rows(q.shape[0])
    gqa = is_grouped(q, k)
    if documents.block_mask is not None:
        if torch.compiler.is_compiling():  # (a compiled block: flex_attention traces as it is)
            from torch.nn.attention.flex_attention import flex_attention

            return flex_attention(q, k, v, block_mask=documents.block_mask, enable_gqa=gqa)
        return _flex(q.is_cuda)(q, k, v, block_mask=documents.block_mask, enable_gqa=gqa)
    if torch.compiler.is_compiling():
        mask = dense_mask(documents.ids, documents.ids)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return _tiled(q, k, v, documents.cached(("tiles", TILE), lambda: _tile_plan(documents)), gqa)


def _tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TilePlan, gqa: bool) -> torch.Tensor:
    """The CPU path: rows of one document together, causal; every other row tile by tile. Rows
    and tiles are cut with unbind / split and keys joined with cat, whose backward is one
    stack / cat (a slice's would write a zero tensor of the whole row per tile)."""
    qr, kr, vr = q.unbind(0), k.unbind(0), v.unbind(0)
    out: list[Any] = [None] * q.shape[0]
    if plan.singles:
        together = (torch.stack([t[r] for r in plan.singles]) for t in (qr, kr, vr))
        done = F.scaled_dot_product_attention(*together, is_causal=True, enable_gqa=gqa)
        for r, o in zip(plan.singles, done.unbind(0), strict=True):
            out[r] = o
    for r, tiles in plan.tiles.items():
        qp, kp, vp = (t[r].split(TILE, dim=1) for t in (qr, kr, vr))
        parts = []
        for i, (first, mask) in enumerate(tiles):
            kt, vt = (torch.cat(p[first : i + 1], dim=1) if i > first else p[i] for p in (kp, vp))
            at = (qp[i].unsqueeze(0), kt.unsqueeze(0), vt.unsqueeze(0))
            if mask is None:
                parts.append(F.scaled_dot_product_attention(*at, is_causal=True, enable_gqa=gqa))
            else:
                parts.append(F.scaled_dot_product_attention(*at, attn_mask=mask, enable_gqa=gqa))
        out[r] = torch.cat(parts, dim=2).squeeze(0)
    return torch.stack(out)


@dataclass
class TilePlan:
    """The CPU path's plan for a micro-batch: the rows that are one document, and every other
    row's tiles as (first key tile, mask or None: plain causal)."""

    singles: list[int]
    tiles: dict[int, list[tuple[int, torch.Tensor | None]]]


def _tile_plan(documents: Documents) -> TilePlan:
    """Query tile i of a row attends to key tiles from the one holding the start of the document
    its first query is in, up to itself; plain causal (no mask) when one document starts at the
    tile and covers it."""
    s, ids = documents.seq_len, documents.ids
    plan = TilePlan([], {})
    for r, lengths in enumerate(documents.lengths):
        if len(lengths) == 1:
            plan.singles.append(r)
            continue
        starts = documents.starts(r)
        tiles = []
        for t0 in range(0, s, TILE):
            t1 = min(t0 + TILE, s)
            first = int(starts[np.searchsorted(starts, t0, side="right") - 1]) // TILE
            if first * TILE == t0 and not np.any((starts > t0) & (starts < t1)):
                tiles.append((first, None))
            else:
                k0 = first * TILE
                tiles.append((first, dense_mask(ids[r : r + 1, t0:t1], ids[r : r + 1, k0:t1], t0 - k0)))
        plan.tiles[r] = tiles
    return plan


def attended_fraction(documents: Documents) -> float:
    """The share of the causal score square the CPU path computes (what it skips is the rest)."""
    s = documents.seq_len
    plan = documents.cached(("tiles", TILE), lambda: _tile_plan(documents))
    causal = sum(min(t0 + TILE, s) * (min(t0 + TILE, s) - t0) for t0 in range(0, s, TILE))
    done = causal * len(plan.singles)
    for tiles in plan.tiles.values():
        done += sum(
            (min(t0 + TILE, s) - f * TILE) * (min(t0 + TILE, s) - t0)
            for t0, (f, _) in zip(range(0, s, TILE), tiles, strict=True)
        )
    return done / (causal * len(documents.lengths))


@functools.cache
def _flex(compiled: bool) -> Any:
    """FlexAttention, compiled once on CUDA (uncompiled it materialises the whole score square;
    on a CPU, where it has no backward, the tests run it uncompiled, forward only)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def flex_block_mask(ids: torch.Tensor) -> Any:
    """FlexAttention's block mask of block-causal attention over ``ids`` (rows, seq)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (ids[b, q] == ids[b, kv]) & (q >= kv)

    rows, s = ids.shape
    # compiled on CUDA: the eager build materialises the whole (rows, s, s) mask first
    return create_block_mask(same_document_causal, rows, None, s, s, device=ids.device, _compile=ids.is_cuda)


def prepare_block_mask(documents: Documents, device: torch.device, flex: bool | None = None) -> None:
    """Before the blocks run (outside any compiled region): on CUDA (or when ``flex``), the
    FlexAttention block mask every layer's attention uses."""
    if documents.single or documents.block_mask is not None:
        return
    if device.type == "cuda" if flex is None else flex:
        documents.block_mask = flex_block_mask(documents.ids.to(device))
