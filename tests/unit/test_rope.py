import math

import pytest
import torch

from meshforge.models.llama import ModelShape, apply_rope, rope_cos_sin, rope_inv_freq

ARGS = ModelShape(hidden=64, layers=1, heads=2, kv_heads=2, ffn_hidden=64, vocab_size=10, max_seq_len=512)


def test_rotation_preserves_norm():
    inv = rope_inv_freq(ARGS)
    cos, sin = rope_cos_sin(inv, torch.arange(50))
    x = torch.randn(1, 2, 50, 32, dtype=torch.float64)
    y = apply_rope(x, cos.double(), sin.double())
    torch.testing.assert_close(x.norm(dim=-1), y.norm(dim=-1))


def test_dot_product_depends_only_on_relative_position():
    inv = rope_inv_freq(ARGS)
    q = torch.randn(32, dtype=torch.float64)
    k = torch.randn(32, dtype=torch.float64)

    def score(m, n):
        cos, sin = rope_cos_sin(inv, torch.tensor([m, n]))
        qr = apply_rope(q.view(1, 1, 1, 32).expand(1, 1, 2, 32), cos.double(), sin.double())
        kr = apply_rope(k.view(1, 1, 1, 32).expand(1, 1, 2, 32), cos.double(), sin.double())
        return float(qr[0, 0, 0] @ kr[0, 0, 1])

    assert score(5, 2) == pytest.approx(score(105, 102), rel=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)


def test_position_zero_is_identity():
    cos, sin = rope_cos_sin(rope_inv_freq(ARGS), torch.tensor([0]))
    x = torch.randn(1, 1, 1, 32)
    torch.testing.assert_close(apply_rope(x, cos, sin), x)


def test_llama3_scaling_bands():
    plain = rope_inv_freq(ARGS)
    args = ModelShape(
        **{**ARGS.__dict__, "rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_max_seq_len": 256}
    )
    scaled = rope_inv_freq(args)
    wavelen = 2 * math.pi / plain
    high = wavelen < 256 / 4.0  # short wavelengths: untouched
    low = wavelen > 256 / 1.0  # long wavelengths: divided by the factor
    assert high.any() and low.any()
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8.0)
    mid = ~(high | low)
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8.0)).all()


def test_llama3_scaling_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    args = ModelShape(
        hidden=64,
        layers=1,
        heads=2,
        kv_heads=2,
        ffn_hidden=64,
        vocab_size=10,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling="llama3",
        rope_factor=8.0,
    )
    torch.testing.assert_close(rope_inv_freq(args), theirs.float(), rtol=1e-6, atol=0)


def test_rotation_of_a_shard_with_offset_positions_is_the_slice_of_the_full_rotation():
    inv = rope_inv_freq(ARGS)
    x = torch.randn(2, 2, 40, 32)
    full = apply_rope(x, *rope_cos_sin(inv, torch.arange(40)))
    p, s = 13, 9
    shard = apply_rope(x[:, :, p : p + s], *rope_cos_sin(inv, torch.arange(p, p + s)))
    torch.testing.assert_close(shard, full[:, :, p : p + s])
    assert not torch.allclose(apply_rope(x[:, :, p : p + s], *rope_cos_sin(inv, torch.arange(s))), shard)


def test_explicit_head_dim_sets_the_rotated_pairs():
    args = ModelShape(
        hidden=64, layers=1, heads=2, kv_heads=2, ffn_hidden=64, vocab_size=10, max_seq_len=8, head_dim=48
    )
    assert rope_inv_freq(args).shape == (24,)
    assert rope_inv_freq(ARGS).shape == (16,)
