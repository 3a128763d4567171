"""Mixture of experts on one device: routing, the grouped GEMM against the loop over experts
and against a per-token reference, capacity, the balance terms and bias, presets' published
parameter counts, FLOPs from active parameters, and bad values refused by key."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from meshforge import compat
from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.models import flops
from meshforge.models.llama import build_model
from meshforge.models.loss import LanguageModelLoss
from meshforge.models.moe import MoE, end_step, grouped_matmul, is_moe_layer, moe_layers
from meshforge.models.presets import get_preset


def _args(**kw):
    a = get_preset("debug-moe")
    a.hidden, a.moe_ffn_hidden = 32, 24
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def _layer(seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    m = MoE(_args(**kw))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    m.init_buffers()
    return m


def _reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per token: the weighted sum of its top-k experts' SwiGLU, computed one token at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = m.router.weight @ x[t]
        probs = logits.softmax(-1) if m.router_score == "softmax" else logits.sigmoid()
        bias = m.expert_bias if m.load_balance == "bias" else 0
        top = (probs + bias).topk(m.top_k).indices
        w = probs[top] / (probs[top].sum() if m.norm_topk else 1)
        for e, we in zip(top.tolist(), w, strict=True):
            ex = m.experts
            h = F.silu(ex.w1[e] @ x[t]) * (ex.w3[e] @ x[t])
            out[t] += we * (ex.w2[e] @ h)
    if m.shared is not None:
        out = out + m.shared(x)
    return out


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"router_score": "sigmoid", "norm_topk": False, "num_shared_experts": 1},
        {"experts_per_token": 1, "load_balance": "bias"},
        {"experts_per_token": 3, "router_score": "sigmoid"},
    ],
)
def test_moe_layer_matches_per_token_reference(kw):
    m = _layer(**kw)
    if m.load_balance == "bias":
        m.expert_bias.copy_(torch.linspace(-0.5, 0.5, m.num_experts))  # changes the choice, not the weights
    x = torch.randn(3, 7, 32)
    got = m(x)
    torch.testing.assert_close(got.view(-1, 32), _reference(m, x.view(-1, 32)), rtol=1e-5, atol=1e-5)


def test_grouped_gemm_equals_loop_forward_and_backward():
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([5, 0, 9, 2])
    x0 = torch.randn(16, 12, generator=gen)
    w0 = torch.randn(4, 20, 12, generator=gen)
    results = []
    for grouped in (True, False):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = grouped_matmul(x, w, counts, grouped)
        y.sum().backward()  # an expanded gradient: the grouped path must take it
        results.append((y, x.grad, w.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    manual = torch.cat([x0[0:5] @ w0[0].t(), x0[5:14] @ w0[2].t(), x0[14:16] @ w0[3].t()])
    torch.testing.assert_close(results[0][0].detach(), manual, rtol=1e-6, atol=1e-6)


def test_first_forward_inside_a_checkpointed_block(monkeypatch):
    """The grouped-GEMM probe runs in the first MoE forward of a process, which activation
    checkpointing may wrap: the recomputation (which skips the cached probe) must save what
    the forward saved. (A fresh ``meshforge train --train.activation_checkpoint full`` of an
    MoE model failed this way before the first step.)"""
    monkeypatch.setattr(compat, "_GROUPED_OK", {})  # as in a fresh process
    layer = _layer()
    layer.train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    (grad,) = torch.autograd.grad(out.square().sum(), [x])
    assert torch.isfinite(grad).all()


def test_capacity_drops_the_lowest_scores_and_counts_them():
    m = _layer(capacity_factor=1.0, experts_per_token=2)
    m.train()
    x = torch.randn(40, 32)
    r = m.route(x)
    cap = m.capacity(40)
    assert cap == math.ceil(1.0 * 40 * 2 / m.num_experts)
    e, w, keep = r.experts.flatten(), r.weights.flatten(), r.keep.flatten()
    for i in range(m.num_experts):
        mine = e == i
        assert int((keep & mine).sum()) == min(cap, int(mine.sum()))
        if (~keep & mine).any():  # every dropped slot scores below every kept one
            assert w[~keep & mine].max() <= w[keep & mine].min()
    assert m.drops.tolist() == [float((~keep).sum()), 80.0]
    assert int((~keep).sum()) > 0  # this router is unbalanced enough to drop


def test_dropped_slots_contribute_nothing():
    m = _layer(capacity_factor=0.5)
    x = torch.randn(24, 32)
    got = m(x)
    r = m.route(x)
    ref = torch.zeros_like(x)
    for t in range(24):
        for s in range(m.top_k):
            if r.keep[t, s]:
                e = int(r.experts[t, s])
                h = F.silu(m.experts.w1[e] @ x[t]) * (m.experts.w3[e] @ x[t])
                ref[t] += r.weights[t, s] * (m.experts.w2[e] @ h)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_aux_and_z_loss_values_reach_the_loss_object():
    m = _layer(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    m.train()
    x = torch.randn(30, 32)
    m(x)
    logits = x @ m.router.weight.t()
    probs = logits.softmax(-1)
    top = probs.topk(m.top_k, -1).indices
    f = torch.bincount(top.flatten(), minlength=m.num_experts).float() / top.numel()
    aux = 0.1 * m.num_experts * (f * probs.mean(0)).sum()
    z = 0.01 * torch.logsumexp(logits, -1).square().mean()
    loss = LanguageModelLoss()
    total = loss(torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), m)
    assert float(loss.terms["aux_loss"]) == pytest.approx(aux.item(), rel=1e-5)
    assert float(loss.terms["z_loss"]) == pytest.approx(z.item(), rel=1e-5)
    assert total.item() == pytest.approx(math.log(5) + aux.item() + z.item(), rel=1e-5)


def test_bias_moves_against_the_load_and_is_checkpointed():
    model = build_model(_args(load_balance="bias", bias_update_rate=0.01, layers=2))
    model.train()
    layer = moe_layers(model)["1"]
    assert "layers.1.feed_forward.expert_bias" in model.state_dict()
    model(torch.randint(0, 512, (2, 16)))
    load = layer.load.clone()
    end_step(model)
    want = 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(layer.expert_bias, want)
    assert layer.load.sum() == 0 and layer.step_load.sum() == 32 * 2
    fresh = build_model(_args(load_balance="bias", layers=2), seed=None)
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(moe_layers(fresh)["1"].expert_bias, want)


def test_evaluation_forwards_count_nothing():
    m = _layer(capacity_factor=1.0)
    m.train()
    with torch.no_grad():  # the evaluator's forwards: no load, no drops, no balance terms
        m(torch.randn(20, 32))
    assert m.load.sum() == 0 and m.drops.sum() == 0
    m(torch.randn(20, 32))
    assert m.load.sum() == 40 and m.drops[1] == 40


def test_moe_interval_and_first_dense_layers_choose_the_blocks():
    a = _args(layers=7, first_dense_layers=2, moe_interval=2)
    assert [i for i in range(7) if is_moe_layer(a, i)] == [2, 4, 6]
    model = build_model(a, device="meta")
    assert sorted(moe_layers(model), key=int) == ["2", "4", "6"]
    assert not is_moe_layer(_args(num_experts=0, first_dense_layers=0), 0)


def test_presets_have_their_published_parameter_counts():
    for name, total, active in (("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9)):
        a = get_preset(name)
        model = build_model(a, device="meta")
        counted = sum(p.numel() for p in model.parameters())
        assert counted == flops.num_params(a)
        assert counted == pytest.approx(total, rel=0.005), name
        assert flops.active_params(a) == pytest.approx(active, rel=0.02), name
    q = get_preset("qwen3-30b-a3b")
    assert (q.heads * q.head_dim, q.hidden, q.qk_norm) == (4096, 2048, True)


def test_flops_count_active_parameters_only():
    a = get_preset("debug-moe")
    dense_like = copy.copy(a)
    dense_like.num_experts = a.experts_per_token  # every expert active: same FLOPs as top-k of many
    assert flops.model_flops_per_token(a, 64) == pytest.approx(flops.model_flops_per_token(dense_like, 64), rel=0.01)
    assert flops.num_params(a) > flops.num_params(dense_like)
    per_block = [flops.block_flops_per_token(a, 64, i) for i in range(a.layers)]
    assert sum(per_block) + flops.head_flops_per_token(a) == pytest.approx(flops.model_flops_per_token(a, 64))


@pytest.mark.parametrize(
    "over, pattern",
    [
        ({"model.experts_per_token": 9}, r"model\.experts_per_token = 9 must be between 1 and model\.num_experts = 8"),
        ({"model.capacity_factor": -1.0}, r"model\.capacity_factor = -1 is out of range: it must be in \[0, "),
        ({"model.load_balance": "bias_loss"}, r"model\.load_balance = 'bias_loss'.*did you mean"),
        ({"model.router_score": "tanh"}, r"model\.router_score = 'tanh' is not one of"),
        ({"model.first_dense_layers": 4}, r"model\.first_dense_layers = 4 leaves no MoE block"),
        ({"model.preset": "debug", "model.experts_per_token": 4}, r"model\.experts_per_token = 4 is a mixture"),
    ],
)
def test_bad_moe_values_are_refused_by_key(over, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, {"model.preset": "debug-moe", **over})
