"""Every input format gives the same shards as the same documents in JSONL; bad input is named."""

import gzip
import json
import sys

import numpy as np
import pytest

from conftest import run_cli
from corpus_files import (
    documents,
    reference_stream,
    shard_bytes,
    split_streams,
    write_hf_dataset,
    write_jsonl,
    write_jsonl_gz,
    write_jsonl_zst,
    write_parquet,
    write_text_dir,
)
from meshforge.data import text_pieces as pieces
from meshforge.data.prepare import prepare
from meshforge.data.sources import discover
from meshforge.data.tokenizer import ByteTokenizer
from meshforge.errors import DataError
from meshforge.health.text_check import refuse_binary

DOCS = documents(40, long_doc=300_000)  # the long one spans five pieces


def _prepare(inputs, out, **kw):
    return prepare(inputs, out, ByteTokenizer(), 0.5, progress=None, workers=2, shard_tokens=50_000, **kw)


@pytest.fixture(scope="module", autouse=True)
def _small_batches():
    """Batches of 16 KiB of text (not 256 KiB), so that this small corpus makes several shards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pieces, "BATCH_BYTES", 1 << 14)
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    return _prepare([write_jsonl(d / "docs.jsonl", DOCS)], d / "out")


def test_reference_holds_the_documents_in_order(reference):
    stream, _ = reference_stream(ByteTokenizer(), DOCS)
    index = json.loads((reference / "index.json").read_text())
    assert index["documents"] == len(DOCS) and index["tokens"] == len(stream)
    assert len(index["splits"]["train"]) > 1  # several shards, closed together with val's
    b, k = index["val_block"], index["val_every"]
    blocks = [stream[i : i + b] for i in range(0, len(stream), b)]
    got = split_streams(reference)
    assert np.array_equal(got["train"], np.concatenate([x for i, x in enumerate(blocks) if i % k != k - 1]))
    assert np.array_equal(got["val"], np.concatenate([x for i, x in enumerate(blocks) if i % k == k - 1]))


@pytest.mark.parametrize(
    "fmt",
    ["text_dir", "jsonl_gz", "jsonl_zst", "parquet", "hf_arrow", "glob", "mixed_dir", "custom_field"],
)
def test_every_format_gives_the_jsonl_shards(tmp_path, reference, fmt):
    half = len(DOCS) // 2
    if fmt in ("parquet", "hf_arrow", "mixed_dir"):
        pytest.importorskip("pyarrow")
    if fmt == "jsonl_zst":
        pytest.importorskip("zstandard")
    field = "text"
    if fmt == "text_dir":
        inputs = [write_text_dir(tmp_path / "docs", DOCS)]
    elif fmt == "jsonl_gz":
        inputs = [write_jsonl_gz(tmp_path / "docs.jsonl.gz", DOCS)]
    elif fmt == "jsonl_zst":
        inputs = [write_jsonl_zst(tmp_path / "docs.jsonl.zst", DOCS)]
    elif fmt == "parquet":
        inputs = [write_parquet(tmp_path / "docs.parquet", DOCS)]
    elif fmt == "hf_arrow":
        inputs = [write_hf_dataset(tmp_path / "saved", DOCS)]
    elif fmt == "glob":  # C4's naming: JSON lines in .json.gz
        write_jsonl_gz(tmp_path / "c4-00000.json.gz", DOCS[:half])
        write_jsonl_gz(tmp_path / "c4-00001.json.gz", DOCS[half:])
        inputs = [str(tmp_path / "c4-*.json.gz")]
    elif fmt == "mixed_dir":
        (tmp_path / "mix").mkdir()
        write_jsonl_gz(tmp_path / "mix" / "a.jsonl.gz", DOCS[:10])
        write_parquet(tmp_path / "mix" / "b.parquet", DOCS[10:half])
        write_text_dir(tmp_path / "mix" / "c", DOCS[half:])
        (tmp_path / "mix" / "notes.json").write_text("{}")  # not data: left out
        inputs = [tmp_path / "mix"]
    else:
        field = "content"
        inputs = [write_parquet(tmp_path / "docs.parquet", DOCS, field="content")]
    out = _prepare(inputs, tmp_path / "out", field=field)
    assert shard_bytes(out) == shard_bytes(reference)


def test_bad_records_name_the_file_and_line_or_row(tmp_path):
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write('{"text": "fine"}\n\n{"text": broken}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz:3 is not valid JSON"):
        _prepare([bad], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
    field = write_jsonl(tmp_path / "f.jsonl", ["a", "b"], field="body")
    with pytest.raises(DataError, match=r'f\.jsonl:1 has no string field "text".*--field'):
        _prepare([field], tmp_path / "out")
    truncated = tmp_path / "cut.jsonl.gz"
    whole = gzip.compress("".join(json.dumps({"text": str(i * i)}) + "\n" for i in range(5000)).encode())
    truncated.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz could not be read as gzip"):
        _prepare([truncated], tmp_path / "out")
    with pytest.raises(DataError, match=r"matches no files"):
        _prepare([str(tmp_path / "nothing-*.parquet")], tmp_path / "out")


def test_a_lone_surrogate_becomes_a_replacement_not_a_crash(tmp_path):
    f = tmp_path / "s.jsonl"
    f.write_text('{"text": "a\\ud800b"}\n{"text": "ok"}\n')  # valid JSON, not valid Unicode
    out = _prepare([f], tmp_path / "out")
    assert split_streams(out)["train"].tolist() == [*b"a?b", 257, *b"ok", 257]


def test_bad_parquet_is_named(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    with pytest.raises(DataError, match=r"no column 'text' \(columns: id, body\).*--field"):
        _prepare([write_parquet(tmp_path / "a.parquet", ["x"], field="body")], tmp_path / "out")
    pq.write_table(pa.table({"text": ["a", "b", "c", None, "e"]}), tmp_path / "n.parquet", row_group_size=2)
    with pytest.raises(DataError, match=r"n\.parquet row 3: 'text' is null"):
        _prepare([tmp_path / "n.parquet"], tmp_path / "out")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "i.parquet")
    with pytest.raises(DataError, match=r"column 'text' holds int64, not text"):
        _prepare([tmp_path / "i.parquet"], tmp_path / "out")
    (tmp_path / "fake.parquet").write_text("not parquet at all")
    with pytest.raises(DataError, match=r"fake\.parquet could not be read"):
        _prepare([tmp_path / "fake.parquet"], tmp_path / "out")
    dd = tmp_path / "dd"
    write_hf_dataset(dd / "train", ["a"])
    (dd / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(DataError, match=r"DatasetDict .* point at one split's directory .*dd/train"):
        _prepare([dd], tmp_path / "out")
    (dd / "train" / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(DataError, match=r"state\.json lists no data files, or files missing from"):
        _prepare([dd / "train"], tmp_path / "out")


def test_prepared_shards_as_input_are_named(tmp_path, reference):
    with pytest.raises(DataError, match=r"holds prepared token shards already \(index\.json\)"):
        _prepare([reference], tmp_path / "out")


def test_missing_optional_packages_say_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    (tmp_path / "b.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(DataError, match=r"needs pyarrow: pip install 'meshforge\[parquet\]'"):
        _prepare([tmp_path / "a.parquet"], tmp_path / "out")
    with pytest.raises(DataError, match=r"needs the zstandard package: pip install 'meshforge\[zstd\]'"):
        _prepare([tmp_path / "b.jsonl.zst"], tmp_path / "out")


def test_directory_walk_takes_data_files_only(tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"x"))
    (tmp_path / "b.parquet").write_bytes(b"")
    (tmp_path / "c.json").write_text("{}")  # metadata, not JSON lines
    (tmp_path / "d.bin").write_bytes(b"\0")
    (tmp_path / "e.ndjson").write_text("")
    kinds = [(s.path.name, s.kind, s.compression) for s in discover([tmp_path])]
    assert kinds == [("a.txt.gz", "text", "gz"), ("b.parquet", "parquet", ""), ("e.ndjson", "jsonl", "")]
    assert [s.kind for s in discover([tmp_path / "d.bin"])] == ["text"]  # named explicitly: text


def test_formats_are_not_refused_as_binary(tmp_path):
    pytest.importorskip("pyarrow")
    refuse_binary(str(write_parquet(tmp_path / "a.parquet", ["some text"] * 50)), allow_binary=False)
    refuse_binary(str(write_jsonl_gz(tmp_path / "a.jsonl.gz", ["some text"] * 50)), allow_binary=False)
    refuse_binary(str(tmp_path), allow_binary=False)


def test_cli_prepares_a_glob_with_a_field_and_names_a_bad_column(tmp_path):
    pytest.importorskip("pyarrow")
    write_parquet(tmp_path / "p0.parquet", DOCS[:20], field="content")
    write_parquet(tmp_path / "p1.parquet", DOCS[20:], field="content")
    args = ("data", "prepare", "--input", str(tmp_path / "p*.parquet"), "--out", str(tmp_path / "out"))
    r = run_cli(*args, "--field", "content", "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert f"prepared {len(DOCS)} documents into {tmp_path / 'out'}" in r.stdout
    r = run_cli(*args[:-1], str(tmp_path / "out2"))
    assert r.returncode == 2 and "meshforge: error:" in r.stderr and "no column 'text'" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out2").exists()
