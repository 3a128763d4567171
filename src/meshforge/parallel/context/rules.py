"""Context parallelism: the sequence split over the cp ranks (zigzag or contiguous) and what it composes with."""

from __future__ import annotations

from collections.abc import Iterator

from meshforge.config.layout import Layout
from meshforge.models.shape import ModelShape
from meshforge.parallel.rule_types import Batch, Problem


def _context_parallel(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    if d.cp == 1:
        return
    chunks = 2 * d.cp if d.cp_balance == "zigzag" else d.cp
    if t.seq_len % chunks:
        what = f"2 x parallel.cp = {chunks}" if d.cp_balance == "zigzag" else f"parallel.cp = {chunks}"
        why = "2 x cp load-balanced chunks (cp_balance = zigzag)" if d.cp_balance == "zigzag" else "cp slices"
        yield Problem(
            "train.seq_len",
            f"train.seq_len = {t.seq_len} must be a multiple of {what} (context parallelism splits each sequence "
            f"into {why}); use e.g. {-(-t.seq_len // chunks) * chunks}",
        )
    elif d.tp > 1 and d.sequence_parallel and t.seq_len % (d.cp * d.tp):
        yield Problem(
            "train.seq_len",
            f"train.seq_len = {t.seq_len} must be a multiple of parallel.cp x parallel.tp = {d.cp * d.tp} (sequence "
            f"parallelism splits each cp rank's seq_len / cp tokens over the tp ranks); use e.g. "
            f"{-(-t.seq_len // (d.cp * d.tp * 2)) * d.cp * d.tp * 2} or set parallel.sequence_parallel = false",
        )
