"""Hostile and careless input, as a table (issue 39): every case answers with its exit code and
one ``meshforge: error:`` paragraph naming what is wrong -- never a traceback -- and writes
nothing where it should not: a refused run leaves its run directory byte for byte as it was
(files and their mtimes; the lock file comes and goes, so the directory's own mtime is not
compared), no user file is written over, no code runs from a checkpoint.

Most cases run in this process through ``cli.main`` (a refusal costs milliseconds); the ones
that train or start ranks are marked slow. The cases of the issue come first, then the old
ones of test_cli.py / test_reliability.py, then what a second pass as a hostile user found.
"""

from __future__ import annotations

import hashlib
import http.client
import importlib.util
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tomllib

from conftest import cli_args, tiny_config, tiny_overrides, train
from meshforge.checkpoint import store
from meshforge.cli.main import main
from meshforge.config import key_type, load_config
from meshforge.config.keys import keys
from meshforge.errors import ConfigError
from meshforge.guards import disk

TINY = [
    *("--model.hidden=64", "--model.layers=2", "--model.heads=4", "--model.kv_heads=2", "--model.ffn_hidden=128"),
    *("--train.seq_len=32", "--train.global_batch_size=8", "--train.eval_batches=0", "--metrics.console=false"),
]
TRAINED = {"train.steps": 4, "checkpoint.interval": 2, "train.eval_batches": 0, "optim.warmup_steps": 1}


def snapshot(d: Path) -> dict[str, object] | None:
    """Every entry under ``d``: a file's sha256 and mtime, a directory's or link's kind."""
    if not d.exists():
        return None
    out: dict[str, object] = {}
    for p in sorted(d.rglob("*")):
        rel = str(p.relative_to(d))
        if p.is_symlink() or not p.is_file():
            out[rel] = "link" if p.is_symlink() else "dir"
        else:
            out[rel] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


def cli(capsys, argv: list[str]) -> tuple[int, str]:
    """``meshforge ARGV`` in this process: (exit code, stdout + stderr)."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code if isinstance(e.code, int) else 2
    got = capsys.readouterr()
    return code, got.out + got.err


def refused(capsys, argv: list[str], said: str, code: int = 2) -> str:
    got, text = cli(capsys, argv)
    assert got == code, text[-3000:]
    assert "Traceback" not in text
    assert said in text, text[-3000:]
    if code == 2:
        assert text.count("meshforge: error:") + text.count(": error: ") >= 1
    return text


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Hostile files, made once: binary, broken and misplaced configs, a FIFO, user folders."""
    h = tmp_path_factory.mktemp("hostile")
    (h / "bin.toml").write_bytes(b"\x00\x01\x02\xff\xfe garbage")
    (h / "bad.toml").write_text("[train\nsteps = ")
    (h / "top.toml").write_text("steps = 3\n")
    (h / "file.txt").write_text("a file\n")
    os.mkfifo(h / "fifo")
    (h / "user").mkdir()
    (h / "user" / "thesis.tex").write_text("mine\n")
    (h / "run" / "checkpoints").mkdir(parents=True)
    (h / "run" / "events.jsonl").write_text("")
    (h / "hf-list").mkdir()
    (h / "hf-list" / "config.json").write_text("[1, 2]")
    (h / "hf-huge").mkdir()
    big = {"model_type": "llama", "hidden_size": 2**30, "num_hidden_layers": 2**20, "num_attention_heads": 4}
    (h / "hf-huge" / "config.json").write_text(json.dumps({**big, "intermediate_size": 128, "vocab_size": 300}))
    (h / "hf-huge" / "model.safetensors").write_bytes(b"\x00" * 64)
    (h / "hf-types").mkdir()
    (h / "hf-types" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "64"}))
    return h


