"""Tokenizing batches of pieces on worker threads, results in input order.

The ``tokenizers`` library releases the GIL while it encodes, so threads give real
parallelism with one copy of the tokenizer (worker processes would each hold one, and
pickle text and tokens across). Each thread encodes single-threaded
(``TOKENIZERS_PARALLELISM=false`` for the duration): the workers are the parallelism,
and the library never starts its own thread pool (which would warn after a fork).
At most ``2 * workers`` batches are in flight, which bounds memory; results come back in
the order the batches went in, so the output does not depend on the number of workers.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from meshforge.data.text_pieces import Piece
from meshforge.data.tokenizer import Tokenizer


def default_workers() -> int:
    """The cores this process may use, at most 16 (memory grows about 30 MB per worker)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores))


def encode_pieces(tokenizer: Tokenizer, batch: list[Piece], eos: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The batch's tokens (EOS after each document's last piece) and the positions in them
    where documents start."""
    texts = [p.text for p in batch]
    try:
        ids = tokenizer.encode_batch(texts)
    except (UnicodeEncodeError, TypeError):  # a lone surrogate (from a JSON "\\ud800" escape) is not text
        ids = tokenizer.encode_batch([t.encode("utf-8", "replace").decode("utf-8") for t in texts])
    lengths = np.fromiter((len(a) + p.last for a, p in zip(ids, batch, strict=True)), np.int64, len(batch))
    begins = np.cumsum(lengths) - lengths
    out = np.empty(int(lengths.sum()), dtype)
    for a, p, b in zip(ids, batch, begins.tolist(), strict=True):
        out[b : b + len(a)] = a
        if p.last:
            out[b + len(a)] = eos
    return out, begins[np.fromiter((p.first for p in batch), bool, len(batch))]


@contextlib.contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def encoded(
    tokenizer: Tokenizer, batches: Iterable[list[Piece]], workers: int, eos: int, dtype: np.dtype
) -> Iterator[tuple[list[Piece], np.ndarray, np.ndarray]]:
    """``(batch, tokens, doc starts)`` for every batch, in order, tokenized by ``workers`` threads."""
    pending: deque[tuple[list[Piece], Future]] = deque()
    with _single_threaded_tokenizers(), ThreadPoolExecutor(workers, thread_name_prefix="meshforge-tokenize") as pool:
        try:
            for batch in batches:
                pending.append((batch, pool.submit(encode_pieces, tokenizer, batch, eos, dtype)))
                if len(pending) >= 2 * workers:
                    done, future = pending.popleft()
                    yield done, *future.result()
            while pending:
                done, future = pending.popleft()
                yield done, *future.result()
        finally:
            for _, future in pending:
                future.cancel()
