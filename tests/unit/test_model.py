import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.models.flops import num_params
from meshforge.models.llama import (
    Block,
    FeedForward,
    ModelShape,
    SDPAttention,
    build_feed_forward,
    build_model,
)
from meshforge.models.loss import LanguageModelLoss, drain_aux, report_aux
from meshforge.models.presets import PRESETS, check_model_shape
from meshforge.parallel.pipeline.split import give_positions

# Published parameter counts (Meta's model cards / HF configs).
PUBLISHED = {
    "llama3.2-1b": 1.236e9,
    "llama3.2-3b": 3.213e9,
    "llama3.1-8b": 8.030e9,
    "llama3.1-70b": 70.554e9,
    "llama3.1-405b": 405.853e9,
}

SMALL = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=100, max_seq_len=64)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_large_presets_on_meta_match_published_counts(name):
    model = build_model(PRESETS[name], device="meta")
    counted = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    assert counted == num_params(PRESETS[name])
    assert abs(counted - PUBLISHED[name]) / PUBLISHED[name] < 5e-4


def test_forward_shape_and_dtype():
    model = build_model(SMALL, seed=0)
    logits = model(torch.randint(0, 100, (3, 17)))
    assert logits.shape == (3, 17, 100) and logits.dtype == torch.float32


def test_causal_future_tokens_do_not_change_past_logits():
    model = build_model(SMALL, seed=0)
    x = torch.randint(0, 100, (1, 20))
    y = x.clone()
    y[0, 12:] = (y[0, 12:] + 1) % 100
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_init_is_a_function_of_seed_and_name_only():
    a = build_model(SMALL, seed=3).state_dict()
    b = build_model(SMALL, seed=3).state_dict()
    c = build_model(SMALL, seed=4).state_dict()
    deeper = build_model(ModelShape(**{**SMALL.__dict__, "layers": 4}), seed=3).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
        if k.endswith("norm.weight"):
            continue
        assert not torch.equal(a[k], c[k]), k
    # A parameter's values do not depend on which other parameters exist (only the depth
    # scaling of residual projections does), so any subset a rank builds gets the same values.
    for k in ("tok_embeddings.weight", "layers.1.attention.wq.weight", "layers.0.feed_forward.w1.weight"):
        torch.testing.assert_close(a[k], deeper[k], rtol=0, atol=0)


def test_residual_projections_scaled_by_depth():
    sd = build_model(SMALL, seed=0).state_dict()
    assert abs(sd["layers.0.attention.wq.weight"].std().item() - 0.02) < 0.002
    assert abs(sd["layers.0.attention.wo.weight"].std().item() - 0.02 / 2) < 0.001


def test_tied_embeddings_share_storage():
    model = build_model(ModelShape(**{**SMALL.__dict__, "tie_embeddings": True}), seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == num_params(model.shape)


def test_grouped_query_attention_equals_repeated_kv_heads():
    torch.manual_seed(0)
    model = build_model(SMALL, seed=1)
    attn = model.layers["0"].attention
    x = torch.randn(2, 10, 64)
    cos = torch.ones(10, 16)
    sin = torch.zeros(10, 16)
    out = attn(x, cos, sin)
    q = attn.wq(x).view(2, 10, 4, 16).transpose(1, 2)
    k = attn.wk(x).view(2, 10, 2, 16).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attn.wv(x).view(2, 10, 2, 16).transpose(1, 2).repeat_interleave(2, dim=1)
    ref = attn.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 10, 64))
    torch.testing.assert_close(out, ref)


# ----------------------------------------------------------------------------- seams


def _args(**over) -> ModelShape:
    return ModelShape(**{**SMALL.__dict__, **over})


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Explicit causal softmax attention with the kv heads repeated (no SDPA)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


class ReferenceCore(nn.Module):
    def forward(self, q, k, v):
        return reference_attention(q, k, v)


def test_head_dim_other_than_hidden_over_heads_builds_trains_and_counts():
    args = _args(head_dim=24)  # heads * head_dim = 96 != hidden 64
    model = build_model(args, seed=0)
    attn = model.layers["0"].attention
    assert attn.wq.weight.shape == (4 * 24, 64) and attn.wk.weight.shape == (2 * 24, 64)
    assert attn.wo.weight.shape == (64, 4 * 24)
    logits = model(torch.randint(0, 100, (2, 9)))
    assert logits.shape == (2, 9, 100)
    logits.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    per_layer = 2 * 64 * 96 + 2 * 64 * 48 + 3 * 64 * 128 + 2 * 64
    expected = 2 * per_layer + 2 * 100 * 64 + 64
    assert sum(p.numel() for p in model.parameters()) == num_params(args) == expected


