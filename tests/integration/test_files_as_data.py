"""Files are data (issue 50): what meshforge is handed -- a run directory, a checkpoint, a prepared
corpus, a config, a corpus file -- may be a link, a FIFO, a device, nested 50,000 deep, a manifest
that lies, a cut-off stream or a tampered checkpoint whose hashes were computed again. Each case
of the issue, by class, ends within 30 s with exit 2 and one ``meshforge: error:`` paragraph (or,
under ``checkpoint.load = latest``, a fallback to an older checkpoint with a warning and exit 0),
never a traceback; nothing outside the run directory is written, and a refused run writes
nothing at all.

Every case runs the real command in this process (``cli.main``), under an alarm: a read that
waits forever fails the test instead of hanging it (the alarm allows for a busy shared machine;
the cases take seconds, `--durations` shows them).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest

from conftest import cli_args, tiny_config, tiny_overrides, train
from meshforge.checkpoint import store
from meshforge.cli.main import main

TRAINED = {"train.steps": 4, "checkpoint.interval": 2, "train.eval_batches": 0, "optim.warmup_steps": 1}
DEEP = 50_000
LIMIT_S = 120  # (the cases take seconds; a read that waits forever is what this catches)


def snapshot(d: Path) -> dict[str, object] | None:
    """Every entry under ``d``: a file's sha256 and mtime, a link's target, a directory."""
    if not d.exists() and not d.is_symlink():
        return None
    out: dict[str, object] = {}
    for p in [d, *sorted(d.rglob("*"))] if d.is_dir() and not d.is_symlink() else [d]:
        rel = str(p.relative_to(d)) if p != d else "."
        if p.is_symlink():
            out[rel] = "link to " + os.readlink(p)
        elif p.is_file():
            out[rel] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = "special"
    return out


@contextlib.contextmanager
def within(seconds: int):
    """Fail (TimeoutError) instead of waiting past ``seconds``: a read of a FIFO or /dev/zero."""

    def ring(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: it waits or reads forever")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def cli(capsys, argv: list[str]) -> tuple[int, str]:
    """``meshforge ARGV`` in this process, within LIMIT_S: (exit code, stdout + stderr)."""
    with within(LIMIT_S):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    got = capsys.readouterr()
    return code, got.out + got.err


def refused(capsys, argv: list[str], said: str) -> str:
    code, text = cli(capsys, argv)
    assert code == 2 and "Traceback" not in text, text[-3000:]
    assert said in text and text.count("meshforge: error:") == 1, text[-3000:]
    return text


def fell_back(capsys, argv: list[str], run: Path, said: str) -> str:
    """The run went on from the older checkpoint (step 2), warning about the newest."""
    code, text = cli(capsys, argv)
    assert code == 0 and "Traceback" not in text, text[-3000:]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e["event"] == "checkpoint_skipped"]
    assert skipped and said in skipped[-1]["reason"], skipped
    assert [e["step"] for e in events if e["event"] == "resumed"][-1] == 2
    return text


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    d = tmp_path_factory.mktemp("trained") / "run"
    train(tiny_config(d, corpus, **TRAINED))
    return d


@pytest.fixture
def run(trained, tmp_path) -> Path:
    r = tmp_path / "run"
    shutil.copytree(trained, r, symlinks=True)
    return r


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory of the user's, outside every run: nothing may write there."""
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("my notes\n")
    (d / "meta.json").write_text('{"mine": true}\n')
    return d


def resume_args(run: Path, corpus: Path, **extra) -> list[str]:
    return ["train", *cli_args(tiny_overrides(run, corpus, **{**TRAINED, "train.steps": 6, **extra}))]


def newest(run: Path) -> Path:
    return run / "checkpoints" / "step-00000004"


def rehash(ckpt: Path, name: str) -> None:
    """Record ``name``'s size and hash in meta.json again, as a tamperer would."""
    meta = json.loads((ckpt / "meta.json").read_text())
    data = (ckpt / name).read_bytes()
    meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "meta.json").write_text(json.dumps(meta))


# --- 1. never written through a link --------------------------------------------------------------


def test_a_config_toml_link_to_a_file_of_yours_is_refused_under_overwrite(capsys, run, outside, corpus):
    (run / "config.toml").unlink()
    (run / "config.toml").symlink_to(outside / "notes.txt")
    before, mine = snapshot(run), snapshot(outside)
    text = refused(capsys, [*resume_args(run, corpus), "--run.overwrite=true"], "is a symbolic link")
    assert "config.toml" in text and snapshot(outside) == mine and snapshot(run) == before


