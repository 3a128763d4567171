"""Tokenizers: a built-in byte-level one, and Hugging Face ``tokenizer.json`` files."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer as _Tok

from meshforge.errors import DataError
from meshforge.safeio.files import MAX_TOKENIZER_BYTES, read_regular


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    name: str

    def encode(self, text: str) -> np.ndarray: ...
    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...
    def decode(self, ids: list[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS = 256 and EOS = 257 (separates documents).

    Needs no files and no training, so every machine can train at once; the price is
    longer sequences than a learned BPE vocabulary would give.
    """

    name = "byte"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """One uint8 array per text (the bytes themselves, no copy)."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` read by the ``tokenizers`` library (no network)."""

    def __init__(self, path: str | Path):
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise DataError(
                f"data.tokenizer = '{path}' is neither 'byte' nor an existing tokenizer.json; "
                "point it at a Hugging Face tokenizer.json file (or its directory)"
            )
        raw = read_regular(p, MAX_TOKENIZER_BYTES, DataError, "point data.tokenizer at a tokenizer.json file")
        try:
            self._tok = _Tok.from_str(raw.decode("utf-8"))  # (its JSON parser stops at 128 levels deep itself)
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise DataError(f"could not read tokenizer file {p}: {str(e)[:300]}") from None
        self.path = p
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        _check_ids(self._tok, self.vocab_size, p)
        eos = next((t for t in _EOS_CANDIDATES if self._tok.token_to_id(t) is not None), None)
        if eos is None:
            raise DataError(
                f"tokenizer {p} has none of the usual end-of-text tokens ({', '.join(_EOS_CANDIDATES)}); "
                "meshforge needs one to separate documents"
            )
        self.eos_id = self._tok.token_to_id(eos)
        self.name = "hf:" + hashlib.sha256(raw).hexdigest()[:16]

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """One uint32 array per text, through the library's batch call (which releases the GIL,
        so threads tokenize in parallel); ``encode_batch_fast`` skips the character offsets."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [np.array(e.ids, dtype=np.uint32) for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids])


def _check_ids(tok: _Tok, size: int, p: Path) -> None:
    """Every id the tokenizer can give must lie below its vocabulary size: the shards' dtype and the
    model's embedding are sized by it (an id of 2**31 - 1 in a 97-token vocabulary overflowed)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    token, top = max(vocab.items(), key=lambda kv: kv[1], default=("", 0))
    if top >= size or top >= 2**32:
        raise DataError(
            f"tokenizer {p} gives id {top:,} to {token[:40]!r} but holds {size:,} tokens: its ids must lie below "
            "its vocabulary size (the model's embedding has a row per id); renumber its tokens or use another tokenizer"
        )


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` or a path to a tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