def test_head_dim_is_resolved_after_config_overrides():
    base = load_config(None, {}).shape
    assert base.head_dim == 32 and not base.explicit_head_dim
    small = load_config(None, {"model.hidden": 64}).shape
    assert small.head_dim == 16
    assert build_model(small, device="meta").layers["0"].attention.wq.weight.shape == (64, 64)
    explicit = load_config(None, {"model.hidden": 64, "model.head_dim": 48}).shape
    assert explicit.head_dim == 48 and explicit.explicit_head_dim
    assert dataclasses.asdict(small)["head_dim"] == 16  # what a checkpoint's meta records
    assert PRESETS["debug"].head_dim == 32  # the preset itself is untouched


def test_head_dim_checks():
    check_model_shape(_args(hidden=62, head_dim=16))  # hidden % heads no longer matters
    with pytest.raises(ConfigError, match="divisible by model.heads"):
        check_model_shape(_args(hidden=62))
    with pytest.raises(ConfigError, match="model.head_dim = 15 must be even"):
        check_model_shape(_args(head_dim=15))


def test_qk_norm_has_named_params_and_changes_output():
    plain, normed = build_model(SMALL, seed=0), build_model(_args(qk_norm=True), seed=0)
    names = {n for n, _ in normed.named_parameters()}
    extra = names - {n for n, _ in plain.named_parameters()}
    assert extra == {f"layers.{i}.attention.{q}_norm.weight" for i in range(2) for q in "qk"}
    sd = normed.state_dict()
    assert sd["layers.0.attention.q_norm.weight"].shape == (16,)
    torch.testing.assert_close(sd["layers.1.attention.k_norm.weight"], torch.ones(16))
    assert sum(p.numel() for p in normed.parameters()) == num_params(normed.shape)
    for n, t in plain.state_dict().items():  # same weights elsewhere: only the norms differ
        torch.testing.assert_close(t, sd[n], rtol=0, atol=0)
    x = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        assert not torch.allclose(plain(x), normed(x), atol=1e-3)


def test_qk_norm_normalises_each_head_of_q_and_k_before_rope():
    model = build_model(_args(qk_norm=True), seed=0)
    attn = model.layers["0"].attention
    with torch.no_grad():
        attn.q_norm.weight.fill_(2.0)
    seen = {}
    attn.core.register_forward_hook(lambda m, inp, out: seen.update(q=inp[0], k=inp[1]))
    with torch.no_grad():
        model(torch.randint(0, 100, (1, 5)))
    # RoPE preserves norms: every head vector has RMS 2 (q) and 1 (k), up to the norm's eps
    rms = lambda t: t.pow(2).mean(-1).sqrt()  # noqa: E731
    torch.testing.assert_close(rms(seen["q"]), torch.full((1, 4, 5), 2.0), atol=2e-3, rtol=0)
    torch.testing.assert_close(rms(seen["k"]), torch.ones(1, 2, 5), atol=2e-3, rtol=0)


@pytest.mark.parametrize("over", [{}, {"head_dim": 24, "qk_norm": True}])
def test_swapping_the_attention_core_for_a_reference_gives_the_same_logits(over):
    model = build_model(_args(**over), seed=2)
    x = torch.randint(0, 100, (2, 15))
    with torch.no_grad():
        sdpa = model(x)
        for block in model.layers.values():
            assert isinstance(block.attention.core, SDPAttention)
            assert not list(block.attention.core.parameters())
            block.attention.core = ReferenceCore()
        ref = model(x)
    torch.testing.assert_close(sdpa, ref, atol=1e-5, rtol=1e-5)


def test_core_is_what_the_block_calls():
    model = build_model(SMALL, seed=0)
    model.layers["1"].attention.core = ZeroCore()  # attention of block 1 contributes nothing
    x = torch.randint(0, 100, (1, 6))
    with torch.no_grad():
        out = model(x)
        model.layers["1"].attention.core = SDPAttention()
        assert not torch.allclose(out, model(x))


class ZeroCore(nn.Module):
    def forward(self, q, k, v):
        return torch.zeros_like(q)


