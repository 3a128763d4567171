"""The planner's parameters + gradients + optimizer bytes equal what a run allocates: the debug
preset trained 2 steps under DDP, ZeRO-1/2/3 and tp 2, in fp32 and bf16 (all ten runs in one
2-rank launch, tests/memory_runs_worker.py), each run's ``state_mem_bytes`` held to the
planner's breakdown for that run's resolved config.toml within 2%."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshforge.planner.plan import parse_plan_args, plan_from_args

LAYOUTS = {
    "ddp": "parallel.dp_shard=2,parallel.zero_stage=0",
    "zero1": "parallel.dp_shard=2,parallel.zero_stage=1",
    "zero2": "parallel.dp_shard=2,parallel.zero_stage=2",
    "zero3": "parallel.dp_shard=2,parallel.zero_stage=3",
    "tp2": "parallel.tp=2",
}
PRECISIONS = ("fp32", "bf16")
WORKER = Path(__file__).resolve().parents[1] / "memory_runs_worker.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("memory-runs")
    specs = [f"{name}-{p}={over},train.precision={p}" for name, over in LAYOUTS.items() for p in PRECISIONS]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*cmd, str(out), str(corpus), *specs], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


def _measured(run: Path) -> dict[str, int]:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["state_mem_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planner_states_equal_what_the_run_allocates(runs, layout, precision):
    run = runs / f"{layout}-{precision}"
    got = _measured(run)
    argv = ["--config", str(run / "config.toml"), "--gpus", "2", "--gpus-per-node", "2", "--gpu", "cpu"]
    pl = plan_from_args(parse_plan_args(argv))
    assert len(pl.results) == 1 and pl.precision == precision  # the run's own layout, every choice fixed
    e = pl.results[0]
    predicted = sum(e.memory[k] for k in ("params", "grads", "optimizer")) * 2**30
    measured = got["params"] + got["grads"] + got["optimizer"]
    assert predicted == pytest.approx(measured, rel=0.02), (e.memory, got)
    if layout == "zero2":  # FSDP2 holds the working parameters gathered from forward to backward
        gathered = e.memory["buffers"] * 2**30 - 2 * 25 * 2**20
        assert gathered == pytest.approx(got["gathered_params"], rel=0.02)
