"""Calibration that knows its noise (metrics/compute_profile.py, issue 51): every figure the fastest
of its rounds with the spread recorded, a noisy figure measured again, a profile that stays noisy
written with a warning naming the figures, and a matmul peak below a plain GEMM's rate treated as
the measurement error it is. The timings are injected: nothing here times anything."""

import argparse
import json

import pytest
import torch

from meshforge.calibration import calibrate
from meshforge.metrics import compute_profile as cp
from meshforge.planner.hardware import PRESETS, Hardware


class Script:
    """Injected rounds by figure: ``plan[figure]`` for the figures it names, ``default`` for the rest;
    ``calls`` counts the timings asked per figure."""

    def __init__(self, plan: dict[str, list[float]], default: list[float] = (1e-3, 1e-3, 1e-3)):
        self.plan, self.default, self.calls = plan, list(default), {}
        self.timer = cp.Timer(rounds_fn=self.rounds, agree=lambda v: v)

    def rounds(self, fn, repeat, min_s=0.0, calls=0) -> list[float]:
        name = self.timer._figure
        self.calls[name] = self.calls.get(name, 0) + 1
        return self.plan.get(name, self.default)


def test_each_figure_is_its_fastest_round_with_its_spread():
    s = Script({"x": [2.0, 1.0, 1.1, 1.05]})
    assert s.timer.figure("x", lambda: s.timer.time(lambda: None, 4)) == 1.0
    assert s.timer.spreads["x"] == pytest.approx(1.075 / 1.0 - 1)
    assert s.timer.attempts["x"] == 1 and s.timer.noisy() == []


def test_a_noisy_figure_is_measured_again_until_it_settles():
    rounds = iter([[1.0, 1.5, 1.6], [1.0, 1.02, 1.05]])  # 50% spread, then 2%
    timer = cp.Timer(rounds_fn=lambda *a, **k: next(rounds), agree=lambda v: v)
    assert timer.figure("attention", lambda: timer.time(lambda: None, 3)) == 1.0
    assert timer.attempts["attention"] == 2 and timer.spreads["attention"] == pytest.approx(0.02)
    assert timer.noisy() == [] and cp.noise_warning(timer.report()) == ""


def test_a_profile_that_stays_noisy_names_the_figures():
    timer = cp.Timer(rounds_fn=lambda *a, **k: [1.0, 1.4, 1.3], agree=lambda v: v)
    timer.figure("bandwidth", lambda: timer.time(lambda: None, 3))
    timer.figure("quiet", lambda: None)
    assert timer.attempts["bandwidth"] == cp.ATTEMPTS and timer.noisy() == ["bandwidth"]
    warning = cp.noise_warning(timer.report())
    assert "bandwidth (30%)" in warning and "quiet" not in warning


def test_ranks_agree_on_a_figures_spread():
    """One rank's noise makes every rank measure the figure again (else one would wait alone)."""
    timer = cp.Timer(rounds_fn=lambda *a, **k: [1.0, 1.0, 1.0], agree=lambda v: max(v, 0.5))  # another rank: 50%
    timer.figure("block fixed", lambda: timer.time(lambda: None, 3))
    assert timer.attempts["block fixed"] == cp.ATTEMPTS and timer.noisy() == ["block fixed"]


def test_a_peak_below_a_plain_gemm_is_a_measurement_error():
    """The issue's busy machine: the sweep read 3.4 GFLOP/s. Below half a plain GEMM measured on
    its own the sweep is measured again and, staying slow, the plain GEMM's rate is the peak."""
    plain_s = 2.0 * cp.PLAIN_GEMM**3 / 100e9  # a plain GEMM at 100 GFLOP/s
    s = Script({"matmul fp32": [1.0, 1.0, 1.0], "plain gemm": [plain_s] * 3})
    prof = cp.compute_profile(torch.device("cpu"), quick=True, timer=s.timer)
    assert prof["peaks"]["fp32"] == pytest.approx(100e9)
    assert s.calls["matmul fp32"] == cp.ATTEMPTS * 5 * 3  # every attempt: 5 sizes x 3 orientations
    assert "a measurement error" in prof["timing"]["errors"][0] and "matmul" in cp.noise_warning(prof["timing"])


def test_a_sweep_at_the_plain_rate_is_kept():
    plain_s = 2.0 * cp.PLAIN_GEMM**3 / 100e9
    s = Script({"plain gemm": [plain_s] * 3}, default=[1e-6] * 3)  # the sweep: far faster than the plain GEMM
    prof = cp.compute_profile(torch.device("cpu"), quick=True, timer=s.timer)
    assert prof["peaks"]["fp32"] > 100e9 and prof["timing"]["errors"] == []


def test_calibrate_writes_a_noisy_profile_with_a_warning(tmp_path, monkeypatch, capsys):
    noisy = {"spreads": {"attention": 0.45}, "attempts": {"attention": 3}, "noisy": ["attention"], "errors": []}
    hw = Hardware(**{**PRESETS["cpu"].__dict__, "extra": {"timing": noisy}})
    monkeypatch.setattr(calibrate, "calibrate", lambda nproc, quick: hw)
    out = tmp_path / "hw.json"
    assert calibrate.run(argparse.Namespace(nproc=1, quick=True, out=str(out))) == 0
    assert json.loads(out.read_text())["extra"]["timing"]["noisy"] == ["attention"]
    err = capsys.readouterr().err
    assert "noisy measurements" in err and "attention (45%)" in err
