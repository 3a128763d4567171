"""What a practitioner sees on the console: progress from step 1, the corpus preparation line,
quiet exits when the reader of a pipe goes away, binary data and configs refused clearly, and
a time breakdown that accounts for the whole wall time. CLI tests run the real CLI."""

import json
import os
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler

import pytest

from conftest import cli_args, run_cli, tiny_config, tiny_overrides, train
from meshforge.cli.main import main
from meshforge.errors import DataError
from meshforge.explore import make_server
from meshforge.health.text_check import non_text_share, refuse_binary
from meshforge.metrics.logged_steps import SLOW_STEP_S, is_logged, slow_step_line


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def console_run(tmp_path_factory, corpus):
    """6 steps logged every 5th, on the console, into a fresh corpus cache."""
    tmp = tmp_path_factory.mktemp("console")
    over = {"train.steps": 6, "metrics.log_interval": 5, "metrics.console": True, "train.eval_batches": 0}
    over["data.cache_dir"] = str(tmp / "cache")
    r = run_cli("train", *cli_args(tiny_overrides(tmp / "run", corpus, **over)))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run", r.stdout


def test_progress_starts_at_step_1_after_the_preparation_line(console_run):
    run, out = console_run
    lines = out.splitlines()
    prep = next(i for i, x in enumerate(lines) if x.startswith("meshforge: preparing"))
    done = next(i for i, x in enumerate(lines) if x.startswith("meshforge: prepared the corpus in"))
    first = next(i for i, x in enumerate(lines) if "step 1/6" in x)
    assert prep < done < first < next(i for i, x in enumerate(lines) if "step 5/6" in x)
    assert "(first use only" in lines[prep]
    assert [r["step"] for r in _metrics(run)] == [1, 5, 6]


def test_logging_step_1_changes_no_loss(console_run, tmp_path, corpus):
    run, _ = console_run
    every = tmp_path / "every"
    train(tiny_config(every, corpus, **{"train.steps": 6, "train.eval_batches": 0}))  # log_interval 1
    by_step = {r["step"]: r["loss"] for r in _metrics(every)}
    assert {r["step"]: r["loss"] for r in _metrics(run)} == {s: by_step[s] for s in (1, 5, 6)}


def test_time_breakdown_accounts_for_the_wall_time(console_run):
    run, _ = console_run
    summary = json.loads((run / "summary.json").read_text())
    tb = summary["time_breakdown"]
    assert tb["wall_s"] == pytest.approx(summary["wall_time_s"], abs=1e-3)
    parts = {k: v for k, v in tb.items() if k != "wall_s"}
    for k in ("compute_s", "exposed_comm_s", "data_s", "optimizer_s", "checkpoint_s", "eval_s", "logging_s", "other_s"):
        assert parts[k] >= 0, k
    assert sum(parts.values()) == pytest.approx(tb["wall_s"], rel=1e-3)
    assert parts["compute_s"] > parts["other_s"]  # the steps are most of a run, and they are accounted for


def test_which_steps_are_logged_and_the_slow_step_line():
    assert [n for n in range(1, 26) if is_logged(n, 10, 25)] == [1, 10, 20, 25]
    assert slow_step_line(7, 100, SLOW_STEP_S / 2, 10) is None
    assert slow_step_line(7, 100, 12.34, 10) == "  step 7/100 took 12.3s (the next logged step, with its loss, is 10)"


@pytest.mark.parametrize(
    "args", [("train", "--help"), ("plan", "--model", "llama3.1-8b", "--gpus", "64"), ("plan", "--help")]
)
def test_a_closed_pipe_ends_quietly(args):
    """The reader is gone before the first byte is written (``| head`` that already exited)."""
    r, w = os.pipe()
    os.close(r)
    p = subprocess.run([sys.executable, "-m", "meshforge", *args], stdout=w, stderr=subprocess.PIPE, text=True)
    os.close(w)
    assert p.returncode == 0 and p.stderr == "", p.stderr


