"""Named model shapes: tiny ``debug`` and ``debug-moe`` models, the public Llama 3 shapes and
two mixtures of experts (Mixtral 8x7B, Qwen3-30B-A3B)."""

from __future__ import annotations

import copy
import dataclasses
import math

from meshforge.errors import ConfigError, suggest
from meshforge.models.shape import ModelShape

_LLAMA3 = dict(
    norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling="llama3",
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_seq_len=8192,
    vocab_size=128256,
    max_seq_len=131072,
)

PRESETS: dict[str, ModelShape] = {
    # Trains on a laptop CPU in seconds; vocab 512 holds the byte tokenizer's 258 ids
    # and divides by every tensor-parallel degree up to 512.
    "debug": ModelShape(
        hidden=128,
        layers=4,
        heads=4,
        kv_heads=2,
        ffn_hidden=384,
        vocab_size=512,
        max_seq_len=1024,
        rope_theta=10000.0,
    ),
    # 8 experts, top-2, one dense block first: the MoE paths on a CPU in seconds
    "debug-moe": ModelShape(
        hidden=128,
        layers=4,
        heads=4,
        kv_heads=2,
        ffn_hidden=384,
        vocab_size=512,
        max_seq_len=1024,
        rope_theta=10000.0,
        num_experts=8,
        experts_per_token=2,
        moe_ffn_hidden=128,
        first_dense_layers=1,
    ),
    "llama3.2-1b": ModelShape(
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        ffn_hidden=8192,
        tie_embeddings=True,
        rope_factor=32.0,
        **_LLAMA3,
    ),
    "llama3.2-3b": ModelShape(
        hidden=3072,
        layers=28,
        heads=24,
        kv_heads=8,
        ffn_hidden=8192,
        tie_embeddings=True,
        rope_factor=32.0,
        **_LLAMA3,
    ),
    "llama3.1-8b": ModelShape(
        hidden=4096, layers=32, heads=32, kv_heads=8, ffn_hidden=14336, rope_factor=8.0, **_LLAMA3
    ),
    "llama3.1-70b": ModelShape(
        hidden=8192, layers=80, heads=64, kv_heads=8, ffn_hidden=28672, rope_factor=8.0, **_LLAMA3
    ),
    "llama3.1-405b": ModelShape(
        hidden=16384, layers=126, heads=128, kv_heads=8, ffn_hidden=53248, rope_factor=8.0, **_LLAMA3
    ),
    # Mistral's Mixtral-8x7B-v0.1 config.json: 46.7B parameters, 12.9B active per token
    "mixtral-8x7b": ModelShape(
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        ffn_hidden=14336,
        vocab_size=32000,
        max_seq_len=32768,
        rope_theta=1e6,
        num_experts=8,
        experts_per_token=2,
        aux_loss_coeff=0.02,
    ),
    # Qwen's Qwen3-30B-A3B config.json: 30.5B parameters, 3.3B active; heads x head_dim = 4096 > hidden
    "qwen3-30b-a3b": ModelShape(
        hidden=2048,
        layers=48,
        heads=32,
        kv_heads=4,
        head_dim=128,
        qk_norm=True,
        ffn_hidden=6144,
        vocab_size=151936,
        max_seq_len=40960,
        norm_eps=1e-6,
        rope_theta=1e6,
        num_experts=128,
        experts_per_token=8,
        moe_ffn_hidden=768,
        aux_loss_coeff=0.001,
    ),
}


def get_preset(name: str) -> ModelShape:
    if name not in PRESETS:
        hint = suggest(name, PRESETS, cutoff=0.4)
        hint = f"{hint} " if hint.startswith("did you mean") else ""
        raise ConfigError(f"unknown model preset '{name}' (model.preset); {hint}known presets: {', '.join(PRESETS)}")
    return copy.copy(PRESETS[name])  # not dataclasses.replace: that would pin a derived head_dim


def _check_types(a: ModelShape) -> None:
    """Whole numbers where the shape counts, finite numbers where it measures (a shape read from a
    config.json or meta.json someone wrote by hand)."""
    for f in dataclasses.fields(ModelShape):
        v, kind = getattr(a, f.name), str(f.type)
        if kind == "int" and type(v) is not int:
            raise ConfigError(f"model.{f.name} = {v!r} must be a whole number")
        if kind == "float" and (type(v) not in (int, float) or not math.isfinite(v)):
            raise ConfigError(f"model.{f.name} = {v!r} must be a finite number")


