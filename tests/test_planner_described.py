"""Run-description options for published runs (issue 28): a framework that reduce-scatters
ZeRO-3 gradients after every micro-batch (Composer's FSDP, as llm-foundry's MPT sweep ran)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshforge.planner.estimate import _dp_time, plan_layout
from meshforge.planner.hardware import get_hardware
from meshforge.planner.plan import parse_plan_args, plan_from_args
from meshforge.planner.shape import from_preset

H100 = get_hardware("h100-sxm")
SHAPE = from_preset("llama3.1-8b")


def _fsdp(n: int, hw=H100) -> float:
    return _dp_time(SHAPE, plan_layout(1, 1, 8, zero_stage=3, num_microbatches=n), "bf16", hw, 8)


def test_reduce_every_microbatch_repeats_the_reduce_scatter_per_microbatch():
    gather = _fsdp(2) - _fsdp(1)  # the forward + backward all-gathers of one micro-batch
    reduce = _fsdp(1) - gather  # the one fp32 reduce-scatter of a step
    assert reduce > 0
    every = replace(H100, reduce_every_microbatch=True)
    assert _fsdp(1, every) == pytest.approx(_fsdp(1))  # one micro-batch: the same step
    assert _fsdp(4, every) == pytest.approx(4 * gather + 4 * reduce)
    assert _fsdp(4) == pytest.approx(4 * gather + reduce)  # meshforge skips non-final reductions


def test_reduce_every_microbatch_is_a_plan_flag_and_leaves_other_runs_alone():
    argv = ["--model", "llama3.1-8b", "--gpus", "8", "--tp", "1", "--pp", "1", "--dp", "8", "--zero", "3"]
    argv += ["--micro-batch", "1", "--global-batch", "32", "--seq-len", "4096"]
    plain = plan_from_args(parse_plan_args(argv))
    every = plan_from_args(parse_plan_args([*argv, "--reduce-every-microbatch"]))
    assert not plain.hw.reduce_every_microbatch and every.hw.reduce_every_microbatch
    assert every.results[0].time["dp_comm_total"] > plain.results[0].time["dp_comm_total"]
    zero1 = [a if a != "3" else "1" for a in argv]  # ZeRO-1 is one reduce-scatter per step either way
    t = [
        plan_from_args(parse_plan_args(z)).results[0].time["dp_comm_total"]
        for z in (zero1, [*zero1, "--reduce-every-microbatch"])
    ]
    assert t[0] == pytest.approx(t[1])
