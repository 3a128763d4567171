"""What a new user met trying every command on a CPU machine (2026-11-28), each kept from
coming back: a short run's token count, the hint of a validation split too small to evaluate,
argparse's usage dump in front of a one-line error, and help that names a key that does not exist."""

from __future__ import annotations

import errno
from types import SimpleNamespace

import pytest

from meshforge import explore
from meshforge.cli.main import main
from meshforge.cli.resume import _check_world
from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.guards.preflight import check_init_from
from meshforge.metrics.step_metrics import end_line
from meshforge.parallel.degrees import resolve_degrees
from meshforge.train.run_log import _more_validation


def _summary(tokens: float) -> dict:
    s = {"step_time_mean_s": 0.4, "step_time_recent_s": 0.4, "interrupted": False, "steps": 10}
    s |= {"wall_time_s": 4.0, "tokens": tokens, "first_loss": 6.3, "final_loss": 4.0, "val_loss": None}
    return s | {"tokens_per_s": 640.0, "mfu": 0.01, "hfu": 0.01, "peak_mem_gib": 0.1}


def test_a_short_runs_tokens_are_counted_not_rounded_to_zero_millions():
    assert "| 2,560 tokens |" in end_line(_summary(2560), "runs/x")  # was "0.00M tokens"
    assert "| 1.64M tokens |" in end_line(_summary(1_638_400), "runs/x")  # the main job's, as README shows


def test_a_resumed_sessions_last_line_counts_its_own_steps():
    """The wall time is this session's: a run resumed at step 10 that ended at 14 took 4 steps in it
    (it said "done: 14 steps in 3.6s")."""
    resumed = _summary(2560) | {"steps": 14, "start_step": 10}
    assert "done: steps 11-14 (4 steps, resumed at step 10) in 4.0s" in end_line(resumed, "runs/x")
    assert "done: 10 steps in 4.0s" in end_line(_summary(2560) | {"start_step": 0}, "runs/x")


def test_too_small_a_prepared_split_is_not_told_to_raise_val_fraction(tmp_path):
    """data.val_fraction splits raw text as it is prepared; shards already split ignore it."""
    (tmp_path / "index.json").write_text("{}")
    hint = _more_validation(str(tmp_path))
    assert "prepare the text again with a larger --val-fraction" in hint and "raise data.val_fraction" not in hint
    assert _more_validation("") == "raise data.val_fraction or add data"  # the default corpus, prepared on use
    assert _more_validation(str(tmp_path / "a.txt")) == "raise data.val_fraction or add data"


@pytest.mark.parametrize(
    "argv, said",
    [
        (
            ["plan", "--model", "llama3.1-8b", "--gpus", "0"],
            "meshforge plan: error: argument --gpus: must be a positive",
        ),
        (["report"], "meshforge report: error: the following arguments are required: RUN_DIR"),
        (["data", "prepare", "--out", "x"], "meshforge data prepare: error: the following arguments are required"),
    ],
)
def test_a_bad_flag_is_one_paragraph_without_the_usage_dump(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(said), err
    assert "usage:" not in err and len(err.strip().splitlines()) == 1, err  # plan's usage alone was 20 lines


def test_report_help_names_the_key_that_sets_a_run_directory(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    out = capsys.readouterr().out
    assert "run.dir" in out and "out_dir" not in out  # there is no out_dir key: --run.out_dir is refused


@pytest.mark.parametrize("name, said", [("nope", "does not exist"), ("a.txt", "is not a directory of weights")])
def test_init_from_that_is_no_weights_directory_says_what_to_give(tmp_path, name, said):
    (tmp_path / "a.txt").write_text("x")
    plan = SimpleNamespace(model=SimpleNamespace(init_from=str(tmp_path / name)))
    with pytest.raises(ConfigError, match=rf"{said}; give a run's final/ or the output of `meshforge convert"):
        check_init_from(plan)


def test_resuming_a_two_rank_run_without_its_nproc_names_the_nproc(tmp_path):
    ran = load_config(None, {"parallel.dp_shard": 2, "parallel.zero_stage": 3})  # as its config.toml records it
    with pytest.raises(ConfigError, match=r"ran on 2 rank\(s\) \(dp_shard 2\), this launch has 1; add --nproc 2"):
        _check_world(tmp_path, ran, {"train.steps": 40}, 1)
    _check_world(tmp_path, ran, {"train.steps": 40}, 2)  # as it ran
    _check_world(tmp_path, ran, {"parallel.dp_shard": 1}, 1)  # another layout, given: the degrees' own check
    with pytest.raises(ConfigError, match=r"ran on 1 rank\(s\) \(one rank\), this launch has 2; leave out --nproc"):
        _check_world(tmp_path, load_config(None, {"parallel.dp_shard": 1}), {}, 2)


@pytest.mark.parametrize("flag, sub", [("--to-hf", "final"), ("--from-checkpoint", "checkpoints")])
def test_convert_given_a_run_directory_names_the_folder_to_give(tmp_path, flag, sub, capsys):
    run = tmp_path / "run"
    (run / sub).mkdir(parents=True)
    (run / "config.toml").write_text("[train]\nsteps = 2\n")
    assert main(["convert", flag, str(run), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {run} is a run directory; give its {sub}/: {flag} {run / sub}" in err, err
    assert not (tmp_path / "hf").exists()  # nothing written


def test_explore_on_an_address_of_another_machine_points_at_host_not_port(monkeypatch, capsys):
    def serve(host: str, port: int) -> int:
        raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")  # bind() to 192.0.2.1 here

    monkeypatch.setattr(explore, "serve", serve)
    assert main(["explore", "--host", "192.0.2.1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--host must be an address of this machine" in err and "try another --port" not in err, err


def test_tensor_parallel_on_one_rank_says_to_start_more_ranks():
    """The newcomer's `meshforge train --parallel.tp 2` without --nproc: "world size" alone did not say how."""
    with pytest.raises(
        ConfigError, match=r"world size 1 is not divisible .* 2; start a multiple of 2 ranks \(--nproc 2"
    ):
        resolve_degrees(load_config(None, {"parallel.tp": 2}).layout, 1)


@pytest.mark.parametrize(
    "toml, said",
    [
        ('[job]\ndump_folder = "./outputs"\n', r"section \[job\] .*that is torchtitan's; meshforge's is \[run\] dir"),
        ('[model]\nname = "llama3"\n', r"model\.name .*that is torchtitan's; meshforge's is \[model\] preset"),
    ],
)
def test_a_torchtitan_job_config_is_pointed_at_meshforges_keys(tmp_path, toml, said):
    """[model] name once answered "optim.name exists: did you mean [optim] name?" (the optimizer's)."""
    (tmp_path / "tt.toml").write_text(toml)
    with pytest.raises(ConfigError, match=said):
        load_config(tmp_path / "tt.toml")
