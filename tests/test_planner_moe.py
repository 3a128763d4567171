"""The planner on mixtures of experts: MFU from active parameters, expert memory under ep,
the all-to-all time from the one formula, Mixtral on 64 GPUs, and an emitted ep config that
meshforge train's config check accepts."""

from __future__ import annotations

import pytest

from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.models import flops
from meshforge.models.presets import PRESETS
from meshforge.parallel.expert_parallel import a2a_bytes_formula
from meshforge.planner import moe_costs, report
from meshforge.planner.estimate import Layout, estimate
from meshforge.planner.hardware import get_hardware
from meshforge.planner.plan import parse_plan_args, plan_from_args, run
from meshforge.planner.shape import Shape, from_preset
from meshforge.resolve import resolve


def _est(shape: Shape, **kw):
    lay = Layout(**{"tp": 1, "pp": 1, "dp": 64, "zero_stage": 3, "recompute": "full", **kw})
    return estimate(shape, lay, 4096, 64, "bf16", get_hardware("h100-sxm"), 8)


def test_mfu_counts_active_parameters():
    s = from_preset("mixtral-8x7b")
    assert s.active_params() < s.num_params() / 3  # 12.9B of 46.7B
    e = _est(s)
    expected = flops.model_flops_per_token(PRESETS["mixtral-8x7b"], 4096) * e.tokens_per_s_per_gpu
    assert e.mfu == pytest.approx(expected / get_hardware("h100-sxm").peak("bf16"))
    assert flops.model_flops_per_token(s, 4096) < 6 * s.num_params()  # not the total count


def test_expert_memory_shrinks_with_ep():
    s = from_preset("mixtral-8x7b")
    psi_e = moe_costs.expert_params_on_stage(s, 1, 1)
    assert psi_e == 32 * 8 * 3 * 4096 * 14336
    # ZeRO-2: the experts are gathered whole without ep, only this rank's E/ep with it
    buffers = {ep: _est(s, ep=ep, zero_stage=2).memory["buffers"] for ep in (1, 2, 4, 8)}
    assert buffers[1] > buffers[2] > buffers[4] > buffers[8]
    assert buffers[1] - buffers[8] == pytest.approx(psi_e * 2 * (1 - 1 / 8) / 2**30, rel=1e-6)
    # DDP would replicate the experts' 16 bytes/parameter; ep splits them
    dense = _est(s, ep=1, zero_stage=0, dp=8)
    split = _est(s, ep=8, zero_stage=0, dp=8)
    assert split.memory["optimizer"] < dense.memory["optimizer"] / 4


def test_all_to_all_time_uses_the_logged_formula_and_the_eps_link():
    s = from_preset("mixtral-8x7b")
    hw = get_hardware("h100-sxm")
    assert _est(s, ep=1).time["ep_a2a"] == 0.0
    tokens = 64 * 4096 / 64
    for ep in (2, 8):
        lay = Layout(1, 1, 64, ep=ep, zero_stage=3, recompute="none")
        t = moe_costs.a2a_seconds(s, lay, tokens, 2, hw, 8, "none")
        bw, _ = hw.link("all_to_all", True)
        assert t >= a2a_bytes_formula(s, int(tokens), 2, ep) / bw
    inside = moe_costs.a2a_seconds(s, Layout(1, 1, 64, ep=8), tokens, 2, hw, 8, "none")
    across = moe_costs.a2a_seconds(s, Layout(1, 1, 64, ep=8), tokens, 2, hw, 4, "none")  # ep 8 spans 2 nodes
    assert across > inside


def test_mixtral_on_64_gpus_answers_with_ep_layouts():
    pl = plan_from_args(parse_plan_args(["--model", "mixtral-8x7b", "--gpus", "64"]))
    assert pl.results and all(e.fits and not e.not_runnable for e in pl.results)
    assert any(e.layout.ep > 1 for e in pl.results[:5])
    assert {e.layout.ep for e in pl.results} > {1, 2}  # ep is searched, not fixed
    best = pl.results[0]
    assert "ep_a2a" in report.explain(best, 80) and " ep " in report.table(pl.results, 5)