@pytest.mark.parametrize("name", ["checkpoints/.tmp-step-00000006", "checkpoints/step-00000004", "metrics.jsonl"])
def test_a_link_where_a_run_writes_or_removes_is_refused_before_anything_is_written(capsys, run, outside, corpus, name):
    target = run / name
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)
    target.symlink_to(outside if name.startswith("checkpoints") else outside / "notes.txt")
    before, mine = snapshot(run), snapshot(outside)
    refused(capsys, resume_args(run, corpus), f"{target} is a symbolic link")
    assert snapshot(outside) == mine and snapshot(run) == before


def test_a_link_put_where_a_save_makes_its_folder_is_refused_not_written_through(tmp_path, outside):
    """The save itself (a link made after the pre-flight looked): refused, not followed."""
    from meshforge.safeio.links import LinkRefused

    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / store.tmp_dir_name(6)).symlink_to(outside)
    mine = snapshot(outside)
    with pytest.raises(LinkRefused, match="is a symbolic link"):
        store.new_save_dir(root / store.tmp_dir_name(6))
    with pytest.raises(LinkRefused, match="is a symbolic link"):
        store.clean_incomplete(root)
    assert snapshot(outside) == mine


def test_report_out_through_a_link_is_refused(capsys, run, outside):
    (run / "elsewhere.html").symlink_to(outside / "notes.txt")
    mine = snapshot(outside)
    refused(capsys, ["report", str(run), "--out", str(run / "elsewhere.html")], "is a symbolic link")
    assert snapshot(outside) == mine


# --- 2. never read forever ------------------------------------------------------------------------


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _link_to_zero(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")


@pytest.mark.parametrize(
    "name, make",
    [("__0_0.distcp", _fifo), ("__0_0.distcp", _link_to_zero), ("meta.json", _link_to_zero), (".metadata", _fifo)],
    ids=["shard-fifo", "shard-dev-zero", "meta-dev-zero", "metadata-fifo"],
)
def test_a_checkpoint_file_that_never_ends_is_refused_by_convert_and_skipped_by_latest(
    capsys, run, tmp_path, corpus, name, make
):
    make(newest(run) / name)
    out = tmp_path / "hf"
    refused(capsys, ["convert", "--from-checkpoint", str(newest(run)), "--out", str(out)], "not a regular file")
    assert not out.exists()
    refused(capsys, resume_args(run, corpus), str(newest(run) / name))  # (a link or FIFO inside run.dir)


def test_a_meta_json_listing_a_device_is_refused_and_latest_falls_back(capsys, run, tmp_path, corpus):
    meta = json.loads((newest(run) / "meta.json").read_text())
    meta["files"]["/dev/zero"] = {"bytes": 1 << 40, "sha256": "0" * 64}
    (newest(run) / "meta.json").write_text(json.dumps(meta))
    refused(capsys, ["convert", "--from-checkpoint", str(newest(run)), "--out", str(tmp_path / "hf")], "/dev/zero")
    fell_back(capsys, resume_args(run, corpus), run, "/dev/zero")


@pytest.mark.parametrize("make", [_fifo, _link_to_zero], ids=["fifo", "dev-zero"])
def test_a_token_shard_that_never_ends_is_refused(capsys, tmp_path, corpus, make):
    data = tmp_path / "data"
    assert cli(capsys, ["data", "prepare", "--input", str(corpus), "--out", str(data)])[0] == 0
    make(data / "train_00000.bin")
    refused(capsys, ["train", *cli_args(tiny_overrides(tmp_path / "r", data))], "is not a regular file")
    assert not (tmp_path / "r").exists()


def test_data_prepare_of_a_fifo_with_no_writer_is_refused(capsys, tmp_path):
    os.mkfifo(tmp_path / "in.txt")
    refused(capsys, ["data", "prepare", "--input", str(tmp_path / "in.txt"), "--out", str(tmp_path / "o")], "FIFO")
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("make", [_fifo, _link_to_zero], ids=["fifo", "dev-zero"])
def test_weights_that_never_end_are_refused_before_a_run_directory_is_written(capsys, run, tmp_path, corpus, make):
    weights = tmp_path / "weights"
    shutil.copytree(run / "final", weights)
    make(weights / "model.safetensors")
    said = "model.safetensors is not a regular file"
    refused(capsys, ["generate", str(weights), "--prompt", "x", "--tokenizer", "byte"], said)
    fresh = tmp_path / "fresh"
    refused(capsys, ["train", *cli_args(tiny_overrides(fresh, corpus, **{"model.init_from": weights}))], said)
    assert not fresh.exists()


# --- 3. nesting has a depth limit ------------------------------------------------------------------


def _deep_json() -> str:
    return "[" * DEEP + "]" * DEEP


def test_a_config_nested_50000_deep_is_refused(capsys, tmp_path, corpus):
    (tmp_path / "deep.toml").write_text("[train]\nx = " + "[" * DEEP + "]" * DEEP + "\n")
    refused(capsys, ["train", "--config", str(tmp_path / "deep.toml"), f"--data.path={corpus}"], "levels deep")


def test_a_jsonl_record_nested_50000_deep_is_refused_and_leaves_no_partial_directory(capsys, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "hello " * 100}) + "\n" + _deep_json() + "\n")
    out = tmp_path / "o"
    refused(capsys, ["data", "prepare", "--input", str(tmp_path / "in.jsonl"), "--out", str(out)], "levels deep")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name not in ("in.jsonl",)]


