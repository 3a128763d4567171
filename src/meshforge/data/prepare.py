"""Corpus preparation: text, directories and JSONL into memory-mappable token shards.

Layout of a prepared directory::

    index.json          format, dtype, tokenizer, vocab size, shards per split
    train_00000.bin     raw little-endian uint16 (vocab <= 65536) or uint32 tokens
    val_00000.bin

Documents are concatenated with the tokenizer's EOS after each. The validation split
takes every k-th block of tokens (k = 1 / val_fraction), so it samples the whole corpus
rather than its last files, and works for a single file too. Blocks are VAL_BLOCK
tokens for large inputs and shrink (down to MIN_VAL_BLOCK) for small ones, so that a
small corpus still gets several validation blocks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from meshforge.data.tokenizer import Tokenizer
from meshforge.errors import DataError

FORMAT = "meshforge-token-shards"
FORMAT_VERSION = 1
VAL_BLOCK = 16384
MIN_VAL_BLOCK = 1024
SHARD_TOKENS = 1 << 28
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".jsonl", ".text", ".tex", ".c", ".h", ".html"}


def default_cache_dir() -> Path:
    return Path(os.environ.get("MESHFORGE_CACHE") or Path.home() / ".cache" / "meshforge")


def stdlib_sources() -> list[Path]:
    """The default corpus: this Python's standard library .py files, sorted, no site-packages."""
    return list(_stdlib_sources(sysconfig.get_paths()["stdlib"]))


@functools.lru_cache(maxsize=2)
def _stdlib_sources(stdlib: str) -> tuple[Path, ...]:
    """Walked once per process, pruning site-packages and __pycache__ instead of listing them
    (every run and rank asks; a rglob over site-packages took ~0.8 s of each rank's start)."""
    root, files = Path(stdlib), []
    for dirpath, dirnames, filenames in os.walk(root):  # like rglob: no symlinked directories
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
        files += [p for name in filenames if name.endswith(".py") and (p := Path(dirpath, name)).is_file()]
    return tuple(sorted(files, key=lambda f: f.relative_to(root).as_posix()))


def _expand(inputs: list[str | Path]) -> list[Path]:
    files: list[Path] = []
    for raw in inputs:
        p = Path(raw)
        if not p.exists():
            raise DataError(f"data path {p} does not exist; point data.path (or --input) at text, JSONL or shards")
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                raise DataError(
                    f"data path {p} is a directory with no text files ({', '.join(sorted(TEXT_SUFFIXES))}) "
                    "and no index.json; put text in it or run `meshforge data prepare`"
                )
            files.extend(found)
        else:
            files.append(p)
    return files


def iter_documents(files: list[Path]) -> Iterator[str]:
    """One string per document: a whole text file, or the ``text`` field of each JSONL line."""
    for f in files:
        if f.suffix.lower() == ".jsonl":
            with f.open("r", encoding="utf-8", errors="replace") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{f}:{lineno} is not valid JSON ({e.msg}); fix or remove that line") from None
                    if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                        raise DataError(f'{f}:{lineno} has no string field "text"; each JSONL line needs one')
                    yield rec["text"]
        else:
            yield f.read_text(encoding="utf-8", errors="replace")