# (id, argv with {run} {corpus} {h} placeholders, exit code, what the message says)
CLI_CASES = [
    # the issue's cases
    ("lr-inf", ["train", "--optim.lr=inf"], 2, "optim.lr = inf must be a finite number"),
    ("steps-1e23", ["train", "--train.steps=100000000000000000000000"], 2, "train.steps"),
    ("max-restarts-negative", ["train", "--max-restarts", "-1"], 2, "--max-restarts -1 must be between 0 and"),
    ("nproc-0-dry-run", ["train", "--nproc", "0", "--dry-run"], 2, "--nproc 0 must be between 1 and"),
    ("nproc-negative", ["train", "--nproc", "-3", "--dry-run"], 2, "--nproc -3 must be between 1 and"),
    ("config-a-directory", ["train", "--config", "{h}"], 2, "is a directory; pass a TOML file"),
    ("run-dir-too-long", ["train", "--run.dir={h}/" + "x" * 300], 2, "too long for its filesystem"),
    # the old ones (test_cli.py, test_reliability.py)
    ("key-in-wrong-section", ["train", "--train.lr=1e-3"], 2, "did you mean --optim.lr?"),
    ("bare-option", ["train", "--optim.lr"], 2, "--optim.lr needs a value"),
    ("from-hf-hub-name", ["convert", "--from-hf", "meta-llama/Llama-3.2-1B", "--out", "{run}"], 2, "no hub downloads"),
    ("unknown-flag", ["train", "--nprocs", "2"], 2, "did you mean '--nproc'?"),
    # a second pass as a hostile user
    ("nproc-text", ["train", "--nproc", "2.5"], 2, "--nproc takes a whole number"),
    ("config-binary", ["train", "--config", "{h}/bin.toml"], 2, "is not a UTF-8 TOML file"),
    ("config-broken", ["train", "--config", "{h}/bad.toml"], 2, "is not valid TOML"),
    ("config-top-level-key", ["train", "--config", "{h}/top.toml"], 2, "must be a section like [steps]"),
    ("config-fifo", ["train", "--config", "{h}/fifo"], 2, "is not a regular file"),
    ("config-device", ["train", "--config", "/dev/zero"], 2, "is not a regular file"),
    ("seed-negative", ["train", "--train.seed=-1"], 2, "train.seed = -1 is out of range"),
    ("lr-typo", ["train", "--optim.lr=3e4"], 2, "optim.lr = 30,000 is out of range: it must be in (0, 10]"),
    ("hidden-10M", ["train", "--model.hidden=10000000"], 2, "model.hidden = 10,000,000 is out of range"),
    ("hang-timeout-1ms", ["train", "--health.hang_timeout_s=0.001"], 2, "or 0"),
    ("pp-layers-negative", ["train", "--parallel.pp_layers=[-1,3]"], 2, "parallel.pp_layers holds -1"),
    ("run-dir-nul", ["train", "--run.dir={h}/a\x00b"], 2, "NUL character"),
    ("run-dir-a-file", ["train", "--run.dir={h}/file.txt"], 2, "exists and is not a directory"),
    ("run-dir-under-a-file", ["train", "--run.dir={h}/file.txt/run"], 2, "Not a directory (ENOTDIR)"),
    ("run-dir-of-user-files", ["train", "--run.dir={h}/user"], 2, "holds files meshforge did not write (thesis.tex)"),
    ("init-from-file", ["train", "--model.init_from=/etc/passwd"], 2, "is not a directory of weights"),
    ("data-cache-a-file", ["train", "--data.cache_dir={h}/file.txt", "--data.path={h}/top.toml"], 2, "data.cache_dir"),
    ("prepare-binary", ["data", "prepare", "--input", "/bin/ls", "--out", "{run}"], 2, "--allow-binary"),
    ("prepare-out-user-dir", ["data", "prepare", "--input", "{corpus}", "--out", "{h}/user"], 2, "is not empty"),
    ("prepare-out-a-file", ["data", "prepare", "--input", "{corpus}", "--out", "{h}/file.txt"], 2, "is a file"),
    ("prepare-out-too-long", ["data", "prepare", "--input", "{corpus}", "--out", "{h}/" + "y" * 300], 2, "too long"),
    ("convert-out-in-a-run", ["convert", "--from-hf", "{h}", "--out", "{h}/run/checkpoints/hf"], 2, "own folders"),
    ("convert-out-a-file", ["convert", "--from-hf", "{h}", "--out", "{h}/file.txt"], 2, "is a file, not a directory"),
    ("convert-out-too-long", ["convert", "--from-hf", "{h}", "--out", "{h}/" + "z" * 300], 2, "ENAMETOOLONG"),
    ("convert-out-unwritable", ["convert", "--from-hf", "{h}", "--out", "/proc/mf-out"], 2, "cannot write --out at"),
    ("hf-config-a-list", ["convert", "--from-hf", "{h}/hf-list", "--out", "{run}"], 2, "not a model config object"),
    ("hf-config-types", ["convert", "--from-hf", "{h}/hf-types", "--out", "{run}"], 2, "config.json"),
    ("hf-config-huge", ["convert", "--from-hf", "{h}/hf-huge", "--out", "{run}"], 2, "weight files hold 64 bytes"),
    ("report-out-a-dir", ["report", "{h}", "--out", "{h}/user"], 2, "is a directory; give a file name"),
    (
        "report-out-user-file",
        ["report", "{h}", "--out", "{h}/user/thesis.tex"],
        2,
        "is not an earlier report (an HTML file), the only",
    ),
    ("report-out-missing-dir", ["report", "{h}", "--out", "{h}/nope/r.html"], 2, "does not exist; create it"),
    ("report-out-under-file", ["report", "{h}", "--out", "{h}/file.txt/r.html"], 2, "is a file, not a directory"),
    ("report-out-too-long", ["report", "{h}", "--out", "{h}/" + "r" * 300], 2, "ENAMETOOLONG"),
    ("report-not-a-run", ["report", "{h}/user"], 2, "is not a meshforge run directory"),
    ("calibrate-out-user-file", ["calibrate", "--out", "{h}/user/thesis.tex", "--quick"], 2, "a hardware profile"),
    ("calibrate-out-a-dir", ["calibrate", "--out", "{h}/user", "--quick"], 2, "is a directory"),
    ("calibrate-out-missing-dir", ["calibrate", "--out", "{h}/nope/hw.json", "--quick"], 2, "does not exist"),
    (
        "emit-config-over-a-file",
        ["plan", "--model", "debug", "--gpus", "2", "--emit-config", "{h}/file.txt"],
        2,
        "not write over",
    ),
    ("explore-port", ["explore", "--port", "70000"], 2, "--port 70000 must be in 0..65535"),
    # meshforge generate (issue 53); what needs a trained run is in test_generate.py
    ("generate-missing", ["generate", "{h}/nope", "--prompt", "x"], 2, "does not exist; give a run directory"),
    ("generate-a-file", ["generate", "/etc/passwd", "--prompt", "x"], 2, "is not a directory"),
    ("generate-fifo", ["generate", "{h}/fifo", "--prompt", "x"], 2, "is not a directory"),
    ("generate-user-dir", ["generate", "{h}/user", "--prompt", "x"], 2, "is neither a run directory (config.toml)"),
    ("generate-temperature-nan", ["generate", "{h}", "--prompt", "x", "--temperature", "nan"], 2, "[0, 100]"),
    ("generate-max-new-0", ["generate", "{h}", "--prompt", "x", "--max-new-tokens", "0"], 2, "between 1 and"),
    ("generate-empty-prompt", ["generate", "{h}", "--prompt", ""], 2, "--prompt is empty"),
    ("generate-tokenizer-fifo", ["generate", "{h}/hf-list", "--prompt", "x", "--tokenizer", "{h}/fifo"], 2, "neither"),
    (
        "generate-hf-config-a-list",
        ["generate", "{h}/hf-list", "--prompt", "x", "--tokenizer", "byte"],
        2,
        "not a model config object",
    ),
    ("generate-hf-huge", ["generate", "{h}/hf-huge", "--prompt", "x", "--tokenizer", "byte"], 2, "hold 64 bytes"),
]


