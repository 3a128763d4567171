"""Attention under document masks, for ``meshforge plan --mean-doc-len N``: packed documents
of exponentially distributed length with mean N (``models/flops.document_span``).

- One device (and tp, pp): a block-sparse kernel (FlexAttention's 128 x 128 tiles on CUDA, the
  query tiles on a CPU) runs about the documents' own squares: the attention core's time
  scales by span / seq.
- Context parallelism: the ring skips whole blocks only (``planner/context_costs.py``:
  ``ring_block_work``); the slowest cp rank sets the pace, so the core's time scales by its
  expected work over the causal ring's (zigzag keeps the causal ring even; the skips are not).
- Model FLOPs (and so the predicted MFU) count attention as executed: over the span, as the
  run's records do (docs/metrics.md).
"""

from __future__ import annotations

from meshforge.config.layout import Layout
from meshforge.models.flops import document_span
from meshforge.planner.context_costs import ring_block_work


def attention_share(seq: int, lay: Layout, mean_doc_len: float) -> float:
    """The attention core's time under document masks as a share of plain causal attention's."""
    if mean_doc_len <= 0:
        return 1.0
    if lay.cp <= 1:
        return document_span(seq, mean_doc_len) / seq
    masked = ring_block_work(seq, lay.cp, lay.cp_balance, mean_doc_len)
    return max(masked) / max(ring_block_work(seq, lay.cp, lay.cp_balance))


def flops_span(seq: int, mean_doc_len: float) -> float:
    """The sequence length the FLOP counts take: the expected span under masks, else ``seq``."""
    return document_span(seq, mean_doc_len)