def _fingerprint(files: list[Path], tok: Tokenizer, val_fraction: float) -> str:
    h = hashlib.sha256(f"{FORMAT_VERSION}|{tok.name}|{val_fraction}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


class _ShardWriter:
    def __init__(self, out: Path, split: str, dtype: np.dtype):
        self.out, self.split, self.dtype = out, split, dtype
        self.shards: list[dict] = []
        self.buf: list[np.ndarray] = []
        self.n = 0

    def add(self, arr: np.ndarray) -> None:
        self.buf.append(arr)
        self.n += len(arr)
        if self.n >= SHARD_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self.n:
            return
        name = f"{self.split}_{len(self.shards):05d}.bin"
        np.concatenate(self.buf).astype(self.dtype).tofile(self.out / name)
        self.shards.append({"file": name, "tokens": int(self.n)})
        self.buf, self.n = [], 0


def val_block_size(input_bytes: int, every: int) -> int:
    """Block length giving about 8 validation blocks for small inputs, VAL_BLOCK for large ones."""
    if not every:
        return VAL_BLOCK
    return int(min(VAL_BLOCK, max(MIN_VAL_BLOCK, input_bytes // (every * 8))))


def _split_blocks(
    files: list[Path], tokenizer: Tokenizer, writers: dict[str, _ShardWriter], every: int, block_size: int
) -> int:
    """Tokenize ``files`` (EOS after each document) into blocks of ``block_size`` tokens,
    every ``every``-th to the validation split; returns the number of documents."""
    dtype = writers["train"].dtype
    pending: list[np.ndarray] = []
    pending_n = 0
    block = 0
    docs = 0

    def emit(arr: np.ndarray) -> None:
        nonlocal block
        split = "val" if every and block % every == every - 1 else "train"
        writers[split].add(arr)
        block += 1

    for text in iter_documents(files):
        ids = tokenizer.encode(text)
        docs += 1
        pending.append(np.append(ids, tokenizer.eos_id).astype(dtype))
        pending_n += len(ids) + 1
        while pending_n >= block_size:
            stream = np.concatenate(pending)
            emit(stream[:block_size])
            rest = stream[block_size:]
            pending, pending_n = [rest], len(rest)
    if pending_n:
        emit(np.concatenate(pending))
    for w in writers.values():
        w.flush()
    return docs


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished directory into place; if another process finished first, keep theirs."""
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "index.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def prepare(
    inputs: list[str | Path],
    out_dir: str | Path,
    tokenizer: Tokenizer,
    val_fraction: float = 0.01,
    source: str | None = None,
) -> Path:
    """Tokenize ``inputs`` into shards under ``out_dir`` (written atomically). Returns ``out_dir``."""
    files = _expand(inputs)
    out = Path(out_dir)
    if (out / "index.json").exists():
        raise DataError(f"{out} already holds prepared data; choose another --out or delete it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32)
        writers = {"train": _ShardWriter(tmp, "train", dtype), "val": _ShardWriter(tmp, "val", dtype)}
        every = max(2, round(1 / val_fraction)) if val_fraction > 0 else 0
        block_size = val_block_size(sum(f.stat().st_size for f in files), every)
        docs = _split_blocks(files, tokenizer, writers, every, block_size)
        total = sum(s["tokens"] for w in writers.values() for s in w.shards)
        if docs == 0 or total <= docs:
            raise DataError(
                f"data path {', '.join(str(i) for i in inputs)} holds no text to train on "
                f"({docs} documents, {total} tokens); point it at non-empty text or JSONL"
            )
        index = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "dtype": dtype.name,
            "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "documents": docs,
            "val_block": block_size,
            "source": source or [str(i) for i in inputs],
            "splits": {k: w.shards for k, w in writers.items()},
        }
        (tmp / "index.json").write_text(json.dumps(index, indent=1))
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def prepared_dir_for(path: str, tokenizer: Tokenizer, val_fraction: float, cache_dir: str = "") -> Path:
    """Where ``data.path`` lives as token shards, preparing (and caching) raw text on first use."""
    if path and (Path(path) / "index.json").is_file():
        return Path(path)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if not path:
        files = stdlib_sources()
        name = "stdlib"
        source = "python-stdlib"
    else:
        files = _expand([path])
        name = "text"
        source = None
    out = cache / "corpora" / f"{name}-{_fingerprint(files, tokenizer, val_fraction)}"
    if not (out / "index.json").is_file():
        size = sum(f.stat().st_size for f in files)
        what = path or "the default corpus (Python standard library sources)"
        print(
            f"meshforge: preparing {what} ({len(files)} file(s), {size / 1e6:.1f} MB) with the {tokenizer.name} "
            f"tokenizer into {out} (first use only; later runs reuse it) ...",
            flush=True,
        )
        t0 = time.perf_counter()
        try:
            prepare(files, out, tokenizer, val_fraction, source=source or [path])
        except OSError as e:  # a cache that is a file, read-only, full; an input that cannot be read
            where = str(e.filename or out)
            ours = where.startswith(str(cache))
            fix = "set data.cache_dir to a writable directory" if ours else "check the file's permissions"
            raise DataError(
                f"cannot {'write the prepared corpus to' if ours else 'read'} {where}: {e.strerror or e}; {fix}"
            ) from None
        print(f"meshforge: prepared the corpus in {time.perf_counter() - t0:.1f}s", flush=True)
    return out