def _core_inputs(model, tokens, positions=None):
    seen = {}
    h = model.layers["0"].attention.core.register_forward_hook(lambda m, inp, out: seen.update(q=inp[0], k=inp[1]))
    with torch.no_grad():  # positions by keyword, as the pipeline's hook passes them
        logits = model(tokens) if positions is None else model(tokens, positions=positions)
    h.remove()
    return logits, seen["q"], seen["k"]


def test_positions_of_a_shard_give_it_the_full_sequences_rotation():
    model = build_model(SMALL, seed=0)
    tokens = torch.randint(0, 100, (2, 24))
    _, q_full, k_full = _core_inputs(model, tokens)
    p, s = 10, 8
    _, q, k = _core_inputs(model, tokens[:, p : p + s], torch.arange(p, p + s))
    torch.testing.assert_close(q, q_full[:, :, p : p + s])
    torch.testing.assert_close(k, k_full[:, :, p : p + s])
    _, q0, _ = _core_inputs(model, tokens[:, p : p + s])  # None: positions 0..s-1
    assert not torch.allclose(q0, q_full[:, :, p : p + s])


def test_offset_positions_keep_logits_rope_is_relative():
    model = build_model(SMALL, seed=0)
    tokens = torch.randint(0, 100, (1, 12))
    a, _, _ = _core_inputs(model, tokens)
    b, _, _ = _core_inputs(model, tokens, torch.arange(100, 112))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_pipeline_hook_passes_the_step_runners_positions():
    model = build_model(SMALL, seed=0)
    holder = SimpleNamespace(positions=None)
    give_positions(model, lambda: None if holder.positions is None else {"positions": holder.positions}, None)
    tokens = torch.randint(0, 100, (1, 8))
    plain, _, _ = _core_inputs(model, tokens)  # nothing set: the model's own default
    holder.positions = torch.arange(40, 48)
    _, q, _ = _core_inputs(model, tokens)
    ref = build_model(SMALL, seed=0)
    _, q_ref, _ = _core_inputs(ref, tokens, torch.arange(40, 48))
    torch.testing.assert_close(q, q_ref)
    later = build_model(SMALL, seed=0)  # a later stage with nothing set: arange(seq_len)
    give_positions(later, lambda: None, 8)
    torch.testing.assert_close(_core_inputs(later, tokens)[0], plain)


def test_feed_forward_factory_builds_the_dense_layer_with_its_names():
    ff = build_feed_forward(SMALL, 1)
    assert isinstance(ff, FeedForward)
    assert {n for n, _ in ff.named_parameters()} == {"w1.weight", "w2.weight", "w3.weight"}
    block = Block(SMALL, 3)
    assert block.layer_id == 3 and isinstance(block.feed_forward, FeedForward)
    names = {n for n, _ in build_model(SMALL, device="meta").named_parameters()}
    assert {f"layers.1.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")} <= names
    assert {f"layers.0.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")} <= names


# ----------------------------------------------------------------------------- loss


class AuxLayer(nn.Module):
    """Reports an auxiliary term (e.g. a balance loss) on each forward."""

    def __init__(self, value: float):
        super().__init__()
        self.value = nn.Parameter(torch.tensor(value))

    def forward(self, x):
        report_aux(self, "balance", self.value * 1.0)
        return x


def test_loss_adds_reported_aux_terms_once_and_drains_them():
    model = nn.Sequential(AuxLayer(0.25), AuxLayer(0.5))
    logits, targets = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    lm = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss_fn = LanguageModelLoss()
    model(logits)
    loss = loss_fn(logits, targets, model)
    torch.testing.assert_close(loss, lm + 0.75)
    assert set(loss_fn.terms) == {"lm_loss", "balance"}
    torch.testing.assert_close(loss_fn.terms["balance"], torch.tensor(0.75))
    assert drain_aux(model) == {}  # drained by the loss
    torch.testing.assert_close(loss_fn(logits, targets, model), lm)  # no forward since: no aux
    loss.backward()
    torch.testing.assert_close(model[0].value.grad, torch.tensor(1.0))


def test_loss_token_sum_drops_aux_terms_and_runs_in_fp32():
    model = AuxLayer(3.0)
    logits = torch.randn(2, 4, 13).to(torch.bfloat16)
    targets = torch.randint(0, 13, (2, 4))
    model(logits)
    total = LanguageModelLoss().token_sum(logits, targets, model)
    assert total.dtype == torch.float32 and drain_aux(model) == {}
    torch.testing.assert_close(total, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum"))
    mean = LanguageModelLoss()(logits, targets)
    assert mean.dtype == torch.float32
    torch.testing.assert_close(mean, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()))
