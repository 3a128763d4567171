"""The planner on mixtures of experts: MFU from active parameters, expert memory under ep,
the all-to-all time from the one formula, Mixtral on 64 GPUs, and an emitted ep config that
meshforge train's config check accepts."""

from __future__ import annotations

import pytest
import torch

from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.models import flops
from meshforge.models.presets import PRESETS
from meshforge.models.shape import ModelShape
from meshforge.parallel.expert.dispatch import a2a_bytes_formula
from meshforge.planner import kernel_costs, moe_costs, output
from meshforge.planner.estimate import estimate, plan_layout
from meshforge.planner.hardware import get_hardware
from meshforge.planner.model_flags import from_preset
from meshforge.planner.plan import parse_plan_args, plan_from_args, run
from meshforge.resolve import resolve


def _est(shape: ModelShape, **kw):
    lay = plan_layout(**{"tp": 1, "pp": 1, "dp": 64, "zero_stage": 3, "activation_checkpoint": "full", **kw})
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
        lay = plan_layout(1, 1, 64, ep=ep, zero_stage=3, activation_checkpoint="none")
        t = moe_costs.a2a_seconds(s, lay, tokens, 2, hw, 8, "none")
        bw, _ = hw.link("all_to_all", True)
        assert t >= a2a_bytes_formula(s, int(tokens), 2, ep) / bw
    inside = moe_costs.a2a_seconds(s, plan_layout(1, 1, 64, ep=8), tokens, 2, hw, 8, "none")
    across = moe_costs.a2a_seconds(s, plan_layout(1, 1, 64, ep=8), tokens, 2, hw, 4, "none")  # ep 8 spans 2 nodes
    assert across > inside


def test_mixtral_on_64_gpus_answers_with_ep_layouts():
    pl = plan_from_args(parse_plan_args(["--model", "mixtral-8x7b", "--gpus", "64"]))
    assert pl.results and all(e.fits and not e.not_runnable for e in pl.results)
    assert any(e.layout.ep > 1 for e in pl.results[:5])
    assert {e.layout.ep for e in pl.results} > {1, 2}  # ep is searched, not fixed
    best = pl.results[0]
    assert "ep_a2a" in output.explain(best, 80) and " ep " in output.table(pl.results, 5)


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
    assert cfg.layout.ep == 2 and cfg.model.preset == "debug-moe" and cfg.layout.dp_shard == 2
    # an explicit MoE shape is written out key by key and resolves the same way
    shape_argv = ["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn-hidden", "128", "--vocab", "256"]
    moe = ["--experts", "4", "--top-k", "2", "--moe-ffn-hidden", "32", "--ep", "2"]
    out2 = tmp_path / "shape.toml"
    run(parse_plan_args([*shape_argv, *moe, *argv[2:], "--global-batch", "4", "--emit-config", str(out2)]))
    cfg2 = resolve(load_config(str(out2), {}), 2)
    assert cfg2.shape.num_experts == 4 and cfg2.shape.moe_ffn_hidden == 32 and cfg2.layout.ep == 2


def test_ep_times_tp_pays_the_slot_all_reduces():
    """Under ep x tp every MoE block all-reduces its slots over tp (forward and backward,
    parallel/tensor/moe.py): the planner's tp time carries exactly that on top of
    the dense block's collectives, and it grows with the number of slots (top-k)."""
    s = from_preset("mixtral-8x7b")
    lay = {"tp": 4, "dp": 16, "ep": 8, "zero_stage": 2, "activation_checkpoint": "selective", "micro_batch_size": 4}
    with_moe = _est(s, **lay).time["tp_comm"]
    dense_like = _est(ModelShape(**{**vars(s), "num_experts": 0}), **lay).time["tp_comm"]
    extra = moe_costs.tp_seconds(s, plan_layout(**{"pp": 1, **lay}), 4 * 4096, 2, lambda kind, b: b)
    assert with_moe > dense_like and extra > 0
    wider = ModelShape(**{**vars(s), "experts_per_token": 4})
    assert moe_costs.tp_seconds(wider, plan_layout(**{"pp": 1, **lay}), 4 * 4096, 2, lambda kind, b: b) > extra
    assert moe_costs.tp_seconds(s, plan_layout(**{"pp": 1, **{**lay, "tp": 1}}), 4 * 4096, 2, lambda k, b: b) == 0


