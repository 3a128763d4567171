"""Packed documents in the step: each batch's document boundaries (``data.document_mask``,
``data.reset_positions``), read from its end-of-text separators on the host before the
batch moves to the device, and what each micro-batch's forward takes from them.

With every sequence one document (no separator inside), the forward takes exactly what it
takes without masking (plain causal attention, positions 0..seq-1): bit for bit the same.
"""

from __future__ import annotations

from typing import Any

import torch

from meshforge.data.dataset import TokenDataset
from meshforge.data.documents import document_lengths, single_document_fraction
from meshforge.errors import DataError
from meshforge.models.documents import Documents
from meshforge.run_plan import RunPlan

WARN_FRACTION = 1.0  # warn when this share of the sampled sequences (all of them) holds a single document


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


def check_separator(plan: RunPlan, data: TokenDataset) -> None:
    """Packed documents need the corpus's end-of-text token: refuse an index.json without one."""
    if (plan.data.document_mask or plan.data.reset_positions) and type(data.eos_id) is not int:
        raise DataError(
            f"data.document_mask / data.reset_positions need the corpus's end-of-text token, but {data.root} "
            "/ index.json has no integer 'eos_id'; re-run `meshforge data prepare`, or set both to false"
        )


def separator_warning(plan: RunPlan, data: TokenDataset) -> str | None:
    """With data.document_mask on, a corpus whose sampled training sequences all hold a single
    document (no end-of-text separator inside) gets one warning: the mask changes nothing there."""
    if not plan.data.document_mask or data.eos_id is None:
        return None
    fraction, read = single_document_fraction(data.train, int(data.eos_id))
    if read == 0 or fraction < WARN_FRACTION:
        return None
    return (
        f"data.document_mask = true, but {fraction:.0%} of {read} training sequences sampled hold a single document "
        f"(no end-of-text token, id {data.eos_id}, inside): the corpus does not separate its documents, so "
        "attention is plain causal; prepare it with one document per file or JSONL line, or set "
        "data.document_mask = false to silence this"
    )
