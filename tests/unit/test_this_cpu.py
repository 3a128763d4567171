"""The planner's hardware for a CPU run is this CPU (issue 51): ``plan --config`` of a CPU run and
the report price it with this machine's measured, cached figures (metrics/cpu_peak.cpu_profile),
not a generic 100 GFLOP/s server CPU, and without ``meshforge calibrate``. The figures here are
injected; tests/test_flops_mfu.py measures a real one."""

import json
import os

import pytest

from meshforge.metrics import compute_profile, cpu_peak
from meshforge.planner.hardware import PRESETS, THIS_CPU, get_hardware
from meshforge.planner.plan import parse_plan_args, plan_from_args

FAKE = {"peaks": {"fp32": 3e11, "bf16": 6e11}, "half": 1e7, "attn": 0.5, "bw": 5e10, "elem": 30.0}
FAKE |= {"fixed": 2e-4, "opt": 1e-4, "timing": {"noisy": []}}


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """compute_profile replaced by FAKE (scaled by the threads it is measured with); the calls."""
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    calls = []

    def fake(device, quick, timer=None):
        import torch

        calls.append(torch.get_num_threads())
        return {**FAKE, "peaks": {k: v * torch.get_num_threads() for k, v in FAKE["peaks"].items()}}

    monkeypatch.setattr(compute_profile, "compute_profile", fake)
    return calls


def _cpu_config(tmp_path) -> str:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[model]\npreset = "debug"\n[train]\ndevice = "cpu"\nseq_len = 256\nglobal_batch_size = 16\n')
    return str(cfg)


def test_plan_config_of_a_cpu_run_prices_this_cpu(tmp_path, measured):
    pl = plan_from_args(parse_plan_args(["--config", _cpu_config(tmp_path), "--gpus", "1"]))
    cores = os.cpu_count() or 1
    assert pl.hw.name == THIS_CPU and pl.hw.is_cpu() and pl.precision == "fp32"
    assert pl.hw.peak_flops["fp32"] == FAKE["peaks"]["fp32"] * cores  # one rank: every core's threads
    assert pl.hw.block_fixed_s == FAKE["fixed"] and pl.hw.elementwise_bytes_per_hidden == FAKE["elem"]
    assert measured == [cores]
    generic = plan_from_args(parse_plan_args(["--config", _cpu_config(tmp_path), "--gpus", "1", "--gpu", "cpu"]))
    assert generic.hw.peak_flops == PRESETS["cpu"].peak_flops  # --gpu cpu: the generic preset, as asked
    assert pl.results[0].step_time_s != generic.results[0].step_time_s


def test_this_cpu_is_measured_once_and_per_rank(tmp_path, measured):
    cores = os.cpu_count() or 1
    get_hardware(THIS_CPU)
    get_hardware(THIS_CPU)  # cached
    assert measured == [cores]
    stored = json.loads((tmp_path / "cpu_peak.json").read_text())["entries"]
    entry = next(v for k, v in stored.items() if k.startswith("profile|") and f"threads={cores}" in k)
    assert entry["machine"] == cpu_peak.machine_fingerprint() and entry["profile"]["elem"] == FAKE["elem"]
    if cores >= 2:
        two = get_hardware(THIS_CPU, ranks=2)  # each of 2 ranks gets half the cores
        assert measured == [cores, cores // 2]
        assert two.peak_flops["fp32"] == FAKE["peaks"]["fp32"] * (cores // 2)
        assert two.for_ranks(1).peak_flops["fp32"] == FAKE["peaks"]["fp32"] * cores


def test_a_profile_from_another_machine_is_measured_again(tmp_path, measured, monkeypatch):
    get_hardware(THIS_CPU)
    monkeypatch.setattr(cpu_peak, "machine_fingerprint", lambda: "another")
    get_hardware(THIS_CPU)
    assert len(measured) == 2