@pytest.mark.parametrize("argv, code, said", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_refusals(capsys, files, corpus, tmp_path, argv, code, said):
    run = tmp_path / "run"
    before = snapshot(files)
    fill = {"{run}": str(run), "{corpus}": str(corpus), "{h}": str(files)}
    args = [_fill(a, fill) for a in argv]
    if args[0] == "train":
        args = ["train", *TINY, f"--data.path={corpus}", f"--run.dir={run}", *args[1:]]
    refused(capsys, args, said, code)
    assert not run.exists(), "a refused command created its output"
    assert snapshot(files) == before, "a refused command changed a file it was pointed at"


def _fill(arg: str, fill: dict[str, str]) -> str:
    for k, v in fill.items():
        arg = arg.replace(k, v)
    return arg


# --- a refusal changes nothing ------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4, final/ and report.html."""
    from meshforge.cli.train import write_run_report

    d = tmp_path_factory.mktemp("trained") / "run"
    cfg = tiny_config(d, corpus, **TRAINED)
    train(cfg)
    write_run_report(cfg)
    return d


def _newest(run: Path) -> Path:
    return store.list_complete(run / "checkpoints")[-1].path


def _edit_meta(run: Path, change) -> None:
    path = _newest(run) / "meta.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


class _Payload:
    """Unpickling this runs a shell command (the attack of issue 39, item 1)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _craft_metadata(run: Path) -> None:
    """A .metadata whose pickle runs code, re-hashed in meta.json as a tamperer would."""
    ckpt = _newest(run)
    data = pickle.dumps(_Payload(run.parent / "PWNED"))
    (ckpt / ".metadata").write_bytes(data)
    _edit_meta(run, lambda m: m["files"].update({".metadata": {"bytes": len(data), "sha256": _sha(data)}}))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hold_lock(run: Path):
    code = "import sys, time; from meshforge.guards import run_lock; run_lock.acquire(sys.argv[1]); "
    code += "print('held', flush=True)"
    p = subprocess.Popen(
        [sys.executable, "-c", code + "; time.sleep(600)", str(run)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "held"
    return p


def _only_user_config(run: Path) -> None:
    """A folder holding nothing but a config.toml someone wrote by hand."""
    shutil.rmtree(run)
    run.mkdir()
    (run / "config.toml").write_text("[train]\nsteps = 3\n")


def _disk_full(run: Path, monkeypatch) -> None:
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))


# (id, extra arguments (with {run} {ckpt} {final}), setup(run, monkeypatch) or None, what the refusal says)
REFUSALS = [
    ("another-shape", ["--model.hidden=128"], None, "was written for another model shape (hidden: 64 vs 128"),
    ("another-seed", ["--train.seed=7"], None, "continues a data order of train.seed = 0"),
    ("another-seq-len", ["--train.seq_len=16"], None, "(train.seed, train.seq_len or the data changed)"),
    ("edited-step", [], lambda r, mp: _edit_meta(r, lambda m: m.update(step=3)), "step 3 (the shards say 4)"),
    ("edited-consumed", [], lambda r, mp: _edit_meta(r, lambda m: m["sampler"].update(consumed=0)), "consumed 0"),
    ("meta-step-text", [], lambda r, mp: _edit_meta(r, lambda m: m.update(step="4")), "step missing or not a whole"),
    ("meta-model-list", [], lambda r, mp: _edit_meta(r, lambda m: m.update(model=[1])), "no readable model shape"),
    ("crafted-metadata", ["--checkpoint.load={ckpt}", "--run.dir={fresh}"], lambda r, mp: _craft_metadata(r), "posix"),
    ("bad-value", ["--optim.lr=nan"], None, "optim.lr = nan must be a finite number"),
    ("fit", [], lambda r, mp: mp.setenv("MESHFORGE_TEST_AVAILABLE_GIB", "0.00001"), "skip_memory_check"),
    ("disk-full", [], _disk_full, "(ENOSPC)"),
    ("only-a-user-config", [], lambda r, mp: _only_user_config(r), "did not write (config.toml)"),
    ("overwrite-loads-inside", ["--run.overwrite=true", "--checkpoint.load={ckpt}"], None, "is inside run.dir"),
    (
        "init-from-shape",
        ["--model.init_from={final}", "--model.layers=3", "--run.overwrite=true"],
        None,
        "another shape",
    ),
    ("wandb-missing", ["--metrics.wandb=true"], None, "needs the wandb package"),
    ("restarts-without-checkpoints", ["--max-restarts=1", "--checkpoint.interval=0"], None, "--max-restarts 1"),
]


@pytest.mark.parametrize("extra, setup, said", [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_a_refused_run_leaves_its_run_directory_as_it_was(
    capsys, monkeypatch, trained, tmp_path, corpus, extra, setup, said
):
    if "wandb" in said and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here: nothing to refuse")
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    if setup:
        setup(run, monkeypatch)
    before = snapshot(run)
    fresh = tmp_path / "fresh"
    ckpt = str(_newest(run)) if (run / "checkpoints").is_dir() else ""
    fill = {"{run}": str(run), "{ckpt}": ckpt, "{final}": str(run / "final"), "{fresh}": str(fresh)}
    o = tiny_overrides(run, corpus, **{**TRAINED, "train.steps": 6})
    refused(capsys, ["train", *cli_args(o), *(_fill(a, fill) for a in extra)], said)
    assert snapshot(run) == before and not fresh.exists()
    assert not (tmp_path / "PWNED").exists(), "the checkpoint ran code"


def test_a_file_of_yours_named_run_lock_is_never_written_over(capsys, tmp_path, corpus):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.lock").write_text("my lock notes\n")
    refused(capsys, ["train", *cli_args(tiny_overrides(run, corpus))], "is not meshforge's lock file")
    assert (run / "run.lock").read_text() == "my lock notes\n"


def test_a_locked_run_dir_is_refused_and_left_as_it_was(capsys, trained, tmp_path, corpus):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    holder = _hold_lock(run)
    try:
        before = snapshot(run)
        refused(capsys, ["train", *cli_args(tiny_overrides(run, corpus, **TRAINED))], f"PID {holder.pid}")
        assert snapshot(run) == before
    finally:
        holder.kill()
        holder.wait()


def test_the_refused_resume_of_the_issue_prints_no_resume_hint_and_the_run_still_resumes(
    capsys, trained, tmp_path, corpus
):
    """Issue 39 item 2 as reported: --config RUN/config.toml --model.hidden 256 --run.dir RUN."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    cfg = run / "config.toml"
    cfg.write_text(cfg.read_text().replace(str(trained), str(run)))  # (the copy's own run.dir)
    text = refused(capsys, ["train", "--config", str(cfg), "--model.hidden", "256", "--run.dir", str(run)], "hidden")
    assert "to resume from its newest checkpoint" not in text  # the run never started: it did not fail
    assert "hidden = 64" in cfg.read_text() and "hidden = 256" not in (run / "report.html").read_text()
    (run / "notes.txt").write_text("mine\n")  # a file of yours added to a run: left alone, not refused
    code, text = cli(capsys, ["train", "--config", str(cfg), "--train.steps=5"])
    assert code == 0, text[-3000:]
    assert '"resumed"' in (run / "events.jsonl").read_text() and (run / "notes.txt").read_text() == "mine\n"


# --- --resume: what cannot continue a run (issue 53) ---------------------------------------------


def _weights_only(run: Path) -> None:
    shutil.rmtree(run / "checkpoints")


def _nothing_kept(run: Path) -> None:
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(run / "final")


def _user_dir(run: Path) -> None:
    shutil.rmtree(run)
    run.mkdir()
    (run / "thesis.tex").write_text("mine\n")


# (id, the --resume target ({run}: the copy of a finished 4-step run), extra arguments, setup, what it says)
RESUME_REFUSALS = [
    ("missing", "{run}/nope", ["--train.steps=8"], None, "/nope: no such directory"),
    ("a-file", "{run}/config.toml", ["--train.steps=8"], None, "is a file, not a run directory"),
    ("user-dir", "{run}", ["--train.steps=8"], _user_dir, "is not a meshforge run directory"),
    ("weights-only", "{run}", ["--train.steps=8"], _weights_only, "--optim.schedule=constant --optim.lr="),
    ("nothing-kept", "{run}", ["--train.steps=8"], _nothing_kept, "no final weights"),
    ("steps-not-above", "{run}", ["--train.steps=3"], None, "--train.steps=3 is not above the step the run is at (4"),
    ("steps-left-out", "{run}", [], None, "its train.steps = 4 is not above the step the run is at (4"),
    ("another-shape", "{run}", ["--train.steps=8", "--model.hidden=128"], None, "(hidden: 64 vs 128"),
    ("another-run-dir", "{run}", ["--train.steps=8", "--run.dir={fresh}"], None, "cannot go with it"),
    ("overwrite", "{run}", ["--train.steps=8", "--run.overwrite=true"], None, "--run.overwrite=True cannot go"),
    ("load-none", "{run}", ["--train.steps=8", "--checkpoint.load=none"], None, "--checkpoint.load=none cannot go"),
    ("with-config", "{run}", ["--train.steps=8", "--config={run}/config.toml"], None, "leave out --config"),
]


@pytest.mark.parametrize(
    "target, extra, setup, said", [c[1:] for c in RESUME_REFUSALS], ids=[c[0] for c in RESUME_REFUSALS]
)
def test_resume_refuses_what_cannot_continue_the_run(capsys, trained, tmp_path, target, extra, setup, said):
    run, fresh = tmp_path / "run", tmp_path / "fresh"
    shutil.copytree(trained, run)
    if setup:
        setup(run)
    before = snapshot(run)
    fill = {"{run}": str(run), "{fresh}": str(fresh)}
    refused(capsys, ["train", "--resume", _fill(target, fill), *(_fill(a, fill) for a in extra)], said)
    assert snapshot(run) == before and not fresh.exists()


# --- never over what meshforge did not write --------------------------------------------------


@pytest.mark.parametrize(
    "target", ["metrics.jsonl", "config.toml", "events.jsonl", "checkpoints/r.html", "final/x.html"]
)
def test_report_never_writes_over_a_runs_own_files(capsys, trained, tmp_path, target):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = snapshot(run)
    refused(capsys, ["report", str(run), "--out", str(run / target)], "own files")
    assert snapshot(run) == before


def test_report_replaces_an_earlier_report_and_writes_its_own(capsys, trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    out = tmp_path / "compare.html"
    assert cli(capsys, ["report", str(run), "--out", str(out)])[0] == 0
    assert cli(capsys, ["report", str(run), "--out", str(out)])[0] == 0  # an earlier report: replaced
    assert cli(capsys, ["report", str(run)])[0] == 0 and (run / "report.html").stat().st_size > 1000


def test_report_shows_a_binary_config_toml_as_a_word_not_its_bytes(capsys, trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "config.toml").write_bytes(b"\x00\x01<script>alert(1)</script>\xff\xfe")
    assert cli(capsys, ["report", str(run)])[0] == 0
    html = (run / "report.html").read_text()
    assert "config.toml not shown: it is not UTF-8 text" in html and "alert(1)" not in html


def test_the_explorer_answers_head_with_the_length_of_its_get():
    from meshforge.explore import make_server

    srv = make_server("127.0.0.1", 0, quiet=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        for path in ("/", "/api/presets"):
            got = {}
            for method in ("GET", "HEAD"):
                conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
                conn.request(method, path)
                r = conn.getresponse()
                got[method] = (r.status, r.getheader("Content-Length"), r.read())
                conn.close()
            assert got["HEAD"][:2] == got["GET"][:2] == (200, str(len(got["GET"][2])))
            assert got["HEAD"][2] == b"" and len(got["GET"][2]) > 1000
    finally:
        srv.shutdown()
        srv.server_close()


# --- every number has a range ------------------------------------------------------------------


def test_every_numeric_key_has_a_range():
    numeric = [k for k in keys() if key_type(k) in (int, float, int | str)]
    assert len(numeric) > 60
    missing = [k for k in numeric if keys()[k].span is None]
    assert missing == [], f"declare these keys' fields with ranged(...) (meshforge/ranges.py): {missing}"
    lists = [k for k in keys() if key_type(k) == tuple[int, ...]]
    assert lists and all(keys()[k].each is not None for k in lists)
    load_config(None, {})  # the defaults are in range


def _outside(span, kind) -> list:
    """Values just outside ``span`` (below and above), none of its special values."""
    step = 1 if kind is int else 0.5
    low = span.lo if span.lo_open else span.lo - step
    while low in span.also:
        low -= step
    high = span.hi if span.hi_open else (span.hi * 2 + 1 if kind is int else span.hi * 2)
    return [kind(low), kind(high)] if math.isfinite(high) else [kind(low)]


@pytest.mark.parametrize("key", sorted(k for k, v in keys().items() if v.span is not None))
def test_a_number_out_of_its_range_is_refused_naming_the_key_and_the_range(key):
    span = keys()[key].span
    for bad in _outside(span, int if key_type(key) == int | str else key_type(key)):
        with pytest.raises(ConfigError, match=rf"^{key} = .* is out of range: it must be in [\[(]"):
            load_config(None, {key: bad})


# --- Ctrl-C, a run.dir of odd characters --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_to_the_launcher_stops_two_ranks_cleanly_with_exit_0(tmp_path, corpus, sig):
    """Issue 39 item 4: the launcher hands the signal to its ranks, which finish a step, save
    final/ and exit 0; the launcher waits for them and exits 0, without a traceback."""
    run = tmp_path / "run"
    o = tiny_overrides(run, corpus, **{"train.steps": 100000, "train.eval_batches": 0})
    cmd = [sys.executable, "-m", "meshforge", "train", "--nproc", "2", *cli_args(o)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None:
            m = run / "metrics.jsonl"
            if m.is_file() and len(m.read_text().splitlines()) >= 2:
                break
            time.sleep(0.5)
        assert p.poll() is None, p.communicate()[1][-3000:]
        p.send_signal(sig)
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-4000:]
    assert "Traceback" not in err and "SignalException" not in err
    events = [json.loads(x)["event"] for x in (run / "events.jsonl").read_text().splitlines()]
    assert "interrupted" in events and "final_weights" in events and (run / "final" / "model.safetensors").is_file()


def test_the_launcher_finds_its_ranks_and_a_stop_is_exit_130_when_they_abort():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from meshforge.launch.local import child_pids, exit_code_of

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in child_pids()
    finally:
        child.kill()
        child.wait()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=130, error_file="")
    e = ChildFailedError("meshforge", {0: failure})
    assert exit_code_of(e, stop_requested=2) == 130 and exit_code_of(e) == 1


@pytest.mark.slow
def test_a_run_dir_holding_a_quote_and_a_newline_writes_valid_toml_and_resumes(capsys, tmp_path, corpus):
    run = tmp_path / 'a "quoted"\nname\twith tab'
    o = tiny_overrides(run, corpus, **{**TRAINED, "train.steps": 2})
    assert cli(capsys, ["train", *cli_args(o)])[0] == 0
    written = tomllib.loads((run / "config.toml").read_text())
    assert written["run"]["dir"] == str(run)
    code, text = cli(capsys, ["train", "--config", str(run / "config.toml"), "--train.steps=3"])
    assert code == 0, text[-3000:]
    ev = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in ev if e["event"] == "resumed"] == [2]
