"""Ring attention over packed documents: which (query chunk, key chunk) blocks of the ring are
computed, and how, when attention stays inside each document.

Documents only ever hide keys, so the causal ring's pairs are the candidates. Per batch row a
pair of chunks is, from the chunks' first and last tokens' document indices alone (host
numbers: no device sync):

- **skipped** when the key chunk's last document ends before the query chunk's first begins
  (no query sees any key of it);
- **full** when one document covers both chunks (every query sees every key: no mask);
- **causal** for a query chunk's own chunk (the causal triangle; masked too when a document
  starts inside it: the CPU kernel takes both and still skips the upper triangle);
- **masked** otherwise: a boolean mask (the key is in the query's document).

A block runs on the rows that are not skipped (a row subset when some are), on the fused
kernel with the mask where one is needed (``kernels.py``). The plan is built once per
micro-batch and rank (cached on the ``Documents``, shared by every layer and the
recomputation) and counts what it skips: ``computed`` and ``skipped`` (row, block) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from meshforge.models.document_attention import dense_mask
from meshforge.models.documents import Documents


@dataclass
class BlockWork:
    """One (query chunk, key chunk) block on this rank: its rows, and its mask (None: none needed)."""

    rows: torch.Tensor | None  # the batch rows that run it (None: all of them)
    causal: bool  # a diagonal block: the causal triangle (masked too when documents start inside)
    mask: torch.Tensor | None  # (rows, 1, chunk, chunk) bool: True where the query sees the key
    empty: torch.Tensor | None = None  # (rows, 1, chunk) bool: queries that see no key of the block
    _float: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as 0 / -inf in ``dtype`` (what the CPU flash kernel takes), built once."""
        if dtype not in self._float:
            assert self.mask is not None
            self._float[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill(
                ~self.mask, float("-inf")
            )
        return self._float[dtype]


@dataclass
class RingPlan:
    """Every block this rank's ring would compute: its work, or None where it is skipped."""

    blocks: dict[tuple[int, int, int], BlockWork | None]  # (source rank, local query chunk, key chunk)
    computed: int  # (row, block) pairs run
    skipped: int  # (row, block) pairs skipped
    work: float  # the blocks' work in block squares (a plain causal triangle 1/2), summed over rows


def _doc_at(ends: np.ndarray, t: int) -> int:
    """The document index of token ``t`` of a row whose documents end at ``ends`` (exclusive)."""
    return int(np.searchsorted(ends, t, side="right"))


def _row_kind(ends: np.ndarray, a: int, b: int, c: int) -> str:
    """How query chunk ``a`` sees key chunk ``b`` (a >= b, chunks of ``c`` tokens) in one row."""
    q_first, q_last = _doc_at(ends, a * c), _doc_at(ends, (a + 1) * c - 1)
    if a == b:
        return "causal" if q_first == q_last else "masked"
    if _doc_at(ends, (b + 1) * c - 1) < q_first:
        return "skip"
    return "full" if _doc_at(ends, b * c) == q_last else "masked"


def plan_ring(documents: Documents, chunk_ids: Any, rank: int, cp: int, n_chunks: int) -> RingPlan:
    """The plan of cp rank ``rank`` (``chunk_ids(r)``: the chunks rank r holds, out of ``n_chunks``)."""
    c = documents.seq_len // n_chunks
    ends = [np.cumsum(r) for r in documents.lengths]
    blocks: dict[tuple[int, int, int], BlockWork | None] = {}
    computed = skipped = 0
    work = 0.0
    for src in range(cp):
        for i, a in enumerate(chunk_ids(rank)):
            for j, b in enumerate(chunk_ids(src)):
                if a < b:
                    continue
                kinds = [_row_kind(e, a, b, c) for e in ends]
                live = [r for r, k in enumerate(kinds) if k != "skip"]
                computed, skipped = computed + len(live), skipped + len(kinds) - len(live)
                blocks[(src, i, j)] = _work(documents, live, {kinds[r] for r in live}, a, b, c) if live else None
                work += len(live) * (0.5 if blocks[(src, i, j)] and blocks[(src, i, j)].causal else 1.0)
    return RingPlan(blocks, computed, skipped, work)


def _work(documents: Documents, live: list[int], kinds: set[str], a: int, b: int, c: int) -> BlockWork:
    ids = documents.ids
    rows = None if len(live) == ids.shape[0] else torch.tensor(live, device=ids.device)
    if kinds == {"causal"}:
        return BlockWork(rows, True, None)
    if kinds == {"full"}:
        return BlockWork(rows, False, None)
    sel = ids if rows is None else ids[rows]
    mask = dense_mask(sel[:, a * c : (a + 1) * c], sel[:, b * c : (b + 1) * c], (a - b) * c)
    if a == b:  # causal and masked: the kernel skips the triangle above the diagonal (a query sees itself)
        return BlockWork(rows, True, mask)
    return BlockWork(rows, False, mask, ~mask.any(-1))