@pytest.mark.parametrize("preset", ["debug", "debug-moe", "qwen3-30b-a3b"])
def test_zero1_partition_sees_every_parameter_tensor(preset):
    """The ZeRO-1 split the planner prices (whole tensors, largest first) is over exactly the
    model's parameters, MoE blocks' router and stacked experts included."""
    from meshforge.planner.zero1_partition import largest_share, param_groups

    s = from_preset(preset)
    assert sum(map(sum, param_groups(s, 1, 1))) == s.num_params()
    dense_twin = ModelShape(**{**vars(s), "num_experts": 0})
    if s.num_experts:  # a few huge expert tensors split less evenly than the dense twin's
        assert largest_share(s, 1, 1, 8) != largest_share(dense_twin, 1, 1, 8)


_H100 = get_hardware("h100-sxm")
_MOE = dict(layers=8, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab_size=32000)


def test_expert_gemms_slow_down_as_rows_per_expert_shrink():
    few = ModelShape(**_MOE, num_experts=8, experts_per_token=2)
    many = ModelShape(**_MOE, num_experts=64, experts_per_token=2)  # same active FLOPs, 8x fewer rows per expert
    assert few.model_flops_per_token(4096) == many.model_flops_per_token(4096)
    lay = plan_layout(1, 1, 64, ep=1, activation_checkpoint="none")
    assert moe_costs.rows_per_expert(few, lay, 4096) == 8 * moe_costs.rows_per_expert(many, lay, 4096)
    per_token = {
        s.num_experts: moe_costs.expert_gemm_seconds(s, lay, 4096, 4096, _H100, "bf16")[0] for s in (few, many)
    }
    assert per_token[64] > per_token[8] > 0
    # and it reaches the step: the same active FLOPs take longer in the GEMMs
    gemm = {s.num_experts: _est(s, activation_checkpoint="none").time["gemm"] for s in (few, many)}
    assert gemm[64] - gemm[8] == pytest.approx(per_token[64] - per_token[8], rel=1e-9)


def test_rows_per_expert_follow_the_dispatch():
    """Mean rows per local expert as expert_parallel's dispatch and moe_tensor_parallel's tp
    shares hand them out, against the planner's formula."""
    from meshforge.parallel.expert.dispatch import _by_local_expert
    from meshforge.parallel.tensor.moe import share_rows

    s = from_preset("debug-moe")
    e, k, tokens_mb = s.num_experts, s.experts_per_token, 96
    gen = torch.Generator().manual_seed(0)
    for ep, tp in ((1, 1), (2, 1), (4, 1), (2, 2), (8, 2)):
        local = e // ep
        # each ep rank routes its own micro-batch (the whole micro-batch on each of its tp ranks)
        counts = [
            torch.bincount(torch.rand(tokens_mb, e, generator=gen).topk(k).indices.flatten(), minlength=e)
            for _ in range(ep)
        ]
        rows = []
        for t in range(tp):
            shares = [share_rows(c, t, tp)[1].tolist() for c in counts]
            for d in range(ep):  # what ep rank d's grouped GEMM gets per local expert
                _, local_counts = _by_local_expert([sh[d * local : (d + 1) * local] for sh in shares], "cpu")
                rows += local_counts.tolist()
        lay = plan_layout(tp, 1, 8, ep=ep)
        assert sum(rows) / len(rows) == pytest.approx(moe_costs.rows_per_expert(s, lay, tokens_mb))


def test_dense_compute_time_is_the_dense_formula():
    s = from_preset("llama3.1-8b")
    assert moe_costs.routed_flops_per_token(s, "full") == 0.0
    lay = plan_layout(2, 1, 32, zero_stage=1, micro_batch_size=2, num_microbatches=1, activation_checkpoint="selective")
    e = estimate(s, lay, 4096, 64, "bf16", _H100, 8)
    rate = kernel_costs.dense_gemm_rate(s, _H100, 2 * 4096, 2, "bf16")
    tokens = 64 * 4096 / 64
    attn = 3.0 * flops.attention_flops_per_token(s, 4096) * tokens * 4 / 3
    attn_s = kernel_costs.attention_seconds(s, _H100, 4096, tokens, s.layers, "selective", "bf16", rate)
    hw_flops = s.hardware_flops_per_token(4096, "selective") * tokens
    assert e.time["gemm"] == pytest.approx((hw_flops - attn) / rate + attn_s, rel=1e-12)


