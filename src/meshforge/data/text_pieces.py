"""Documents as pieces of bounded length, grouped into batches for the tokenizer.

A tokenizer's working memory grows with the text it is handed (about 100 bytes per
character for a byte-level BPE), so a long document is cut into pieces of at most
PIECE_CHARS characters. A cut goes after a newline that sits between two non-space
characters, else before a space between two non-space characters, else (a run of
PIECE_CHARS / 2 characters with neither) at the limit: the places where GPT-2 / Llama 3
style pre-tokenizers split anyway, so for them the pieces' tokens are the document's.

Where every cut falls is a function of the text alone, and so is every batch (pieces in
input order up to BATCH_BYTES): the shards do not depend on how many workers tokenize.
Each piece carries the cursor of the piece after it, so a preparation can resume there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from meshforge.data.columnar import ArrowReader, ParquetReader
from meshforge.data.sources import JsonlReader, Reader, Source, TextReader

PIECE_CHARS = 1 << 16
BATCH_BYTES = 1 << 17  # UTF-8 bytes of text per tokenizer call
BATCH_PIECES = 4096  # and at most this many pieces (many tiny documents)


@dataclass
class Piece:
    text: str
    first: bool  # the document starts here
    last: bool  # the document ends here (EOS follows)
    after: tuple[int, int, int]  # cursor (source, record, piece) of the next piece
    done: int  # bytes of the inputs on disk read so far


def open_reader(src: Source, field: str = "text") -> Reader:
    if src.kind in ("parquet", "arrow"):
        return (ParquetReader if src.kind == "parquet" else ArrowReader)(src, field)
    return (JsonlReader if src.kind == "jsonl" else TextReader)(src, field)


def cut_point(text: str, start: int, end: int) -> int:
    """Where to end the piece that starts at ``start`` and may reach ``end`` (< len(text))."""
    lo = start + (end - start) // 2
    for sep, after in (("\n", 1), (" ", 0)):
        i = text.rfind(sep, lo, end)
        while i > lo:
            if not text[i - 1].isspace() and not text[i + 1].isspace():
                return i + after
            i = text.rfind(sep, lo, i)
    return end


def cut(chunks: Iterable[str], limit: int = PIECE_CHARS) -> Iterator[str]:
    """A document (its text in chunks of any size) as pieces of at most ``limit`` characters;
    an empty document is one empty piece."""
    buf, any_piece = "", False
    for chunk in chunks:
        buf = buf + chunk if buf else chunk
        start = 0
        while len(buf) - start > limit:
            end = cut_point(buf, start, start + limit)
            yield buf[start:end]
            any_piece, start = True, end
        buf = buf[start:]
    if buf or not any_piece:
        yield buf


def _with_last(items: Iterator[str]) -> Iterator[tuple[str, bool]]:
    prev = next(items)
    for item in items:
        yield prev, False
        prev = item
    yield prev, True


def iter_pieces(sources: list[Source], field: str, cursor: tuple[int, int, int] = (0, 0, 0)) -> Iterator[Piece]:
    """Every piece of every document of ``sources``, from ``cursor`` (source, record, piece) on."""
    done_before = sum(s.size for s in sources[: cursor[0]])
    for si in range(cursor[0], len(sources)):
        reader = open_reader(sources[si], field)
        first_record = cursor[1] if si == cursor[0] else 0
        for ri, chunks in enumerate(reader.records(first_record), first_record):
            skip = cursor[2] if (si, ri) == cursor[:2] else 0
            for pi, (text, last) in enumerate(_with_last(cut(chunks))):
                if pi >= skip:
                    after = (si, ri + 1, 0) if last else (si, ri, pi + 1)
                    yield Piece(text, pi == 0, last, after, done_before + reader.consumed())
        done_before += sources[si].size


def _nbytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def batches(pieces: Iterable[Piece]) -> Iterator[list[Piece]]:
    """Pieces in order, grouped up to BATCH_BYTES of text or BATCH_PIECES pieces."""
    batch: list[Piece] = []
    size = 0
    for p in pieces:
        batch.append(p)
        size += _nbytes(p.text)
        if size >= BATCH_BYTES or len(batch) >= BATCH_PIECES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