def test_moe_flags_describe_an_explicit_shape_and_are_checked():
    base = ["--layers", "4", "--hidden", "256", "--heads", "4", "--ffn-hidden", "512", "--vocab", "1000"]
    pl = plan_from_args(parse_plan_args([*base, "--experts", "8", "--top-k", "2", "--gpus", "8", "--gpu", "cpu"]))
    assert pl.shape.num_experts == 8 and pl.shape.active_params() < pl.shape.num_params()
    assert {e.layout.ep for e in pl.results} - {1}
    with pytest.raises(ConfigError, match="--top-k"):
        plan_from_args(parse_plan_args([*base, "--experts", "4", "--top-k", "5", "--gpus", "8"]))
    with pytest.raises(ConfigError, match="--ep 3"):
        plan_from_args(parse_plan_args([*base, "--experts", "8", "--ep", "3", "--gpus", "8"]))


def test_emitted_ep_config_resolves(tmp_path):
    out = tmp_path / "plan.toml"
    argv = ["--model", "debug-moe", "--gpu", "cpu", "--gpus", "2", "--gpus-per-node", "2", "--seq-len", "64"]
    run(parse_plan_args([*argv, "--global-batch", "4", "--ep", "2", "--emit-config", str(out)]))
    cfg = resolve(load_config(str(out), {}), 2)
    assert cfg.parallel.ep == 2 and cfg.model.preset == "debug-moe" and cfg.parallel.dp_shard == 2
    # an explicit MoE shape is written out key by key and resolves the same way
    shape_argv = ["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn-hidden", "128", "--vocab", "256"]
    moe = ["--experts", "4", "--top-k", "2", "--moe-ffn-hidden", "32", "--ep", "2"]
    out2 = tmp_path / "shape.toml"
    run(parse_plan_args([*shape_argv, *moe, *argv[2:], "--global-batch", "4", "--emit-config", str(out2)]))
    cfg2 = resolve(load_config(str(out2), {}), 2)
    assert cfg2.model.num_experts == 4 and cfg2.model.moe_ffn_hidden == 32 and cfg2.parallel.ep == 2


def test_ep_times_tp_pays_the_slot_all_reduces():
    """Under ep x tp every MoE block all-reduces its slots over tp (forward and backward,
    parallel/moe_tensor_parallel.py): the planner's tp time carries exactly that on top of
    the dense block's collectives, and it grows with the number of slots (top-k)."""
    s = from_preset("mixtral-8x7b")
    lay = {"tp": 4, "dp": 16, "ep": 8, "zero_stage": 2, "recompute": "selective", "micro_batch_size": 4}
    with_moe = _est(s, **lay).time["tp_comm"]
    dense_like = _est(Shape(**{**vars(s), "num_experts": 0}), **lay).time["tp_comm"]
    extra = moe_costs.tp_seconds(s, Layout(**{"pp": 1, **lay}), 4 * 4096, 2, lambda kind, b: b)
    assert with_moe > dense_like and extra > 0
    wider = Shape(**{**vars(s), "experts_per_token": 4})
    assert moe_costs.tp_seconds(wider, Layout(**{"pp": 1, **lay}), 4 * 4096, 2, lambda kind, b: b) > extra
    assert moe_costs.tp_seconds(s, Layout(**{"pp": 1, **{**lay, "tp": 1}}), 4 * 4096, 2, lambda k, b: b) == 0


@pytest.mark.parametrize("preset", ["debug", "debug-moe", "qwen3-30b-a3b"])
def test_zero1_partition_sees_every_parameter_tensor(preset):
    """The ZeRO-1 split the planner prices (whole tensors, largest first) is over exactly the
    model's parameters, MoE blocks' router and stacked experts included."""
    from meshforge.planner.zero1_partition import largest_share, param_groups

    s = from_preset(preset)
    assert sum(map(sum, param_groups(s, 1, 1))) == s.num_params()
    dense_twin = Shape(**{**vars(s), "num_experts": 0})
    if s.num_experts:  # a few huge expert tensors split less evenly than the dense twin's
        assert largest_share(s, 1, 1, 8) != largest_share(dense_twin, 1, 1, 8)