def test_an_index_json_nested_50000_deep_is_refused(capsys, tmp_path, corpus):
    data = tmp_path / "data"
    assert cli(capsys, ["data", "prepare", "--input", str(corpus), "--out", str(data)])[0] == 0
    (data / "index.json").write_text(_deep_json())
    refused(capsys, ["train", *cli_args(tiny_overrides(tmp_path / "r", data))], "levels deep")
    assert not (tmp_path / "r").exists()


def test_a_meta_json_nested_50000_deep_is_refused_and_latest_falls_back(capsys, run, tmp_path, corpus):
    (newest(run) / "meta.json").write_text('{"format": ' + _deep_json() + "}")
    refused(capsys, ["convert", "--from-checkpoint", str(newest(run)), "--out", str(tmp_path / "hf")], "levels deep")
    fell_back(capsys, resume_args(run, corpus), run, "levels deep")


def test_a_metrics_line_nested_50000_deep_is_skipped_by_report(capsys, run):
    with (run / "metrics.jsonl").open("a") as f:
        f.write(_deep_json() + "\n")
    code, text = cli(capsys, ["report", str(run)])
    assert code == 0 and "Traceback" not in text and (run / "report.html").stat().st_size > 1000


def test_an_hf_config_nested_50000_deep_is_refused(capsys, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama", "x": ' + _deep_json() + "}")
    refused(capsys, ["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "o")], "levels deep")
    assert not (tmp_path / "o").exists()


# --- 4. manifests are checked against their schema ---------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus) -> Path:
    from meshforge.data.prepare import prepare
    from meshforge.data.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare([corpus], out, load_tokenizer("byte"))
    return out


def _edited_index(prepared: Path, tmp_path: Path, change) -> Path:
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    index = json.loads((data / "index.json").read_text())
    change(index)
    (data / "index.json").write_text(json.dumps(index))
    return data


def _float64(index: dict) -> None:
    """dtype float64, the token counts adjusted to the files' sizes (uint16: a quarter of them)."""
    index["dtype"] = "float64"
    for shards in index["splits"].values():
        for s in shards:
            s["tokens"] //= 4


INDEX_EDITS = [
    ("dtype-float64", _float64, "dtype must be one of 'uint16', 'uint32'"),
    ("dtype-notatype", lambda i: i.update(dtype="notatype"), "dtype must be one of"),
    ("vocab-size-text", lambda i: i.update(vocab_size="512"), "vocab_size must be a whole number"),
    ("splits-train-a-dict", lambda i: i["splits"].update(train={"file": "x"}), "splits.train must be a list"),
    ("no-splits", lambda i: i.pop("splits"), "splits is missing"),
    ("val-every-text", lambda i: i.update(val_every="9"), "val_every must be a whole number"),
    ("version-text", lambda i: i.update(version="2"), "version must be a whole number"),
    ("shard-outside", lambda i: i["splits"]["train"][0].update(file="../../etc/passwd"), "a plain file name"),
    ("max-id-past-vocab", lambda i: i.update(max_token_id=i["vocab_size"]), "lies outside its vocab_size"),
]


@pytest.mark.parametrize("change, said", [c[1:] for c in INDEX_EDITS], ids=[c[0] for c in INDEX_EDITS])
def test_an_index_json_that_lies_is_refused_before_the_run_starts(capsys, prepared, tmp_path, change, said):
    data = _edited_index(prepared, tmp_path, change)
    refused(capsys, ["train", *cli_args(tiny_overrides(tmp_path / "r", data))], said)
    assert not (tmp_path / "r").exists()


def test_token_ids_beyond_the_vocabulary_are_refused_before_the_run_starts(capsys, prepared, tmp_path):
    """Shards edited after index.json was written (its max_token_id no longer true)."""
    data = _edited_index(prepared, tmp_path, lambda i: None)
    shard = data / "train_00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[100:102] = (5000).to_bytes(2, "little")
    shard.write_bytes(bytes(raw))
    refused(capsys, ["train", *cli_args(tiny_overrides(tmp_path / "r", data))], "token id 5000")
    assert not (tmp_path / "r").exists()


# --- 5. a cut-off stream is an error -------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".txt.zst", ".txt.gz", ".jsonl.zst"])
def test_a_truncated_compressed_file_is_refused(capsys, tmp_path, corpus, suffix):
    zstandard = pytest.importorskip("zstandard")
    text = "".join(p.read_text() for p in sorted(corpus.iterdir()))
    if suffix.startswith(".jsonl"):
        text = "".join(json.dumps({"text": line}) + "\n" for line in text.splitlines())
    packed = zstandard.ZstdCompressor().compress(text.encode()) if "zst" in suffix else gzip.compress(text.encode())
    (tmp_path / f"in{suffix}").write_bytes(packed[: len(packed) // 2])
    out = tmp_path / "o"
    refused(capsys, ["data", "prepare", "--input", str(tmp_path / f"in{suffix}"), "--out", str(out)], "truncated")
    assert not out.exists()
    (tmp_path / f"in{suffix}").write_bytes(packed)  # whole: prepared
    assert cli(capsys, ["data", "prepare", "--input", str(tmp_path / f"in{suffix}"), "--out", str(out)])[0] == 0


# --- 6. a tampered checkpoint whose hashes were computed again -------------------------------------------


def _edit_metadata(change):
    def edit(ckpt: Path) -> None:
        md = pickle.loads((ckpt / ".metadata").read_bytes())  # (the test's own file: trusted here)
        change(md)
        (ckpt / ".metadata").write_bytes(pickle.dumps(md))
        rehash(ckpt, ".metadata")

    return edit


def _huge(md) -> None:
    entry = md.state_dict_metadata["model.layers.0.attention.wq.weight"]
    entry.size = type(entry.size)([2**40, 2**20])


def _negative_offset(md) -> None:
    info = next(iter(md.storage_data.values()))
    info.offset = -8


def _moved(md) -> None:
    """The second stored item said to lie where the first one does (both hashes recomputed)."""
    first, second = list(md.storage_data.values())[:2]
    second.offset = first.offset


def _field_renamed(ckpt: Path) -> None:
    """One byte of the pickle changed: the Metadata it builds lacks state_dict_metadata (the fuzz found it)."""
    raw = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(raw.replace(b"state_dict_metadata", b"state_dict_meXadata", 1))
    rehash(ckpt, ".metadata")


def _edit_rank_file(change):
    def edit(ckpt: Path) -> None:
        data = json.loads((ckpt / "rank-00000.json").read_text())
        change(data)
        (ckpt / "rank-00000.json").write_text(json.dumps(data))
        rehash(ckpt, "rank-00000.json")

    return edit


def _edit_meta(change):
    def edit(ckpt: Path) -> None:
        meta = json.loads((ckpt / "meta.json").read_text())
        change(meta)
        (ckpt / "meta.json").write_text(json.dumps(meta))

    return edit


def _not_utf8(ckpt: Path) -> None:
    (ckpt / "meta.json").write_bytes(b'{"format": "\xff\xfe"}')


TAMPERED = [
    ("size-2^40x2^20", _edit_metadata(_huge), "model.layers.0.attention.wq.weight"),
    (
        "chunks-a-string",
        _edit_metadata(lambda md: setattr(next(iter(md.state_dict_metadata.values())), "chunks", "x")),
        "no list of stored chunks",
    ),
    ("empty-state-dict", _edit_metadata(lambda md: md.state_dict_metadata.clear()), "holds no model."),
    ("negative-offset", _edit_metadata(_negative_offset), "negative or non-integer offset"),
    ("item-moved", _edit_metadata(_moved), "is said to be stored inside"),
    ("field-renamed", _field_renamed, "state_dict_metadata is not a mapping"),
    ("rng-garbage", _edit_rank_file(lambda d: d["rng"].update(torch="AAAA")), "RNG state"),
    ("version-text", _edit_meta(lambda m: m.update(version="1")), "version must be a whole number"),
    ("bytes-missing", _edit_meta(lambda m: m["files"]["__0_0.distcp"].pop("bytes")), "bytes is missing"),
    ("meta-not-utf8", _not_utf8, "is not UTF-8"),
]


@pytest.mark.parametrize("tamper, said", [c[1:] for c in TAMPERED], ids=[c[0] for c in TAMPERED])
def test_a_tampered_checkpoint_is_refused_by_name_and_latest_falls_back_past_it(
    capsys, run, tmp_path, corpus, tamper, said
):
    tamper(newest(run))
    fresh = tmp_path / "fresh"
    argv = resume_args(fresh, corpus, **{"checkpoint.load": str(newest(run))})
    refused(capsys, argv, said)
    assert not fresh.exists(), "a refused run wrote its run directory"
    refused(capsys, ["convert", "--from-checkpoint", str(newest(run)), "--out", str(tmp_path / "hf")], said)
    fell_back(capsys, resume_args(run, corpus), run, said)


def test_shards_of_another_model_are_refused_and_latest_falls_back(capsys, run, tmp_path, corpus):
    other = tmp_path / "other"
    train(tiny_config(other, corpus, **{**TRAINED, "model.hidden": 32, "model.ffn_hidden": 64}))
    for name in (".metadata", "__0_0.distcp"):
        shutil.copy(other / "checkpoints" / "step-00000004" / name, newest(run) / name)
        rehash(newest(run), name)
    refused(capsys, ["convert", "--from-checkpoint", str(newest(run)), "--out", str(tmp_path / "hf")], "another model")
    fell_back(capsys, resume_args(run, corpus), run, "another model")


# --- 7. odd names ---------------------------------------------------------------------------------------------


def test_a_run_dir_of_bytes_that_are_not_utf8_is_refused_writing_nothing(capsys, tmp_path, corpus):
    run = Path(os.fsdecode(bytes(tmp_path) + b"/r\xffun"))
    refused(capsys, ["train", *cli_args(tiny_overrides(run, corpus))], "not UTF-8")
    assert os.listdir(tmp_path) == []


def test_a_tokenizer_with_an_id_past_its_vocabulary_is_refused(capsys, tmp_path, corpus):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "a": 1, "<|endoftext|>": 2**31 - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.save(str(tmp_path / "tokenizer.json"))
    argv = ["data", "prepare", "--input", str(corpus), "--out", str(tmp_path / "o")]
    text = refused(capsys, [*argv, "--tokenizer", str(tmp_path / "tokenizer.json")], "2,147,483,647")
    assert "resume" not in text and not (tmp_path / "o").exists()


def test_a_link_to_itself_in_the_input_directory_is_passed_over(capsys, tmp_path, corpus):
    d = tmp_path / "in"
    shutil.copytree(corpus, d)
    (d / "loop.txt").symlink_to(d / "loop.txt")
    code, text = cli(capsys, ["data", "prepare", "--input", str(d), "--out", str(tmp_path / "o")])
    assert code == 0 and "Traceback" not in text, text[-3000:]


def test_a_stop_while_two_ranks_start_says_so_and_leaves_no_run_directory(tmp_path, corpus):
    """SIGTERM after the launcher started its ranks, before they installed their stop handler
    (they are still importing torch): one line that says what happened, and the run directory
    this launch created, holding only config.toml, is gone."""
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "meshforge", "train", "--nproc", "2", *cli_args(tiny_overrides(run, corpus))]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None and not _ranks_started(p.pid, run):
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()[1][-3000:]
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert "stopped (SIGTERM) while its 2 rank(s) were starting" in err and "see their output above" not in err
    assert not run.exists(), sorted(os.listdir(run))


def _ranks_started(pid: int, run: Path) -> bool:
    """The pre-flight is over (config.toml written: no corpus workers any more) and ``pid`` has children."""
    if not (run / "config.toml").exists():
        return False
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                return True
    return False
