"""Writing token shards as the tokens arrive: the train/val split by blocks, the document
offsets beside the tokens, and the journal an interrupted preparation resumes from.

The token stream (documents, EOS after each) is cut into blocks of ``block`` tokens and
every ``every``-th block goes to the validation split. Each split's tokens go to
``{split}_{n:05d}.bin`` (flat little-endian uint16/uint32) and the positions, inside that
shard, where a document starts go to ``{split}_{n:05d}.docs.bin`` (little-endian int64,
ascending). Files are appended to as tokens come, so memory does not grow with the corpus.

Shards close together, at a batch boundary, once one of them holds ``shard_tokens`` tokens;
the journal (``progress.json``, replaced atomically) then records the closed shards and
where in the input the next batch starts. A file the journal does not list is unfinished.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

import numpy as np

from meshforge.errors import MeshforgeError
from meshforge.safeio.parse import read_json

JOURNAL = "progress.json"
VAL_BLOCK = 16384
MIN_VAL_BLOCK = 1024
HEAD_TOKENS = 1 << 24  # a corpus this long gets VAL_BLOCK whatever its validation fraction


class SplitWriter:
    """One split's shards: closed ones (listed) and the one being appended to."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, shards: list[dict[str, Any]]):
        self.root, self.split, self.dtype = root, split, np.dtype(dtype).newbyteorder("<")
        self.shards = list(shards)
        self.files: tuple[IO[bytes], IO[bytes]] | None = None
        self.tokens = self.docs = 0

    def write(self, tokens: np.ndarray, starts: np.ndarray) -> None:
        """Append ``tokens``; ``starts`` are the positions in ``tokens`` where documents begin."""
        if not len(tokens):
            return
        if self.files is None:
            stem = self.root / f"{self.split}_{len(self.shards):05d}"
            self.files = (open(f"{stem}.bin", "xb"), open(f"{stem}.docs.bin", "xb"))  # noqa: SIM115
        self.files[0].write(np.ascontiguousarray(tokens, dtype=self.dtype).data)
        if len(starts):
            self.files[1].write(np.ascontiguousarray(starts + self.tokens, dtype="<i8").data)
        self.tokens += len(tokens)
        self.docs += len(starts)

    def close(self) -> None:
        """Finish the open shard: on disk (fsync) before the journal may list it."""
        if self.files is None:
            return
        for f in self.files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        name = Path(self.files[0].name).name
        self.shards.append(
            {"file": name, "tokens": self.tokens, "docs": name[: -len(".bin")] + ".docs.bin", "doc_starts": self.docs}
        )
        self.files, self.tokens, self.docs = None, 0, 0

    def abandon(self) -> None:
        if self.files is not None:
            for f in self.files:
                f.close()
            self.files = None


def val_block_size(tokens: int, every: int) -> int:
    """Validation block length for a corpus of ``tokens`` tokens: VAL_BLOCK, shrunk (down to
    MIN_VAL_BLOCK) for small corpora so that they still get about 8 validation blocks."""
    if not every or tokens >= HEAD_TOKENS:
        return VAL_BLOCK
    return int(min(VAL_BLOCK, max(MIN_VAL_BLOCK, tokens // (every * 8))))


class ShardSet:
    """Both splits, fed the token stream in order; ``position`` is how many tokens it has had.

    The block length depends on the corpus's token count only when that is small, so the
    first tokens are held (at most HEAD_TOKENS) until the stream is known to be long or ends:
    the split is then a function of the tokens alone, whatever format or compression they
    were read from.
    """

    def __init__(self, root: Path, dtype: np.dtype, every: int, shard_tokens: int, state: dict[str, Any] | None):
        state = state or {"position": 0, "block": None, "splits": {}}
        self.every, self.shard_tokens = every, shard_tokens
        self.block: int | None = state["block"]
        self.position = int(state["position"])
        self.held: list[tuple[np.ndarray, np.ndarray]] = []
        self.splits = {s: SplitWriter(root, s, dtype, state["splits"].get(s, [])) for s in ("train", "val")}
        self.top = state.get("max_token_id")  # the largest token id written (index.json records it)
        if self.top is None:  # (a journal from before it was kept: the listed shards say)
            listed = [root / sh["file"] for w in self.splits.values() for sh in w.shards]
            self.top = max((int(np.fromfile(f, dtype=dtype).max(initial=0)) for f in listed), default=0)

    def _split_of(self, block: int) -> SplitWriter:
        val = self.every and block % self.every == self.every - 1
        return self.splits["val" if val else "train"]

    def write(self, tokens: np.ndarray, starts: np.ndarray) -> None:
        """Append ``tokens``; ``starts`` (ascending) index documents' first tokens in them."""
        if len(tokens):
            self.top = max(self.top, int(tokens.max()))
        if self.block is not None:
            return self._route(tokens, starts)
        self.held.append((tokens, starts))
        self.position += len(tokens)
        if self.position >= min(HEAD_TOKENS, VAL_BLOCK * self.every * 8):
            self._decide(VAL_BLOCK)

    def _decide(self, block: int) -> None:
        held, self.held, self.block, self.position = self.held, [], block, 0
        for tokens, starts in held:
            self._route(tokens, starts)

    def _route(self, tokens: np.ndarray, starts: np.ndarray) -> None:
        assert self.block is not None
        i, n = 0, len(tokens)
        while i < n:
            block = (self.position + i) // self.block
            end = n if not self.every else min(n, (block + 1) * self.block - self.position)
            lo, hi = np.searchsorted(starts, (i, end))
            self._split_of(block).write(tokens[i:end], starts[lo:hi] - i)
            i = end
        self.position += n

    def full(self) -> bool:
        return any(w.tokens >= self.shard_tokens for w in self.splits.values())

    def close(self) -> None:
        """Close the open shards (at the end of the stream, deciding the block length first)."""
        if self.block is None:
            self._decide(val_block_size(self.position, self.every))
        for w in self.splits.values():
            w.close()

    def abandon(self) -> None:
        for w in self.splits.values():
            w.abandon()

    def state(self) -> dict[str, Any]:
        splits = {k: list(w.shards) for k, w in self.splits.items()}
        return {"position": self.position, "block": self.block, "splits": splits, "max_token_id": self.top}


def save_journal(root: Path, record: dict[str, Any]) -> None:
    """Replace the journal atomically (and durably), so a kill leaves the old one or the new one."""
    tmp = root / (JOURNAL + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / JOURNAL)


def load_journal(root: Path, fingerprint: str, itemsize: int) -> dict[str, Any] | None:
    """The journal of an interrupted preparation of the same inputs and settings, its listed
    shards checked on disk and everything unlisted removed; None (and an empty directory but
    for ``keep``) when there is nothing to resume."""
    try:
        record = read_json(root / JOURNAL, MeshforgeError)
        ok = record.get("fingerprint") == fingerprint and all(
            (root / s["file"]).stat().st_size == s["tokens"] * itemsize
            and (root / s["docs"]).stat().st_size == s["doc_starts"] * 8
            for shards in record["state"]["splits"].values()
            for s in shards
        )
    except (MeshforgeError, OSError, ValueError, KeyError, TypeError, AttributeError):
        record, ok = None, False
    splits = record["state"]["splits"].values() if ok else []
    listed = {s[k] for shards in splits for s in shards for k in ("file", "docs")}
    for f in root.iterdir():
        if f.name not in listed | {JOURNAL, ".lock"} and f.is_file():
            f.unlink()
    if not ok and (root / JOURNAL).exists():
        (root / JOURNAL).unlink()
    return record if ok else None
