"""The command line as a newcomer meets it: --help, --dry-run and the errors for common slips."""

import pytest
import torch

from meshforge.cli.main import main
from meshforge.cli.train import parse_train_args
from meshforge.config import keys, load_config
from meshforge.errors import ConfigError
from meshforge.launch.local import check_nproc

TINY = ["--model.hidden=64", "--model.layers=2", "--model.heads=4", "--model.kv_heads=2", "--model.ffn_hidden=128"]


def test_train_help_lists_every_key(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for key in keys():
        assert f"--{key} " in out, f"{key} missing from meshforge train --help"
    assert "--dry-run" in out and "default 200" in out and "auto|fp32|bf16|fp8" in out


def test_dry_run_prints_the_resolved_config_and_the_estimate(tmp_path, capsys):
    run = tmp_path / "never"
    argv = ["train", "--dry-run", "--nproc", "2", "--parallel.pp=2", "--train.seq_len=32", f"--run.dir={run}", *TINY]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[parallel]" in out and "pp = 2" in out and "dp_shard = 1" in out  # resolved for 2 ranks
    assert "planner estimate on 2 x cpu" in out and "GiB per device" in out and "MFU" in out
    assert not run.exists()


def test_a_dry_runs_verdict_is_its_exit_code(tmp_path, capsys, monkeypatch):
    """Issue 53: `--model.preset llama3.2-1b --dry-run` said `does NOT fit` and exited 0."""
    from meshforge.guards.memory_fit import AVAILABLE_ENV

    monkeypatch.setenv(AVAILABLE_ENV, "20")
    run = tmp_path / "never"
    assert main(["train", "--dry-run", "--model.preset=llama3.2-1b", "--train.device=cpu", f"--run.dir={run}"]) == 2
    out = capsys.readouterr().out
    assert "does NOT fit: needs" in out and "of 20 GiB" in out and "dry run: no ranks started" in out
    assert main(["train", "--dry-run", "--train.device=cpu", f"--run.dir={run}", *TINY]) == 0
    assert "(fits)" in capsys.readouterr().out and not run.exists()


def test_cuda_without_gpus_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="no CUDA device is visible.*--train.device cpu"):
        check_nproc(1, "cuda")


def test_a_key_under_the_wrong_section_names_the_right_one(tmp_path):
    with pytest.raises(ConfigError, match=r"optim.lr exists: did you mean --optim.lr\?"):
        load_config(None, {"train.lr": 1e-3})
    toml = tmp_path / "c.toml"
    toml.write_text("[train]\nlr = 0.001\n")
    with pytest.raises(ConfigError, match=r"did you mean \[optim\] lr\?"):
        load_config(toml)


def test_a_bare_option_that_needs_a_value():
    with pytest.raises(ConfigError, match="--optim.lr needs a value"):
        parse_train_args(["--optim.lr"])
    assert parse_train_args(["--train.compile"])[3] == {"train.compile": True}  # booleans may stand alone


def test_a_text_key_takes_the_text_as_written():
    """A run directory named 1, nan or true is a name, not a number or a boolean."""
    got = parse_train_args(["--run.dir=1", "--data.path", "true", "--data.cache_dir", "nan", "--optim.lr=1e-3"])[3]
    assert got == {"run.dir": "1", "data.path": "true", "data.cache_dir": "nan", "optim.lr": 1e-3}
    assert load_config(None, got).run.dir == "1"


@pytest.mark.parametrize("source", ["meta-llama/Llama-3.2-1B", "missing-dir"])
def test_convert_from_hf_reads_local_directories_only(tmp_path, monkeypatch, capsys, source):
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "--from-hf", source, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--from-hf {source}: not a directory" in err and "local" in err and "no hub downloads" in err
