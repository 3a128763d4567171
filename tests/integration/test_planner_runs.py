"""The planner against real runs: a config it emits trains on 2 ranks and plans back to the same
layout, and ``meshforge calibrate`` on 2 ranks writes a profile the planner reads."""

import json

import pytest

from conftest import run_cli
from meshforge.calibration.collectives import COLLECTIVES
from meshforge.planner.hardware import get_hardware

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn-hidden", "128", "--vocab", "512"]


@pytest.mark.slow
def test_emitted_config_trains_and_plans_back(tmp_path, corpus):
    """plan -> --emit-config -> meshforge train on 2 ranks -> plan --config of the run's
    resolved config.toml gives the same layout back."""
    cfg = tmp_path / "plan.toml"
    r = run_cli(
        "plan", *TINY, "--gpu", "cpu", "--gpus", "2", "--gpus-per-node", "2", "--seq-len", "32",
        "--global-batch", "8", "--emit-config", str(cfg), "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    best = json.loads(r.stdout)["layouts"][0]
    run = tmp_path / "run"
    r = run_cli(
        "train", "--config", str(cfg), "--nproc", "2", "--train.steps=3", f"--data.path={corpus}",
        f"--run.dir={run}", "--metrics.console=false", "--metrics.log_interval=1",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    cluster = ["--gpu", "cpu", "--gpus", "2", "--gpus-per-node", "2"]
    r = run_cli("plan", "--config", str(run / "config.toml"), *cluster)
    assert r.returncode == 0, r.stderr
    r = run_cli("plan", "--config", str(run / "config.toml"), *cluster, "--json")
    again = json.loads(r.stdout)["layouts"]
    assert len(again) == 1  # every choice was fixed by the resolved config
    for k in ("tp", "dp_shard", "zero_stage", "micro_batch_size", "activation_checkpoint"):
        assert again[0][k] == best[k]


@pytest.mark.slow
def test_calibrate_writes_a_profile_the_planner_reads(tmp_path):
    out = tmp_path / "cpu.json"
    r = run_cli("calibrate", "--quick", "--nproc", "2", "--out", str(out), timeout=300)  # a loaded machine: minutes
    assert r.returncode == 0, r.stderr[-3000:]
    hw = get_hardware(None, str(out))
    assert hw.peak("fp32") > 1e9 and hw.intra_bw > 1e6 and 0 < hw.intra_latency < 0.1
    assert set(hw.collectives) == set(COLLECTIVES)  # each as training issues it
    assert all(0 <= alpha < 0.1 and bw > 1e6 for alpha, bw in hw.collectives.values())
    assert 0 <= hw.comm_overlap <= 1 and hw.elementwise_bytes_per_hidden > 0
    assert set(hw.layout_fixed_s) == {"tp", "fsdp"}  # per-op costs of each layout kind, measured
    assert all(0 <= v < 1 for kind in hw.layout_fixed_s.values() for v in kind.values())
    assert hw.by_ranks["1"]["peak_flops"]["fp32"] > 1e9  # a 1-rank run gets all the cores' threads
    r = run_cli("plan", *TINY, "--hardware", str(out), "--gpus", "2", "--gpus-per-node", "2", "--seq-len=32", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layouts"][0]["step_time_s"] > 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x"}')
    r = run_cli("plan", *TINY, "--hardware", str(bad), "--gpus", "2")
    assert r.returncode == 2 and "not a hardware profile written by meshforge calibrate" in r.stderr
