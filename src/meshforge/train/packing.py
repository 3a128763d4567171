"""Packed documents in the step: each batch's document boundaries (``data.document_mask``,
``data.reset_positions``), read from its end-of-text separators on the host before the
batch moves to the device, and what each micro-batch's forward takes from them.

With every sequence one document (no separator inside), the forward takes exactly what it
takes without masking (plain causal attention, positions 0..seq-1): bit for bit the same.
"""

from __future__ import annotations

from typing import Any

import torch

from meshforge.config.run_plan import RunPlan
from meshforge.data.eos_boundaries import document_lengths
from meshforge.models.documents import Documents


class Packing:
    """Turns a step's batch into its ``Documents`` and a micro-batch's forward arguments."""

    def __init__(self, plan: RunPlan, eos_id: int | None, device: torch.device, cp_index: torch.Tensor | None):
        """``cp_index``: under cp, this rank's token index into each sequence (its inputs and positions)."""
        self.mask, self.reset = plan.data.document_mask, plan.data.reset_positions
        self.on = (self.mask or self.reset) and eos_id is not None  # (no corpus, e.g. calibration: off)
        self.eos_id, self.device, self.seq_len = eos_id, device, plan.train.seq_len
        self.cp_index = cp_index
        # the positions of a sequence's tokens without resetting: 0..seq-1, or this cp rank's share
        self.positions = torch.arange(self.seq_len, device=device) if cp_index is None else cp_index

    def documents(self, batch: torch.Tensor) -> Documents | None:
        """The documents of ``batch`` (host tokens, rows of seq_len + 1), on the device; None when off."""
        if not self.on:
            return None
        lengths = document_lengths(batch[:, :-1].numpy(), self.eos_id)
        return Documents.from_lengths(lengths, self.seq_len, self.device)

    def forward_args(self, documents: Documents | None, start: int, stop: int) -> dict[str, Any]:
        """``positions`` and ``documents`` for the forward of rows [start, stop) of the batch."""
        if documents is None:
            return {"positions": self.positions}
        d = documents.rows(start, stop)
        positions = self.positions
        if self.reset and not d.single:
            positions = d.positions if self.cp_index is None else d.positions[:, self.cp_index]
        return {"positions": positions, "documents": d if self.mask else None}
