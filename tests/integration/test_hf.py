import json

import pytest
import torch

from conftest import assert_convert_both_ways, run_cli
from meshforge.models.hf import HFCheckpointError, load_hf_checkpoint, save_hf_checkpoint

transformers = pytest.importorskip("transformers")

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def small_hf(tie=False, rope_scaling=None, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=120,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tie, rope", [(False, None), (True, None), (False, LLAMA31_ROPE)])
def test_round_trip_through_transformers(tmp_path, tie, rope):
    hf = small_hf(tie, rope)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_checkpoint(tmp_path / "hf")
    x = torch.randint(0, 120, (2, 200))
    with torch.no_grad():
        ref = hf(x).logits
        got = ours(x)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)

    save_hf_checkpoint(ours, tmp_path / "back")
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, ref, atol=1e-4, rtol=0)


def test_sharded_checkpoint_with_index(tmp_path):
    hf = small_hf()
    ours = load_hf_checkpoint(_save(hf, tmp_path / "hf"))
    save_hf_checkpoint(ours, tmp_path / "sharded", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = load_hf_checkpoint(tmp_path / "sharded")
    x = torch.randint(0, 120, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(again(x), hf(x).logits, atol=1e-4, rtol=0)
        from_hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "sharded").eval()
        torch.testing.assert_close(from_hf(x).logits, hf(x).logits, atol=1e-4, rtol=0)


def _save(hf, path):
    hf.save_pretrained(path)
    return path


def test_non_llama_checkpoint_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(HFCheckpointError, match="meshforge reads Llama-family checkpoints"):
        load_hf_checkpoint(tmp_path)


def test_missing_weights_refused(tmp_path):
    hf = small_hf()
    hf.config.save_pretrained(tmp_path)
    with pytest.raises(HFCheckpointError, match="neither model.safetensors"):
        load_hf_checkpoint(tmp_path)


def test_convert_cli_both_ways(tmp_path):
    assert_convert_both_ways(small_hf(seed=1), transformers.LlamaForCausalLM, tmp_path, vocab=120)
    r = run_cli("convert", "--to-hf", str(tmp_path / "mf"), "--out", str(tmp_path / "hf2"))
    assert r.returncode == 2 and "not empty" in r.stderr and "Traceback" not in r.stderr


def _round_trip(hf, cls, tmp_path, x):
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_checkpoint(tmp_path / "hf")
    with torch.no_grad():
        ref = hf(x).logits
        torch.testing.assert_close(ours(x), ref, atol=1e-4, rtol=0)
    save_hf_checkpoint(ours, tmp_path / "back")
    again = cls.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, ref, atol=1e-4, rtol=0)
    return ours, json.loads((tmp_path / "back" / "config.json").read_text())


def test_llama_with_explicit_head_dim_round_trips(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=120,
        max_position_embeddings=128,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    ours, back = _round_trip(hf, transformers.LlamaForCausalLM, tmp_path, torch.randint(0, 120, (2, 50)))
    assert ours.shape.head_dim == 24 and not ours.shape.qk_norm
    assert back["model_type"] == "llama" and back["head_dim"] == 24


@pytest.mark.skipif(not hasattr(transformers, "Qwen3Config"), reason="transformers without Qwen3")
def test_dense_qwen3_round_trips_with_qk_norm(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=120,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises the QK-norm weights to ones; make them matter
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    ours, back = _round_trip(hf, transformers.Qwen3ForCausalLM, tmp_path, torch.randint(0, 120, (2, 50)))
    assert ours.shape.qk_norm and ours.shape.head_dim == 24
    w = hf.model.layers[1].self_attn.k_norm.weight
    torch.testing.assert_close(ours.state_dict()["layers.1.attention.k_norm.weight"], w, rtol=0, atol=0)
    assert back["model_type"] == "qwen3" and back["architectures"] == ["Qwen3ForCausalLM"]
