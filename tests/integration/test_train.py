import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import cli_args, run_cli, tiny_config, tiny_overrides, train
from meshforge.checkpoint.weights import load_weights
from meshforge.config import load_config
from tb_read import read_scalars

KEYS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "mfu",
    "hfu",
    "peak_mem_gib",
    "tokens_seen",
}


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_short_run_writes_the_run_directory(tmp_path, corpus):
    run = tmp_path / "run"
    cfg = tiny_config(run, corpus, **{"train.steps": 30, "optim.lr": 1e-2, "train.eval_interval": 10})
    out = io.StringIO()
    summary = train(
        load_config(
            None,
            {
                **tiny_overrides(run, corpus),
                "train.steps": 30,
                "optim.lr": 1e-2,
                "train.eval_interval": 10,
                "metrics.console": True,
                "metrics.tensorboard": True,
            },
        ),
        stream=out,
    )
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert KEYS <= set(rows[0])
    assert all(0 < r["mfu"] < 1.5 and r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0 for r in rows)
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert first > 5.0 and last < first - 1.5, (first, last)  # ln(512) = 6.2 at init
    assert summary["val_loss"] is not None and summary["val_loss"] < first - 1.5
    events = [json.loads(e) for e in (run / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("eval") == 3  # steps 10, 20 and the final one
    assert load_config(run / "config.toml").shape.hidden == 64 == cfg.shape.hidden
    tb = read_scalars(next((run / "tensorboard").iterdir()))
    assert {tag for _, tag, _ in tb} >= {"loss", "mfu", "val_loss"}
    final = load_weights(run / "final")
    assert final.shape.hidden == 64
    text = out.getvalue()
    assert "step 30/30" in text and "done: 30 steps" in text and "MFU" in text
    assert f"meshforge train --resume {run} --train.steps=60" in text  # goes on (checkpoint.final's checkpoint)


def test_deterministic_mode_gives_bit_identical_losses(tmp_path, corpus):
    runs = []
    before = torch.are_deterministic_algorithms_enabled()
    for i in range(2):
        train(tiny_config(tmp_path / f"r{i}", corpus, **{"train.deterministic": True, "train.micro_batch_size": 4}))
        runs.append([r["loss"] for r in metrics(tmp_path / f"r{i}")])
    assert runs[0] == runs[1]
    assert not before and not torch.are_deterministic_algorithms_enabled()  # the process-wide flag is put back


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_computes_the_same_function(tmp_path, corpus, mode):
    train(tiny_config(tmp_path / "ref", corpus))
    train(tiny_config(tmp_path / mode, corpus, **{"train.activation_checkpoint": mode}))
    ref = [r["loss"] for r in metrics(tmp_path / "ref")]
    got = [r["loss"] for r in metrics(tmp_path / mode)]
    assert got == pytest.approx(ref, rel=1e-5)
    assert metrics(tmp_path / mode)[0]["hfu"] > metrics(tmp_path / mode)[0]["mfu"]


def test_bf16_autocast_trains(tmp_path, corpus):
    train(tiny_config(tmp_path / "bf16", corpus, **{"train.precision": "bf16", "train.steps": 12, "optim.lr": 1e-2}))
    rows = metrics(tmp_path / "bf16")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5


@pytest.mark.slow
def test_data_parallel_two_ranks_matches_single_process(tmp_path, corpus):
    """DDP (2 gloo ranks) with accumulation and clipping reproduces the single-process run."""
    extra = {"train.micro_batch_size": 2, "train.grad_clip": 0.5, "train.steps": 6}
    train(tiny_config(tmp_path / "single", corpus, **extra))
    r = run_cli("train", "--nproc", "2", *cli_args(tiny_overrides(tmp_path / "ddp", corpus, **extra)))
    assert r.returncode == 0, r.stderr[-3000:]
    ref, got = metrics(tmp_path / "single"), metrics(tmp_path / "ddp")
    assert [g["loss"] for g in got] == pytest.approx([x["loss"] for x in ref], rel=1e-5)
    assert [g["grad_norm"] for g in got] == pytest.approx([x["grad_norm"] for x in ref], rel=1e-5)
    a, b = load_weights(tmp_path / "single" / "final"), load_weights(tmp_path / "ddp" / "final")
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_external_torchrun_matches_single_process(tmp_path, corpus):
    """The same entry point runs unchanged when torchrun starts the ranks."""
    extra = {"train.steps": 4}
    train(tiny_config(tmp_path / "single", corpus, **extra))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "meshforge",
        "train",
        *cli_args(tiny_overrides(tmp_path / "tr", corpus, **extra)),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    ref, got = metrics(tmp_path / "single"), metrics(tmp_path / "tr")
    assert [g["loss"] for g in got] == pytest.approx([x["loss"] for x in ref], rel=1e-5)


@pytest.mark.slow
def test_compiled_blocks_compute_the_same_function(tmp_path, corpus):
    pytest.importorskip("torch._inductor")
    extra = {"train.steps": 3, "model.layers": 1}
    train(tiny_config(tmp_path / "eager", corpus, **extra))
    train(tiny_config(tmp_path / "compiled", corpus, **extra, **{"train.compile": True}))
    ref = [r["loss"] for r in metrics(tmp_path / "eager")]
    got = [r["loss"] for r in metrics(tmp_path / "compiled")]
    assert got == pytest.approx(ref, rel=1e-4)


def test_init_from_previous_weights(tmp_path, corpus):
    train(tiny_config(tmp_path / "a", corpus, **{"train.steps": 20, "optim.lr": 1e-2}))
    train(tiny_config(tmp_path / "b", corpus, **{"model.init_from": str(tmp_path / "a" / "final")}))
    train(tiny_config(tmp_path / "c", corpus))
    warm, cold = metrics(tmp_path / "b")[0]["loss"], metrics(tmp_path / "c")[0]["loss"]
    assert warm < cold - 1.0


def test_init_from_other_shape_refused(tmp_path, corpus):
    from meshforge.errors import ConfigError

    train(tiny_config(tmp_path / "a", corpus, **{"train.steps": 2}))
    with pytest.raises(ConfigError, match="hidden: 64 vs 96"):
        train(
            tiny_config(
                tmp_path / "b",
                corpus,
                **{"model.init_from": str(tmp_path / "a" / "final"), "model.hidden": 96},
            )
        )


BAD_INPUTS = [
    ({"data.path": "/nonexistent/corpus"}, "data path /nonexistent/corpus does not exist"),
    ({"model.preset": "llama-9b"}, "unknown model preset 'llama-9b'"),
    ({"train.global_batch_size": 100000, "train.micro_batch_size": 2}, "fewer than one global batch of 100000"),
    ({"train.stepz": 3}, "did you mean 'steps'"),
    ({"model.vocab_size": 200}, "smaller than the tokenizer's vocabulary (258)"),
]


@pytest.mark.parametrize("override, message", BAD_INPUTS)
def test_bad_input_is_one_clear_paragraph_and_exit_2(tmp_path, corpus, override, message):
    o = {**tiny_overrides(tmp_path / "run", corpus), **override}
    r = run_cli("train", *cli_args(o))
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_restarts_without_checkpoints_refused(tmp_path, corpus):
    r = run_cli("train", "--nproc", "2", "--max-restarts", "2", *cli_args(tiny_overrides(tmp_path / "run", corpus)))
    assert r.returncode == 2 and "--max-restarts 2" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_too_many_local_ranks_refused_before_start(tmp_path, corpus):
    r = run_cli("train", "--nproc", "512", *cli_args(tiny_overrides(tmp_path / "run", corpus)))
    assert r.returncode == 2 and "--nproc 512" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_malformed_toml_and_empty_data(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = = 3\n")
    r = run_cli("train", "--config", str(bad))
    assert r.returncode == 2 and "bad.toml is not valid TOML" in r.stderr and "Traceback" not in r.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = run_cli("train", f"--data.path={empty}", f"--run.dir={tmp_path / 'run'}")
    assert r.returncode == 2 and "holds no text" in r.stderr


def test_non_llama_init_from_refused(tmp_path, corpus):
    hf = tmp_path / "gpt2"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    r = run_cli("train", *cli_args(tiny_overrides(tmp_path / "run", corpus)), f"--model.init_from={hf}")
    assert r.returncode == 2 and "Llama-family" in r.stderr and "Traceback" not in r.stderr


def test_existing_run_is_not_written_over(tmp_path, corpus):
    """A run with nothing to resume (checkpoint.final = false; with its final checkpoint the same
    command would continue it, as checkpoint.load = latest says) is refused, not replaced."""
    train(tiny_config(tmp_path / "run", corpus, **{"train.steps": 2, "checkpoint.final": False}))
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    r = run_cli("train", *cli_args(tiny_overrides(tmp_path / "run", corpus)))
    assert r.returncode == 2 and "already holds a run" in r.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before
    train(tiny_config(tmp_path / "run", corpus, **{"train.steps": 3, "run.overwrite": True}))
    assert len(metrics(tmp_path / "run")) == 3


@pytest.mark.slow
def test_ctrl_c_stops_after_the_step_and_saves(tmp_path, corpus):
    run = tmp_path / "run"
    args = cli_args(tiny_overrides(run, corpus, **{"train.steps": 100000, "train.eval_batches": 0}))
    p = subprocess.Popen(
        [sys.executable, "-m", "meshforge", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (
        (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3
    ):
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and 3 <= summary["steps"] < 100000
    assert len(metrics(run)) == summary["steps"]
    assert load_weights(run / "final").shape.hidden == 64
