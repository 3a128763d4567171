import json

import numpy as np
import pytest

from meshforge.data.dataset import TokenDataset
from meshforge.data.prepare import prepare, prepared_dir_for, val_block_size
from meshforge.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from meshforge.errors import DataError


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcödé, 日本語, 🙂"
    ids = tok.encode(text)
    assert ids.max() < 256 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode(list(ids) + [tok.eos_id]) == text


def _write_hf_tokenizer(path, with_eos=True):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "foo": 3}
    if with_eos:
        vocab["<|endoftext|>"] = 4
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def test_hf_tokenizer_json_round_trip(tmp_path):
    f = tmp_path / "tokenizer.json"
    _write_hf_tokenizer(f)
    tok = load_tokenizer(str(f))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("hello world foo bar")
    assert list(ids) == [1, 2, 3, 0]
    assert tok.decode(ids[:3]) == "hello world foo"
    assert tok.eos_id == 4 and tok.vocab_size == 5


def test_hf_tokenizer_without_eos_refused(tmp_path):
    f = tmp_path / "tokenizer.json"
    _write_hf_tokenizer(f, with_eos=False)
    with pytest.raises(DataError, match="end-of-text"):
        HFTokenizer(f)


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(DataError, match="neither 'byte' nor an existing tokenizer.json"):
        load_tokenizer(str(tmp_path / "nope.json"))


def test_prepare_text_and_jsonl(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("abc" * 20000)
    (src / "docs.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["xy", "zzz"])))
    out = prepare([src], tmp_path / "out", ByteTokenizer(), val_fraction=0.25)
    index = json.loads((out / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["documents"] == 3 and index["vocab_size"] == 258
    counts = {k: sum(s["tokens"] for s in v) for k, v in index["splits"].items()}
    assert counts["train"] + counts["val"] == 60000 + 2 + 3 + 3  # text plus one EOS per document
    # every 4th block goes to validation; the last block is the short rest
    block = index["val_block"]
    assert block == val_block_size(60008, 4) == 60008 // 32  # from the token count, not the files' sizes
    sizes = [block] * (60008 // block) + ([60008 % block] if 60008 % block else [])
    assert counts["val"] == sum(n for i, n in enumerate(sizes) if i % 4 == 3) > 0
    train = np.fromfile(out / index["splits"]["train"][0]["file"], dtype=np.uint16)
    assert (train == 257).sum() + (np.fromfile(out / "val_00000.bin", dtype=np.uint16) == 257).sum() == 3


@pytest.mark.parametrize(
    "content, pattern",
    [
        ("{not json}\n", r"docs\.jsonl:1 is not valid JSON"),
        ('{"txt": "a"}\n', r"docs\.jsonl:1 has no string field"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, content, pattern):
    f = tmp_path / "docs.jsonl"
    f.write_text(content)
    with pytest.raises(DataError, match=pattern):
        prepare([f], tmp_path / "out", ByteTokenizer())
    assert not (tmp_path / "out").exists()


def test_missing_and_empty_inputs(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare([tmp_path / "nope"], tmp_path / "out", ByteTokenizer())
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="holds no text"):
        prepare([tmp_path / "empty.txt"], tmp_path / "out", ByteTokenizer())
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="no text, JSONL, Parquet or Arrow files"):
        prepare([tmp_path / "d"], tmp_path / "out", ByteTokenizer())


def test_sequences_share_one_boundary_token(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("".join(chr(97 + i % 26) for i in range(5000)))
    ds = TokenDataset(prepare([f], tmp_path / "out", ByteTokenizer(), val_fraction=0), seq_len=16)
    batch = ds.train.get([0, 1, 2]).numpy()
    assert batch.shape == (3, 17)
    assert batch[0, -1] == batch[1, 0] and batch[1, -1] == batch[2, 0]
    assert len(ds.train) == (5001 - 1) // 16


def test_truncated_shard_is_named(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("x" * 3000)
    out = prepare([f], tmp_path / "out", ByteTokenizer(), val_fraction=0)
    shard = out / "train_00000.bin"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DataError, match="train_00000.bin has 100 bytes"):
        TokenDataset(out, 16)


def test_raw_paths_are_prepared_once_and_cached(tmp_path, corpus):
    a = prepared_dir_for(str(corpus), ByteTokenizer(), 0.01, str(tmp_path / "cache"))
    mtime = (a / "index.json").stat().st_mtime_ns
    b = prepared_dir_for(str(corpus), ByteTokenizer(), 0.01, str(tmp_path / "cache"))
    assert a == b and (b / "index.json").stat().st_mtime_ns == mtime


def test_default_corpus_is_the_stdlib_and_deterministic(tmp_path):
    a = prepared_dir_for("", ByteTokenizer(), 0.01, str(tmp_path / "c1"))
    b = prepared_dir_for("", ByteTokenizer(), 0.01, str(tmp_path / "c2"))
    ia, ib = (json.loads((d / "index.json").read_text()) for d in (a, b))
    assert ia["source"] == "python-stdlib" and ia["documents"] > 500
    assert ia["splits"] == ib["splits"]
    assert (a / "train_00000.bin").read_bytes()[:100000] == (b / "train_00000.bin").read_bytes()[:100000]


def test_index_from_a_newer_meshforge_is_refused(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("x" * 3000)
    out = prepare([f], tmp_path / "out", ByteTokenizer(), val_fraction=0)
    index = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps({**index, "version": 99}))
    with pytest.raises(DataError, match=r"newer meshforge \(format version 99 > 2\)"):
        TokenDataset(out, 16)
    (out / "index.json").write_text("{not json")
    with pytest.raises(DataError, match=r"cannot read .*index.json.*meshforge data prepare"):
        TokenDataset(out, 16)
