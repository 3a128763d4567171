"""What a newcomer met following the README (issue 36, item 8), each kept from coming back:
shortening the main job, re-planning a run on another number of devices, a corpus too small
for evaluation, the profiler's stray lines, and a final loss that says what it is."""

from __future__ import annotations

import json

from conftest import cli_args, run_cli, tiny_overrides


def test_shortening_the_main_job_clips_its_warmup_and_says_so(tmp_path):
    r = run_cli("train", "--config", "configs/debug.toml", "--train.steps=3", "--dry-run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "# changed: optim.warmup_steps = 40 runs as 3: longer than the run" in r.stdout
    assert "warmup_steps = 3" in r.stdout


def test_a_run_replans_on_another_number_of_devices_on_its_own_device(tmp_path, corpus):
    run = tmp_path / "run"
    r = run_cli("train", *cli_args(tiny_overrides(run, corpus, **{"train.steps": 2, "optim.warmup_steps": 1})))
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("plan", "--config", str(run / "config.toml"), "--gpus", "8", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "layout is for 1 rank(s); searching the layouts for --gpus 8" in r.stderr
    best = json.loads(r.stdout)["layouts"][0]
    assert best["dp_shard"] * best["tp"] * best["pp"] * best["cp"] == 8
    r = run_cli("plan", "--config", str(run / "config.toml"), "--gpus", "8")
    assert r.returncode == 0 and "| 8 x this-cpu (" in r.stdout  # the run's device (measured), not an H100


def test_a_validation_split_too_small_to_evaluate_is_said(tmp_path, corpus):
    over = {"train.steps": 2, "optim.warmup_steps": 1, "data.val_fraction": 0.0001, "metrics.console": True}
    r = run_cli("train", *cli_args(tiny_overrides(tmp_path / "run", corpus, **over)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "note: no evaluation: the validation split holds" in r.stdout and "raise data.val_fraction" in r.stdout


def test_profiling_prints_no_stray_library_lines_and_the_loss_says_it_is_a_mean(tmp_path, corpus):
    over = {"train.steps": 4, "optim.warmup_steps": 1, "profile.steps": 2, "metrics.console": True}
    r = run_cli("train", *cli_args(tiny_overrides(tmp_path / "run", corpus, **over)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "run" / "profile" / "rank-00000.json").is_file()
    assert "USDT" not in r.stdout + r.stderr
    assert "(mean of the last 4 steps)" in r.stdout  # (all 4: fewer than 10)
