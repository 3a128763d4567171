"""How async TP's rings (parallel/tensor/async_tp.py) cut the chunk each rank passes on. Pure
Python: the planner prices the same pieces (planner/time_terms.py) without importing torch."""

from __future__ import annotations

PIECES = 4  # each rank's chunk travels in up to this many pieces, so the GEMMs start on the first


def pieces_of(length: int) -> int:
    """Pieces per chunk of ``length`` positions: the most, up to PIECES, that divide it."""
    return max(k for k in range(1, PIECES + 1) if length % k == 0)