def check_model_shape(a: ModelShape) -> None:
    _check_types(a)
    for k in ("hidden", "layers", "heads", "kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
        if getattr(a, k) <= 0:
            raise ConfigError(f"model.{k} = {getattr(a, k)} must be > 0")
    if a.head_dim < 0:
        raise ConfigError(f"model.head_dim = {a.head_dim} must be > 0 (or 0: hidden / heads)")
    if not a.explicit_head_dim and a.hidden % a.heads:
        raise ConfigError(
            f"model.hidden = {a.hidden} must be divisible by model.heads = {a.heads}, or set model.head_dim explicitly"
        )
    if a.heads % a.kv_heads:
        raise ConfigError(f"model.heads = {a.heads} must be divisible by model.kv_heads = {a.kv_heads}")
    if a.head_dim % 2:
        what = "model.head_dim" if a.explicit_head_dim else "head dim hidden/heads"
        raise ConfigError(f"{what} = {a.head_dim} must be even for rotary embeddings")
    if a.norm_eps <= 0 or a.rope_theta <= 0 or a.init_std <= 0:
        raise ConfigError("model.norm_eps, model.rope_theta and model.init_std must be > 0")
    if a.rope_scaling == "llama3" and a.rope_high_freq_factor <= a.rope_low_freq_factor:
        raise ConfigError("model.rope_high_freq_factor must be greater than model.rope_low_freq_factor")
    check_moe_shape(a)


def check_moe_shape(a: ModelShape) -> None:
    """Mixture-of-experts values, each refused with its key and a valid value."""
    if a.num_experts < 0:
        raise ConfigError(f"model.num_experts = {a.num_experts} must be >= 0 (0: a dense model)")
    for k in ("num_shared_experts", "moe_ffn_hidden", "first_dense_layers"):
        if getattr(a, k) < 0:
            raise ConfigError(f"model.{k} = {getattr(a, k)} must be >= 0")
    for k in ("capacity_factor", "aux_loss_coeff", "bias_update_rate", "z_loss_coeff"):
        if getattr(a, k) < 0:
            raise ConfigError(f"model.{k} = {getattr(a, k)} must be >= 0" + (" (0: dropless)" if k[0] == "c" else ""))
    if a.num_experts == 0:
        _check_dense(a)
        return
    if not 1 <= a.experts_per_token <= a.num_experts:
        raise ConfigError(
            f"model.experts_per_token = {a.experts_per_token} must be between 1 and model.num_experts = "
            f"{a.num_experts}; e.g. {min(2, a.num_experts)}"
        )
    if a.moe_interval < 1:
        raise ConfigError(f"model.moe_interval = {a.moe_interval} must be >= 1 (1: every block is MoE)")
    if a.first_dense_layers >= a.layers:
        raise ConfigError(
            f"model.first_dense_layers = {a.first_dense_layers} leaves no MoE block of model.layers = {a.layers}; "
            f"use at most {a.layers - 1}, or model.num_experts = 0 for a dense model"
        )


MOE_FIELDS = (
    "experts_per_token",
    "num_shared_experts",
    "moe_ffn_hidden",
    "moe_interval",
    "first_dense_layers",
    "router_score",
    "norm_topk",
    "capacity_factor",
    "load_balance",
    "aux_loss_coeff",
    "bias_update_rate",
    "z_loss_coeff",
)


def _check_dense(a: ModelShape) -> None:
    """A dense model (num_experts = 0) with an MoE option changed: the option would do nothing."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelShape)}
    for k in MOE_FIELDS:
        if getattr(a, k) != defaults[k]:
            raise ConfigError(
                f"model.{k} = {getattr(a, k)!r} is a mixture-of-experts option, but the model is dense "
                f"(model.num_experts = 0); set model.num_experts (e.g. 8) or use an MoE preset "
                f"(debug-moe, mixtral-8x7b, qwen3-30b-a3b), or drop model.{k}"
            )
