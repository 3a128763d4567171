"""Corpus inputs: which files paths, directories and globs name, their formats, and their documents.

A source is one file with a format (plain text, JSON lines, Parquet, Arrow) and an optional
compression (gzip, zstd). Its reader yields documents as iterators of text chunks, so a
multi-gigabyte text file streams through in bounded memory, and reports how many of the
file's bytes it has read (for the progress line). Readers can skip their first records
without parsing them, which is how an interrupted preparation resumes.
"""

from __future__ import annotations

import glob
import io
import os
import stat
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Protocol

from meshforge.data.zstd_frames import ZstdFrames
from meshforge.errors import DataError
from meshforge.safeio.files import cannot_read, not_regular, open_regular
from meshforge.safeio.parse import loads_json, read_json

# plain-text suffixes a directory walk takes (and `train`'s not-text check samples)
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".jsonl", ".text", ".tex", ".c", ".h", ".html"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}
COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
COLUMNAR = {".parquet": "parquet", ".arrow": "arrow"}
CHUNK_CHARS = 1 << 17  # how much of a text file is read at a time
_FIX = "point --input (data.path) at text, JSONL, Parquet or Arrow files"


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # "text" | "jsonl" | "parquet" | "arrow"
    compression: str = ""  # "" | "gz" | "zst"
    size: int = 0  # bytes on disk, and the modification time, when it was found
    mtime_ns: int = 0

    def stat(self) -> Source:
        """This source with its size and time, once it is known to be a regular file (a FIFO or
        device, even behind a link, is refused by name: reading it would wait or never end)."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise DataError(cannot_read(self.path, e, _FIX)) from None
        if not stat.S_ISREG(st.st_mode):
            raise DataError(not_regular(self.path, st.st_mode, _FIX))
        return replace(self, size=st.st_size, mtime_ns=st.st_mtime_ns)


class Reader(Protocol):
    def records(self, skip: int = 0) -> Iterator[Iterable[str]]: ...
    def consumed(self) -> int: ...


def classify(path: Path, explicit: bool = True) -> Source | None:
    """The format a file name says; an explicitly named file of unknown type is plain text,
    one found by a directory walk is left out (None)."""
    name, comp = path.name.lower(), ""
    for suffix, c in COMPRESSIONS.items():
        if name.endswith(suffix):
            name, comp = name[: -len(suffix)], c
            break
    ext = Path(name).suffix
    if ext in COLUMNAR and not comp:
        return Source(path, COLUMNAR[ext])
    if ext in JSONL_SUFFIXES or (comp and ext == ".json"):  # .json.gz: JSON lines, as C4 ships them
        return Source(path, "jsonl", comp)
    if ext in TEXT_SUFFIXES or explicit:
        return Source(path, "text", comp)
    return None


def discover(inputs: Iterable[str | Path]) -> list[Source]:
    """Every source that ``inputs`` (files, directories, glob patterns) name, in a fixed order."""
    sources: list[Source] = []
    for raw in inputs:
        text = str(raw)
        p = Path(text)
        if p.exists():
            paths = [p]
        elif any(c in text for c in "*?["):
            paths = sorted(Path(m) for m in glob.glob(text, recursive=True))
            if not paths:
                raise DataError(f"data path pattern {text} matches no files; check the pattern (** spans directories)")
        else:
            raise DataError(
                f"data path {p} does not exist; point data.path (or --input) at text, JSONL, Parquet, a glob or shards"
            )
        for q in paths:
            sources.extend(_walk(q) if q.is_dir() else [classify(q).stat()])
    return sources


def _files_under(d: str, parts: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str, os.stat_result]]:
    """Every file below ``d`` (symlinks to files too, not to directories): its path's parts
    below ``d`` (the order Path sorts in), its path and its stat."""
    out = []
    with os.scandir(d) as entries:
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                out += _files_under(e.path, (*parts, e.name))
                continue
            try:
                st = e.stat()  # (links followed: a link to a file is that file)
            except OSError:  # a link that leads nowhere, or back to itself: not a file, as a FIFO is not
                continue
            if stat.S_ISREG(st.st_mode):
                out.append(((*parts, e.name), e.path, st))
    return out


def _walk(d: Path) -> list[Source]:
    if (d / "index.json").is_file():
        raise DataError(f"{d} holds prepared token shards already (index.json); train on it, or name the raw data")
    if (d / "dataset_dict.json").is_file():
        splits = sorted(x.name for x in d.iterdir() if x.is_dir())
        raise DataError(
            f"{d} is a Hugging Face DatasetDict saved with save_to_disk; point at one split's directory "
            f"({', '.join(str(d / s) for s in splits) or 'e.g. ' + str(d / 'train')})"
        )
    hf = _hf_dataset_files(d)
    if hf is not None:
        return hf
    found = [
        replace(s, size=st.st_size, mtime_ns=st.st_mtime_ns)
        for _, f, st in sorted(_files_under(str(d)), key=lambda x: x[0])
        if (s := classify(Path(f), explicit=False))
    ]
    if not found:
        raise DataError(
            f"data path {d} is a directory with no text, JSONL, Parquet or Arrow files "
            f"({', '.join(sorted(TEXT_SUFFIXES))}, .parquet, .arrow, and .gz/.zst of text and JSONL) "
            "and no index.json; put data in it or run `meshforge data prepare`"
        )
    return found


def _hf_dataset_files(d: Path) -> list[Source] | None:
    """A Hugging Face ``Dataset.save_to_disk`` directory: its Arrow files, in state.json's order."""
    state = d / "state.json"
    if not state.is_file() or not (d / "dataset_info.json").is_file():
        return None
    try:
        files = [f["filename"] for f in read_json(state, DataError, "save the dataset again")["_data_files"]]
    except (KeyError, TypeError) as e:
        raise DataError(f"{state} is not a readable Hugging Face dataset state ({e}); save the dataset again") from None
    if not files or not all(isinstance(f, str) and f and Path(f).name == f and (d / f).is_file() for f in files):
        raise DataError(f"{state} lists no data files, or files missing from {d}; save the dataset again")
    return [Source(d / f, "arrow").stat() for f in files]


