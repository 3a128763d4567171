"""How async TP's rings (parallel/tensor/async_tp.py) cut the chunk each rank passes on. Pure
Python: the planner prices the same pieces (planner/time_terms.py) without importing torch."""

from __future__ import annotations

PIECES = 4  # each rank's chunk travels in up to this many pieces, so the GEMMs start on the first
# fewest tokens (GEMM rows) a piece keeps: below it a CPU GEMM loses more than the finer pipeline
# hides (measured on the 2-core CI machine, fp32, 1,024 x 2,048: 256 rows cost 1.06x the
# whole GEMM's time per row, 128 rows 1.45x, 64 rows 2.2x)
MIN_PIECE_TOKENS = 256


def pieces_of(length: int, rows: int = 1) -> int:
    """Pieces per chunk of ``length`` positions in each of ``rows`` sequences: the most, up to
    PIECES, that divide it and leave each piece MIN_PIECE_TOKENS tokens (at least one piece)."""
    fits = [k for k in range(1, PIECES + 1) if length % k == 0 and rows * length // k >= MIN_PIECE_TOKENS]
    return max(fits, default=1)
