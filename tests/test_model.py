import pytest
import torch
import torch.nn.functional as F

from meshforge.models.flops import num_params
from meshforge.models.llama import ModelArgs, build_model
from meshforge.models.presets import PRESETS

# Published parameter counts (Meta's model cards / HF configs).
PUBLISHED = {
    "llama3.2-1b": 1.236e9,
    "llama3.2-3b": 3.213e9,
    "llama3.1-8b": 8.030e9,
    "llama3.1-70b": 70.554e9,
    "llama3.1-405b": 405.853e9,
}

SMALL = ModelArgs(hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=100, max_seq_len=64)


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
    deeper = build_model(ModelArgs(**{**SMALL.__dict__, "layers": 4}), seed=3).state_dict()
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
    model = build_model(ModelArgs(**{**SMALL.__dict__, "tie_embeddings": True}), seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == num_params(model.args)


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
