"""Prepared token shards, read through memory maps as fixed-length training sequences."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshforge.data.prepare import FORMAT, FORMAT_VERSION
from meshforge.errors import DataError
from meshforge.manifest import read_manifest


class TokenSplit:
    """One split as sequences of ``seq_len + 1`` tokens (inputs plus shifted targets).

    Sequence i of a shard is tokens [i*seq_len, i*seq_len + seq_len + 1): neighbouring
    sequences share one token, so every token is a target exactly once.
    """

    def __init__(self, root: Path, shards: list[dict], dtype: str, seq_len: int):
        self.seq_len = seq_len
        self.maps: list[np.memmap] = []
        counts = []
        for s in shards:
            f = root / s["file"]
            if not f.is_file():
                raise DataError(
                    f"shard {f} listed in {root / 'index.json'} is missing; re-run `meshforge data prepare`"
                )
            expected = s["tokens"] * np.dtype(dtype).itemsize
            if f.stat().st_size != expected:
                raise DataError(
                    f"shard {f} has {f.stat().st_size} bytes but index.json says {expected}; "
                    "it is truncated or was overwritten — re-run `meshforge data prepare`"
                )
            mm = np.memmap(f, dtype=dtype, mode="r")
            self.maps.append(mm)
            counts.append(max(0, (len(mm) - 1) // seq_len))
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.tokens = int(sum(len(m) for m in self.maps))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def get(self, indices: np.ndarray | list[int]) -> torch.Tensor:
        """(n, seq_len + 1) int64 tensor for global sequence indices."""
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(indices):
            shard = int(np.searchsorted(self.starts, i, side="right") - 1)
            off = (int(i) - int(self.starts[shard])) * self.seq_len
            out[row] = self.maps[shard][off : off + self.seq_len + 1]
        return torch.from_numpy(out)


class TokenDataset:
    """A prepared directory: its index and its train/val splits."""

    def __init__(self, root: str | Path, seq_len: int):
        self.root = Path(root)
        index = read_manifest(
            self.root / "index.json", FORMAT, FORMAT_VERSION, DataError, "re-run `meshforge data prepare`"
        )
        self.index = index
        self.vocab_size = int(index["vocab_size"])
        self.tokenizer = index["tokenizer"]
        self.eos_id = index.get("eos_id")  # the end-of-text token that separates documents (data/documents.py)
        self.train = TokenSplit(self.root, index["splits"].get("train", []), index["dtype"], seq_len)
        self.val = TokenSplit(self.root, index["splits"].get("val", []), index["dtype"], seq_len)