def test_capacity_factor_caps_the_imbalance():
    dropless = from_preset("mixtral-8x7b")
    assert dropless.capacity_factor == 0
    capped = {cf: ModelShape(**{**dropless.__dict__, "capacity_factor": cf}) for cf in (1.0, 1.1, 2.0)}
    one_per_rank = plan_layout(1, 1, 64, ep=8)  # 8 experts on 8 ranks: a rank's load is its expert's
    default = moe_costs.DEFAULT_EXPERT_IMBALANCE
    assert moe_costs.expert_imbalance(dropless, one_per_rank) == default
    assert moe_costs.expert_imbalance(capped[1.1], one_per_rank) == pytest.approx(1.1)
    assert moe_costs.expert_imbalance(capped[1.0], one_per_rank) == 1.0
    assert moe_costs.expert_imbalance(capped[2.0], one_per_rank) == default  # the cap is above the default
    # more experts per rank average some of it out; ep = 1 computes exactly its own slots
    by_ep = [moe_costs.expert_imbalance(dropless, plan_layout(1, 1, 64, ep=ep)) for ep in (1, 2, 4, 8)]
    assert by_ep[0] == 1.0 and by_ep == sorted(by_ep) and len(set(by_ep)) == 4
    gemm = {s.capacity_factor: _est(s, ep=8).time["gemm"] for s in (dropless, capped[1.1])}
    assert gemm[1.1] < gemm[0.0]


def test_capacity_factor_flag_is_checked_and_emitted(tmp_path):
    argv = ["--model", "debug-moe", "--gpu", "cpu", "--gpus", "2", "--gpus-per-node", "2", "--seq-len", "64"]
    out = tmp_path / "cf.toml"
    run(
        parse_plan_args(
            [*argv, "--global-batch", "4", "--ep", "2", "--capacity-factor", "1.25", "--emit-config", str(out)]
        )
    )
    cfg = resolve(load_config(str(out), {}), 2)
    assert cfg.shape.capacity_factor == 1.25 and cfg.shape.num_experts == 8 and cfg.layout.ep == 2
    with pytest.raises(SystemExit, match="2"):  # argparse's type check names the flag and its range
        parse_plan_args([*argv, "--capacity-factor", "-1"])


def test_chunked_all_to_alls_hide_beside_the_expert_gemms():
    """parallel.ep_chunks = C: per pass min(transfers, expert GEMMs) x (C-1)/C hidden (issue 42);
    one chunk hides nothing, and the step is shorter by exactly what is hidden."""
    s = from_preset("mixtral-8x7b")
    one, four = _est(s, ep=8, ep_chunks=1), _est(s, ep=8, ep_chunks=4)
    assert one.time["ep_a2a_hidden"] == 0.0
    hidden = four.time["ep_a2a_hidden"]
    everything = four.time["ep_a2a"] + hidden
    assert 0 < hidden <= everything * 3 / 4
    assert four.step_time_s == pytest.approx(one.step_time_s - (one.time["ep_a2a"] - four.time["ep_a2a"]))
    lay = plan_layout(1, 1, 64, ep=8, ep_chunks=4, activation_checkpoint="none")
    # slow transfers hide only the GEMMs' time, slow GEMMs only the transfers' (x 3/4)
    assert moe_costs.a2a_hidden(10.0, 3.0, lay, 8) == pytest.approx((1.0 + 2.0) * 3 / 4)
    assert moe_costs.a2a_hidden(2.0, 30.0, lay, 8) == pytest.approx((1.0 + 1.0) * 3 / 4)
    full = lay.replace(activation_checkpoint="full")  # two forward passes of transfers and GEMMs
    assert moe_costs.a2a_hidden(3.0, 4.0, full, 8) == pytest.approx((2 * 1.0 + 1.0) * 3 / 4)


def test_auto_chunks_only_where_the_experts_cross_nodes():
    """parallel.ep_chunks = 0 (the default): ep 8 inside an 8-GPU node runs one chunk (nothing hidden,
    one all-to-all each way); ep 8 at stride tp 2 spans two nodes and runs two."""
    s = from_preset("mixtral-8x7b")
    inside, across = _est(s, ep=8), _est(s, ep=8, tp=2)
    assert inside.time["ep_a2a_hidden"] == 0.0 and across.time["ep_a2a_hidden"] > 0
    assert inside.time["ep_a2a"] == pytest.approx(_est(s, ep=8, ep_chunks=1).time["ep_a2a"])
    assert across.time["ep_a2a_hidden"] == pytest.approx(_est(s, ep=8, tp=2, ep_chunks=2).time["ep_a2a_hidden"])
