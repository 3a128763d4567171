"""Continuing a run (issue 53, part 1). A run keeps a resumable checkpoint at its end
(``checkpoint.final``) and, under ``optim.schedule = "wsd"``, at the end of its stable phase;
its last line is ``meshforge train --resume RUN_DIR --train.steps=M``, which extends it in
place. Under wsd the extended run is the run planned that long from the start (the equivalence
test: N steps extended to M against one run of M, bit for bit); cosine is stretched to the new
end and says so; a run that kept its final weights alone prints a fine-tune that never
re-warms above the learning rate it ended at. The refusals of --resume are in
test_hostile_inputs.py's table."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from conftest import cli_args, run_cli, tiny_overrides
from meshforge.checkpoint import store
from meshforge.checkpoint.weights import load_pretrained

WSD = {
    "optim.schedule": "wsd",
    "optim.warmup_steps": 2,
    "train.deterministic": True,
    "metrics.console": True,
    "train.eval_interval": 0,
}


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def val_losses(run: Path) -> dict[int, float]:
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    return {e["step"]: e["val_loss"] for e in events if e["event"] == "eval"}


def printed_command(stdout: str) -> list[str]:
    """The command the run's last line names, as arguments to ``meshforge``."""
    last = stdout.strip().splitlines()[-1]
    words = shlex.split(last[last.index("meshforge train") :])
    assert words[:2] == ["meshforge", "train"], last
    return words[1:]


def trained(run: Path, corpus: Path, **over) -> str:
    r = run_cli("train", *cli_args(tiny_overrides(run, corpus, **over)))
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_an_extended_wsd_run_is_the_run_planned_that_long(tmp_path, corpus):
    run, whole = tmp_path / "run", tmp_path / "whole"
    out = trained(run, corpus, **WSD, **{"train.steps": 10})
    assert [c.step for c in store.list_complete(run / "checkpoints")] == [8, 10]  # stable phase's end, the end
    command = printed_command(out)
    assert command == ["train", "--resume", str(run), "--train.steps=20"]
    before, val_before = rows(run), val_losses(run)[10]
    r = run_cli(*command)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step-00000008'} at step 8" in r.stdout
    assert "the run goes on from the end of its stable phase (step 8" in r.stdout
    assert "now decays over steps 17-20" in r.stdout
    trained(whole, corpus, **WSD, **{"train.steps": 20})
    got, want = rows(run), rows(whole)
    assert [x["step"] for x in got] == list(range(1, 21))  # one run directory, one curve
    assert [(x["loss"], x["lr"], x["grad_norm"]) for x in got] == [(x["loss"], x["lr"], x["grad_norm"]) for x in want]
    assert val_losses(run)[20] == val_losses(whole)[20] < val_before
    a, b = load_pretrained(run / "final").state_dict(), load_pretrained(whole / "final").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert "steps = 20" in (run / "config.toml").read_text()
    # the curve goes on past the first run's end without a jump: against the extended curve and
    # against the loss the first run showed at its end
    assert abs(got[10]["loss"] / got[9]["loss"] - 1) < 0.05
    assert abs(got[10]["loss"] / before[9]["loss"] - 1) < 0.05


def test_an_extended_cosine_run_is_stretched_and_says_so(tmp_path, corpus):
    run = tmp_path / "run"
    out = trained(run, corpus, **{**WSD, "optim.schedule": "cosine", "train.steps": 6})
    assert "(cosine: its decay is stretched to the new end; wsd would continue the curve)" in out
    r = run_cli(*printed_command(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step-00000006'} at step 6" in r.stdout
    assert "optim.schedule = cosine: the schedule is stretched to the new end (step 12; it ended at 6)" in r.stdout
    got = rows(run)
    assert [x["step"] for x in got] == list(range(1, 13))
    assert got[6]["lr"] > got[5]["lr"]  # what stretching does: said, not hidden
    assert "schedule_continued" in (run / "events.jsonl").read_text()


def test_a_run_with_its_weights_alone_fine_tunes_without_a_rewarm(tmp_path, corpus):
    run = tmp_path / "run"
    out = trained(run, corpus, **WSD, **{"train.steps": 6, "checkpoint.final": False})
    assert not store.list_complete(run / "checkpoints")
    command = printed_command(out)
    assert command[-2:] == ["--optim.schedule=constant", "--optim.lr=0.0003"]  # 3e-3 x min_lr_ratio 0.1
    ended = rows(run)[-1]["lr"]
    r = run_cli(*command, "--train.steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    more = rows(Path(f"{run}-more"))
    assert max(x["lr"] for x in more) <= ended * (1 + 1e-9) and more[-1]["lr"] == pytest.approx(ended)
    assert f'init_from = "{run / "final"}"' in (Path(f"{run}-more") / "config.toml").read_text()
