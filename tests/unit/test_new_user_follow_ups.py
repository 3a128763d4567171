"""What a new user met after README command 1 (issue 53), each kept from coming back: a vocabulary
taken from their own tokenizer, a prepared split too small to use said at preparation, an ETA
from the recent pace, CPU ranks that outnumber the cores warned of (and no straggler alarms from
it), and a download hint that names the command huggingface_hub installs today."""

from __future__ import annotations

import io

import pytest

from meshforge.cli.main import main
from meshforge.config import load_config
from meshforge.config.run_plan import World
from meshforge.data.corpus import split_warnings
from meshforge.errors import ConfigError
from meshforge.launch import env as launch_env
from meshforge.launch.local import check_nproc
from meshforge.metrics import sinks
from meshforge.metrics.pace import Pace
from meshforge.metrics.step_metrics import end_line
from meshforge.resolve import resolve

BPE = World(size=1, device="cpu", tokenizer_vocab=1000)  # a tokenizer.json of 1,000 tokens


def test_auto_vocabulary_is_the_tokenizers_rounded_up_and_said():
    plan = resolve(load_config(), world=BPE)
    assert plan.shape.vocab_size == 1024 and plan.model.auto_shape == ()
    (change,) = plan.changes
    assert (change.key, change.given, change.used) == ("model.vocab_size", "auto", 1024)
    assert "# changed: model.vocab_size = 'auto' runs as 1024: the vocabulary of data.tokenizer (1,000 tokens)" in (
        plan.to_toml()
    )
    assert "vocab_size = 1024" in plan.to_toml()  # config.toml holds the number: rerunning it reproduces the run


def test_auto_keeps_the_presets_vocabulary_with_bytes_or_weights_to_start_from():
    byte = resolve(load_config(), world=World(size=1, device="cpu"))
    assert byte.shape.vocab_size == 512 and byte.changes == ()  # README command 1 is unchanged
    weights = resolve(load_config(None, {"model.init_from": "w"}), world=BPE)
    assert weights.shape.vocab_size == 512 and weights.changes == ()  # the weights' shape decides


@pytest.mark.parametrize("given", [300, 2048])
def test_a_vocabulary_given_as_a_number_is_kept(given):
    plan = resolve(load_config(None, {"model.vocab_size": given}), world=BPE)
    assert plan.shape.vocab_size == given and plan.changes == ()


def test_auto_is_a_word_of_the_key_in_a_file_and_on_the_command_line(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[model]\nvocab_size = 2048\n")
    assert load_config(f).model.auto_shape == ()
    f.write_text('[model]\nvocab_size = "auto"\n')
    assert load_config(f).model.auto_shape == ("vocab_size",)
    assert load_config(f, {"model.vocab_size": 640}).shape.vocab_size == 640
    with pytest.raises(ConfigError, match=r'model.vocab_size must be an integer, got \'many\' \(or "auto"\)'):
        load_config(None, {"model.vocab_size": "many"})


def test_train_help_shows_the_word_and_its_default(capsys):
    assert main(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert '--model.vocab_size int|auto, default "auto"' in out


def test_a_split_too_small_to_use_is_a_warning_naming_the_fix():
    (val,) = split_warnings({"train": 33_822, "val": 0}, 0.01)
    assert "the validation split holds 0 tokens" in val and "raise --val-fraction to 0.167" in val
    (train, val) = split_warnings({"train": 3_000, "val": 0}, 0.01)
    assert "the train split holds 3,000 tokens" in train and val.endswith("add data")
    assert split_warnings({"train": 33_822, "val": 0}, 0.0) == []  # no validation was asked for
    assert split_warnings({"train": 10**6, "val": 10**4}, 0.01) == []


def test_the_eta_follows_the_recent_pace_after_a_slow_start():
    pace = Pace()
    pace.add(1, 30.0)  # start-up: a slow first step
    pace.add(19, 19 * 2.0)  # then steps of 2 s under load
    for _ in range(8):
        pace.add(20, 20 * 0.5)  # the load goes: 0.5 s a step
    assert pace.average > 1.6 * 0.5 and pace.eta(200) == pytest.approx(200 * 0.5, rel=0.05)


def test_the_progress_line_uses_the_recent_pace_and_the_summary_says_both(tmp_path, monkeypatch):
    steps = [1, *range(20, 201, 20)]
    clock = iter([0.0, 100.0, 120.0, *(120.0 + 5 * i for i in range(1, 10))])  # start-up, then 0.25 s a step
    monkeypatch.setattr(sinks.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    log = sinks.MetricsLogger(tmp_path, 400, jsonl=False, tensorboard=False, stream=out)
    for step in steps:
        log.log_step({"step": step, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0, "mfu": 0.1})
    last = out.getvalue().splitlines()[-1]
    assert "step 200/400" in last and last.endswith("ETA 50s"), last  # the mean since the start: 2m45s
    summary = {"step_time_mean_s": 0.45, "step_time_recent_s": 0.4, "interrupted": False, "steps": 400}
    summary |= {"wall_time_s": 181.7, "tokens": 1.6e6, "first_loss": 6.3, "final_loss": 1.6, "val_loss": None}
    summary |= {"tokens_per_s": 9000.0, "mfu": 0.4, "hfu": 0.4, "peak_mem_gib": 0.1}
    assert "in 181.7s (0.45 s/step on average, 0.4 s/step recently)" in end_line(summary, "runs/x")


def test_cpu_ranks_above_the_cores_are_a_warning_and_turn_the_straggler_check_off(monkeypatch, capsys):
    monkeypatch.setattr(launch_env, "cpu_cores", lambda: 2)
    check_nproc(2, "cpu")
    assert capsys.readouterr().err == ""
    check_nproc(4, "cpu")
    (line,) = capsys.readouterr().err.splitlines()
    assert "warning: --nproc 4 CPU ranks on 2 cores" in line and "the straggler check is off" in line
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert launch_env.oversubscribed("cpu") and not launch_env.oversubscribed("cuda")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not launch_env.oversubscribed("cpu")


def test_the_hub_hint_names_hf_download(capsys, tmp_path):
    assert main(["convert", "--from-hf", "meta-llama/Llama-3.2-1B", "--out", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "`hf download meta-llama/Llama-3.2-1B --local-dir DIR`" in err and "huggingface-cli" not in err


def test_tensorboard_is_off_by_default():
    assert load_config().metrics.tensorboard is False
    assert load_config("configs/debug.toml").metrics.tensorboard is False  # README command 1 prints no note


@pytest.mark.parametrize("ranks, off", [(4, True), (2, False)])
def test_the_keeper_leaves_the_straggler_check_off_when_ranks_share_cores(monkeypatch, tmp_path, ranks, off):
    import types

    import torch

    from meshforge.health.fault_hooks import RunHooks
    from meshforge.health.keeper import HealthKeeper

    monkeypatch.setattr(launch_env, "cpu_cores", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    plan = resolve(load_config(None, {"health.hang_timeout_s": 0, "run.dir": str(tmp_path)}), world=BPE)
    mesh = types.SimpleNamespace(distributed=True, device=torch.device("cpu"), rank=0, world_size=ranks, is_main=False)
    runner = types.SimpleNamespace(reduce_loss=None, guard=None)
    events: list[dict] = []
    report = (lambda name, **f: events.append({"event": name, **f}), lambda text: None)
    keeper = HealthKeeper(plan, mesh, runner, torch.nn.Linear(2, 2), [], report, RunHooks(), lambda lag: [])
    assert (keeper.stragglers is None) == off
    assert [e["key"] for e in events if e["event"] == "warning"] == (["health.straggler_factor"] if off else [])
