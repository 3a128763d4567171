"""Input that does not look like text: under the byte tokenizer a binary file trains without
a word (every byte is a token), so its share of invalid UTF-8 is measured and warned about.
"""

from __future__ import annotations

from pathlib import Path

from meshforge.errors import DataError

SAMPLE_BYTES = 1 << 20  # per file
MAX_FILES = 200
REFUSE_FRACTION = 0.3  # a file with more non-text bytes than this is not text (random bytes: ~55%)
_CONTROL = frozenset(range(32)) - {9, 10, 11, 12, 13} | {127}


def invalid_utf8_share(data: bytes) -> float:
    """The share of ``data``'s bytes that are not part of valid UTF-8."""
    if not data:
        return 0.0
    kept = len(data.decode("utf-8", errors="ignore").encode("utf-8"))
    return (len(data) - kept) / len(data)


def not_text_files(path: str, threshold: float) -> list[tuple[Path, float]]:
    """Plain text files of ``data.path`` (a file, directory or glob; not JSONL, Parquet or prepared
    shards) whose sampled share of invalid UTF-8 is above ``threshold``, worst first."""
    from meshforge.data.sources import plain_text_files

    p = Path(path)
    if not path or (p / "index.json").is_file():
        return []
    bad = []
    for f in plain_text_files(path)[:MAX_FILES]:
        with f.open("rb") as fh:
            share = invalid_utf8_share(fh.read(SAMPLE_BYTES))
        if share > threshold:
            bad.append((f, share))
    return sorted(bad, key=lambda x: -x[1])


def non_text_share(data: bytes) -> float:
    """The share of ``data``'s bytes that text does not hold: invalid UTF-8, and control
    characters other than whitespace (random bytes: about 55%; source code and prose: 0)."""
    if not data:
        return 0.0
    valid = data.decode("utf-8", errors="ignore")
    controls = sum(1 for ch in valid if ord(ch) in _CONTROL)
    return (len(data) - len(valid.encode("utf-8")) + controls) / len(data)


def refuse_binary(
    path: str, allow_binary: bool, key: str = "data.path", allow: str = "data.allow_binary = true"
) -> None:
    """Refuse ``data.path`` when a file of it is mostly not text, unless ``data.allow_binary``
    (plain text files only: JSONL, Parquet, Arrow and compressed files are formats, not text;
    ``key``/``allow``: how the command spells the path and the way around, e.g. --input, --allow-binary)."""
    from meshforge.data.sources import plain_text_files

    p = Path(path)
    if allow_binary or not path or (p / "index.json").is_file():
        return
    for f in plain_text_files(path)[:MAX_FILES]:
        with f.open("rb") as fh:
            share = non_text_share(fh.read(SAMPLE_BYTES))
        if share > REFUSE_FRACTION:
            raise DataError(
                f"{key}: {f} is not text: {share:.0%} of its bytes are invalid UTF-8 or control characters "
                f"(more than {REFUSE_FRACTION:.0%}); point {key} at text, or set {allow} to train on it anyway"
            )