def test_a_pipe_closed_mid_run_stops_training_quietly(tmp_path, corpus):
    """``meshforge train | head -2``: the reader leaves after the first lines; the run stops at its
    next console line with no traceback and no "the run failed" advice (it did not fail)."""
    over = tiny_overrides(tmp_path / "run", corpus, **{"train.steps": 50, "metrics.console": True})
    cmd = [sys.executable, "-m", "meshforge", "train", *cli_args(over)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        for line in p.stdout:  # read until the first step's line, then leave
            if "/50 | loss" in line:
                break
        p.stdout.close()
        err = p.stderr.read()
    assert p.returncode == 0 and "Traceback" not in err and "failed" not in err, err
    assert "BrokenPipeError" in (tmp_path / "run" / "events.jsonl").read_text()  # the run's record says why


@pytest.mark.slow
def test_a_pipe_closed_mid_run_stops_every_rank_quietly(tmp_path, corpus):
    """``meshforge train --nproc 2 | head``: rank 0 leaves at its next console line, and rank 1,
    stranded in a collective, stops quietly too (no "another rank went away", exit 0): rank 0 says
    in the rendezvous store why it left."""
    over = tiny_overrides(tmp_path / "run", corpus, **{"train.steps": 200, "metrics.console": True})
    over["metrics.log_interval"] = 1
    cmd = [sys.executable, "-m", "meshforge", "train", "--nproc", "2", *cli_args(over)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        for line in p.stdout:
            if "/200 | loss" in line:
                break
        p.stdout.close()
        err = p.stderr.read()
    assert p.returncode == 0, err
    assert "went away" not in err and "Traceback" not in err and "failed" not in err, err
    failures = [e for e in (tmp_path / "run" / "events.jsonl").read_text().splitlines() if '"failure"' in e]
    assert len(failures) == 1 and "BrokenPipeError" in failures[0]  # rank 0's reason; rank 1 records nothing


def test_the_explorer_ignores_a_client_that_went_away(monkeypatch, capsys):
    def gone(self):
        raise ConnectionResetError("client went away")

    monkeypatch.setattr(BaseHTTPRequestHandler, "handle_one_request", gone)
    srv = make_server("127.0.0.1", 0, quiet=False)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{srv.server_address[1]}/", timeout=10)
    finally:
        srv.shutdown()
        srv.server_close()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err, err


def test_binary_data_is_refused_unless_allowed(tmp_path, corpus):
    blob = tmp_path / "random.bin"
    blob.write_bytes(os.urandom(200_000))
    r = run_cli("train", *cli_args(tiny_overrides(tmp_path / "run", blob, **{"train.steps": 1})))
    assert r.returncode == 2, r.stderr[-2000:]
    assert str(blob) in r.stderr and "% of its bytes" in r.stderr and "data.allow_binary = true" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()
    refuse_binary(str(blob), allow_binary=True)  # allowed: no error
    refuse_binary(str(corpus), allow_binary=False)  # text: no error
    with pytest.raises(DataError, match="random.bin is not text"):
        refuse_binary(str(blob), allow_binary=False)
    assert non_text_share(b"def f(x):\n\treturn x  # caf\xc3\xa9\n") == 0
    assert 0.4 < non_text_share(os.urandom(100_000)) < 0.7


def test_a_binary_config_says_it_is_not_a_utf8_toml_file(tmp_path):
    cfg = tmp_path / "model.bin"
    cfg.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(2000))
    r = run_cli("train", "--config", str(cfg))
    assert r.returncode == 2
    assert f"config file {cfg} is not a UTF-8 TOML file (line 1, byte 0 " in r.stderr and "at that line" not in r.stderr
    cfg.write_bytes(b"[train]\nsteps = 5\n\xff\xfe = 3\n")  # a stray non-UTF-8 byte in a text file: its line
    r = run_cli("train", "--config", str(cfg))
    assert r.returncode == 2 and "(line 3, byte 18 is not UTF-8" in r.stderr, r.stderr


def test_explore_on_an_unknown_host_says_so(capsys):
    """The bind fails inside socketserver's constructor, which then closes the half-built server."""
    assert main(["explore", "--host", "nosuchhost.invalid", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "cannot listen on --host nosuchhost.invalid" in err and "Traceback" not in err, err


def test_calibrate_refuses_zero_ranks(capsys):
    with pytest.raises(SystemExit):
        main(["calibrate", "--out", "x.json", "--nproc", "0"])
    assert "argument --nproc: must be a positive integer up to 1,024, got 0" in capsys.readouterr().err
