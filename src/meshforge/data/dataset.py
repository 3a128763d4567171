"""Prepared token shards, read through memory maps as fixed-length training sequences, and
the document offsets beside them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshforge.data.manifest import read_manifest
from meshforge.data.prepare import FORMAT, FORMAT_VERSION
from meshforge.errors import DataError
from meshforge.safeio.files import regular_size
from meshforge.safeio.schema import FILE_NAME, Int, ListOf, Null, Obj, OneOf, Str

DTYPES = ("uint16", "uint32")  # what `data prepare` writes; any other dtype reinterprets the bytes
_ID = Int(0, 2**32 - 1)
_SHARD = Obj(
    {"file": Str(FILE_NAME), "tokens": Int(0), "docs": Str(FILE_NAME), "doc_starts": Int(0)},
    optional=frozenset({"docs", "doc_starts"}),
)
INDEX = Obj(  # index.json: what its readers trust, checked before a shard is opened
    {
        "dtype": Str(choices=DTYPES),
        "tokenizer": Str(most=4096),
        "vocab_size": Int(1, 2**32),
        "eos_id": OneOf((_ID, Null()), "a token id or null"),
        "max_token_id": _ID,  # the largest token id in the shards (recorded since 2026-12)
        "val_every": Int(0, 2**40),
        "val_block": Int(1, 2**40),
        "splits": Obj({"train": ListOf(_SHARD), "val": ListOf(_SHARD)}, optional=frozenset({"train", "val"})),
    },
    optional=frozenset({"eos_id", "max_token_id", "val_every", "val_block"}),
)
SCAN_TOKENS = 1 << 27  # a split of at most this many tokens is scanned for its largest id (~0.2 s a GiB, cached)
_FIX = "re-run `meshforge data prepare`"


def _mapped(root: Path, name: str, count: int, dtype: str | np.dtype) -> np.ndarray:
    """``root/name`` as a read-only memory map of ``count`` items, its size checked against the index."""
    f = root / name
    if not f.exists():
        raise DataError(f"shard {f} listed in {root / 'index.json'} is missing; re-run `meshforge data prepare`")
    expected = count * np.dtype(dtype).itemsize
    size = regular_size(f, DataError, _FIX)  # (a FIFO or device, even behind a link, is refused by name)
    if size != expected:
        raise DataError(
            f"shard {f} has {size} bytes but index.json says {expected}; "
            "it is truncated or was overwritten — re-run `meshforge data prepare`"
        )
    return np.memmap(f, dtype=dtype, mode="r") if count else np.empty(0, dtype)


class TokenSplit:
    """One split as sequences of ``seq_len + 1`` tokens (inputs plus shifted targets).

    Sequence i of a shard is tokens [i*seq_len, i*seq_len + seq_len + 1): neighbouring
    sequences share one token, so every token is a target exactly once. Positions in
    ``span``, ``doc_starts`` and ``seams`` count in the split's stream: its shards end to end.
    ``seam_every``: the split's stream skips the other split's tokens after every this many
    tokens (0: never; None: not recorded, format version 1).
    """

    def __init__(self, root: Path, shards: list[dict], dtype: str, seq_len: int, seam_every: int | None = 0):
        self.root, self.seq_len, self.seam_every = root, seq_len, seam_every
        self.vocab: int | None = None  # once set (data/corpus.py), a token id at or above it is refused
        self.maps = [_mapped(root, s["file"], s["tokens"], dtype) for s in shards]
        with_docs = all("docs" in s for s in shards)
        self.doc_maps = [_mapped(root, s["docs"], s["doc_starts"], "<i8") for s in shards] if with_docs else None
        counts = [max(0, (len(m) - 1) // seq_len) for m in self.maps]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum([len(m) for m in self.maps])]).astype(np.int64)
        self.tokens = int(self.offsets[-1])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _locate(self, i: int) -> tuple[int, int]:
        shard = int(np.searchsorted(self.starts, i, side="right") - 1)
        return shard, (int(i) - int(self.starts[shard])) * self.seq_len

    def get(self, indices: np.ndarray | list[int]) -> torch.Tensor:
        """(n, seq_len + 1) int64 tensor for global sequence indices."""
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(indices):
            shard, off = self._locate(i)
            out[row] = self.maps[shard][off : off + self.seq_len + 1]
        if self.vocab is not None and len(out) and int(out.max()) >= self.vocab:
            self._beyond(int(out.max()))
        return torch.from_numpy(out)

    def _beyond(self, token: int) -> None:
        """A token id the model has no row for: the shards changed after index.json was written."""
        raise DataError(
            f"{self.root} holds token id {token}, beyond the model's vocabulary ({self.vocab}): its shards "
            f"do not match index.json (edited or overwritten); {_FIX}"
        )

    def largest_token(self) -> int | None:
        """The largest token id in this split's shards (None: more than SCAN_TOKENS to read)."""
        if self.tokens > SCAN_TOKENS:
            return None
        return max((int(m.max()) for m in self.maps if len(m)), default=0)

    def span(self, i: int) -> tuple[int, int]:
        """The stream positions [a, b) that sequence ``i`` covers (b - a = seq_len + 1)."""
        shard, off = self._locate(i)
        a = int(self.offsets[shard]) + off
        return a, a + self.seq_len + 1

    def doc_starts(self, a: int, b: int) -> np.ndarray:
        """The positions p, a <= p < b, where a document's first token is (int64, ascending)."""
        if self.doc_maps is None:
            self._unrecorded()
        out = []
        first = max(0, int(np.searchsorted(self.offsets, a, side="right")) - 1)
        for shard in range(first, len(self.maps)):
            base = int(self.offsets[shard])
            if base >= b:
                break
            m = self.doc_maps[shard]
            lo, hi = np.searchsorted(m, (a - base, b - base))
            out.append(np.asarray(m[lo:hi], dtype=np.int64) + base)
        return np.concatenate(out) if out else np.empty(0, np.int64)

    def _unrecorded(self) -> None:
        raise DataError(
            f"{self.root} was prepared by an older meshforge, without document offsets; "
            "prepare it again (`meshforge data prepare`) to use document boundaries"
        )

    def seams(self, a: int, b: int) -> np.ndarray:
        """The positions p, a <= p < b (p > 0), where the stream resumes after tokens that went
        to the other split: the tokens on either side are not neighbours in the corpus."""
        if self.seam_every is None:
            self._unrecorded()
        if not self.seam_every:
            return np.empty(0, np.int64)
        k = self.seam_every
        first = max(1, -(-a // k))
        return np.arange(first * k, min(b, self.tokens), k, dtype=np.int64)


class TokenDataset:
    """A prepared directory: its index and its train/val splits."""

    def __init__(self, root: str | Path, seq_len: int):
        self.root = Path(root)
        index = read_manifest(self.root / "index.json", FORMAT, FORMAT_VERSION, DataError, _FIX, INDEX)
        self.index = index
        self.vocab_size = index["vocab_size"]
        self.tokenizer = index["tokenizer"]
        self.eos_id = index.get("eos_id")  # the end-of-text token that separates documents (data/eos_boundaries.py)
        self.max_token_id: int | None = index.get("max_token_id")
        _consistent(index, self.root / "index.json")
        splits, dtype = index["splits"], index["dtype"]
        train_seams = val_seams = None  # (format version 1 did not record the split's period)
        if "val_every" in index:
            every, block = index["val_every"], index.get("val_block", 1)
            train_seams, val_seams = ((every - 1) * block, block) if every else (0, 0)
        self.train = TokenSplit(self.root, splits.get("train", []), dtype, seq_len, train_seams)
        self.val = TokenSplit(self.root, splits.get("val", []), dtype, seq_len, val_seams)

    def largest_token(self) -> int | None:
        """The largest token id in the shards: scanned where they hold at most SCAN_TOKENS (a shard
        edited after index.json was written is caught before the run starts), else index.json's
        record (None: neither; every batch is still checked as it is read)."""
        found = [self.train.largest_token(), self.val.largest_token()]
        return self.max_token_id if None in found else max(found)


def _consistent(index: dict, path: Path) -> None:
    """What the schema cannot say alone: a split's shards record offsets all or none; ids the
    index names lie inside its own vocabulary."""
    for name, shards in index["splits"].items():
        if any(("docs" in s) != ("doc_starts" in s) for s in shards):
            raise DataError(f"{path}: a shard of splits.{name} has docs without doc_starts (or the reverse); {_FIX}")
    vocab = index["vocab_size"]
    for key in ("eos_id", "max_token_id"):
        if isinstance(index.get(key), int) and index[key] >= vocab:
            raise DataError(f"{path}: {key} = {index[key]} lies outside its vocab_size ({vocab}); {_FIX}")
    if "val_every" in index and "val_block" not in index:
        raise DataError(f"{path}: val_every without val_block; {_FIX}")
