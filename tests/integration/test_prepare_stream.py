"""Streaming preparation: pieces, determinism across workers, resume after a kill, document
offsets, progress, and training on Parquet equals training on JSONL."""

import io
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import tiny_config
from corpus_files import (
    documents,
    reference_stream,
    shard_bytes,
    split_streams,
    stdlib_text,
    train_bpe,
    write_jsonl,
    write_parquet,
)
from meshforge.data import shards
from meshforge.data import text_pieces as pieces
from meshforge.data.dataset import TokenDataset
from meshforge.data.prepare import prepare
from meshforge.data.progress import Progress
from meshforge.data.sources import discover
from meshforge.data.text_pieces import cut
from meshforge.data.tokenizer import ByteTokenizer, load_tokenizer
from meshforge.errors import DataError


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return load_tokenizer(str(train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json")))


@pytest.fixture
def small_batches(monkeypatch):
    """Batches of 16 KiB of text, and the block length settled after 16 Ki tokens, so that
    these small corpora make several shards."""
    monkeypatch.setattr(pieces, "BATCH_BYTES", 1 << 14)
    monkeypatch.setattr(shards, "HEAD_TOKENS", 1 << 14)


def test_pieces_tokenize_like_the_whole_document(bpe):
    text = stdlib_text(300_000)
    parts = list(cut([text], limit=20_000))
    assert "".join(parts) == text and len(parts) > 15 and max(map(len, parts)) <= 20_000
    assert all(p.endswith("\n") or p[-1] != " " for p in parts[:-1])  # cut after a newline or before a space
    chunked = [text[i : i + 7_777] for i in range(0, len(text), 7_777)]
    assert list(cut(chunked, limit=20_000)) == parts  # where a file's reads fall changes nothing
    whole = bpe.encode(text)
    assert np.array_equal(np.concatenate(bpe.encode_batch(parts)), whole)
    assert list(cut(["x" * 50_000], limit=20_000)) == ["x" * 20_000] * 2 + ["x" * 10_000]  # no space: at the limit
    assert list(cut([""])) == [""] and list(cut([])) == [""]


def test_shards_are_byte_identical_whatever_the_worker_count(tmp_path, bpe, small_batches):
    docs = documents(60, seed=1, long_doc=150_000)
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    outs = [
        prepare([src], tmp_path / f"w{w}", bpe, 0.5, workers=w, shard_tokens=10_000, progress=None) for w in (1, 2, 5)
    ]
    assert shard_bytes(outs[0]) == shard_bytes(outs[1]) == shard_bytes(outs[2])
    assert len(json.loads((outs[0] / "index.json").read_text())["splits"]["train"]) > 2
    stream, _ = reference_stream(bpe, docs)  # every document encoded alone, as before streaming
    got = split_streams(outs[0])
    assert sorted(np.concatenate([got["train"], got["val"]]).tolist()) == sorted(stream.tolist())
    assert len(got["train"]) + len(got["val"]) == len(stream)


def test_reading_resumes_at_any_cursor(tmp_path):
    """From any piece's ``after`` cursor, the pieces are exactly the rest of the full read:
    records skipped in JSONL and Parquet (whole row groups too), pieces inside a document."""
    pytest.importorskip("pyarrow")
    docs = documents(30, seed=4, long_doc=150_000)
    (tmp_path / "t.txt").write_text(docs[15])
    sources = discover(
        [write_jsonl(tmp_path / "a.jsonl", docs), tmp_path / "t.txt", write_parquet(tmp_path / "b.parquet", docs)]
    )
    full = list(pieces.iter_pieces(sources, "text"))
    assert len(full) == 2 * (len(docs) + 2) + 3  # the long document (docs[15]) is three pieces, three times
    inside = [i for i, p in enumerate(full) if p.after[2]]  # cursors inside a document
    assert len(inside) == 6
    for i in sorted({*range(0, len(full) - 1, 5), *inside}):
        rest = list(pieces.iter_pieces(sources, "text", full[i].after))
        assert [(p.text, p.first, p.last) for p in rest] == [(p.text, p.first, p.last) for p in full[i + 1 :]]


def _byte_docs(n=300, seed=2):
    rng = np.random.default_rng(seed)
    return ["".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(0, 3000))) for _ in range(n)]


