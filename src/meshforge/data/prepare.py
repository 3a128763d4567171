"""Corpus preparation: text, JSONL, Parquet and Arrow (compressed or not) into token shards.

Layout of a prepared directory (docs/data.md has the details)::

    index.json              format, dtype, tokenizer, vocab size, shards per split
    train_00000.bin         raw little-endian uint16 (vocab <= 65536) or uint32 tokens
    train_00000.docs.bin    little-endian int64: where in that shard each document starts
    val_00000.bin, val_00000.docs.bin

Documents are concatenated with the tokenizer's EOS after each. The validation split
takes every k-th block of tokens (k = 1 / val_fraction), so it samples the whole corpus
rather than its last files, and works for a single file too. Blocks are VAL_BLOCK
tokens for large inputs and shrink (down to MIN_VAL_BLOCK) for small ones, so that a
small corpus still gets several validation blocks.

Preparation streams: documents are read in chunks, cut into pieces (pieces.py), tokenized
in batches by worker threads (encode.py) and appended to the shards as they come
(shards.py), so memory is bounded whatever the corpus or document size. It is written
into ``.NAME.partial`` beside the output and renamed when complete; a killed preparation
resumes there from its last complete shards.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from meshforge.data import shards
from meshforge.data import text_pieces as pieces
from meshforge.data.encode import default_workers, encoded
from meshforge.data.progress import Progress
from meshforge.data.shards import JOURNAL, ShardSet, load_journal, save_journal, val_block_size
from meshforge.data.sources import Source, discover
from meshforge.data.tokenizer import Tokenizer
from meshforge.errors import DataError
from meshforge.safeio.links import make_dir

try:
    import fcntl
except ImportError:  # not POSIX: no lock between concurrent preparations of one directory
    fcntl = None  # type: ignore[assignment]

__all__ = ["FORMAT", "FORMAT_VERSION", "SHARD_TOKENS", "prepare", "prepared_dir_for", "val_block_size"]

FORMAT = "meshforge-token-shards"
FORMAT_VERSION = 2  # 2: document offsets beside every shard; version 1 (no offsets) is still read
SHARD_TOKENS = 1 << 28


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


def _fingerprint(sources: list[Source], *settings: object) -> str:
    """The inputs (paths, formats, sizes, modification times) and settings, hashed."""
    h = hashlib.sha256("|".join(str(s) for s in (FORMAT_VERSION, *settings)).encode())
    for s in sources:
        h.update(f"{os.path.abspath(s.path)}|{s.kind}|{s.compression}|{s.size}|{s.mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _check_out(out: Path) -> None:
    if (out / "index.json").exists():
        raise DataError(f"{out} already holds prepared data; choose another --out or delete it first")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} exists and is not an empty directory; choose another --out (nothing was written)")


def _partial(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


@contextlib.contextmanager
def _claimed(out: Path) -> Iterator[Path | None]:
    """``out``'s partial directory, locked by this process (other preparers of ``out`` wait);
    None when one of them completed ``out`` meanwhile."""
    partial = _partial(out)
    while True:
        make_dir(partial, "remove it (a preparation writes its partial directory itself)")
        fd = os.open(partial / ".lock", os.O_CREAT | os.O_RDWR | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            if (out / "index.json").is_file():
                with contextlib.suppress(OSError):  # a partial directory only this waiter created
                    if os.listdir(partial) == [".lock"]:
                        shutil.rmtree(partial)
                yield None
                return
            try:
                ours = os.stat(partial / ".lock").st_ino == os.fstat(fd).st_ino  # not renamed away meanwhile
            except OSError:
                ours = False
            if ours:
                yield partial
                return
        finally:
            os.close(fd)


def _publish(partial: Path, out: Path, index: dict[str, Any]) -> None:
    """index.json last, then the rename: ``out`` is complete the moment it exists."""
    import json

    tmp = partial / "index.json.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(partial / "index.json")
    (partial / JOURNAL).unlink(missing_ok=True)
    (partial / ".lock").unlink()
    partial.rename(out)


def prepare(
    inputs: list[str | Path],
    out_dir: str | Path,
    tokenizer: Tokenizer,
    val_fraction: float = 0.01,
    source: str | list[str] | None = None,
    *,
    field: str = "text",
    workers: int = 0,
    shard_tokens: int = SHARD_TOKENS,
    progress: TextIO | None = None,
) -> Path:
    """Tokenize ``inputs`` into shards under ``out_dir``; resumes an interrupted run of the same
    inputs and settings. ``field``: the JSONL field / Parquet or Arrow column holding the text;
    ``workers``: tokenizing threads (0: one per core, at most 16); ``progress``: where the
    progress line goes (None: nowhere). Returns ``out_dir``."""
    sources = discover(inputs)
    out = Path(out_dir)
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _claimed(out) as partial:
        if partial is None:
            return out
        try:
            workers = workers or default_workers()
            index = _run(partial, sources, tokenizer, val_fraction, field, workers, shard_tokens, progress)
        except DataError:
            shutil.rmtree(partial, ignore_errors=True)  # the input needs fixing: nothing to resume
            raise
        except BaseException:
            if progress is not None:
                progress.write(f"\nmeshforge: preparation stopped; the same command resumes it from {partial}\n")
            raise
        index["source"] = source or [str(i) for i in inputs]
        _publish(partial, out, index)
    return out


def _run(
    root: Path,
    sources: list[Source],
    tokenizer: Tokenizer,
    val_fraction: float,
    field: str,
    workers: int,
    shard_tokens: int,
    stream: TextIO | None,
) -> dict[str, Any]:
    """Prepare into ``root`` (resuming from its journal if it has one); the index to publish."""
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32)
    every = max(2, round(1 / val_fraction)) if val_fraction > 0 else 0
    settings = (tokenizer.name, val_fraction, field, shard_tokens)
    key = _fingerprint(sources, *settings, pieces.PIECE_CHARS, pieces.BATCH_BYTES, shards.HEAD_TOKENS)
    journal = load_journal(root, key, dtype.itemsize) or {"cursor": (0, 0, 0), "documents": 0, "done": 0}
    sink = ShardSet(root, dtype, every, shard_tokens, journal.get("state"))
    if "state" in journal and stream is not None:
        stream.write(f"meshforge: resuming from {root}: {sink.position:,} tokens already prepared\n")
    meter = Progress(sum(s.size for s in sources), stream, journal["done"], sink.position)
    work = pieces.batches(pieces.iter_pieces(sources, field, tuple(journal["cursor"])))
    docs = journal["documents"]
    try:
        for batch, tokens, starts in encoded(tokenizer, work, workers, tokenizer.eos_id, dtype):
            sink.write(tokens, starts)
            docs += len(starts)
            meter.update(batch[-1].done, len(tokens))
            if sink.full():  # a checkpoint: the shards so far, and where the input goes on
                sink.close()
                state = {"cursor": batch[-1].after, "documents": docs, "done": batch[-1].done}
                save_journal(root, {"fingerprint": key, **state, "state": sink.state()})
        sink.close()
    except BaseException:
        sink.abandon()
        raise
    meter.finish()
    if docs == 0 or sink.position <= docs:
        names = ", ".join(str(s.path) for s in sources[:3]) + (" ..." if len(sources) > 3 else "")
        raise DataError(
            f"data path {names} holds no text to train on ({docs} documents, {sink.position} tokens); "
            "point it at non-empty text, JSONL or Parquet"
        )
    return {
        **{"format": FORMAT, "version": FORMAT_VERSION, "dtype": dtype.name, "tokenizer": tokenizer.name},
        **{"vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "documents": docs, "tokens": sink.position},
        **{"val_block": sink.block, "val_every": every, "splits": sink.state()["splits"], "max_token_id": sink.top},
    }


def prepared_dir_for(path: str, tokenizer: Tokenizer, val_fraction: float, cache_dir: str = "") -> Path:
    """Where ``data.path`` lives as token shards, preparing (and caching) raw data on first use."""
    if path and (Path(path) / "index.json").is_file():
        return Path(path)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if not path:
        sources = discover(stdlib_sources())
        name, source = "stdlib", "python-stdlib"
    else:
        sources = discover([path])
        name, source = "text", None
    out = cache / "corpora" / f"{name}-{_fingerprint(sources, tokenizer.name, val_fraction)}"
    if not (out / "index.json").is_file():
        size = sum(s.size for s in sources)
        what = path or "the default corpus (Python standard library sources)"
        print(
            f"meshforge: preparing {what} ({len(sources)} file(s), {size / 1e6:.1f} MB) with the {tokenizer.name} "
            f"tokenizer into {out} (first use only; later runs reuse it) ...",
            flush=True,
        )
        t0 = time.perf_counter()
        try:
            files = [s.path for s in sources]
            prepare(files, out, tokenizer, val_fraction, source=source or [path], progress=sys.stderr)
        except OSError as e:  # a cache that is a file, read-only, full; an input that cannot be read
            where = str(e.filename or out)
            ours = where.startswith(str(cache))
            fix = "set data.cache_dir to a writable directory" if ours else "check the file's permissions"
            raise DataError(
                f"cannot {'write the prepared corpus to' if ours else 'read'} {where}: {e.strerror or e}; {fix}"
            ) from None
        print(f"meshforge: prepared the corpus in {time.perf_counter() - t0:.1f}s", flush=True)
    return out