def plain_text_files(path: str) -> list[Path]:
    """The uncompressed plain-text files ``path`` names ([] when it names none or nothing)."""
    try:
        return [s.path for s in discover([path]) if s.kind == "text" and not s.compression]
    except DataError:
        return []


def _decompressed(src: Source, raw: IO[bytes]) -> IO[bytes]:
    if src.compression == "gz":
        import gzip

        return gzip.GzipFile(fileobj=raw, mode="rb")
    if src.compression == "zst":
        try:
            import zstandard
        except ImportError:
            raise DataError(
                f"{src.path} is zstd-compressed and reading it needs the zstandard package: "
                "pip install 'meshforge[zstd]' (or decompress the file)"
            ) from None
        return io.BufferedReader(ZstdFrames(raw, zstandard.ZstdDecompressor()))  # (a cut-off frame: an error)
    return raw


def _read_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
    try:
        import zstandard

        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


class _Stream:
    """A source's bytes as text (UTF-8, bad bytes replaced, newlines made ``\\n``), reporting
    how far into the file on disk it has read and naming the file when it cannot be read."""

    def __init__(self, src: Source, field: str):
        self.src, self.field = src, field
        self._raw: IO[bytes] | None = None
        self._done = 0

    def consumed(self) -> int:
        return self._raw.tell() if self._raw is not None and not self._raw.closed else self._done

    def _lines_or_chunks(self, chunked: bool) -> Iterator[str]:
        with open_regular(self.src.path, DataError, _FIX) as raw:  # (a file swapped for a FIFO since: refused)
            self._raw = raw
            text = io.TextIOWrapper(_decompressed(self.src, raw), encoding="utf-8", errors="replace", newline=None)
            try:
                if chunked:
                    while chunk := text.read(CHUNK_CHARS):
                        yield chunk
                else:
                    yield from text
            except _read_errors() as e:
                what = {"gz": "gzip", "zst": "zstd"}.get(self.src.compression, "a file")
                msg = f"{self.src.path} could not be read as {what} ({e}); is it truncated or damaged?"
                raise DataError(msg) from None
            self._done = self.src.size
        self._raw = None


class TextReader(_Stream):
    """A text file is one document, streamed in chunks whatever its size."""

    def records(self, skip: int = 0) -> Iterator[Iterable[str]]:
        if skip == 0:
            yield self._lines_or_chunks(chunked=True)


class JsonlReader(_Stream):
    """One document per non-blank line: the line's JSON object's string field ``field``."""

    def records(self, skip: int = 0) -> Iterator[Iterable[str]]:
        seen = 0
        for lineno, line in enumerate(self._lines_or_chunks(chunked=False), 1):
            if not line.strip():
                continue
            seen += 1
            if seen > skip:
                yield (self._text(line, lineno),)

    def _text(self, line: str, lineno: int) -> str:
        where = f"{self.src.path}:{lineno}"
        rec = loads_json(line, where, DataError, "fix or remove that line")
        if not isinstance(rec, dict) or not isinstance(rec.get(self.field), str):
            raise DataError(
                f'{where} has no string field "{self.field}"; each JSONL line needs one (--field names another field)'
            )
        return rec[self.field]
