"""Packed documents: where each sequence of a batch splits into documents.

Pretraining packs many documents into one sequence. ``Documents`` says where they are, in
two forms: each row's document lengths on the host (``lengths``: what decides, without a
device sync, which attention blocks can be skipped) and, on the device, each token's
document index in its row (``ids``) and its position within its document (``positions``,
for RoPE positions that restart at each document). The model passes it, untouched, to the
attention core, whose causal attention then stays inside each document (block-causal).

It is built once per micro-batch (``from_lengths``: the lengths are checked against the
batch by name) and shared by every layer; what a core derives from it (tile plans, masks,
a FlexAttention block mask) is built on first use and cached on it, so recomputation under
activation checkpointing reuses it. The lengths may come from end-of-text separators
(``data/eos_boundaries.py``) or from a prepared corpus's document offsets alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from meshforge.errors import DataError


class Documents:
    """The documents of a batch of packed sequences of ``seq_len`` tokens (see the module doc)."""

    def __init__(self, lengths: tuple[tuple[int, ...], ...], ids: torch.Tensor, positions: torch.Tensor):
        self.lengths = lengths
        self.seq_len = int(ids.shape[1])
        self.ids = ids  # (rows, seq_len) int32: the document index of each token within its row
        self.positions = positions  # (rows, seq_len) int64: each token's position within its document
        self.single = all(len(r) == 1 for r in lengths)  # every row one document: plain causal attention
        self.block_mask: Any = None  # CUDA: FlexAttention's block mask, built by ``prepare``
        self._cache: dict[Any, Any] = {}

    @classmethod
    def from_lengths(
        cls, lengths: Sequence[Sequence[int]], seq_len: int, device: torch.device | str | None = None
    ) -> Documents:
        """From each row's document lengths (positive, summing to ``seq_len``); refuses a list
        that does not describe the batch, naming the row."""
        rows = tuple(tuple(int(n) for n in r) for r in lengths)
        for i, r in enumerate(rows):
            if not r or min(r) <= 0 or sum(r) != seq_len:
                raise DataError(
                    f"document boundaries of row {i} ({len(r)} lengths summing to {sum(r)}, smallest "
                    f"{min(r, default=0)}) do not describe a sequence of train.seq_len = {seq_len} tokens: "
                    "each row needs positive document lengths that add up to the sequence length"
                )
        ids = np.zeros((len(rows), seq_len), dtype=np.int32)
        pos = np.empty((len(rows), seq_len), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i] = np.repeat(np.arange(len(r), dtype=np.int32), r)
            starts = np.repeat(np.cumsum((0, *r[:-1])), r)
            pos[i] = np.arange(seq_len) - starts
        to = {"device": device, "non_blocking": True}
        return cls(rows, torch.from_numpy(ids).to(**to), torch.from_numpy(pos).to(**to))

    def check_rows(self, rows: int) -> None:
        """Refuse documents given for another number of sequences than the batch has."""
        if rows != len(self.lengths):
            raise DataError(
                f"document boundaries are given for {len(self.lengths)} sequences, but the batch holds {rows}; "
                "pass one list of document lengths per sequence of the batch"
            )

    def rows(self, start: int, stop: int) -> Documents:
        """Rows [start, stop): a micro-batch's documents (cached, so every pipeline stage shares one)."""
        if (start, stop) == (0, len(self.lengths)):
            return self
        return self.cached(("rows", start, stop), lambda: self._rows(start, stop))

    def _rows(self, start: int, stop: int) -> Documents:
        return Documents(self.lengths[start:stop], self.ids[start:stop], self.positions[start:stop])

    def starts(self, row: int) -> np.ndarray:
        """Where each document of ``row`` starts (token offsets, the first 0)."""
        return np.cumsum((0, *self.lengths[row][:-1]))

    def span(self) -> float:
        """The mean over rows of sum(L²) / seq_len: the keys a token attends to, as a full-square
        count (``seq_len`` for one document per row). Attention FLOPs under the mask scale with it."""
        return float(np.mean([sum(n * n for n in r) for r in self.lengths])) / self.seq_len

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """What an attention core derived from these documents, built on first use."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]