def test_doc_starts_seams_and_spans(tmp_path, small_batches):
    docs = _byte_docs()
    out = prepare([write_jsonl(tmp_path / "d.jsonl", docs)], tmp_path / "o", ByteTokenizer(), 0.25, shard_tokens=40_000)
    index = json.loads((out / "index.json").read_text())
    stream, starts = reference_stream(ByteTokenizer(), docs)
    b, k = index["val_block"], index["val_every"]
    pos = np.arange(len(stream))
    ds = TokenDataset(out, seq_len=64)
    assert len(index["splits"]["train"]) > 2
    for name, split in (("train", ds.train), ("val", ds.val)):
        mine = pos[((pos // b) % k == k - 1) == (name == "val")]  # the corpus positions this split holds
        assert np.array_equal(np.concatenate([split.maps[i] for i in range(len(split.maps))]), stream[mine])
        want_starts = np.flatnonzero(np.isin(mine, starts))
        want_seams = np.flatnonzero(np.diff(mine) != 1) + 1
        assert np.array_equal(split.doc_starts(0, split.tokens), want_starts) and len(want_starts) > 10
        assert np.array_equal(split.seams(0, split.tokens), want_seams) and len(want_seams) > 2
        for a, e in [(0, 1), (5, 9_000), (30_000, 95_000), (split.tokens - 50, split.tokens + 10)]:
            assert np.array_equal(split.doc_starts(a, e), want_starts[(want_starts >= a) & (want_starts < e)])
            assert np.array_equal(split.seams(a, e), want_seams[(want_seams >= a) & (want_seams < e)])
    flat = np.concatenate(list(ds.train.maps))
    for i in (0, 7, len(ds.train) // 2, len(ds.train) - 1):
        a, e = ds.train.span(i)
        assert np.array_equal(ds.train.get([i])[0].numpy(), flat[a:e])


def test_format_version_1_still_reads_but_has_no_offsets(tmp_path):
    (tmp_path / "t.txt").write_text("abc " * 2000)
    out = prepare([tmp_path / "t.txt"], tmp_path / "o", ByteTokenizer(), 0.1, progress=None)
    index = json.loads((out / "index.json").read_text())
    for listed in index["splits"].values():
        for s in listed:
            (out / s.pop("docs")).unlink()
            s.pop("doc_starts")
    index.update(version=1)
    index.pop("val_every")
    (out / "index.json").write_text(json.dumps(index))
    ds = TokenDataset(out, 16)
    assert ds.train.get([0]).shape == (1, 17)
    for call in (ds.train.doc_starts, ds.val.seams):
        with pytest.raises(DataError, match="without document offsets; prepare it again"):
            call(0, 10)


# Killed from call 25 on, at the first call that finds a shard open (written, not yet in the
# journal): the worker threads tokenize ahead of the writer, so a fixed call number alone may
# fall between two shards and the partly written shard the resume must discard would be absent.
_KILLER = """
import json, os, signal, sys
from pathlib import Path
from meshforge.data import shards
from meshforge.data import text_pieces as pieces
from meshforge.data.prepare import prepare
from meshforge.data.tokenizer import ByteTokenizer
pieces.BATCH_BYTES = shards.HEAD_TOKENS = 1 << 14
out = Path(sys.argv[2])
partial = out.parent / f".{out.name}.partial"
def shard_open():
    try:
        kept = json.loads((partial / "progress.json").read_text())["state"]["splits"]["train"]
    except (OSError, ValueError):
        return False
    return bool(kept) and (partial / f"train_{len(kept):05d}.bin").exists()
class Dying(ByteTokenizer):
    calls = 0
    def encode_batch(self, texts):
        Dying.calls += 1
        if Dying.calls >= 25 and shard_open():
            os.kill(os.getpid(), signal.SIGKILL)
        return super().encode_batch(texts)
prepare([sys.argv[1]], sys.argv[2], Dying(), 0.5, workers=2, shard_tokens=20_000, progress=None)
"""


class Counting(ByteTokenizer):
    def __init__(self):
        self.calls = 0

    def encode_batch(self, texts):
        self.calls += 1
        return super().encode_batch(texts)


def test_a_killed_preparation_resumes_from_its_last_complete_shard(tmp_path, small_batches):
    src = write_jsonl(tmp_path / "d.jsonl", _byte_docs(600))
    clean = Counting()
    prepare([src], tmp_path / "clean", clean, 0.5, workers=2, shard_tokens=20_000, progress=None)
    r = subprocess.run([sys.executable, "-c", _KILLER, str(src), str(tmp_path / "out")], capture_output=True)
    assert r.returncode == -9, r.stderr.decode()[-2000:]
    partial = tmp_path / ".out.partial"
    assert not (tmp_path / "out").exists() and (partial / "progress.json").is_file()
    kept = json.loads((partial / "progress.json").read_text())["state"]["splits"]["train"]
    assert kept and (partial / f"train_{len(kept):05d}.bin").exists()  # the shard being written when killed
    resumed, said = Counting(), io.StringIO()
    prepare([src], tmp_path / "out", resumed, 0.5, workers=2, shard_tokens=20_000, progress=said)
    assert "resuming from" in said.getvalue() and 0 < resumed.calls < clean.calls - 10
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "clean") and not partial.exists()


def test_changed_inputs_restart_instead_of_resuming(tmp_path, small_batches):
    src = write_jsonl(tmp_path / "d.jsonl", _byte_docs(600))
    r = subprocess.run([sys.executable, "-c", _KILLER, str(src), str(tmp_path / "out")], capture_output=True)
    assert r.returncode == -9 and (tmp_path / ".out.partial" / "progress.json").is_file()
    write_jsonl(src, _byte_docs(600, seed=5))
    said = io.StringIO()
    prepare([src], tmp_path / "out", ByteTokenizer(), 0.5, workers=2, shard_tokens=20_000, progress=said)
    prepare([src], tmp_path / "clean", ByteTokenizer(), 0.5, workers=2, shard_tokens=20_000, progress=None)
    assert "resuming" not in said.getvalue() and shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "clean")


def test_concurrent_preparations_of_one_directory(tmp_path, small_batches):
    src = write_jsonl(tmp_path / "d.jsonl", _byte_docs(200))
    results, errors = [], []

    def run():
        try:
            results.append(prepare([src], tmp_path / "out", ByteTokenizer(), 0.1, progress=None))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 3
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl", "out"]
    TokenDataset(tmp_path / "out", 16)


def test_an_occupied_output_directory_is_refused(tmp_path):
    (tmp_path / "t.txt").write_text("x" * 3000)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(DataError, match="exists and is not an empty directory"):
        prepare([tmp_path / "t.txt"], tmp_path / "out", ByteTokenizer(), progress=None)
    assert os.listdir(tmp_path / "out") == ["mine.txt"]


def test_progress_line_says_rates_and_time_left():
    out = io.StringIO()
    p = Progress(10_000_000, out, done=1_000_000, tokens=5_000, interval=0)
    p.update(5_000_000, 1_000_000)
    assert out.getvalue().startswith("meshforge: prepare  50% | 5.0 / 10.0 MB |") and out.getvalue().count("\n") == 1
    assert p.line(p.t0 + 2.0) == (  # two seconds in: 4 MB and 1M tokens of this run's work
        "meshforge: prepare  50% | 5.0 / 10.0 MB | 2.00 MB/s | 500,000 tokens/s | 1,005,000 tokens | ETA 0:02"
    )
    quiet = io.StringIO()
    Progress(100, quiet).update(50, 10)  # a log gets a line every 30 s, not every batch
    assert quiet.getvalue() == ""


@pytest.mark.slow
def test_training_on_parquet_equals_training_on_jsonl(tmp_path):
    pytest.importorskip("pyarrow")
    from conftest import train

    docs = documents(120, seed=3)
    dirs = {
        "jsonl": prepare([write_jsonl(tmp_path / "d.jsonl", docs)], tmp_path / "pj", ByteTokenizer(), 0.05),
        "parquet": prepare([write_parquet(tmp_path / "d.parquet", docs)], tmp_path / "pp", ByteTokenizer(), 0.05),
    }
    assert shard_bytes(dirs["jsonl"]) == shard_bytes(dirs["parquet"])
    losses = {}
    for name, data in dirs.items():
        train(tiny_config(tmp_path / f"run-{name}", data, **{"train.steps": 4, "train.eval_batches": 1}))
        lines = (tmp_path / f"run-{name}" / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in lines]
    assert len(losses["jsonl"]) == 4 and losses["jsonl"] == losses["parquet"]
