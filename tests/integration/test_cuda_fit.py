"""The pre-flight fit check on a real GPU (skipped without one, by conftest): a model that
cannot fit one GPU is refused with exit 2 before it is built, naming the GPU and its free
memory; a tiny run passes the check and trains; --dry-run names the GPU."""

import pytest
import torch

from conftest import cli_args, run_cli, tiny_overrides
from meshforge.guards.memory_fit import AVAILABLE_ENV

pytestmark = pytest.mark.cuda


def test_a_model_larger_than_the_gpu_is_refused_before_it_is_built(tmp_path):
    run = tmp_path / "run"  # 70B: over 1 TB of model states, on any single GPU
    r = run_cli("train", "--model.preset=llama3.1-70b", "--train.device=cuda", f"--run.dir={run}", timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    name = torch.cuda.get_device_name(0)
    assert "cannot fit" in r.stderr and f"GiB free on {name}" in r.stderr
    for fix in ("--train.activation_checkpoint=full", "--parallel.offload=cpu", "meshforge plan --model llama3.1-70b"):
        assert fix in r.stderr, fix
    assert not run.exists()


def test_a_tiny_run_passes_and_a_mocked_full_gpu_is_refused_unless_skipped(tmp_path, corpus):
    o = tiny_overrides(tmp_path / "run", corpus, **{"train.device": "cuda", "train.steps": 2})
    r = run_cli("train", *cli_args(o))
    assert r.returncode == 0, r.stderr[-3000:]
    o["run.dir"] = str(tmp_path / "refused")
    r = run_cli("train", *cli_args(o), env={AVAILABLE_ENV: "0.01"})
    assert r.returncode == 2 and "0.0 GiB free on" in r.stderr, r.stderr[-3000:]
    r = run_cli("train", *cli_args(o), "--train.skip_memory_check=true", env={AVAILABLE_ENV: "0.01"})
    assert r.returncode == 0, r.stderr[-3000:]


def test_dry_run_names_the_gpu_and_its_memory(tmp_path):
    r = run_cli("train", "--dry-run", "--train.device=cuda", f"--run.dir={tmp_path / 'x'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"device: {torch.cuda.get_device_name(0)}, " in r.stdout and "GiB free of" in r.stdout
    assert "device: CPU" not in r.stdout
