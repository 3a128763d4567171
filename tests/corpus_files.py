"""Small corpora in every input format, and a BPE tokenizer trained here (no network)."""

from __future__ import annotations

import gzip
import json
import random
import sysconfig
from pathlib import Path

import numpy as np

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_text(limit: int = 400_000) -> str:
    out, n = [], 0
    for f in sorted(STDLIB.glob("*.py")):
        t = f.read_text(encoding="utf-8", errors="replace").replace("\r", "")
        out.append(t)
        n += len(t)
        if n >= limit:
            break
    return "".join(out)


def documents(n: int = 40, seed: int = 0, long_doc: int = 0) -> list[str]:
    """``n`` documents cut from stdlib text (a few with non-ASCII, one empty), plus one of
    ``long_doc`` characters when asked (longer than a piece)."""
    rng, text = random.Random(seed), stdlib_text()
    docs = []
    for i in range(n):
        size = rng.choice([0, 3, 50, 400, 2000, 9000]) if i else 0
        start = rng.randrange(len(text) - size)
        doc = text[start : start + size]
        docs.append(doc + (" ünïcödé 日本語 🙂" if i % 7 == 3 else ""))
    if long_doc:
        docs.insert(n // 2, (text * (long_doc // len(text) + 1))[:long_doc])
    return docs


def write_jsonl(path: Path, docs: list[str], field: str = "text", opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")
    return path


def write_jsonl_gz(path: Path, docs: list[str]) -> Path:
    return write_jsonl(path, docs, opener=gzip.open)


def write_jsonl_zst(path: Path, docs: list[str]) -> Path:
    import zstandard

    raw = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    half = len(raw) // 2
    cut = raw.index(b"\n", half) + 1
    c = zstandard.ZstdCompressor()
    path.write_bytes(c.compress(raw[:cut]) + c.compress(raw[cut:]))  # two frames, as concatenated files have
    return path


def write_text_dir(d: Path, docs: list[str]) -> Path:
    d.mkdir(parents=True)
    for i, doc in enumerate(docs):
        (d / f"doc_{i:04d}.txt").write_text(doc, encoding="utf-8")
    return d


def write_parquet(path: Path, docs: list[str], field: str = "text", row_group_size: int = 7) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=row_group_size)
    return path


def write_hf_dataset(d: Path, docs: list[str]) -> Path:
    """What ``datasets.Dataset.save_to_disk`` writes: Arrow stream files, state.json, dataset_info.json."""
    import pyarrow as pa

    d.mkdir(parents=True)
    half = len(docs) // 2
    names = []
    for i, part in enumerate((docs[:half], docs[half:])):
        name = f"data-{i:05d}-of-00002.arrow"
        table = pa.table({"text": part, "id": list(range(len(part)))})
        with pa.OSFile(str(d / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table, max_chunksize=5)
        names.append(name)
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names], "_split": None}))
    (d / "dataset_info.json").write_text("{}")
    return d


def train_bpe(path: Path, vocab: int = 600) -> Path:
    """A byte-level BPE tokenizer.json trained on stdlib text in about a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([stdlib_text(200_000)], trainer)
    tok.save(str(path))
    return path


def reference_stream(tokenizer, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The corpus as the old one-document-at-a-time preparation made it: each document's tokens,
    EOS after each; and where each document starts."""
    parts = [np.append(tokenizer.encode(d), tokenizer.eos_id) for d in docs]
    starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])[:-1]]).astype(np.int64)
    return np.concatenate(parts), starts


def shard_bytes(out: Path) -> dict[str, bytes]:
    """Every file of a prepared directory (index.json without its "source")."""
    files = {f.name: f.read_bytes() for f in sorted(out.iterdir()) if f.name != "index.json"}
    index = json.loads((out / "index.json").read_text())
    index.pop("source")
    files["index.json"] = json.dumps(index, sort_keys=True).encode()
    return files


def split_streams(out: Path) -> dict[str, np.ndarray]:
    index = json.loads((out / "index.json").read_text())
    return {
        k: np.concatenate([np.fromfile(out / s["file"], dtype=index["dtype"]) for s in v] or [np.empty(0, int)])
        for k, v in index["splits"].items()
    }
