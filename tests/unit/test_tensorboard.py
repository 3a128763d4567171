"""TensorBoard files through torch.utils.tensorboard, read back with tensorboard's EventAccumulator;
without the tensorboard package a one-line note and no crash."""

import io
import sys

import pytest

from meshforge.metrics.sinks import TB_MISSING, MetricsLogger, TensorBoardWriter
from tb_read import read_scalars

pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'meshforge[tensorboard]')")


def test_scalars_round_trip(tmp_path):
    w = TensorBoardWriter(tmp_path)
    w.add_scalars(1, {"loss": 2.5, "lr": 1e-3})
    w.add_scalars(300, {"loss": 1.25})
    got = read_scalars(tmp_path)  # flushed on every call: readable before close
    w.close()
    assert got[0] == (1, "loss", 2.5)
    assert got[1][:2] == (1, "lr") and got[1][2] == pytest.approx(1e-3)
    assert got[2] == (300, "loss", 1.25)


def test_logger_writes_grouped_and_legacy_tags(tmp_path):
    log = MetricsLogger(tmp_path, 10, console=False)
    log.log_step({"step": 2, "loss": 3.0, "lr": 0.1, "tokens_per_s": 5.0, "mfu": 0.2, "comm_bytes": {"dp": 8}})
    log.log_eval(2, 2.0)
    log.close()
    tags = {tag for _, tag, _ in read_scalars(tmp_path / "tensorboard")}
    assert {"loss", "train/loss", "perf/mfu", "perf/comm_bytes/dp", "train/val_loss"} <= tags


def test_missing_package_is_a_note_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # the import fails
    out = io.StringIO()
    log = MetricsLogger(tmp_path, 10, console=False, stream=out)
    log.log_step({"step": 1, "loss": 3.0, "lr": 0.1, "tokens_per_s": 5.0, "mfu": 0.2})
    log.close()
    assert out.getvalue().strip() == TB_MISSING and "\n" not in out.getvalue().strip()
    assert not (tmp_path / "tensorboard").exists() and (tmp_path / "metrics.jsonl").is_file()
