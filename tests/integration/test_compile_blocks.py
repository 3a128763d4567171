"""Whole-block compile (parallel/compile.py): torch._dynamo.explain finds one graph and no
break in a dense block (plain, under activation checkpointing), and breaks in an MoE block,
which is why it falls back to piecewise compile with its reason in the plan; the compiled
loss call equals the eager one."""

import pytest
import torch
import torch._dynamo as dynamo

from meshforge.models.llama import build_model, rope_cos_sin
from meshforge.models.loss import LanguageModelLoss
from meshforge.models.shape import ModelShape
from meshforge.parallel.activation_checkpoint import apply_activation_checkpoint
from meshforge.parallel.compile import MOE_REASON, compile_loss, compile_plan_event, fullgraph_reason

MOE = {"num_experts": 4, "experts_per_token": 2}


def tiny(dtype=torch.float32, ac="none", **kw):
    model = build_model(ModelShape(64, 2, 4, 2, 128, 256, 64, **kw), device="cpu").to(dtype)
    apply_activation_checkpoint(list(model.layers.values()), ac)
    return model


def explain_block(model, dtype):
    block = model.layers["0"]
    x = torch.randn(2, 16, 64, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(model.rope_inv_freq, torch.arange(16))
    block(x, cos, sin)  # eager once (the MoE grouped-GEMM probe is cached)
    dynamo.reset()
    return dynamo.explain(block)(x, cos, sin)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_dense_block_is_one_graph(ac):
    model = tiny(ac=ac)
    e = explain_block(model, torch.float32)
    assert (e.graph_count, e.graph_break_count) == (1, 0), [str(b.reason)[:200] for b in e.break_reasons]
    assert fullgraph_reason(model.layers["0"]) is None


def test_moe_block_breaks_and_falls_back_with_its_reason():
    model = tiny(torch.bfloat16, **MOE)  # (bf16: the grouped GEMM's meta kernel takes no fp32)
    e = explain_block(model, torch.bfloat16)
    assert e.graph_break_count > 0
    assert any("Dynamic shape operator" in str(b.reason) for b in e.break_reasons)
    assert fullgraph_reason(model.layers["0"]) == MOE_REASON
    plan = compile_plan_event(list(model.layers.values()))
    assert plan == {"fullgraph_blocks": 0, "fallback": [{"blocks": [0, 1], "reason": MOE_REASON}]}
    assert compile_plan_event(list(tiny(ac="full").layers.values())) == {"fullgraph_blocks": 2, "fallback": []}


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {**MOE, "z_loss_coeff": 1e-3}], ids=["dense", "moe"])
def test_compiled_loss_equals_eager(kw):
    model = tiny(**kw)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    runs = []
    for compiled in (False, True):
        loss = LanguageModelLoss()
        fn = compile_loss(loss) if compiled else loss
        model.zero_grad(set_to_none=True)
        values = []
        for _ in range(2):
            value = fn(model(x, torch.arange(16)), y, model)
            value.backward()
            values.append(value.detach())
        runs.append((torch.stack(values), [p.grad.clone() for p in model.parameters()], sorted(loss.terms)))
    (a, ga, ta), (b, gb, tb) = runs
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for g, h in zip(ga, gb, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-6)
    assert ta == tb  # the auxiliary terms are still drained and kept
