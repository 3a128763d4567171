"""Grouped TensorBoard tags (with the legacy flat names kept) and the optional W&B sink,
tested against a stand-in module (wandb is not a dependency)."""

import sys
import types

import pytest

from meshforge.errors import ConfigError
from meshforge.metrics.sinks import MetricsLogger
from meshforge.metrics.tb_tags import grouped, health_scalar
from meshforge.metrics.wandb_sink import WandbSink
from tb_read import read_scalars

REC = {
    "step": 4,
    "loss": 3.5,
    "lr": 1e-3,
    "grad_norm": 0.7,
    "tokens_per_s": 900.0,
    "mfu": 0.1,
    "tokens_per_s_ok": True,
    "peak_mem_gib": 0.3,
    "time_breakdown": {"compute_s": 0.02, "by_rank": [[0.1]]},
    "state_mem_bytes": {"params": 8},
}


def test_tags_are_grouped_and_old_names_kept():
    tags = grouped(REC)
    assert tags["train/loss"] == tags["loss"] == 3.5 and tags["train/grad_norm"] == 0.7
    assert tags["perf/mfu"] == 0.1 and tags["perf/time_breakdown/compute_s"] == 0.02
    assert tags["mem/peak_mem_gib"] == 0.3 and tags["mem/state_mem_bytes/params"] == 8
    assert "step" not in tags and "perf/tokens_per_s_ok" not in tags and "perf/time_breakdown/by_rank" not in tags
    assert health_scalar("loss_spike", {"score": 9.5}) == {"health/loss_spike": 9.5}
    assert health_scalar("eval", {}) == {}


class FakeRun:
    def __init__(self, **kw):
        self.init, self.logged, self.finished = kw, [], False

    def log(self, scalars, step):
        self.logged.append((step, dict(scalars)))

    def finish(self):
        self.finished = True


def test_wandb_sink_logs_offline_through_the_logger(tmp_path, monkeypatch):
    runs = []
    fake = types.SimpleNamespace(init=lambda **kw: runs.append(FakeRun(**kw)) or runs[-1])
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = MetricsLogger(tmp_path, 10, console=False)
    log.add_sink(WandbSink(tmp_path, {"train": {"steps": 10}}))
    log.log_step(REC)
    log.event("straggler", step=4, rank=1, ratio=3.0)
    log.close()
    (run,) = runs
    assert (
        run.init["mode"] == "offline"
        and run.init["dir"] == str(tmp_path)
        and run.init["config"]["train"]["steps"] == 10
    )
    assert run.logged[0][0] == 4 and run.logged[0][1]["train/loss"] == 3.5 and run.finished
    tb = {tag for _, tag, _ in read_scalars(next((tmp_path / "tensorboard").iterdir()))}
    assert {"loss", "train/loss", "health/straggler"} <= tb


def test_wandb_missing_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(ConfigError, match="metrics.wandb = true needs the wandb package"):
        WandbSink(tmp_path, {})
