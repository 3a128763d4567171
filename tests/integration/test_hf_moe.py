"""Hugging Face Mixtral and Qwen3-MoE: tiny random models built offline with transformers'
config classes round-trip through meshforge with the same logits (fp32, 1e-4)."""

import json

import pytest
import torch

from conftest import assert_convert_both_ways
from meshforge.models.hf import load_hf_checkpoint, save_hf_checkpoint
from meshforge.models.hf_moe import HFMoEError
from meshforge.models.llama import ModelShape, build_model

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "MixtralConfig") or not hasattr(transformers, "Qwen3MoeConfig"):
    pytest.skip("transformers without Mixtral / Qwen3-MoE", allow_module_level=True)

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=120,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def mixtral(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, **COMMON)
    return _spread_router(transformers.MixtralForCausalLM(cfg).eval())


def qwen3_moe(norm_topk, mlp_only_layers=(), seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        intermediate_size=96,
        moe_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk,
        decoder_sparse_step=1,
        mlp_only_layers=list(mlp_only_layers),
        head_dim=24,
        rms_norm_eps=1e-6,
        **COMMON,
    )
    hf = _spread_router(transformers.Qwen3MoeForCausalLM(cfg).eval())
    with torch.no_grad():  # HF initialises the QK-norm weights to ones; make them matter
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return hf


def _spread_router(hf):
    """Larger router weights: with init_std 0.02 every token's top-k would be a near tie."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    return hf


def _round_trip(hf, tmp_path, x):
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_checkpoint(tmp_path / "hf")
    with torch.no_grad():
        ref = hf(x).logits
        torch.testing.assert_close(ours(x), ref, atol=1e-4, rtol=0)
    save_hf_checkpoint(ours, tmp_path / "back")
    again = type(hf).from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, ref, atol=1e-4, rtol=0)
    return ours, json.loads((tmp_path / "back" / "config.json").read_text())


def test_mixtral_round_trips(tmp_path):
    hf = mixtral()
    ours, back = _round_trip(hf, tmp_path, torch.randint(0, 120, (2, 40)))
    a = ours.shape
    assert (a.num_experts, a.experts_per_token, a.norm_topk, a.qk_norm) == (4, 2, True, False)
    w = hf.model.layers[1].mlp.experts.down_proj[3]  # transformers 5 fuses the experts in memory
    torch.testing.assert_close(ours.state_dict()["layers.1.feed_forward.experts.w2"][3], w, rtol=0, atol=0)
    assert back["model_type"] == "mixtral" and back["num_local_experts"] == 4


@pytest.mark.parametrize("norm_topk, dense", [(True, [0]), (False, [])])
def test_qwen3_moe_round_trips(tmp_path, norm_topk, dense):
    hf = qwen3_moe(norm_topk, dense)
    ours, back = _round_trip(hf, tmp_path, torch.randint(0, 120, (2, 40)))
    a = ours.shape
    assert a.qk_norm and a.head_dim == 24 and a.norm_topk == norm_topk and a.moe_ffn_hidden == 48
    assert a.first_dense_layers == len(dense) and a.ffn_hidden == 96
    assert back["model_type"] == "qwen3_moe" and back["mlp_only_layers"] == dense
    assert back["norm_topk_prob"] == norm_topk


def test_fused_expert_tensors_are_read(tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj / experts.down_proj) loads too."""
    from safetensors.torch import save_file

    hf = mixtral(seed=2)
    hf.config.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    save_file(sd, str(tmp_path / "model.safetensors"))
    ours = load_hf_checkpoint(tmp_path)
    x = torch.randint(0, 120, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-4, rtol=0)


@pytest.mark.slow  # two CLI subprocesses
def test_convert_cli_both_ways_qwen3_moe(tmp_path):
    assert_convert_both_ways(qwen3_moe(True, [0], seed=1), transformers.Qwen3MoeForCausalLM, tmp_path, vocab=120)


def _tiny_moe(**kw):
    base = dict(hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=48, vocab_size=64, max_seq_len=32)
    return build_model(ModelShape(**base, num_experts=4, experts_per_token=2, **kw), seed=0)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(router_score="sigmoid"), "router_score"),
        (dict(num_shared_experts=1), "num_shared_experts"),
        (dict(norm_topk=False), "Mixtral always renormalises"),
        (dict(first_dense_layers=1), "Mixtral is all-MoE"),
        (dict(moe_ffn_hidden=16), "moe_ffn_hidden"),
    ],
)
def test_routing_hf_cannot_reproduce_is_refused(tmp_path, kw, match):
    with pytest.raises(HFMoEError, match=match):
        save_hf_checkpoint(_tiny_moe(**kw), tmp_path / "out")


def test_balance_bias_refused_only_when_it_changes_selection(tmp_path):
    model = _tiny_moe(load_balance="bias")
    save_hf_checkpoint(model, tmp_path / "zero")  # a zero bias selects what HF selects
    with torch.no_grad():
        model.layers["0"].feed_forward.expert_bias[1] = 0.1
    with pytest.raises(HFMoEError, match="balance bias"):
        save_hf_checkpoint(model, tmp_path / "moved")
