"""Continuing a run, without training one: which checkpoint an extended wsd run goes on from
(``follows_schedule``), what a resumed run says about its schedule (``continuation_note``), the
stable-phase checkpoint kept by retention, the run's last line, and --resume on the command line."""

from __future__ import annotations

import pytest

from meshforge.checkpoint import store
from meshforge.checkpoint.continuing import resume_hint
from meshforge.checkpoint.resume_point import continuation_note, follows_schedule
from meshforge.cli.train import parse_train_args
from meshforge.config import load_config
from meshforge.config.schedule import schedule_record
from meshforge.resolve import resolve

BASE = {"optim.lr": 3e-3, "optim.warmup_steps": 40, "optim.min_lr_ratio": 0.1}


def plan(schedule: str, steps: int, run_dir: str = "", **extra):
    over = {**BASE, "optim.schedule": schedule, "train.steps": steps, "run.dir": run_dir, **extra}
    return resolve(load_config(None, over))


def meta(schedule: str, steps: int, step: int) -> dict:
    """A checkpoint's meta.json (the parts read here) at ``step`` of a ``steps``-step run."""
    p = plan(schedule, steps)
    return {"step": step, "lr_schedule": schedule_record(p.optim, steps, step)}


def test_an_extended_wsd_run_goes_on_from_its_stable_phase_not_its_decay():
    longer = plan("wsd", 800)  # decays from step 640
    assert follows_schedule(meta("wsd", 400, 320), 320, longer)  # the stable phase's end
    assert follows_schedule(meta("wsd", 400, 300), 300, longer)
    assert not follows_schedule(meta("wsd", 400, 400), 400, longer)  # inside the 400-step run's decay
    assert not follows_schedule(meta("wsd", 400, 321), 321, longer)
    assert follows_schedule(meta("wsd", 800, 700), 700, longer)  # its own schedule: an ordinary resume
    assert follows_schedule(meta("wsd", 400, 400), 400, plan("wsd", 400))
    assert follows_schedule({"step": 400}, 400, longer)  # written before lr_schedule: as it was
    assert follows_schedule(meta("cosine", 400, 400), 400, longer)
    shorter = plan("wsd", 360)  # cut back: decays from step 288, so 320 is past it
    assert not follows_schedule(meta("wsd", 400, 320), 320, shorter)


def test_a_resumed_run_says_how_its_schedule_goes_on():
    note = continuation_note(meta("wsd", 400, 320), plan("wsd", 800))
    assert note.startswith("optim.schedule = wsd: the run goes on from the end of its stable phase (step 320")
    assert "now decays over steps 641-800" in note
    note = continuation_note(meta("cosine", 400, 400), plan("cosine", 800))
    assert "the schedule is stretched to the new end (step 800; it ended at 400)" in note
    assert "step 401 takes learning rate 0.00176" in note and "would have taken 0.0003" in note
    assert 'optim.schedule = "wsd" extends a run without this jump' in note
    note = continuation_note(meta("wsd", 400, 400), plan("wsd", 800))
    assert "no checkpoint from before its decay is left (step 320)" in note
    assert continuation_note(meta("wsd", 400, 200), plan("wsd", 400)) is None  # a resume within the run
    assert continuation_note(meta("constant", 400, 400), plan("constant", 800)) is None
    assert continuation_note({"step": 4, "lr_schedule": {"schedule": 1}}, plan("wsd", 800)) is None


def _checkpoint(root, step: int) -> None:
    d = root / store.step_dir_name(step)
    d.mkdir(parents=True)
    (d / store.COMPLETE).write_text("ok\n")


def test_retention_keeps_the_stable_phase_checkpoint(tmp_path):
    for step in (10, 20, 30, 40, 50):
        _checkpoint(tmp_path, step)
    removed = store.retain(tmp_path, 2, protect=20)
    assert sorted(p.name for p in removed) == ["step-00000010", "step-00000030"]
    assert [c.step for c in store.list_complete(tmp_path)] == [20, 40, 50]


def test_the_last_line_continues_the_run(tmp_path):
    run = tmp_path / "run"
    p = plan("wsd", 400, str(run))
    _checkpoint(run / "checkpoints", 400)
    assert resume_hint(p, 1, True) == (
        "to continue it exactly (wsd: from the end of its stable phase, as if it had been planned that long): "
        f"meshforge train --resume {run} --train.steps=800"
    )
    assert resume_hint(p, 2, False).endswith(f"meshforge train --resume {run} --nproc 2")
    assert "(cosine: its decay is stretched to the new end" in resume_hint(plan("cosine", 400, str(run)), 1, True)


def test_a_run_with_its_weights_alone_fine_tunes_at_the_learning_rate_it_ended_at(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    hint = resume_hint(plan("wsd", 400, str(run)), 1, True)
    assert hint.startswith("no resumable checkpoint (checkpoint.final = false and checkpoint.interval = 0)")
    assert hint.endswith(
        f"--model.init_from {run / 'final'} --run.dir {run}-more --optim.schedule=constant --optim.lr=0.0003"
    )
    mid = resume_hint(plan("wsd", 400, str(run)), 1, False, step=100)  # stopped in the stable phase
    assert mid.endswith("--optim.lr=0.003")
    assert "--checkpoint.final=true" in resume_hint(plan("wsd", 400, str(tmp_path / "bare")), 1, True)


def test_resume_on_the_command_line():
    args = parse_train_args(["--resume", "runs/a", "--train.steps=800"])
    assert (args.resume, args.config, args.overrides) == ("runs/a", None, {"train.steps": 800})
    assert parse_train_args(["--resume=runs/b"]).resume == "runs/b"
    with pytest.raises(Exception, match="--resume needs a value"):
        parse_train_args(["--resume"])


def test_the_derived_warmup_is_kept_when_a_run_is_extended(tmp_path):
    """``optim.warmup_steps = -1`` is min(100, steps / 10) of the run as first planned; config.toml
    records the number, so an extended run (``--resume`` reads config.toml) keeps the warmup its
    steps so far took, rather than re-deriving it from the new length (80 for 800 steps)."""
    first = plan("wsd", 400, **{"optim.warmup_steps": -1})
    assert first.optim.warmup_steps == 40
    (tmp_path / "config.toml").write_text(first.to_toml())
    longer = resolve(load_config(str(tmp_path / "config.toml"), {"train.steps": 800}))
    assert longer.optim.warmup_steps == 40
    assert resolve(load_config(None, {**BASE, "optim.warmup_steps": -1, "train.steps": 800})).optim.warmup_steps == 80
    assert follows_schedule(meta("wsd", 400, 320), 320, longer)
