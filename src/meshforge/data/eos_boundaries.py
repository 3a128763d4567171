"""Document boundaries of packed training sequences, read from the end-of-text separators.

The prepared shards end every document with the tokenizer's end-of-text token
(``index.json``'s ``eos_id``). A training sequence's inputs are ``seq_len`` tokens of that
stream, so its documents are found where they are: a document ends after each end-of-text
token (the separator belongs to the document it closes, as its last input, whose target is
the next document's first token, as without masking). The first document of a sequence may
have started in the sequence before and the last one may go on in the next: a document
longer than a sequence spans several, as without masking.

The result is each row's document lengths, which is what ``models.documents.Documents``
takes; an index of document offsets could give the same lengths without reading tokens.
"""

from __future__ import annotations

import numpy as np

from meshforge.data.dataset import TokenSplit

SAMPLE_TOKENS = 1 << 22  # tokens read to judge whether a corpus separates its documents


def document_lengths(inputs: np.ndarray, eos_id: int) -> list[list[int]]:
    """Each row's document lengths (positive, summing to the row's length) for a (rows, seq)
    array of input tokens: a document ends after each ``eos_id``."""
    rows, seq = inputs.shape
    out = []
    for r in range(rows):
        ends = np.flatnonzero(inputs[r] == eos_id) + 1  # one past each separator
        cuts = np.concatenate(([0], ends[ends < seq], [seq]))
        out.append(np.diff(cuts).tolist())
    return out


def single_document_fraction(split: TokenSplit, eos_id: int) -> tuple[float, int]:
    """(the share of sequences that hold a single document, how many were read): sequences
    spread evenly over the split, about ``SAMPLE_TOKENS`` tokens in all (every one of a small split)."""
    n = len(split)
    take = min(n, max(1, SAMPLE_TOKENS // (split.seq_len + 1)))
    if take == 0:
        return 0.0, 0
    idx = np.arange(take, dtype=np.int64) * n // take
    inputs = split.get(idx)[:, :-1].numpy()
    single = int((~(inputs[:, :-1] == eos_id).any(axis=1)).sum())  # a separator as last input ends the row's document
    return single / take, take
