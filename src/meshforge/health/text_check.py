"""Input that does not look like text: under the byte tokenizer a binary file trains without
a word (every byte is a token), so its share of invalid UTF-8 is measured and warned about.
"""

from __future__ import annotations

from pathlib import Path

SAMPLE_BYTES = 1 << 20  # per file
MAX_FILES = 200


def invalid_utf8_share(data: bytes) -> float:
    """The share of ``data``'s bytes that are not part of valid UTF-8."""
    if not data:
        return 0.0
    kept = len(data.decode("utf-8", errors="ignore").encode("utf-8"))
    return (len(data) - kept) / len(data)


def not_text_files(path: str, threshold: float) -> list[tuple[Path, float]]:
    """Files of ``data.path`` (a file or a directory of text files; not JSONL or prepared
    shards) whose sampled share of invalid UTF-8 is above ``threshold``, worst first."""
    from meshforge.data.prepare import TEXT_SUFFIXES

    p = Path(path)
    if not path or not p.exists() or (p / "index.json").is_file():
        return []
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
    bad = []
    for f in files[:MAX_FILES]:
        if f.suffix.lower() == ".jsonl":
            continue
        with f.open("rb") as fh:
            share = invalid_utf8_share(fh.read(SAMPLE_BYTES))
        if share > threshold:
            bad.append((f, share))
    return sorted(bad, key=lambda x: -x[1])
